"""The weight feed's HTTP server: an event-loop HTTP/1.1 server answering from pre-encoded responses.

Load balancers poll the feed many times a second each; at fleet scale that is hundreds of thousands
of polls a second. A thread-per-connection server spends most of each poll in the HTTP machinery,
so this one parses just what the feed needs (request line, ``Content-Length``, ``Transfer-Encoding``,
``Connection``) on one asyncio loop (uvloop when installed) and answers repeated polls with the same
encoded bytes until the engine publishes a new result (:func:`~triscope.exporters.feed_http.route`
returns the same body object until then, so the cache key's hash is computed once).

Bounds (connection caps, eviction of slow clients: :mod:`.loop_server`): request heads over
``MAX_HEAD_BYTES`` get 431, bodies over the feed's
``max_body_bytes`` 413 (nothing read), chunked bodies 411; a connection idle for
``header_timeout_s`` before a complete request is closed.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from typing import TYPE_CHECKING

from triscope.errors import one_line
from triscope.exporters.feed_http import JSON_TYPE, json_error, route
from triscope.exporters.loop_server import LoopConnection, LoopServer
from triscope.httpserver import DEFAULT_HEADER_TIMEOUT_S

if TYPE_CHECKING:
    from triscope.exporters.feed import WeightFeed

log = logging.getLogger(__name__)

MAX_HEAD_BYTES = 16 * 1024
_CACHE_LIMIT = 64
_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed", 411: "Length Required",
            413: "Payload Too Large", 431: "Request Header Fields Too Large", 500: "Internal Server Error",
            503: "Service Unavailable"}


class FeedHTTPServer(LoopServer):
    """The feed's HTTP listener on ``bind:port`` (0 = ephemeral) on its own thread and event loop."""

    thread_name = "triscope-feed-http"

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
    head = (f"HTTP/1.1 {status} {_REASONS.get(status, 'Error')}\r\nServer: triscope-feed\r\n"
            f"Content-Type: {ctype}\r\nContent-Length: {len(body)}\r\nCache-Control: no-store\r\n"
            + ("Connection: close\r\n" if close else "") + "\r\n")
    return head.encode("latin-1") + body


class FeedConnection(LoopConnection):
    """The feed's HTTP connection protocol (:mod:`.table_servers` answers some requests from a table)."""

    server: FeedHTTPServer

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while self.transport is not None and not self.transport.is_closing():
            end = self.buffer.find(b"\r\n\r\n")
            if end < 0:
                if len(self.buffer) > MAX_HEAD_BYTES:
                    self._fail(431, "request head too large")
                return
            if end > MAX_HEAD_BYTES:
                self._fail(431, "request head too large")
                return
            if not self._one(end):
                return

    def _one(self, end: int) -> bool:
        """Answer the request whose head ends at ``end``; False when its body has not fully arrived."""
        lines = self.buffer[:end].decode("latin-1").split("\r\n")
        parts = lines[0].split(" ")
        if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
            self._fail(400, "malformed request line")
            return False
        method, target, version = parts
        length, chunked, connection = "0", False, ""
        for line in lines[1:]:
            name, _, value = line.partition(":")
            name = name.strip().lower()
            if name == "content-length":
                length = value.strip()
            elif name == "transfer-encoding":
                chunked = value.strip().lower() != "identity"
            elif name == "connection":
                connection = value.strip().lower()
        if chunked:
            self._fail(411, "chunked bodies are not accepted; send Content-Length")
            return False
        try:
            size = int(length)
        except ValueError:
            size = -1
        if size < 0:
            self._fail(400, f"bad Content-Length {length!r}")
            return False
        limit = self.server.max_body_bytes
        if size > limit:
            self._fail(413, f"body of {size} bytes exceeds the limit of {limit} ([weights.feed] max_body_bytes)")
            return False
        start = end + 4
        if len(self.buffer) < start + size:
            return False
        raw = self.buffer[:start + size]
        body, self.buffer = self.buffer[start:start + size], self.buffer[start + size:]
        close = connection == "close" or (version == "HTTP/1.0" and connection != "keep-alive")
        return self.respond(method, target.split("?", 1)[0], body, close, raw)

    def respond(self, method: str, path: str, body: bytes, close: bool, raw: bytes) -> bool:
        """Answer one parsed request (``raw``: its bytes as sent); False when nothing more is to be read now."""
        assert self.transport is not None
        self.transport.write(self.server.response(method, path, body, close))
        return self.answered(close)

    def answered(self, close: bool) -> bool:
        """After an answer: close, or wait for the next request; False once closed."""
        self.answered_total += 1
        if close:
            assert self.transport is not None
            self.transport.close()
            return False
        self.since = asyncio.get_running_loop().time()
        self._arm()
        return True

    def _fail(self, status: int, message: str) -> None:
        """An error answer, then close: the rest of the stream cannot be framed."""
        assert self.transport is not None
        self.transport.write(encode(status, JSON_TYPE, json_error(message), True))
        self.transport.close()


FeedHTTPServer.connection = FeedConnection
