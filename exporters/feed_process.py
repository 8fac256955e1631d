"""The feed's ports served by a process of their own, from answer tables the engine sends.

In the feed's process the engine update holds the interpreter lock while it runs (about 40 ms over
1,000 backends; a few ms a turn for the scrapes of a small fleet), and a poll arriving then waits up
to a switch interval per turn: that wait is the feed's tail latency. With ``[weights.feed]
serve_process = true`` the feed binds its ports itself and hands the listening sockets to a child
process (:mod:`.table_servers`). After every update it sends the child the agent's answers for
every backend and every (backend, class) pair, and the encoded ``GET /v1/weights`` and
``GET /v1/traefik`` responses. The child never runs the engine: a poll is a dictionary lookup.
Other HTTP requests (EDS, ``/metrics``, ``/healthz``) go through the child to the feed's own
server on a loopback port, so every route keeps one implementation.

A child that dies is started again, on the same sockets, at the next update; the parent keeps the
listening sockets, so ports never change and polls queue in their backlog meanwhile. A watchdog
thread pings the child every :data:`PING_S`; a child that leaves a table or a ping unanswered for
:data:`HANG_S` (stopped, deadlocked, swapping) is killed and replaced, so polls resume within about
two seconds. The child exits when the parent closes or dies (its end of the pipe closes).
"""

from __future__ import annotations

import json
import logging
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Mapping
from multiprocessing.connection import Connection
from typing import Any, Self

from triscope.analyzers.routing import WeightsResult
from triscope.exporters.haproxy_agent import MAX_LINE, READ_TIMEOUT_S, agent_reply

log = logging.getLogger(__name__)

START_TIMEOUT_S = 30.0
"""How long a new child may take to import, take its first tables and start serving."""
PING_S = 0.25
"""How often the watchdog asks an idle child for its counters."""
HANG_S = 1.0
"""A child that has not answered a table or a ping for this long is hung: killed and replaced."""


def agent_table(result: WeightsResult | None, max_inflight: Mapping[str, int]) -> dict[str, bytes]:
    """Every answer the agent can give for ``result``: by backend name and by ``"NAME CLASS"``."""
    if result is None:
        return {}
    table: dict[str, bytes] = {}
    for name in result.backends:
        limit = max_inflight.get(name, 0)
        table[name] = agent_reply(result, name, limit).encode()
        for request_class in result.class_admission:
            table[f"{name} {request_class}"] = agent_reply(result, name, limit, request_class).encode()
    return table


def _listener(bind: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in bind else socket.AF_INET
    return socket.create_server((bind, port), family=family, backlog=1024)


class FeedProcess:
    """The parent's handle: binds the ports (0 = ephemeral, None = off), runs the child, sends it tables.

    ``http`` settings: ``upstream_port`` (the feed's own server), ``max_body_bytes``,
    ``header_timeout_s``; both: ``max_connections``, ``max_per_client``.
    """

    def __init__(self, bind: str, agent_port: int | None, http_port: int | None, max_connections: int = 512,
                 max_per_client: int = 0, upstream_port: int = -1, max_body_bytes: int = 1 << 20,
                 header_timeout_s: float = 10.0) -> None:
        self._socks: dict[str, socket.socket] = {}
        try:
            if agent_port is not None:
                self._socks["agent"] = _listener(bind, agent_port)
            if http_port is not None:
                self._socks["http"] = _listener(bind, http_port)
        except OSError:
            self._close_socks()
            raise
        limits = {"max_connections": max_connections, "max_per_client": max_per_client}
        self._settings: dict[str, Any] = {
            "agent": {**limits, "max_line": MAX_LINE, "read_timeout_s": READ_TIMEOUT_S},
            "http": {**limits, "upstream_port": upstream_port, "max_body_bytes": max_body_bytes,
                     "header_timeout_s": header_timeout_s}}
        self._proc: subprocess.Popen[bytes] | None = None
        self._conn: Connection | None = None
        self._lock = threading.Lock()
        self._tables: dict[str, Any] = {"agent": {}, "http": {}}
        self.counters: dict[str, dict[str, int]] = {}
        """The child's counters per server as of its last acknowledged tables (``requests_total``, ...)."""
        self.restarts_total = 0
        self.hangs_total = 0
        """Children killed and replaced because they stopped answering."""
        self._unacked: deque[float] = deque()  # send times of the messages the child has not answered
        self._closed = threading.Event()
        self._watchdog: threading.Thread | None = None

    def port(self, which: str) -> int:
        """The bound port of ``"agent"`` or ``"http"`` (-1 when off)."""
        sock = self._socks.get(which)
        return int(sock.getsockname()[1]) if sock is not None else -1

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def start(self, agent: dict[str, bytes], http: dict[tuple[str, str], tuple[bytes, bytes]]) -> Self:
        """Start the child with these tables; returns once it serves them."""
        with self._lock:
            self._tables = {"agent": agent, "http": http}
            try:
                self._spawn()
            except OSError:
                self._close_socks()
                raise
        self._watchdog = threading.Thread(target=self._watch, name="triscope-feed-watchdog", daemon=True)
        self._watchdog.start()
        return self

    def _send(self, message: Any) -> None:
        assert self._conn is not None
        self._conn.send(message)
        self._unacked.append(time.monotonic())

    def _take_acks(self) -> None:
        assert self._conn is not None
        while self._conn.poll():
            self.counters = self._conn.recv()
            if self._unacked:
                self._unacked.popleft()

    def _watch(self) -> None:
        """Ping an idle child; replace one that leaves a message unanswered for HANG_S."""
        while not self._closed.wait(PING_S / 2):
            with self._lock:
                if self._closed.is_set():
                    return
                try:
                    if self._conn is None or self._proc is None or self._proc.poll() is not None:
                        raise EOFError("not running")
                    self._take_acks()
                    if self._unacked and time.monotonic() - self._unacked[0] > HANG_S:
                        self.hangs_total += 1
                        self._restart(f"no answer for {time.monotonic() - self._unacked[0]:.1f}s (hung)", kill=True)
                    elif not self._unacked:
                        self._send(None)
                except (OSError, EOFError) as exc:
                    self._restart(str(exc) or "gone")

    def _restart(self, why: str, kill: bool = False) -> None:
        log.warning("feed process: %s; starting it again", why)
        if kill and self._proc is not None:
            self._proc.kill()
        self._stop_child()
        try:
            self._spawn()
            self.restarts_total += 1
        except OSError as start_exc:
            log.warning("%s", start_exc)

    def _spawn(self) -> None:
        # a fresh interpreter, not multiprocessing: no fork of a threaded parent, no re-import of __main__
        parent_sock, child_sock = socket.socketpair()
        fds = {which: sock.fileno() for which, sock in self._socks.items()}
        settings = {which: {**self._settings[which], "fd": fd} for which, fd in fds.items()}
        argv = [sys.executable, "-m", __name__, str(child_sock.fileno()), json.dumps(settings)]
        proc = subprocess.Popen(argv, pass_fds=(*fds.values(), child_sock.fileno()), stdin=subprocess.DEVNULL)
        child_sock.close()
        parent_end = Connection(parent_sock.detach())
        try:
            parent_end.send(self._tables)
            if not parent_end.poll(START_TIMEOUT_S):
                raise OSError(f"it did not start within {START_TIMEOUT_S:g}s")
            self.counters = parent_end.recv()
        except (OSError, EOFError) as exc:
            parent_end.close()
            proc.kill()
            proc.wait(timeout=5.0)
            raise OSError(f"feed process failed to start: {exc or f'it exited with {proc.returncode}'}") from None
        self._proc, self._conn = proc, parent_end
        self._unacked.clear()

    def publish(self, agent: dict[str, bytes], http: dict[tuple[str, str], tuple[bytes, bytes]]) -> None:
        """Send new tables; a dead child is started again first (errors are logged, not raised)."""
        with self._lock:
            self._tables = {"agent": agent, "http": http}
            try:
                if self._conn is None or self._proc is None or self._proc.poll() is not None:
                    raise EOFError("not running")
                self._take_acks()  # the acknowledgements of the previous tables and pings
                self._send(self._tables)
            except (OSError, EOFError) as exc:
                self._restart(str(exc) or "gone")

    def _stop_child(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        if self._proc is not None:
            try:
                self._proc.wait(timeout=2.0)  # the closed pipe tells it to exit
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(timeout=2.0)
            self._proc = None

    def _close_socks(self) -> None:
        for sock in self._socks.values():
            sock.close()

    def close(self) -> None:
        """Stop the child and close the ports; idempotent."""
        self._closed.set()
        with self._lock:
            self._stop_child()
            self._close_socks()
        if self._watchdog is not None and self._watchdog is not threading.current_thread():
            self._watchdog.join(timeout=2.0)


def _serve(pipe_fd: int, settings: dict[str, dict[str, Any]]) -> None:
    """The child: take the first tables, serve, then swap in each set sent; exit when the parent goes."""
    from triscope.exporters.table_servers import TableAgentServer, TableHTTPServer

    conn = Connection(pipe_fd)
    servers: dict[str, Any] = {}
    for which, cls in (("agent", TableAgentServer), ("http", TableHTTPServer)):
        if which in settings:
            kwargs = dict(settings[which])
            servers[which] = cls(socket.socket(fileno=kwargs.pop("fd")), **kwargs)

    def counters() -> dict[str, dict[str, int]]:
        return {which: {"requests_total": getattr(server, "requests_total", 0),
                        "passed_total": getattr(server, "passed_total", 0), "refused_total": server.refused_total,
                        "evicted_total": server.evicted_total, "expired_total": server.expired_total,
                        "connections": server.connections} for which, server in servers.items()}

    try:
        first = True
        while True:
            tables = conn.recv()
            if tables is None:  # the parent's liveness ping
                conn.send(counters())
                continue
            for which, server in servers.items():
                server.table = tables[which]
            if first:
                for server in servers.values():
                    server.start()
                first = False
            conn.send(counters())
    except (EOFError, OSError, KeyboardInterrupt):
        pass
    finally:
        for server in servers.values():
            server.close()


__all__ = ["FeedProcess", "START_TIMEOUT_S", "agent_table"]

if __name__ == "__main__":
    _serve(int(sys.argv[1]), json.loads(sys.argv[2]))
