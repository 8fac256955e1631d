"""A raw-socket HTTP server on 127.0.0.1 for scraper tests: each path answers with a scripted
behaviour (plain body, trickled headers or body, redirect, chunked, oversized), so fetch deadlines
and body bounds are tested against real sockets, not mocks."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass


@dataclass
class Route:
    """How one path answers. ``trickle_s`` > 0 sends the response one byte at a time with that
    pause (``trickle_headers`` False: the headers arrive at once and only the body trickles)."""

    body: bytes = b""
    status: str = "200 OK"
    headers: tuple[tuple[str, str], ...] = (("Content-Type", "text/plain; version=0.0.4"),)
    trickle_s: float = 0.0
    trickle_headers: bool = False
    chunked: bool = False
    content_length: bool = True


class RawServer:
    """``routes``: path -> Route, or a callable returning one per request (to change it between scrapes)."""

    def __init__(self, routes: dict[str, Route | Callable[[], Route]]) -> None:
        self.routes = routes
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.stop = threading.Event()
        self.requests: list[str] = []
        self._threads: list[threading.Thread] = []
        self._accept = threading.Thread(target=self._serve, daemon=True)

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def __enter__(self) -> RawServer:
        self._accept.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop listening (a closed port refuses connections); idempotent."""
        self.stop.set()
        self.sock.close()
        self._accept.join(timeout=5)
        for t in self._threads:
            t.join(timeout=5)

    def _serve(self) -> None:
        self.sock.settimeout(0.1)
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except (TimeoutError, OSError):
                continue
            t = threading.Thread(target=self._handle, args=(conn,), daemon=True)
            self._threads.append(t)
            t.start()

    def _handle(self, conn: socket.socket) -> None:
        with conn, contextlib.suppress(OSError):
            conn.settimeout(5)
            data = b""
            while b"\r\n\r\n" not in data:
                got = conn.recv(4096)
                if not got:
                    return
                data += got
            path = data.split(b" ", 2)[1].decode()
            self.requests.append(path)
            route = self.routes.get(path, Route(status="404 Not Found", body=b"no such path\n"))
            if callable(route):
                route = route()
            head, body = self._render(route)
            if route.trickle_s > 0 and route.trickle_headers:
                self._trickle(conn, head + body, route.trickle_s)
                return
            conn.sendall(head)
            if route.trickle_s > 0:
                self._trickle(conn, body, route.trickle_s)
            else:
                conn.sendall(body)

    def _trickle(self, conn: socket.socket, data: bytes, pause: float) -> None:
        for i in range(len(data)):
            if self.stop.is_set():
                return
            conn.sendall(data[i:i + 1])
            time.sleep(pause)

    @staticmethod
    def _render(route: Route) -> tuple[bytes, bytes]:
        headers = list(route.headers) + [("Connection", "close")]
        body = route.body
        if route.chunked:
            headers.append(("Transfer-Encoding", "chunked"))
            body = b"".join(b"%x\r\n%s\r\n" % (len(body[i:i + 1000]), body[i:i + 1000])
                            for i in range(0, len(body), 1000)) + b"0\r\n\r\n"
        elif route.content_length:
            headers.append(("Content-Length", str(len(body))))
        head = f"HTTP/1.1 {route.status}\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers) + "\r\n"
        return head.encode(), body


@contextlib.contextmanager
def raw_server(routes: dict[str, Route | Callable[[], Route]]) -> Iterator[RawServer]:
    with RawServer(routes) as server:
        yield server
