"""Each LB format's ``polled`` flag decides how a serving process answers it: from its table, or relayed."""

from __future__ import annotations

import pytest

from triscope.analyzers.routing import BackendInputs, WeightParams
from triscope.exporters import formats
from triscope.exporters.feed import WeightFeed
from triscope.exporters.formats import FORMATS, WEIGHTS_PATH, Format


def _table_routes() -> set[tuple[str, str]]:
    """The routes a started feed puts in the serving process's table."""
    params = WeightParams.from_config({"weights": {"backends": {"a:1": {}}, "feed": {"port": 0, "agent_port": 0}}})
    with WeightFeed(params, inputs_fn=lambda: [BackendInputs("a:1")]).start() as feed:
        return set(feed._polled_responses())


def test_every_format_flag_drives_its_path() -> None:
    routes = _table_routes()
    assert ("GET", WEIGHTS_PATH) in routes
    for name, fmt in FORMATS.items():
        assert ((fmt.method, fmt.path) in routes) == fmt.polled, name
    assert len(routes) == 1 + sum(fmt.polled for fmt in FORMATS.values())


def test_a_new_format_is_polled_by_its_own_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    render = FORMATS["traefik"].render
    monkeypatch.setattr(formats, "FORMATS", {**FORMATS, "traefik": Format("GET", "/v1/traefik", render),
                                              "polled_one": Format("GET", "/v1/polled", render, polled=True)})
    monkeypatch.setattr("triscope.exporters.feed.FORMATS", formats.FORMATS)
    routes = _table_routes()
    assert ("GET", "/v1/polled") in routes and ("GET", "/v1/traefik") not in routes


def test_a_polled_format_answers_get() -> None:
    with pytest.raises(ValueError, match="polled format is answered to GET"):
        Format("POST", "/v1/x", "m:render", polled=True)
