"""The feed's load-balancer output formats: name -> HTTP route and render function.

Adding a format is one module with a ``render(result, params, request_body)`` function returning
``(HTTP status, content type, body)``, plus one line in :data:`FORMATS`, which says whether load
balancers poll it (:attr:`Format.polled`). Render modules are imported on first use: an absent
module answers 503 instead of stopping the feed.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

from triscope.analyzers.routing import WeightParams, WeightsResult

Render = Callable[[WeightsResult, WeightParams, bytes], tuple[int, str, bytes]]
"""``(result, params, request body) -> (HTTP status, content type, body)``."""


@dataclass(frozen=True)
class Format:
    """One output format: where the feed serves it, the ``module:function`` rendering it, and
    whether it is polled."""

    method: str
    path: str
    render: str
    polled: bool = False
    """True: load balancers poll it with a bodiless ``GET`` whose answer depends only on the latest
    result, so the feed renders it once per update and a serving process (``serve_process``)
    answers it from its table, a lookup. False: every request is rendered by the feed (a serving
    process relays it), as a ``POST`` whose body selects the answer needs."""

    def __post_init__(self) -> None:
        if self.polled and self.method != "GET":
            raise ValueError(f"format at {self.path}: a polled format is answered to GET, not {self.method}")


FORMATS: dict[str, Format] = {
    "envoy_eds": Format("POST", "/v3/discovery:endpoints", "triscope.exporters.envoy_eds:render"),
    "traefik": Format("GET", "/v1/traefik", "triscope.exporters.traefik_provider:render", polled=True),
}
"""Formats by name (the name is also the key of the feed's ``urls``)."""

WEIGHTS_PATH = "/v1/weights"
"""The feed's own JSON answer (not a format), polled like a polled format."""


def polled_paths() -> tuple[str, ...]:
    """The ``GET`` routes load balancers poll: the JSON weights and every polled format's."""
    return (WEIGHTS_PATH, *(fmt.path for fmt in FORMATS.values() if fmt.polled))


def renderer(fmt: Format) -> Render | None:
    """The render function of ``fmt``; None when its module is absent."""
    module_name, _, attr = fmt.render.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name == module_name:
            return None
        raise
    render: Render = getattr(module, attr)
    return render
