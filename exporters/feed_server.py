"""The weight feed's HTTP server: an event-loop HTTP/1.1 server answering from pre-encoded responses.

Load balancers poll the feed many times a second each; at fleet scale that is hundreds of thousands
of polls a second. A thread-per-connection server spends most of each poll in the HTTP machinery,
so this one parses just what the feed needs (request line, ``Content-Length``, ``Transfer-Encoding``,
``Connection``) on one asyncio loop (uvloop when installed) and answers repeated polls with the same
encoded bytes until the engine publishes a new result (:func:`~triscope.exporters.feed_http.route`
returns the same body object until then, so the cache key's hash is computed once).

Bounds (connection caps, eviction of slow clients: :mod:`triscope.loop_server`; request parsing, 431,
413 over the feed's ``max_body_bytes``, 411: :mod:`triscope.loop_http`); a connection idle for
``header_timeout_s`` before a complete request is closed.
"""

from __future__ import annotations

import logging
import socket
from typing import TYPE_CHECKING

from triscope.errors import one_line
from triscope.exporters.feed_http import JSON_TYPE, json_error, route
from triscope.loop_http import MAX_HEAD_BYTES as MAX_HEAD_BYTES  # re-exported for the table servers
from triscope.loop_http import HttpConnection
from triscope.loop_http import encode as http_encode
from triscope.loop_server import DEFAULT_HEADER_TIMEOUT_S, LoopServer

if TYPE_CHECKING:
    from triscope.exporters.feed import WeightFeed

log = logging.getLogger(__name__)

_CACHE_LIMIT = 64


class FeedHTTPServer(LoopServer):
    """The feed's HTTP listener on ``bind:port`` (0 = ephemeral) on its own thread and event loop."""

    thread_name = "triscope-feed-http"
    server_header = "triscope-feed"
    body_limit_key = "[weights.feed] max_body_bytes"

    def __init__(self, feed: WeightFeed | None, bind: str, port: int, max_connections: int, max_per_client: int = 0,
                 header_timeout_s: float | None = None, sock: socket.socket | None = None) -> None:
        self.feed = feed
        self._cache: dict[tuple[int, str, bytes, bool], bytes] = {}
        super().__init__(bind, port, max_connections, max_per_client, header_timeout_s or DEFAULT_HEADER_TIMEOUT_S,
                         sock)

    @property
    def max_body_bytes(self) -> int:
        assert self.feed is not None
        return self.feed.max_body_bytes

    @property
    def header_timeout_s(self) -> float:
        return self.timeout_s

    def response(self, method: str, path: str, body: bytes, close: bool) -> bytes:
        """The encoded answer to one request (HEAD: headers only)."""
        assert self.feed is not None
        try:
            status, ctype, payload = route(self.feed, "GET" if method == "HEAD" else method, path, body)
        except Exception as exc:
            log.warning("feed %s %s failed: %s", method, path, one_line(exc))
            status, ctype, payload = 500, JSON_TYPE, json_error(one_line(exc))
        if method == "HEAD":
            return encode(status, ctype, payload, close)[: -len(payload) or None]
        key = (status, ctype, payload, close)
        cached = self._cache.get(key)
        if cached is None:
            if len(self._cache) >= _CACHE_LIMIT:
                self._cache.clear()
            cached = self._cache[key] = encode(status, ctype, payload, close)
        return cached


def encode(status: int, ctype: str, body: bytes, close: bool) -> bytes:
    """One whole answer of the feed."""
    return http_encode(status, ctype, body, close, FeedHTTPServer.server_header)


class FeedConnection(HttpConnection):
    """The feed's HTTP connection protocol (:mod:`.table_servers` answers some requests from a table)."""

    server: FeedHTTPServer

    def respond(self, method: str, path: str, body: bytes, close: bool, raw: bytes) -> bool:
        """Answer one parsed request (``raw``: its bytes as sent); False when nothing more is to be read now."""
        assert self.transport is not None
        self.transport.write(self.server.response(method, path, body, close))
        return self.answered(close)


FeedHTTPServer.connection = FeedConnection
