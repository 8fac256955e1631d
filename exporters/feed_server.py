"""The weight feed's HTTP server: an event-loop HTTP/1.1 server answering from pre-encoded responses.

Load balancers poll the feed many times a second each; at fleet scale that is hundreds of thousands
of polls a second. A thread-per-connection server spends most of each poll in the HTTP machinery,
so this one parses just what the feed needs (request line, ``Content-Length``, ``Transfer-Encoding``,
``Connection``) on one asyncio loop (uvloop when installed) and answers repeated polls with the same
encoded bytes until the engine publishes a new result (:func:`~triscope.exporters.feed_http.route`
returns the same body object until then, so the cache key's hash is computed once).

Bounds: at most ``max_connections`` connections (``max_per_client`` from one address); at a limit a
new connection takes the slot of the oldest slow one (from that client when its own limit is the one
reached): one that started a request and has not finished its head within 0.25 s, or that has sent
nothing for 1 s, as :mod:`triscope.httpserver` does; with none, the new one is closed unanswered. A
poll that sends its request at once therefore gets in while slow clients hold every slot. Request
heads over ``MAX_HEAD_BYTES`` get 431, bodies over the feed's
``max_body_bytes`` 413 (nothing read), chunked bodies 411; a connection idle for
``header_timeout_s`` before a complete request is closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections import Counter
from typing import TYPE_CHECKING, cast

from triscope.exporters.feed_http import JSON_TYPE, json_error, one_line, route
from triscope.httpserver import (
    DEFAULT_EVICT_AFTER_S,
    DEFAULT_EVICT_PARTIAL_AFTER_S,
    DEFAULT_HEADER_TIMEOUT_S,
    default_max_per_client,
)

if TYPE_CHECKING:
    from triscope.exporters.feed import WeightFeed

log = logging.getLogger(__name__)

MAX_HEAD_BYTES = 16 * 1024
_CACHE_LIMIT = 64
_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed", 411: "Length Required",
            413: "Payload Too Large", 431: "Request Header Fields Too Large", 500: "Internal Server Error",
            503: "Service Unavailable"}


def _new_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop  # optional: about twice the requests per second of the default loop
    except ImportError:
        return asyncio.new_event_loop()
    loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
    return loop


class FeedHTTPServer:
    """The feed's HTTP listener on ``bind:port`` (0 = ephemeral) on its own thread and event loop."""

    def __init__(self, feed: WeightFeed, bind: str, port: int, max_connections: int, max_per_client: int = 0,
                 header_timeout_s: float | None = None) -> None:
        self.feed = feed
        self.max_connections = max_connections
        self.max_per_client = max_per_client or default_max_per_client(max_connections)
        self.header_timeout_s = header_timeout_s or DEFAULT_HEADER_TIMEOUT_S
        self.per_client: Counter[str] = Counter()
        self.open_connections: set[_Connection] = set()
        self.refused_total = 0
        self.evicted_total = 0
        self.expired_total = 0
        self._cache: dict[tuple[int, str, bytes, bool], bytes] = {}
        self._loop = _new_loop()
        self._server: asyncio.Server | None = None
        self._loop.run_until_complete(self._listen(bind, port))
        assert self._server is not None
        self.port: int = int(self._server.sockets[0].getsockname()[1])
        self._thread: threading.Thread | None = None

    async def _listen(self, bind: str, port: int) -> None:
        self._server = await self._loop.create_server(lambda: _Connection(self), bind, port, backlog=1024,
                                                      reuse_address=True)

    def start(self) -> FeedHTTPServer:
        self._thread = threading.Thread(target=self._loop.run_forever, name="triscope-feed-http", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        async def shutdown() -> None:
            if self._server is not None:
                self._server.close()
                for conn in list(self.open_connections):
                    conn.close()
        if self._thread is not None and self._thread.is_alive():
            with contextlib.suppress(Exception):
                asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(timeout=2.0)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=2.0)
        self._thread = None
        if not self._loop.is_running() and not self._loop.is_closed():
            self._loop.close()

    @property
    def connections(self) -> int:
        """Connections holding a slot now."""
        return len(self.open_connections)

    def admit(self, conn: _Connection, now: float) -> bool:
        """Give ``conn`` a slot, evicting the oldest slow connection at a limit; False: refuse it."""
        client_full = self.per_client[conn.client] >= self.max_per_client
        if client_full or self.connections >= self.max_connections:
            victim = self._victim(conn.client if client_full else None, now)
            if victim is None:
                self.refused_total += 1
                return False
            self.evicted_total += 1
            victim.drop(abort=True)
        self.open_connections.add(conn)
        self.per_client[conn.client] += 1
        return True

    def release(self, conn: _Connection) -> None:
        if conn in self.open_connections:
            self.open_connections.discard(conn)
            self.per_client[conn.client] -= 1
            if self.per_client[conn.client] <= 0:
                del self.per_client[conn.client]

    def _victim(self, client: str | None, now: float) -> _Connection | None:
        best: _Connection | None = None
        for c in self.open_connections:
            grace = DEFAULT_EVICT_PARTIAL_AFTER_S if c.buffer else DEFAULT_EVICT_AFTER_S
            if now - c.since < grace or (client is not None and c.client != client):
                continue
            if best is None or c.since < best.since:
                best = c
        return best

    def response(self, method: str, path: str, body: bytes, close: bool) -> bytes:
        """The encoded answer to one request (HEAD: headers only)."""
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


class _Connection(asyncio.Protocol):
    def __init__(self, server: FeedHTTPServer) -> None:
        self.server = server
        self.buffer = b""
        self.transport: asyncio.Transport | None = None
        self.client = ""
        self.since = 0.0
        """When it connected or last got an answer (the start of its wait for a request)."""
        self.timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = tcp = cast(asyncio.Transport, transport)  # uvloop's TCP transport is no subclass
        peer = tcp.get_extra_info("peername")
        self.client = str(peer[0]) if peer else ""
        self.since = asyncio.get_running_loop().time()
        if not self.server.admit(self, self.since):
            tcp.abort()  # over the bound and nobody to evict: closed unanswered
            self.transport = None
            return
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self.drop(abort=False)

    def drop(self, abort: bool) -> None:
        """Give the slot back (at once, also when evicted); ``abort`` cuts the connection."""
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        self.server.release(self)
        if abort and self.transport is not None:
            self.transport.abort()

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def _expire(self) -> None:
        self.server.expired_total += 1
        self.close()

    def _arm(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
        self.timer = asyncio.get_running_loop().call_later(self.server.header_timeout_s, self._expire)

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
        limit = self.server.feed.max_body_bytes
        if size > limit:
            self._fail(413, f"body of {size} bytes exceeds the limit of {limit} ([weights.feed] max_body_bytes)")
            return False
        start = end + 4
        if len(self.buffer) < start + size:
            return False
        body, self.buffer = self.buffer[start:start + size], self.buffer[start + size:]
        close = connection == "close" or (version == "HTTP/1.0" and connection != "keep-alive")
        assert self.transport is not None
        self.transport.write(self.server.response(method, target.split("?", 1)[0], body, close))
        if close:
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
