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
        if path == "/big":  # over COPY_MAX_BYTES: head and body go out as two buffers
            return 200, "application/octet-stream", bytes(range(256)) * 1024, ()
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


def test_slow_clients_are_bounded_cut_at_their_deadline_and_quiet(caplog: pytest.LogCaptureFixture) -> None:
    """300 connections from two addresses trickling a header line every 0.3 s: at most max_per_client of
    each at once, every one cut within the 1 s request deadline (in total, not per read) or evicted for a
    newer one, a prompt request still answered, and no traceback or warning."""
    import contextlib
    import logging

    caplog.set_level(logging.DEBUG, logger="triscope")
    srv = _Slow(max_connections=64)
    srv.timeout_s, srv.max_per_client = 1.0, 16
    srv.start()
    socks: list[tuple[socket.socket, float]] = []
    cut_after: list[float] = []
    try:
        for i in range(300):
            s = socket.socket()
            s.bind(("127.0.0.1" if i % 2 else "127.0.0.2", 0))
            s.connect(("127.0.0.1", srv.port))
            s.sendall(b"POST / HTTP/1.1\r\nHost: x\r\n")
            s.setblocking(False)
            socks.append((s, time.monotonic()))
        with socket.create_connection(("127.0.0.1", srv.port)) as prompt:
            prompt.sendall(b"GET /now HTTP/1.1\r\nConnection: close\r\n\r\n")
            assert b"GET /now 0" in _read(prompt, 1)
        end = time.monotonic() + 3.0
        while socks and time.monotonic() < end:
            assert srv.connections <= 2 * srv.max_per_client + 1
            assert max(srv.per_client.values(), default=0) <= srv.max_per_client
            kept = []
            for s, t0 in socks:
                try:
                    data = s.recv(100)
                except BlockingIOError:
                    with contextlib.suppress(OSError):
                        s.send(b"X-Slow: 1\r\n")
                    kept.append((s, t0))
                    continue
                except OSError:
                    data = b""
                if not data:
                    cut_after.append(time.monotonic() - t0)
                s.close()
            socks = kept
            time.sleep(0.3)
        assert not socks, f"{len(socks)} slow connections outlived the request deadline"
        assert max(cut_after) < 3.0  # 1 s plus scheduling on a loaded machine, never a per-read timeout
        assert srv.evicted_total + srv.expired_total + srv.refused_total >= 299 and srv.calls == ["/now"]
    finally:
        for s, _ in socks:
            s.close()
        srv.close()
    assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.WARNING]


def test_clients_hanging_up_mid_request_cost_nothing(server: _Slow, caplog: pytest.LogCaptureFixture) -> None:
    import logging

    caplog.set_level(logging.DEBUG, logger="triscope")
    for _ in range(5):
        s = socket.create_connection(("127.0.0.1", server.port))
        s.sendall(b"POST / HTTP/1.1\r\nContent-Length: 16\r\n\r\nonly a p")
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")  # RST
        s.close()
    with socket.create_connection(("127.0.0.1", server.port)) as ok:
        ok.sendall(b"GET /after HTTP/1.1\r\nConnection: close\r\n\r\n")
        assert b"GET /after 0" in _read(ok, 1)
    time.sleep(0.2)
    assert server.connections == 0 and server.calls == ["/after"]
    assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.WARNING]


def test_an_answer_past_its_deadline_is_the_late_answer_and_the_connection_goes_on(server: _Slow) -> None:
    server.answer_timeout_s = 0.3
    with socket.create_connection(("127.0.0.1", server.port)) as s:
        t0 = time.monotonic()
        s.sendall(b"GET /wait HTTP/1.1\r\n\r\n")
        late = _read(s, 1)
        assert late.startswith(b"HTTP/1.1 504 ") and b"no answer within 0.3 s" in late
        assert time.monotonic() - t0 < 4.0  # the deadline, not the handler's 5 s wait
        s.sendall(b"GET /big HTTP/1.1\r\n\r\n")  # read on while /wait still runs on its worker
        server.gate.set()  # /wait's answer now comes, and is dropped
        data = b""
        s.settimeout(5)
        while len(data) < 262144 or b"\r\n\r\n" not in data:
            data += s.recv(65536)
        head, _, body = data.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200 OK") and b"Content-Length: 262144" in head
        assert body == bytes(range(256)) * 1024
        s.sendall(b"GET /after HTTP/1.1\r\nConnection: close\r\n\r\n")
        rest = _read(s, 1)
    assert rest.startswith(b"HTTP/1.1 200 OK") and b"GET /after 0" in rest and b"GET /wait" not in rest
    deadline = time.monotonic() + 5.0
    while server.in_flight and time.monotonic() < deadline:  # /wait's worker returns on its own schedule
        time.sleep(0.01)
    assert server.calls == ["/wait", "/big", "/after"] and server.in_flight == 0
