"""HAProxy agent-check server: HAProxy sends its ``agent-send`` line, we answer ``ready NN%`` or ``drain``.

Protocol (HAProxy 2.6 ``agent-check``): HAProxy opens a TCP connection, writes the configured
``agent-send`` string and reads one ASCII line. We read at most :data:`MAX_LINE` bytes up to the
first newline; the line names the backend (``gpu-a:8000``), optionally followed by a space and a
request class (``gpu-a:8000 offline_video``) for per-class HAProxy pools. Answers:

* ``ready NN%\n`` for a ready backend, ``NN`` = its integer LB weight (1..100 with ``lb_scale`` 100),
  a percentage of the server's configured ``weight`` (configure ``weight 100``); ``ready`` also
  lifts a drain set by a previous answer;
  followed by `` maxconn:M`` when the backend has ``max_inflight`` configured: ``M = max(1,
  round(max_inflight * weight))``, so HAProxy caps the server's concurrency as its weight falls and
  queues the rest in the backend (admission control; ``timeout queue`` bounds the wait);
* ``drain\n`` for a drained backend, and for a backend closed to the named class by that class's
  ``admit_kv_ratio`` or ``admit_batch_ratio`` (a class the feed does not know gets the
  backend's own answer);
* ``ready 100%\n`` for a name the feed does not know, or an empty line: fail open, so a typo in
  ``agent-send`` leaves HAProxy balancing as if the feed were absent rather than starving a server;
* nothing (the connection is closed) when the line is longer than :data:`MAX_LINE` bytes without a
  newline; HAProxy counts that as an agent failure, which changes no weight.

A line that has not arrived within :data:`LINE_DEADLINE_S` in all (one read waits at most
``read_timeout_s``) is answered as it stands, so a client trickling bytes holds its slot that long
at most; connection limits and eviction of slow clients: :mod:`triscope.httpserver`.

HAProxy 2.6 does not parse ``weight:N``, so only percentages are sent.
"""

from __future__ import annotations

import logging
import socket
import socketserver
import threading
import time
from collections.abc import Callable, Mapping

from triscope.analyzers.routing import DRAIN, WeightsResult
from triscope.httpserver import DEFAULT_MAX_CONNECTIONS, BoundedTCPServer, serve_in_thread, stop

log = logging.getLogger(__name__)

MAX_LINE = 256
"""Longest ``agent-send`` line read, newline included."""

READ_TIMEOUT_S = 1.0
LINE_DEADLINE_S = 1.5
"""Total time for the ``agent-send`` line, however it trickles in (HAProxy sends it at once)."""
REPLY_DEADLINE_S = 2.0
"""Total time for the answer once the line is in."""
UNKNOWN_REPLY = "ready 100%\n"


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
    if bw.state == DRAIN or (request_class and result.class_state(name, request_class) == DRAIN):
        return "drain\n"
    reply = f"ready {max(1, int(bw.lb_weight))}%"
    if max_inflight > 0:
        reply += f" maxconn:{max(1, round(max_inflight * bw.weight))}"
    return reply + "\n"


def read_line(sock: socket.socket, limit: int = MAX_LINE, deadline_s: float = LINE_DEADLINE_S,
              on_data: Callable[[], None] | None = None) -> str | None:
    """Read up to ``limit`` bytes until a newline (or EOF, a read timeout, or ``deadline_s`` in all);
    None when the line is too long. ``on_data`` is called once, when the first bytes arrive."""
    data = b""
    read_timeout = sock.gettimeout()
    end = time.monotonic() + deadline_s
    while b"\n" not in data:
        if len(data) >= limit:
            return None
        left = end - time.monotonic()
        if left <= 0:
            break
        sock.settimeout(left if read_timeout is None else min(read_timeout, left))
        try:
            chunk = sock.recv(limit - len(data))
        except TimeoutError:
            break
        if not chunk:
            break
        if not data and on_data is not None:
            on_data()
        data += chunk
    line = data.split(b"\n", 1)[0]
    if len(line) >= limit:
        return None
    return line.strip().decode("utf-8", errors="replace")


class AgentServer:
    """Threaded TCP agent-check server; ``result_fn`` returns the current :class:`WeightsResult`."""

    def __init__(self, result_fn: Callable[[], WeightsResult | None], bind: str = "127.0.0.1",
                 port: int = 0, max_line: int = MAX_LINE, read_timeout_s: float = READ_TIMEOUT_S,
                 max_connections: int = DEFAULT_MAX_CONNECTIONS,
                 max_inflight: Mapping[str, int] | None = None, max_per_client: int = 0) -> None:
        self.result_fn = result_fn
        self.max_inflight = dict(max_inflight or {})
        self.max_line = max_line
        self.read_timeout_s = read_timeout_s
        self.requests_total = 0
        agent = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                agent._handle(self.request)

        # the deadlines are backstops: read_line answers within LINE_DEADLINE_S by itself
        self._server = BoundedTCPServer((bind, port), Handler, max_connections=max_connections,
                                        read_timeout_s=read_timeout_s, header_timeout_s=LINE_DEADLINE_S + 1.0,
                                        deadline_s=REPLY_DEADLINE_S, max_per_client=max_per_client or None,
                                        name="triscope-haproxy-agent")
        self.port = int(self._server.server_address[1])
        self._thread: threading.Thread | None = None

    def _handle(self, sock: socket.socket) -> None:
        sock.settimeout(self.read_timeout_s)
        try:
            line = read_line(sock, self.max_line, on_data=lambda: self._server.request_partial(sock))
            if line is None:
                return
            self._server.request_started(sock)
            self.requests_total += 1
            name, request_class = parse_agent_line(line)
            reply = agent_reply(self.result_fn(), name, self.max_inflight.get(name, 0), request_class)
            sock.sendall(reply.encode())
        except OSError as exc:
            log.debug("agent connection: %s", exc)

    def start(self) -> AgentServer:
        self._thread = serve_in_thread(self._server, "triscope-haproxy-agent")
        return self

    def close(self) -> None:
        stop(self._server, self._thread, timeout_s=2.0)
        self._thread = None
