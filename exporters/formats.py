"""The feed's load-balancer output formats: name -> HTTP route and render function.

Adding a format is one module with a ``render(result, params, request_body)`` function returning
``(HTTP status, content type, body)``, plus one line in :data:`FORMATS`. Render modules are imported
on first use: an absent module answers 503 instead of stopping the feed.
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
    """One output format: where the feed serves it and the ``module:function`` rendering it."""

    method: str
    path: str
    render: str


FORMATS: dict[str, Format] = {
    "envoy_eds": Format("POST", "/v3/discovery:endpoints", "triscope.exporters.envoy_eds:render"),
    "traefik": Format("GET", "/v1/traefik", "triscope.exporters.traefik_provider:render"),
}
"""Formats by name (the name is also the key of the feed's ``urls``)."""


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
