"""The HAProxy agent port served by a process of its own, from answer tables the engine sends.

In the feed's process the engine update holds the interpreter lock while it runs (about 40 ms over
1,000 backends), and an agent check arriving then waits up to a switch interval per turn: that
wait is the agent's tail latency at fleet scale. With ``[weights.feed] agent_process = true`` the
feed binds the agent port itself and hands the listening socket to a child process running the
same event-loop server (:class:`~triscope.exporters.haproxy_agent.AgentServer`); after every
update it sends the child a table ``agent-send line -> encoded answer`` for every backend and every
(backend, class) pair. The child never runs the engine: a check is a dictionary lookup.

Answers are those of :func:`~triscope.exporters.haproxy_agent.agent_reply` (tested line for line):
a class the table does not know gets the backend's own answer, a backend it does not know (or no
table yet) ``ready 100%``. A child that dies is started again, on the same socket, at the next
update; the parent keeps the listening socket, so the port never changes and checks queue in its
backlog meanwhile.
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
from triscope.exporters.haproxy_agent import (
    MAX_LINE,
    READ_TIMEOUT_S,
    UNKNOWN_REPLY,
    AgentServer,
    agent_reply,
    parse_agent_line,
)

log = logging.getLogger(__name__)

START_TIMEOUT_S = 30.0
"""How long a new child may take to import, take its first table and start serving."""
_UNKNOWN = UNKNOWN_REPLY.encode()
Table = dict[str, bytes]


def agent_table(result: WeightsResult | None, max_inflight: Mapping[str, int]) -> Table:
    """Every answer the agent can give for ``result``: by backend name and by ``"NAME CLASS"``."""
    if result is None:
        return {}
    table: Table = {}
    for name in result.backends:
        limit = max_inflight.get(name, 0)
        table[name] = agent_reply(result, name, limit).encode()
        for request_class in result.class_admission:
            table[f"{name} {request_class}"] = agent_reply(result, name, limit, request_class).encode()
    return table


def table_reply(table: Mapping[str, bytes], line: str) -> bytes:
    """The answer to one ``agent-send`` line (stripped) from a table of :func:`agent_table`."""
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
    """The agent server answering from :attr:`table` (replaced whole by the parent's updates)."""

    def __init__(self, sock: socket.socket, max_connections: int, max_per_client: int, max_line: int,
                 read_timeout_s: float) -> None:
        self.table: Table = {}
        super().__init__(lambda: None, max_line=max_line, read_timeout_s=read_timeout_s,
                         max_connections=max_connections, max_per_client=max_per_client, sock=sock)

    def reply(self, line: str) -> bytes:
        return table_reply(self.table, line)

    def counters(self) -> dict[str, int]:
        return {"requests_total": self.requests_total, "refused_total": self.refused_total,
                "evicted_total": self.evicted_total, "expired_total": self.expired_total,
                "connections": self.connections}


def _serve(listen_fd: int, pipe_fd: int, settings: dict[str, Any]) -> None:
    """The child: take the first table, serve, then swap in each table sent; exit when the parent goes."""
    conn = Connection(pipe_fd)
    server = TableAgentServer(socket.socket(fileno=listen_fd), **settings)
    try:
        server.table = conn.recv()
        server.start()
        conn.send(server.counters())
        while True:
            server.table = conn.recv()
            conn.send(server.counters())
    except (EOFError, OSError, KeyboardInterrupt):
        pass
    finally:
        server.close()


class AgentProcess:
    """The parent's handle: binds ``bind:port`` (0 = ephemeral), runs the child, sends it tables."""

    def __init__(self, bind: str = "127.0.0.1", port: int = 0, max_inflight: Mapping[str, int] | None = None,
                 max_connections: int = 512, max_per_client: int = 0, max_line: int = MAX_LINE,
                 read_timeout_s: float = READ_TIMEOUT_S) -> None:
        self.max_inflight = dict(max_inflight or {})
        self._settings = {"max_connections": max_connections, "max_per_client": max_per_client,
                          "max_line": max_line, "read_timeout_s": read_timeout_s}
        family = socket.AF_INET6 if ":" in bind else socket.AF_INET
        self._sock = socket.create_server((bind, port), family=family, backlog=1024)
        self.port: int = int(self._sock.getsockname()[1])
        self._proc: subprocess.Popen[bytes] | None = None
        self._conn: Connection | None = None
        self._lock = threading.Lock()
        self._table: Table = {}
        self.counters: dict[str, int] = {}
        """The child's counters as of its last acknowledged table (``requests_total``, ...)."""
        self.restarts_total = 0

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def start(self, result: WeightsResult | None) -> Self:
        """Start the child with the answers of ``result``; returns once it serves them."""
        with self._lock:
            self._table = agent_table(result, self.max_inflight)
            try:
                self._spawn()
            except OSError:
                self._sock.close()
                raise
        return self

    def _spawn(self) -> None:
        # a fresh interpreter, not multiprocessing: no fork of a threaded parent, no re-import of __main__
        parent_sock, child_sock = socket.socketpair()
        fds = (self._sock.fileno(), child_sock.fileno())
        argv = [sys.executable, "-m", __name__, str(fds[0]), str(fds[1]), json.dumps(self._settings)]
        proc = subprocess.Popen(argv, pass_fds=fds, stdin=subprocess.DEVNULL)
        child_sock.close()
        parent_end = Connection(parent_sock.detach())
        try:
            parent_end.send(self._table)
            if not parent_end.poll(START_TIMEOUT_S):
                raise OSError(f"it did not start within {START_TIMEOUT_S:g}s")
            self.counters = parent_end.recv()
        except (OSError, EOFError) as exc:
            parent_end.close()
            proc.kill()
            proc.wait(timeout=5.0)
            raise OSError(f"agent process failed to start: {exc or f'it exited with {proc.returncode}'}") from None
        self._proc, self._conn = proc, parent_end

    def publish(self, result: WeightsResult | None) -> None:
        """Send the answers of ``result``; a dead child is started again first (errors are logged)."""
        table = agent_table(result, self.max_inflight)
        with self._lock:
            self._table = table
            conn = self._conn
            try:
                if conn is None or self._proc is None or self._proc.poll() is not None:
                    raise EOFError("not running")
                while conn.poll():  # the acknowledgement of the previous table
                    self.counters = conn.recv()
                conn.send(table)
            except (OSError, EOFError) as exc:
                log.warning("haproxy agent process: %s; starting it again on port %d", exc or "gone", self.port)
                self._stop_child()
                try:
                    self._spawn()
                    self.restarts_total += 1
                except OSError as start_exc:
                    log.warning("haproxy agent process: %s", start_exc)

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

    def close(self) -> None:
        """Stop the child and close the port; idempotent."""
        with self._lock:
            self._stop_child()
            self._sock.close()


__all__ = ["AgentProcess", "TableAgentServer", "agent_table", "table_reply"]


if __name__ == "__main__":
    _serve(int(sys.argv[1]), int(sys.argv[2]), json.loads(sys.argv[3]))
