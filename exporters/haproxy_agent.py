"""HAProxy agent-check server: HAProxy sends its ``agent-send`` line, we answer ``up ready NN%``, ``drain`` or ``down``.

Protocol (HAProxy 2.6 ``agent-check``): HAProxy opens a TCP connection, writes the configured
``agent-send`` string and reads one ASCII line. We read at most :data:`MAX_LINE` bytes up to the
first newline; the line names the backend (``gpu-a:8000``), optionally followed by a space and a
request class (``gpu-a:8000 offline_video``) for per-class HAProxy pools. Answers:

* ``up ready NN%\n`` for a ready backend, ``NN`` = its integer LB weight (1..100 with ``lb_scale`` 100),
  a percentage of the server's configured ``weight`` (configure ``weight 100``); ``ready`` lifts a
  drain and ``up`` a DOWN set by a previous answer (HAProxy keeps an agent's DOWN until it says ``up``);
  followed by `` maxconn:M`` when the backend has ``max_inflight`` configured: ``M = max(1,
  round(max_inflight * weight))``, so HAProxy caps the server's concurrency as its weight falls and
  queues the rest in the backend (admission control; ``timeout queue`` bounds the wait);
* ``down\n`` for a backend that does not answer (its scrape refused or failing, its requests failing,
  its spans stopped): HAProxy marks it DOWN and sends it nothing until the agent says ``up``;
* ``drain\n`` for a drained backend, and for a backend closed to the named class by that class's
  ``admit_kv_ratio`` or ``admit_batch_ratio`` (a class the feed does not know gets the
  backend's own answer);
* ``ready 100%\n`` for a name the feed does not know, or an empty line: fail open, so a typo in
  ``agent-send`` leaves HAProxy balancing as if the feed were absent rather than starving a server;
* nothing (the connection is closed) when the line is longer than :data:`MAX_LINE` bytes without a
  newline; HAProxy counts that as an agent failure, which changes no weight.

A line that has not arrived within :data:`LINE_DEADLINE_S` in all (or after ``read_timeout_s`` of
silence) is answered as it stands, so a client trickling bytes holds its slot that long at most;
connection limits and eviction of slow clients: :mod:`triscope.loop_server`. The server runs on one event
loop and answers from encoded replies cached per engine result (a poll is a dictionary lookup until
the engine publishes again): at fleet scale, 100 load balancers checking 1,000 backends every 100 ms
is a million checks a second.

HAProxy 2.6 does not parse ``weight:N``, so only percentages are sent.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable, Mapping

from triscope.analyzers.routing import DOWN, DRAIN, WeightsResult
from triscope.loop_server import DEFAULT_MAX_CONNECTIONS, LoopConnection, LoopServer

log = logging.getLogger(__name__)

MAX_LINE = 256
"""Longest ``agent-send`` line read, newline included."""

READ_TIMEOUT_S = 1.0
LINE_DEADLINE_S = 1.5
"""Total time for the ``agent-send`` line, however it trickles in (HAProxy sends it at once)."""
REPLY_DEADLINE_S = 2.0
"""Total time for the answer once the line is in."""
UNKNOWN_REPLY = "up ready 100%\n"


def parse_agent_line(line: str) -> tuple[str, str]:
    """``"NAME"`` or ``"NAME CLASS"`` -> (backend name, request class or "")."""
    name, _, request_class = line.strip().partition(" ")
    return name, request_class.strip()


def agent_reply(result: WeightsResult | None, name: str, max_inflight: int = 0, request_class: str = "") -> str:
    """The agent-check answer for backend ``name`` (and ``request_class``) given the latest engine result.

    ``max_inflight`` > 0 adds ``maxconn:N`` scaled by the backend's weight.
    """
    bw = result.backends.get(name) if result is not None else None
    if result is None or bw is None:
        return UNKNOWN_REPLY
    if bw.state == DOWN:  # operationally DOWN: no traffic, persistent sessions included
        return "down\n"
    if bw.state == DRAIN or (request_class and result.class_state(name, request_class) == DRAIN):
        return "drain\n"
    reply = f"up ready {max(1, int(bw.lb_weight))}%"  # "up" lifts a DOWN set by an earlier "down" answer
    if max_inflight > 0:
        reply += f" maxconn:{max(1, round(max_inflight * bw.weight))}"
    return reply + "\n"


class AgentServer(LoopServer):
    """Event-loop TCP agent-check server; ``result_fn`` returns the current :class:`WeightsResult`."""

    thread_name = "triscope-haproxy-agent"

    def __init__(self, result_fn: Callable[[], WeightsResult | None], bind: str = "127.0.0.1",
                 port: int = 0, max_line: int = MAX_LINE, read_timeout_s: float = READ_TIMEOUT_S,
                 max_connections: int = DEFAULT_MAX_CONNECTIONS,
                 max_inflight: Mapping[str, int] | None = None, max_per_client: int = 0,
                 sock: socket.socket | None = None) -> None:
        self.result_fn = result_fn
        self.max_inflight = dict(max_inflight or {})
        self.max_line = max_line
        self.read_timeout_s = read_timeout_s
        self.requests_total = 0
        self.on_probation = 0
        """Connections over the bound waiting :data:`PROBATION_S` for their line (at most ``max_connections``)."""
        self._replies: dict[str, bytes] = {}
        self._replies_for: WeightsResult | None = None
        super().__init__(bind, port, max_connections, max_per_client, LINE_DEADLINE_S, sock)

    def reply(self, line: str) -> bytes:
        """The encoded answer to one ``agent-send`` line, cached until the engine publishes a new result."""
        result = self.result_fn()
        if result is not self._replies_for:
            self._replies, self._replies_for = {}, result
        cached = self._replies.get(line)
        if cached is not None:
            return cached
        name, request_class = parse_agent_line(line)
        answer = agent_reply(result, name, self.max_inflight.get(name, 0), request_class).encode()
        # only lines naming a known backend (and class) are kept: what clients send cannot grow the cache
        if result is not None and name in result.backends and (
                not request_class or request_class in result.class_admission):
            self._replies[line] = answer
        return answer


PROBATION_S = 0.1
"""A connection over the bound with nobody to evict may still send its whole line this soon: an agent
check needs no slot beyond its answer, so HAProxy's checks get in while slow clients hold every slot
(even while those are too young to evict)."""


class _AgentConnection(LoopConnection):
    server: AgentServer
    probation = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        if self.transport is not None and not self.probation:
            self._arm_read()

    def refused(self) -> None:
        if self.server.on_probation >= self.server.max_connections:
            super().refused()
            return
        self.probation = True
        self.server.on_probation += 1
        self.timer = asyncio.get_running_loop().call_later(PROBATION_S, super().refused)

    def drop(self, abort: bool) -> None:
        if self.probation:
            self.probation = False
            self.server.on_probation -= 1
        super().drop(abort)

    def _arm_read(self) -> None:
        """Answer after ``read_timeout_s`` of silence, or :data:`LINE_DEADLINE_S` after connecting."""
        if self.timer is not None:
            self.timer.cancel()
        loop = asyncio.get_running_loop()
        left = self.since + LINE_DEADLINE_S - loop.time()  # since: when it connected (answered once, then closed)
        self.timer = loop.call_later(max(0.0, min(self.server.read_timeout_s, left)), self._expire)

    def _expire(self) -> None:  # the line as it stands (HAProxy sends it at once: a slow client's)
        self.server.expired_total += 1
        self._answer(self.buffer)

    def data_received(self, data: bytes) -> None:
        if self.transport is None or self.transport.is_closing():
            return
        self.buffer += data
        end = self.buffer.find(b"\n")
        if end >= 0:
            self._answer(self.buffer[:end])
        elif len(self.buffer) >= self.server.max_line:
            self.close()  # too long: no answer (HAProxy counts an agent failure, which changes nothing)
        elif not self.probation:
            self._arm_read()

    def eof_received(self) -> bool:
        self._answer(self.buffer)
        return True  # keep the write side open for the answer

    def _answer(self, raw: bytes) -> None:
        if self.transport is None or self.transport.is_closing():
            return
        if len(raw) >= self.server.max_line:
            self.close()
            return
        self.server.requests_total += 1
        self.transport.write(self.server.reply(raw.strip().decode("utf-8", errors="replace")))
        self.close()


AgentServer.connection = _AgentConnection
