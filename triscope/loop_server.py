"""One event loop on its own thread serving a TCP protocol with bounded connections: the server kit of
the daemon (the feed's HTTP server and its HAProxy agent port, the table servers, the pick table,
``/metrics``; HTTP on it: :mod:`triscope.loop_http`).

At most ``max_connections`` connections (``max_per_client`` from one address), within the process's
connection budget (:mod:`triscope.conn_budget`); at a limit a new connection takes the slot of the oldest
one that has not completed a request (from that client when its own limit is the one reached); with none,
the new one is closed unanswered. A keep-alive connection that
has been answered (a load balancer polling on it) is never evicted. A client that sends its request at
once therefore gets in, and an LB keeps its connection, while slow clients hold every other slot. A
connection whose request is not complete ``timeout_s`` after it connected (or after its last answer)
expires.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
from collections import Counter
from typing import Self, cast

from triscope.conn_budget import BUDGET

DEFAULT_HOST = "127.0.0.1"
DEFAULT_MAX_CONNECTIONS = 512
DEFAULT_HEADER_TIMEOUT_S = 10.0
"""A connection's request must be complete this long after it connected or got its last answer."""


def default_max_per_client(max_connections: int) -> int:
    """A quarter of ``max_connections``, at least 16 (at most ``max_connections``)."""
    return min(max_connections, max(16, max_connections // 4))


def _new_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop  # optional: about twice the requests per second of the default loop
    except ImportError:
        return asyncio.new_event_loop()
    loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
    return loop


class LoopServer:
    """A listener on ``bind:port`` (0 = ephemeral) whose connections are ``connection(self)`` protocols."""

    connection: type[LoopConnection]
    thread_name = "triscope-loop-server"

    def __init__(self, bind: str, port: int, max_connections: int, max_per_client: int, timeout_s: float,
                 sock: socket.socket | None = None) -> None:
        self.max_connections = max_connections
        self.max_per_client = max_per_client or default_max_per_client(max_connections)
        self.timeout_s = timeout_s
        self.per_client: Counter[str] = Counter()
        self.open_connections: set[LoopConnection] = set()
        self.refused_total = 0
        self.evicted_total = 0
        self.expired_total = 0
        self._loop = _new_loop()
        self._server: asyncio.Server | None = None
        self._loop.run_until_complete(self._listen(bind, port, sock))
        assert self._server is not None
        self.port: int = int(self._server.sockets[0].getsockname()[1])
        self._thread: threading.Thread | None = None

    async def _listen(self, bind: str, port: int, sock: socket.socket | None) -> None:
        if sock is not None:  # a listening socket handed over by another process (agent_process)
            self._server = await self._loop.create_server(lambda: self.connection(self), sock=sock, backlog=1024)
            return
        self._server = await self._loop.create_server(lambda: self.connection(self), bind, port, backlog=1024,
                                                      reuse_address=True)

    def start(self) -> Self:
        self._thread = threading.Thread(target=self._loop.run_forever, name=self.thread_name, daemon=True)
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

    def admit(self, conn: LoopConnection, now: float) -> bool:
        """Give ``conn`` a slot, evicting the oldest slow connection at a limit (this server's, or the
        process's connection budget); False: refuse it."""
        client_full = self.per_client[conn.client] >= self.max_per_client
        server_full = client_full or self.connections >= self.max_connections
        if server_full or not BUDGET.try_acquire():
            victim = self._victim(conn.client if client_full else None, now)
            if victim is None:
                self.refused_total += 1
                if not server_full:
                    BUDGET.refused()
                return False
            self.evicted_total += 1
            victim.drop(abort=True)  # releases its budget slot
            if not BUDGET.try_acquire():  # another server took it meanwhile (another thread)
                self.refused_total += 1
                BUDGET.refused()
                return False
        self.open_connections.add(conn)
        self.per_client[conn.client] += 1
        return True

    def release(self, conn: LoopConnection) -> None:
        if conn in self.open_connections:
            BUDGET.release()
            self.open_connections.discard(conn)
            self.per_client[conn.client] -= 1
            if self.per_client[conn.client] <= 0:
                del self.per_client[conn.client]

    def _victim(self, client: str | None, now: float) -> LoopConnection | None:
        """The connection to evict for a new one (of ``client`` when given): the oldest that never completed a
        request (a slow or idle client; a load balancer sends its request at once, so its connection is the
        youngest until it is answered). A keep-alive connection that has been answered (a load balancer's,
        polling on it) is never evicted: it ends by its idle timeout."""
        best: LoopConnection | None = None
        for c in self.open_connections:
            if c.answered_total or c.busy or (client is not None and c.client != client):
                continue
            if best is None or c.since < best.since:
                best = c
        return best


class LoopConnection(asyncio.Protocol):
    """One connection of a :class:`LoopServer`: its slot, its timer and what it has sent so far."""

    def __init__(self, server: LoopServer) -> None:
        self.server = server
        self.buffer = b""
        self.transport: asyncio.Transport | None = None
        self.client = ""
        self.since = 0.0
        """When it connected or last got an answer (the start of its wait for a request)."""
        self.answered_total = 0
        """Requests answered on it: a connection that never completed one is evicted first."""
        self.busy = False
        """A request of it is being answered (off the loop): it is not evicted meanwhile."""
        self.timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = tcp = cast(asyncio.Transport, transport)  # uvloop's TCP transport is no subclass
        peer = tcp.get_extra_info("peername")
        self.client = str(peer[0]) if peer else ""
        self.since = asyncio.get_running_loop().time()
        if not self.server.admit(self, self.since):
            self.refused()
            return
        self._arm()

    def refused(self) -> None:
        """Over the bound and nobody to evict: closed unanswered."""
        if self.transport is not None:
            self.transport.abort()
        self.transport = None

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

    def _arm(self, timeout_s: float | None = None) -> None:
        """(Re)start the timer: ``timeout_s`` (default the server's) for the request to be complete."""
        if self.timer is not None:
            self.timer.cancel()
        self.timer = asyncio.get_running_loop().call_later(timeout_s or self.server.timeout_s, self._expire)
