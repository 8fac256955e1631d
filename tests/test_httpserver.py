"""The shared bounded server (triscope.httpserver): connection cap, per-connection deadline, body bound,
quiet logging of clients that hang up. Real sockets on 127.0.0.1."""

from __future__ import annotations

import http.client
import logging
import socket
import time
from collections.abc import Iterator

import pytest

from triscope.httpserver import BoundedHTTPHandler, BoundedHTTPServer, HttpError, read_body, serve_in_thread, stop


class _Echo(BoundedHTTPHandler):
    def do_POST(self) -> None:
        try:
            body = read_body(self, 16, required=True)
            status = 200
        except HttpError as err:
            body, status = str(err).encode(), err.status
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture()
def server() -> Iterator[BoundedHTTPServer]:
    srv = BoundedHTTPServer(("127.0.0.1", 0), _Echo, max_connections=2, deadline_s=0.5, name="test-echo")
    thread = serve_in_thread(srv, "test-echo", poll_interval=0.05)
    yield srv
    stop(srv, thread)


def _post(srv: BoundedHTTPServer, body: bytes) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", srv.server_address[1], timeout=5)
    conn.request("POST", "/", body=body)
    resp = conn.getresponse()
    out = resp.status, resp.read()
    conn.close()
    return out


def _recv_all(sock: socket.socket) -> bytes:
    sock.settimeout(5)
    data = b""
    while chunk := sock.recv(4096):
        data += chunk
    return data


def test_body_bound_and_keep_alive(server: BoundedHTTPServer) -> None:
    assert _post(server, b"hello") == (200, b"hello")
    status, message = _post(server, b"x" * 17)
    assert status == 413 and message == b"body of 17 bytes exceeds the limit of 16"
    conn = http.client.HTTPConnection("127.0.0.1", server.server_address[1], timeout=5)
    for i in range(3):  # one connection, several requests, each within its own deadline
        conn.request("POST", "/", body=str(i).encode())
        assert conn.getresponse().read() == str(i).encode()
        time.sleep(0.3)
    conn.close()


def test_slow_client_is_cut_at_the_deadline(server: BoundedHTTPServer) -> None:
    slow = socket.create_connection(server.server_address[:2])
    slow.sendall(b"POST / HTTP/1.1\r\nContent-Length: 5\r\n")  # headers never finish
    t0 = time.monotonic()
    _recv_all(slow)  # the server shuts the socket down
    assert time.monotonic() - t0 < 3
    assert server.expired_total == 1
    slow.close()


def test_connections_over_the_cap_are_closed_and_others_served(server: BoundedHTTPServer,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="triscope.httpserver")
    held = [socket.create_connection(server.server_address[:2]) for _ in range(2)]
    time.sleep(0.1)
    extra = socket.create_connection(server.server_address[:2])
    assert _recv_all(extra) == b""  # closed at accept, no thread for it
    assert server.refused_total >= 1
    for s in held:
        s.close()
    time.sleep(0.2)
    assert _post(server, b"ok") == (200, b"ok")  # slots come back when clients leave
    extra.close()
    assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]  # no tracebacks


def test_binds_ipv6_when_asked() -> None:
    if not socket.has_ipv6:
        pytest.skip("no IPv6")
    try:
        srv = BoundedHTTPServer(("::1", 0), _Echo)
    except OSError as exc:
        pytest.skip(f"::1 not usable here: {exc}")
    try:
        assert srv.socket.family == socket.AF_INET6
    finally:
        srv.server_close()
