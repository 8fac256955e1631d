"""The feed's two servers answering from tables instead of a live feed (run by :mod:`.feed_process`).

:class:`TableAgentServer` answers every agent check from a table ``agent-send line -> answer``.
:class:`TableHTTPServer` answers the requests a load balancer polls (``GET /v1/weights``,
``GET /v1/traefik``) from a table ``(method, path) -> encoded response`` and passes any other request
(the EDS ``POST``, ``/metrics``, ``/healthz``, errors) byte for byte to the feed's own HTTP server on
a loopback port, relaying its answer: one implementation of every route, no copy.
Both swap in a whole new table at once (:attr:`table`), so an answer never mixes two updates.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Mapping

from triscope.errors import one_line
from triscope.exporters.feed_http import JSON_TYPE, json_error
from triscope.exporters.feed_server import MAX_HEAD_BYTES, FeedConnection, FeedHTTPServer, encode
from triscope.exporters.haproxy_agent import UNKNOWN_REPLY, AgentServer, parse_agent_line

_UNKNOWN = UNKNOWN_REPLY.encode()
UPSTREAM_TIMEOUT_S = 10.0
"""Longest wait for the feed's own server to answer a passed-on request."""


def table_reply(table: Mapping[str, bytes], line: str) -> bytes:
    """The answer to one ``agent-send`` line (stripped) from a table keyed by name and ``"NAME CLASS"``:
    a class the table does not know gets the backend's own answer, an unknown backend ``up ready 100%``."""
    hit = table.get(line)
    if hit is not None:
        return hit
    name, request_class = parse_agent_line(line)
    if request_class:  # spacing differs from the table's key, or a class it does not know
        hit = table.get(f"{name} {request_class}")
        if hit is not None:
            return hit
    return table.get(name, _UNKNOWN)


class TableAgentServer(AgentServer):
    """The agent server answering from :attr:`table`."""

    def __init__(self, sock: socket.socket, max_connections: int, max_per_client: int, max_line: int,
                 read_timeout_s: float) -> None:
        self.table: dict[str, bytes] = {}
        super().__init__(lambda: None, max_line=max_line, read_timeout_s=read_timeout_s,
                         max_connections=max_connections, max_per_client=max_per_client, sock=sock)

    def reply(self, line: str) -> bytes:
        return table_reply(self.table, line)


HttpTable = dict[tuple[str, str], tuple[bytes, bytes]]
"""``(method, path) -> (keep-alive response, Connection: close response)``."""


class TableHTTPServer(FeedHTTPServer):
    """The feed's HTTP port answering table requests itself and passing the rest to ``upstream_port``."""

    thread_name = "triscope-feed-http-table"

    def __init__(self, sock: socket.socket, upstream_port: int, max_body_bytes: int, max_connections: int,
                 max_per_client: int, header_timeout_s: float) -> None:
        self.table: HttpTable = {}
        self.upstream_port = upstream_port
        self._max_body_bytes = max_body_bytes
        self.passed_total = 0
        super().__init__(None, "", 0, max_connections, max_per_client, header_timeout_s, sock)

    @property
    def max_body_bytes(self) -> int:
        return self._max_body_bytes


class _TableConnection(FeedConnection):
    server: TableHTTPServer
    waiting = False
    """True while a passed-on request is out: later pipelined requests wait in the buffer, in order."""

    def data_received(self, data: bytes) -> None:
        if self.waiting:
            self.buffer += data
            if len(self.buffer) > MAX_HEAD_BYTES + self.server.max_body_bytes:
                self._fail(431, "too much sent while a request is answered")
            return
        super().data_received(data)

    def respond(self, method: str, path: str, body: bytes, close: bool, raw: bytes) -> bool:
        hit = self.server.table.get((method, path))
        if hit is not None:
            assert self.transport is not None
            self.transport.write(hit[close])
            return self.answered(close)
        self.waiting = True
        self.server.passed_total += 1
        asyncio.get_running_loop().create_task(self._pass_on(raw, close))
        return False

    async def _pass_on(self, raw: bytes, close: bool) -> None:
        try:
            answer = await asyncio.wait_for(self._upstream(raw), UPSTREAM_TIMEOUT_S)
        except (OSError, EOFError, ValueError, TimeoutError, asyncio.IncompleteReadError,
                asyncio.LimitOverrunError) as exc:
            answer, close = encode(502, JSON_TYPE, json_error(f"feed unavailable: {one_line(exc)}"), True), True
        if self.transport is None or self.transport.is_closing():
            return
        self.transport.write(answer)
        self.waiting = False
        if self.answered(close) and self.buffer:
            self.data_received(b"")  # requests pipelined behind this one

    async def _upstream(self, raw: bytes) -> bytes:
        reader, writer = await asyncio.open_connection("127.0.0.1", self.server.upstream_port)
        try:
            writer.write(raw)
            head = await reader.readuntil(b"\r\n\r\n")
            length = 0
            for line in head.split(b"\r\n")[1:]:
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value)
            method = raw.split(b" ", 1)[0]
            body = b"" if method == b"HEAD" else await reader.readexactly(length)
            return head + body
        finally:
            writer.close()


TableHTTPServer.connection = _TableConnection

__all__ = ["HttpTable", "TableAgentServer", "TableHTTPServer", "UPSTREAM_TIMEOUT_S", "table_reply"]
