"""The weight feed's HTTP routes and one-line JSON errors (the server is :mod:`triscope.exporters.feed_server`).

Routes: ``GET /v1/weights``, ``GET /metrics``, ``GET /healthz`` and one per LB format of
:data:`~triscope.exporters.formats.FORMATS`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from triscope.errors import one_line as one_line  # re-exported for the feed
from triscope.exporters.formats import FORMATS
from triscope.loop_http import JSON_TYPE as JSON_TYPE  # re-exported for the feed's modules
from triscope.loop_http import json_error as json_error

if TYPE_CHECKING:
    from triscope.exporters.feed import Response, WeightFeed



def route(feed: WeightFeed, method: str, path: str, body: bytes) -> Response:
    """The response of ``feed`` to ``method path`` with request ``body``."""
    if path == "/v1/weights":
        handler = feed.weights_response if method == "GET" else None
    elif path == "/metrics":
        handler = feed.metrics_response if method == "GET" else None
    elif path == "/healthz":
        handler = feed.health_response if method == "GET" else None
    else:
        name = next((n for n, f in FORMATS.items() if f.path == path), None)
        if name is None:
            return 404, JSON_TYPE, json_error(f"no such endpoint {path}")
        if method != FORMATS[name].method:
            return 405, JSON_TYPE, json_error(f"{method} not allowed on {path}")
        return feed.format_response(name, body)
    if handler is None:
        return 405, JSON_TYPE, json_error(f"{method} not allowed on {path}")
    return handler()
