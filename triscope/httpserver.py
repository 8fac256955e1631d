"""Bounded threaded TCP/HTTP servers: every triscope listener (OTLP, /metrics, weight feed, HAProxy agent).

A thread per connection, and these bounds, so slow or hostile clients cannot starve the others:

* at most ``max_connections`` at once, and at most ``max_per_client`` from one client address;
* a total deadline for a request's headers (``header_timeout_s``, from accept or from the end of
  the previous answer on a keep-alive connection) and one for the rest of the request once its
  headers are in (``deadline_s``); past it the socket is shut down, however the bytes trickle in;
  ``read_timeout_s`` still bounds each single read;
* at a limit, a new connection takes the slot of the oldest slow connection (from that client
  when its own limit is the one reached): one that started a request and has not finished its
  head within ``evict_partial_after_s``, or that has sent nothing for ``evict_after_s``; when there
  is none it is closed at accept. A poll that sends its request at once therefore still gets an
  answer while slow clients hold every slot;
* a listen backlog of ``request_queue_size``.

A client that fails costs one log line, never a traceback (debug for hang-ups, time-outs and
evictions; a warning, at most once a minute, sums up refusals). Hosts default to 127.0.0.1; an
address with ``:`` binds IPv6. Handlers report the first bytes of a request with
``server.request_partial(sock)``, a whole request head with ``server.request_started(sock)``
(:class:`BoundedHTTPHandler` does both) and a connection waiting for its next request with
``server.renew_deadline(sock)``.
"""

from __future__ import annotations

import contextlib
import http.server
import logging
import math
import socket
import socketserver
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

from triscope.conn_budget import BUDGET
from triscope.http_body import HttpError, read_body

log = logging.getLogger(__name__)

DEFAULT_HOST = "127.0.0.1"
DEFAULT_MAX_CONNECTIONS = 512
DEFAULT_BACKLOG = 512
DEFAULT_READ_TIMEOUT_S = 10.0
DEFAULT_HEADER_TIMEOUT_S = 10.0
DEFAULT_DEADLINE_S = 60.0
DEFAULT_EVICT_AFTER_S = 1.0
DEFAULT_EVICT_PARTIAL_AFTER_S = 0.25
REFUSAL_LOG_EVERY_S = 60.0


def default_max_per_client(max_connections: int) -> int:
    """A quarter of ``max_connections``, at least 16 (at most ``max_connections``)."""
    return min(max_connections, max(16, max_connections // 4))


@dataclass
class _Conn:
    """One live connection: its client address, since when it waits, whether a request is in."""

    client: str
    since: float
    deadline: float
    busy: bool = False
    partial: bool = False
    cut: bool = False


class BoundedServerMixIn(socketserver.ThreadingMixIn):
    """Thread per connection with the bounds of the module docstring; put it before a socketserver class."""

    daemon_threads = True
    block_on_close = False
    allow_reuse_address = True
    request_queue_size = DEFAULT_BACKLOG
    max_connections = DEFAULT_MAX_CONNECTIONS
    max_per_client = 0
    """0: :func:`default_max_per_client` of ``max_connections``."""
    read_timeout_s: float | None = DEFAULT_READ_TIMEOUT_S
    header_timeout_s: float | None = DEFAULT_HEADER_TIMEOUT_S
    deadline_s: float | None = DEFAULT_DEADLINE_S
    evict_after_s: float = DEFAULT_EVICT_AFTER_S
    evict_partial_after_s: float = DEFAULT_EVICT_PARTIAL_AFTER_S
    name = "triscope-server"
    address_family: int = socket.AF_INET

    def __init__(self, address: tuple[str, int], handler: Any, *, max_connections: int | None = None,
                 read_timeout_s: float | None = None, deadline_s: float | None = None, name: str | None = None,
                 header_timeout_s: float | None = None, max_per_client: int | None = None,
                 evict_after_s: float | None = None, evict_partial_after_s: float | None = None,
                 **kwargs: Any) -> None:
        if ":" in address[0]:
            self.address_family = int(socket.AF_INET6)
        for key, value in (("max_connections", max_connections), ("read_timeout_s", read_timeout_s),
                           ("deadline_s", deadline_s), ("header_timeout_s", header_timeout_s),
                           ("max_per_client", max_per_client), ("evict_after_s", evict_after_s),
                           ("evict_partial_after_s", evict_partial_after_s)):
            if value is not None:
                setattr(self, key, value)
        if self.max_per_client <= 0:
            self.max_per_client = default_max_per_client(self.max_connections)
        self.name = name or self.name
        self.refused_total = 0
        self.evicted_total = 0
        self.expired_total = 0
        self._conns: dict[socket.socket, _Conn] = {}
        self._per_client: Counter[str] = Counter()
        self._evicted: set[socket.socket] = set()
        self._evict_slack = max(8, self.max_connections // 8)  # evicted threads still exiting, at most
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._watchdog: threading.Thread | None = None
        self._next_due = math.inf  # when the watchdog looks next: only an earlier deadline wakes it
        self._last_refusal_log = -math.inf
        super().__init__(address, handler, **kwargs)  # type: ignore[call-arg]  # the socketserver class after us

    # ---------------------------------------------------------------- deadlines

    def _waiting_deadline(self, now: float) -> float:
        """Deadline of a connection waiting for a request's headers (never past ``deadline_s``)."""
        limits = [t for t in (self.header_timeout_s, self.deadline_s) if t is not None]
        return now + min(limits) if limits else math.inf

    def renew_deadline(self, sock: socket.socket) -> None:
        """``sock`` answered a request and waits for the next one (HTTP/1.1 keep-alive)."""
        now = time.monotonic()
        self._update(sock, busy=False, since=now, deadline=self._waiting_deadline(now))

    def request_partial(self, sock: socket.socket) -> None:
        """``sock`` sent the first bytes of a request: from now it has ``evict_partial_after_s`` to finish."""
        with self._lock:
            conn = self._conns.get(sock)
            if conn is not None and not conn.busy:
                conn.partial = True

    def request_started(self, sock: socket.socket) -> bool:
        """``sock`` delivered a whole request head: it is no longer evictable, ``deadline_s`` starts.
        False when the connection was already cut or evicted (its "head" ended with the shutdown):
        do not run the request."""
        now = time.monotonic()
        return self._update(sock, busy=True, since=now,
                            deadline=now + self.deadline_s if self.deadline_s is not None else math.inf)

    def _update(self, sock: socket.socket, busy: bool, since: float, deadline: float) -> bool:
        with self._lock:
            conn = self._conns.get(sock)
            if conn is None or conn.cut:
                return False
            conn.busy, conn.since, conn.deadline, conn.partial = busy, since, deadline, False
            early = deadline < self._next_due
        if early:
            self._wake.set()
        return True

    def _run_watchdog(self) -> None:
        """Shut down sockets past their deadline (wakes the handler's blocked read or write); the
        handler's thread then unregisters it. Runs while connections live."""
        while True:
            now = time.monotonic()
            with self._lock:
                for sock, conn in self._conns.items():
                    if conn.deadline <= now:
                        conn.deadline, conn.cut = math.inf, True
                        self.expired_total += 1
                        log.debug("%s: client %s: cut at its deadline", self.name, conn.client)
                        with contextlib.suppress(OSError):
                            sock.shutdown(socket.SHUT_RDWR)
                if not self._conns:
                    self._watchdog, self._next_due = None, math.inf
                    return
                wait = min(1.0, max(0.01, min(c.deadline for c in self._conns.values()) - now))
                self._next_due = now + wait
            self._wake.wait(wait)
            self._wake.clear()

    # ---------------------------------------------------------------- admission

    def _victim(self, client: str | None, now: float) -> socket.socket | None:
        """The oldest slow connection (of ``client`` when given); None when there is none."""
        best: tuple[float, socket.socket] | None = None
        for sock, conn in self._conns.items():
            grace = self.evict_partial_after_s if conn.partial else self.evict_after_s
            if conn.busy or now - conn.since < grace or (client is not None and conn.client != client):
                continue
            if best is None or conn.since < best[0]:
                best = (conn.since, sock)
        return best[1] if best is not None else None

    def _admit(self, request: socket.socket, client: str) -> bool:
        """Register ``request``, evicting a slow waiting connection when a limit is reached (this server's,
        or the process's connection budget); False: refuse. A victim's budget slot passes to ``request``."""
        now = time.monotonic()
        with self._lock:
            client_full = self._per_client[client] >= self.max_per_client
            server_full = client_full or len(self._conns) >= self.max_connections
            if server_full or not BUDGET.try_acquire():
                victim = self._victim(client if client_full else None, now)
                if victim is None or len(self._evicted) >= self._evict_slack:
                    self.refused_total += 1
                    if not server_full:
                        BUDGET.refused()
                    return False
                gone = self._conns.pop(victim)
                self._release(gone.client)
                self._evicted.add(victim)
                self.evicted_total += 1
                log.debug("%s: client %s: evicted after %.1fs without a request", self.name, gone.client,
                          now - gone.since)
                with contextlib.suppress(OSError):  # under the lock: its thread cannot have closed it yet
                    victim.shutdown(socket.SHUT_RDWR)
            self._conns[request] = _Conn(client, now, self._waiting_deadline(now))
            self._per_client[client] += 1
            early = self._conns[request].deadline < self._next_due
            if self._watchdog is None:
                self._watchdog = threading.Thread(target=self._run_watchdog, name=f"{self.name}-deadline",
                                                  daemon=True)
                self._watchdog.start()
        if early:
            self._wake.set()
        return True

    def _release(self, client: str) -> None:
        """One connection of ``client`` fewer (called under the lock); no zero entries are kept."""
        self._per_client[client] -= 1
        if self._per_client[client] <= 0:
            del self._per_client[client]

    def _forget(self, request: Any) -> None:
        with self._lock:
            conn = self._conns.pop(request, None)
            if conn is not None:  # (an evicted one's slot went to the connection that evicted it)
                self._release(conn.client)
                BUDGET.release()
            self._evicted.discard(request)

    @property
    def connections(self) -> int:
        """Connections holding a slot now."""
        with self._lock:
            return len(self._conns)

    def process_request(self, request: Any, client_address: Any) -> None:
        client = str(client_address[0]) if isinstance(client_address, tuple) else str(client_address)
        if not self._admit(request, client):
            now = time.monotonic()
            if now - self._last_refusal_log >= REFUSAL_LOG_EVERY_S:
                self._last_refusal_log = now
                log.warning("%s: connection limit reached (%d at once, %d per client); refusing more "
                            "(%d refused, %d evicted so far)", self.name, self.max_connections, self.max_per_client,
                            self.refused_total, self.evicted_total)
            self._close(request)
            return
        try:
            if self.read_timeout_s is not None:
                request.settimeout(self.read_timeout_s)
            super().process_request(request, client_address)
        except BaseException:
            self._forget(request)
            raise

    def shutdown_request(self, request: Any) -> None:
        self._forget(request)
        self._close(request)

    def _close(self, request: Any) -> None:
        with contextlib.suppress(OSError):
            request.shutdown(socket.SHUT_WR)
        request.close()

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A failed client is one line: debug for hang-ups and timeouts, a warning otherwise."""
        exc = sys.exc_info()[1]
        if isinstance(exc, OSError):
            log.debug("%s: client %s: %s", self.name, client_address, exc)
        else:
            log.warning("%s: connection from %s failed: %r", self.name, client_address, exc)


class BoundedTCPServer(BoundedServerMixIn, socketserver.TCPServer):
    """A bounded line/stream server (the HAProxy agent)."""


class BoundedHTTPServer(BoundedServerMixIn, http.server.HTTPServer):
    """A bounded HTTP server; use :class:`BoundedHTTPHandler` (or call ``request_started`` and
    ``renew_deadline``) so requests get their own deadlines."""


class BoundedRequestMixIn(http.server.BaseHTTPRequestHandler):
    """Tells a bounded server when a request's head is in; put it before another handler class
    (a WSGI handler, say) whose requests should not count as slow clients."""

    disable_nagle_algorithm = True
    """``http.server`` writes an answer's head and body apart: with Nagle's algorithm the body waited
    for the client's delayed ACK, 44 ms per keep-alive request (177 requests/s at 8 connections
    against 11,574 with TCP_NODELAY; ``bench/http_stack.py``)."""

    def parse_request(self) -> bool:
        partial = getattr(self.server, "request_partial", None)
        if partial is not None:  # the request line is in, the headers may trickle
            partial(self.connection)
        ok = super().parse_request()
        started = getattr(self.server, "request_started", None)
        if ok and started is not None and started(self.connection) is False:
            self.close_connection = True  # cut or evicted while its headers trickled: no answer
            return False
        return ok


class BoundedHTTPHandler(BoundedRequestMixIn):
    """HTTP/1.1 handler whose connection deadline restarts after each answered request; logs at debug."""

    protocol_version = "HTTP/1.1"

    def handle_one_request(self) -> None:
        super().handle_one_request()
        renew = getattr(self.server, "renew_deadline", None)
        if renew is not None and not self.close_connection:
            renew(self.connection)

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s " + format, self.address_string(), *args)


def serve_in_thread(server: socketserver.BaseServer, name: str, poll_interval: float = 0.2) -> threading.Thread:
    """Run ``server.serve_forever`` in a daemon thread named ``name``; stop it with :func:`stop`."""
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": poll_interval}, name=name,
                              daemon=True)
    thread.start()
    return thread


def stop(server: socketserver.BaseServer, thread: threading.Thread | None, timeout_s: float = 5.0) -> None:
    """Stop serving (when ``thread`` runs it), close the listening socket, join the thread."""
    if thread is not None and thread.is_alive():
        server.shutdown()
    server.server_close()
    if thread is not None:
        thread.join(timeout=timeout_s)


__all__ = ["DEFAULT_BACKLOG", "DEFAULT_DEADLINE_S", "DEFAULT_EVICT_AFTER_S", "DEFAULT_EVICT_PARTIAL_AFTER_S",
           "DEFAULT_HEADER_TIMEOUT_S",
           "DEFAULT_HOST", "DEFAULT_MAX_CONNECTIONS", "DEFAULT_READ_TIMEOUT_S", "BoundedHTTPHandler",
           "BoundedHTTPServer", "BoundedRequestMixIn", "BoundedServerMixIn", "BoundedTCPServer", "HttpError",
           "default_max_per_client", "read_body", "serve_in_thread", "stop"]
