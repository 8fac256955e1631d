"""The weight feed's HTTP server: routes, bounded request bodies, one-line JSON errors.

Routes: ``GET /v1/weights``, ``GET /metrics``, ``GET /healthz`` and one per LB format of
:data:`~triscope.exporters.formats.FORMATS`. Request bodies over ``max_body_bytes`` get 413 before
anything is read; chunked bodies get 411. Connection bounds: :mod:`triscope.httpserver`.
"""

from __future__ import annotations

import json
import logging
import threading
from typing import TYPE_CHECKING

from triscope.exporters.formats import FORMATS
from triscope.httpserver import BoundedHTTPHandler, BoundedHTTPServer, HttpError, read_body, serve_in_thread, stop

if TYPE_CHECKING:
    from triscope.exporters.feed import Response, WeightFeed

log = logging.getLogger(__name__)

JSON_TYPE = "application/json"


def json_error(message: str) -> bytes:
    """``{"error": message}`` on one line."""
    return json.dumps({"error": message}).encode() + b"\n"


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


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


class _Handler(BoundedHTTPHandler):
    server_version = "triscope-feed"
    disable_nagle_algorithm = True  # headers and body are separate writes: no 40 ms delayed-ACK stall
    server: _Server

    def log_request(self, code: int | str = "-", size: int | str = "-") -> None:
        pass  # per-request access logs cost more than the request itself at feed rates

    def _send(self, status: int, ctype: str, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _route(self, method: str) -> None:
        try:
            body = read_body(self, self.server.feed.max_body_bytes)
        except HttpError as exc:
            why = f"{exc} ([weights.feed] max_body_bytes)" if exc.status == 413 else str(exc)
            self._send(exc.status, JSON_TYPE, json_error(why))
            return
        path = self.path.split("?", 1)[0]
        try:
            out = route(self.server.feed, method, path, body)
        except Exception as exc:
            log.warning("feed %s %s failed: %s", method, path, _one_line(exc))
            out = (500, JSON_TYPE, json_error(_one_line(exc)))
        self._send(*out)

    def do_GET(self) -> None:
        self._route("GET")

    def do_HEAD(self) -> None:
        self._route("GET")

    def do_POST(self) -> None:
        self._route("POST")


class _Server(BoundedHTTPServer):
    feed: WeightFeed


class FeedHTTPServer:
    """The feed's HTTP listener on ``bind:port`` (0 = ephemeral), at most ``max_connections`` at once
    (``max_per_client`` from one address; 0 = the server's default)."""

    def __init__(self, feed: WeightFeed, bind: str, port: int, max_connections: int, max_per_client: int = 0,
                 header_timeout_s: float | None = None) -> None:
        self._server = _Server((bind, port), _Handler, max_connections=max_connections,
                               max_per_client=max_per_client or None, header_timeout_s=header_timeout_s,
                               name="triscope-feed-http")
        self._server.feed = feed
        self.port = int(self._server.server_address[1])
        self._thread: threading.Thread | None = None

    def start(self) -> FeedHTTPServer:
        self._thread = serve_in_thread(self._server, "triscope-feed-http")
        return self

    def close(self) -> None:
        stop(self._server, self._thread, timeout_s=2.0)
        self._thread = None
