"""Bounded threaded TCP/HTTP servers: every triscope listener (OTLP, /metrics, weight feed, HAProxy agent).

A thread per connection, at most ``max_connections`` at once (extra ones are closed at accept),
a listen backlog of ``request_queue_size``, a per-read timeout (``read_timeout_s``) and a total
deadline per connection (``deadline_s``; for HTTP/1.1 keep-alive, per request) after which the
socket is shut down, so a slow client cannot hold a thread. A client that fails costs one log
line, never a traceback. Hosts default to 127.0.0.1; an address with ``:`` binds IPv6.
"""

from __future__ import annotations

import contextlib
import http.server
import logging
import socket
import socketserver
import sys
import threading
import time
from typing import Any

log = logging.getLogger(__name__)

DEFAULT_HOST = "127.0.0.1"
DEFAULT_MAX_CONNECTIONS = 512
DEFAULT_BACKLOG = 128
DEFAULT_READ_TIMEOUT_S = 10.0
DEFAULT_DEADLINE_S = 60.0


class HttpError(Exception):
    """An HTTP error answer: ``status``, a one-line message and extra response headers."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message.replace("\n", " "))
        self.status = status
        self.headers = headers or {}


def read_body(handler: http.server.BaseHTTPRequestHandler, limit: int, *, required: bool = False) -> bytes:
    """The request's ``Content-Length`` body, at most ``limit`` bytes, else :class:`HttpError`:
    411 chunked (or no length when ``required``), 400 a bad or short length, 413 over ``limit``
    (nothing read). On an error the connection is marked to close: an unread body cannot be skipped."""
    try:
        if handler.headers.get("Transfer-Encoding", "identity").strip().lower() != "identity":
            raise HttpError(411, "chunked bodies are not accepted; send Content-Length")
        raw = handler.headers.get("Content-Length")
        if raw is None:
            if required:
                raise HttpError(411, "Content-Length is required")
            return b""
        try:
            length = int(raw)
        except ValueError:
            length = -1
        if length < 0:
            raise HttpError(400, f"bad Content-Length {raw!r}")
        if length > limit:
            raise HttpError(413, f"body of {length} bytes exceeds the limit of {limit}")
        body = handler.rfile.read(length) if length else b""
        if len(body) < length:
            raise HttpError(400, f"body ended after {len(body)} of {length} bytes")
        return body
    except HttpError:
        handler.close_connection = True
        raise


class _Watchdog:
    """Shuts down sockets past their deadline (one thread per server, running while connections live)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._due: dict[socket.socket, float] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self.expired = 0

    def set(self, sock: socket.socket, deadline: float) -> None:
        with self._lock:
            self._due[sock] = deadline
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=f"{self.name}-deadline", daemon=True)
                self._thread.start()
        self._wake.set()

    def discard(self, sock: socket.socket) -> None:
        with self._lock:  # serialised with _run's shutdown: never shut a socket being closed
            self._due.pop(sock, None)

    def _run(self) -> None:
        while True:
            now = time.monotonic()
            with self._lock:
                expired = [s for s, t in self._due.items() if t <= now]
                for sock in expired:
                    del self._due[sock]
                    self.expired += 1
                    with contextlib.suppress(OSError):
                        sock.shutdown(socket.SHUT_RDWR)  # wakes the handler's blocked read or write
                if not self._due:
                    self._thread = None
                    return
                wait = min(self._due.values()) - now
            self._wake.wait(max(0.01, wait))
            self._wake.clear()


class BoundedServerMixIn(socketserver.ThreadingMixIn):
    """Thread per connection with the bounds of the module docstring; put it before a socketserver class."""

    daemon_threads = True
    block_on_close = False
    allow_reuse_address = True
    request_queue_size = DEFAULT_BACKLOG
    max_connections = DEFAULT_MAX_CONNECTIONS
    read_timeout_s: float | None = DEFAULT_READ_TIMEOUT_S
    deadline_s: float | None = DEFAULT_DEADLINE_S
    name = "triscope-server"
    address_family: int = socket.AF_INET

    def __init__(self, address: tuple[str, int], handler: Any, *, max_connections: int | None = None,
                 read_timeout_s: float | None = None, deadline_s: float | None = None, name: str | None = None,
                 **kwargs: Any) -> None:
        if ":" in address[0]:
            self.address_family = int(socket.AF_INET6)
        if max_connections is not None:
            self.max_connections = max_connections
        if read_timeout_s is not None:
            self.read_timeout_s = read_timeout_s
        if deadline_s is not None:
            self.deadline_s = deadline_s
        self.name = name or self.name
        self.refused_total = 0
        self._slots = threading.BoundedSemaphore(self.max_connections)
        self._watchdog = _Watchdog(self.name)
        self._last_refusal_log = 0.0
        super().__init__(address, handler, **kwargs)  # type: ignore[call-arg]  # the socketserver class after us

    @property
    def expired_total(self) -> int:
        """Connections shut down at their deadline."""
        return self._watchdog.expired

    def renew_deadline(self, sock: socket.socket) -> None:
        """Start a new deadline for ``sock`` (an HTTP/1.1 connection about to wait for its next request)."""
        if self.deadline_s is not None:
            self._watchdog.set(sock, time.monotonic() + self.deadline_s)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self.refused_total += 1
            now = time.monotonic()
            if now - self._last_refusal_log >= 60:
                self._last_refusal_log = now
                log.warning("%s: %d connection(s) open, the limit; refusing more (%d refused so far)",
                            self.name, self.max_connections, self.refused_total)
            self._close(request)
            return
        try:
            if self.read_timeout_s is not None:
                request.settimeout(self.read_timeout_s)
            self.renew_deadline(request)
            super().process_request(request, client_address)
        except BaseException:
            self._watchdog.discard(request)
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def shutdown_request(self, request: Any) -> None:
        self._watchdog.discard(request)
        self._close(request)

    def _close(self, request: Any) -> None:
        with contextlib.suppress(OSError):
            request.shutdown(socket.SHUT_WR)
        request.close()

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A failed client is one line: debug for hang-ups and timeouts, a warning otherwise."""
        exc = sys.exc_info()[1]
        if isinstance(exc, ConnectionError | TimeoutError):
            log.debug("%s: client %s: %s", self.name, client_address, exc)
        else:
            log.warning("%s: connection from %s failed: %r", self.name, client_address, exc)


class BoundedTCPServer(BoundedServerMixIn, socketserver.TCPServer):
    """A bounded line/stream server (the HAProxy agent)."""


class BoundedHTTPServer(BoundedServerMixIn, http.server.HTTPServer):
    """A bounded HTTP server; use :class:`BoundedHTTPHandler` (or call ``renew_deadline``) for keep-alive."""


class BoundedHTTPHandler(http.server.BaseHTTPRequestHandler):
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


__all__ = ["DEFAULT_BACKLOG", "DEFAULT_DEADLINE_S", "DEFAULT_HOST", "DEFAULT_MAX_CONNECTIONS", "DEFAULT_READ_TIMEOUT_S",
           "BoundedHTTPHandler", "BoundedHTTPServer", "BoundedServerMixIn", "BoundedTCPServer", "HttpError",
           "read_body", "serve_in_thread", "stop"]
