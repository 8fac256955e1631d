"""Threaded socket servers with a cap on concurrent connections (one thread each)."""

from __future__ import annotations

import logging
import socketserver
import sys
import threading
import typing
from typing import Any

log = logging.getLogger(__name__)

DEFAULT_MAX_CONNECTIONS = 512


class BoundedThreadingMixIn(socketserver.ThreadingMixIn):
    """Thread per connection, at most ``max_connections`` at once; extra connections are closed."""

    daemon_threads = True
    block_on_close = False
    max_connections = DEFAULT_MAX_CONNECTIONS
    refused_total = 0

    def process_request(self, request: Any, client_address: Any) -> None:
        slots = self.__dict__.setdefault("_slots", threading.BoundedSemaphore(self.max_connections))
        if not slots.acquire(blocking=False):
            self.refused_total += 1
            typing.cast(socketserver.BaseServer, self).shutdown_request(request)  # the mixin sits on a server
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            slots.release()
            raise

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that resets or hangs up is routine: one debug line, not a traceback on stderr."""
        exc = sys.exc_info()[1]
        if isinstance(exc, ConnectionError | TimeoutError):
            log.debug("client %s: %s", client_address, exc)
            return
        log.warning("connection from %s failed: %r", client_address, exc)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.__dict__["_slots"].release()
