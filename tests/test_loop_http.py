"""The server kit's HTTP on the loop, with a handler that blocks (the shape of ``/metrics``)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest

from triscope.loop_http import Answer, BlockingHttpConnection, BlockingHttpServer


class _Slow(BlockingHttpServer):
    thread_name = "test-blocking"
    max_body_bytes = 1024

    def __init__(self, max_connections: int) -> None:
        self.gate = threading.Event()
        self.calls: list[str] = []
        super().__init__("127.0.0.1", 0, max_connections, max_connections, 2.0, workers=2)

    def handle(self, conn: BlockingHttpConnection, method: str, path: str, body: bytes) -> Answer:
        self.calls.append(path)
        if path == "/wait":
            self.gate.wait(5)
        return 200, "text/plain", f"{method} {path} {len(body)}\n".encode(), (("X-Seen", conn.headers.get("x-a", "")),)


@pytest.fixture()
def server() -> Iterator[_Slow]:
    srv = _Slow(max_connections=2).start()
    try:
        yield srv
    finally:
        srv.gate.set()
        srv.close()


def _read(sock: socket.socket, answers: int) -> bytes:
    data = b""
    sock.settimeout(5)
    while data.count(b"HTTP/1.1 ") < answers or not data.endswith(b"\n"):
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    return data


def test_pipelined_requests_are_answered_in_order_off_the_loop(server: _Slow) -> None:
    with socket.create_connection(("127.0.0.1", server.port)) as s:
        s.sendall(b"GET /a HTTP/1.1\r\nX-A: 1\r\n\r\n"
                  b"POST /b HTTP/1.1\r\nContent-Length: 3\r\n\r\nxyz"
                  b"HEAD /c HTTP/1.1\r\n\r\n")
        data = _read(s, 3)
    assert data.index(b"GET /a 0") < data.index(b"POST /b 3") and b"HEAD /c" not in data
    assert data.count(b"HTTP/1.1 200 OK") == 3 and b"X-Seen: 1" in data and server.calls == ["/a", "/b", "/c"]


def test_a_request_in_flight_is_never_evicted(server: _Slow) -> None:
    busy = socket.create_connection(("127.0.0.1", server.port))
    busy.sendall(b"GET /wait HTTP/1.1\r\n\r\n")
    idle = socket.create_connection(("127.0.0.1", server.port))
    time.sleep(0.3)
    newcomer = socket.create_connection(("127.0.0.1", server.port))  # at the cap: the idle one goes, not the busy one
    newcomer.sendall(b"GET /now HTTP/1.1\r\nConnection: close\r\n\r\n")
    assert b"GET /now 0" in _read(newcomer, 1)
    idle.settimeout(5)
    assert idle.recv(10) == b"" and server.evicted_total == 1
    server.gate.set()
    assert b"GET /wait 0" in _read(busy, 1)
    for s in (busy, idle, newcomer):
        s.close()


@pytest.mark.parametrize(("request_", "status"), [
    (b"POST /x HTTP/1.1\r\nContent-Length: 5000\r\n\r\n", b"413"),
    (b"POST /x HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n", b"411"),
    (b"GET /x\r\n\r\n", b"400"),
    (b"GET /x HTTP/1.1\r\nX: " + b"a" * 20000, b"431"),
])
def test_bad_requests_are_answered_and_closed(server: _Slow, request_: bytes, status: bytes) -> None:
    with socket.create_connection(("127.0.0.1", server.port)) as s:
        s.sendall(request_)
        data = _read(s, 1)
        assert data.startswith(b"HTTP/1.1 " + status) and b"Connection: close" in data and s.recv(10) == b""
    assert server.calls == []
