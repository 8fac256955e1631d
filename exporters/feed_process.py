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
listening sockets, so ports never change and polls queue in their backlog meanwhile. The child exits
when the parent closes or dies (its end of the pipe closes).
"""

from __future__ import annotations

import json
import logging
import socket
import subprocess
import sys
import threading
from collections.abc import Mapping
from multiprocessing.connection import Connection
from typing import Any, Self

from triscope.analyzers.routing import WeightsResult
from triscope.exporters.haproxy_agent import MAX_LINE, READ_TIMEOUT_S, agent_reply

log = logging.getLogger(__name__)

START_TIMEOUT_S = 30.0
"""How long a new child may take to import, take its first tables and start serving."""


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
        return self

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

    def publish(self, agent: dict[str, bytes], http: dict[tuple[str, str], tuple[bytes, bytes]]) -> None:
        """Send new tables; a dead child is started again first (errors are logged, not raised)."""
        with self._lock:
            self._tables = {"agent": agent, "http": http}
            conn = self._conn
            try:
                if conn is None or self._proc is None or self._proc.poll() is not None:
                    raise EOFError("not running")
                while conn.poll():  # the acknowledgement of the previous tables
                    self.counters = conn.recv()
                conn.send(self._tables)
            except (OSError, EOFError) as exc:
                log.warning("feed process: %s; starting it again", exc or "gone")
                self._stop_child()
                try:
                    self._spawn()
                    self.restarts_total += 1
                except OSError as start_exc:
                    log.warning("%s", start_exc)

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
        with self._lock:
            self._stop_child()
            self._close_socks()


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
