"""collectors/http_fetch.py against real sockets on 127.0.0.1: a total deadline (trickled headers
and bodies), bounded bodies, chunked bodies, redirect policy, one-line errors."""

from __future__ import annotations

import time

import pytest
from conftest import free_port
from scrape_helpers import Route, raw_server

from triscope.errors import InputError
from triscope.http_fetch import RefusedError, UnreachableError, fetch

BODY = b"# TYPE up gauge\nup 1\n"


def test_plain_and_chunked_bodies() -> None:
    big = b"x" * 250_000
    with raw_server({"/a": Route(body=BODY), "/c": Route(body=big, chunked=True),
                     "/n": Route(body=BODY, content_length=False)}) as s:
        assert fetch(s.url("/a"), timeout_s=2, max_bytes=1000) == BODY
        assert fetch(s.url("/c"), timeout_s=2, max_bytes=len(big)) == big
        assert fetch(s.url("/n"), timeout_s=2, max_bytes=1000) == BODY  # framed by close


@pytest.mark.parametrize("trickle_headers", [False, True])
def test_trickled_answer_hits_the_total_deadline(trickle_headers: bool) -> None:
    # 200 bytes at one per 50 ms take 10 s; every single read succeeds well inside a 0.5 s
    # per-read timeout, so only a total deadline stops it.
    route = Route(body=b"y" * 200, trickle_s=0.05, trickle_headers=trickle_headers)
    with raw_server({"/slow": route}) as s:
        t0 = time.monotonic()
        with pytest.raises(UnreachableError, match=r"within 0.5 s \(total deadline\)") as err:
            fetch(s.url("/slow"), timeout_s=0.5, max_bytes=10_000)
        took = time.monotonic() - t0
    assert took < 1.5, took
    assert "\n" not in str(err.value) and s.url("/slow") in str(err.value)


def test_body_bound_with_and_without_content_length() -> None:
    with raw_server({"/big": Route(body=b"z" * 5000), "/bigchunked": Route(body=b"z" * 5000, chunked=True)}) as s:
        with pytest.raises(InputError, match="exceeds 4096 bytes"):
            fetch(s.url("/big"), timeout_s=2, max_bytes=4096)
        with pytest.raises(InputError, match="exceeds 4096 bytes"):
            fetch(s.url("/bigchunked"), timeout_s=2, max_bytes=4096)


def test_status_refused_and_encoding_are_one_line() -> None:
    with raw_server({"/gz": Route(body=b"\x1f\x8b...", headers=(("Content-Encoding", "gzip"),))}) as s:
        with pytest.raises(UnreachableError, match=r"HTTP 404 Not Found"):
            fetch(s.url("/missing"), timeout_s=2, max_bytes=100)
        with pytest.raises(InputError, match="unsupported Content-Encoding 'gzip'"):
            fetch(s.url("/gz"), timeout_s=2, max_bytes=100)
    for bad in ("http://127.0.0.1:99999/metrics", "http://127.0.0.1:port/metrics", "ftp://127.0.0.1/metrics"):
        with pytest.raises(InputError, match="not an http"):
            fetch(bad, timeout_s=1, max_bytes=100)
    with pytest.raises(RefusedError, match="scrape failed") as err:  # nothing listens: a process gone
        fetch(f"http://127.0.0.1:{free_port()}/metrics", timeout_s=1, max_bytes=100)
    assert "\n" not in str(err.value) and isinstance(err.value, UnreachableError)


def test_redirect_policy() -> None:
    with raw_server({"/metrics": Route(status="307 Temporary Redirect", headers=(("Location", "/metrics/"),)),
                     "/metrics/": Route(body=BODY),
                     "/away": Route(status="302 Found", headers=(("Location", "http://10.255.255.1:9/metrics"),)),
                     "/file": Route(status="302 Found", headers=(("Location", "file:///etc/passwd"),)),
                     "/loop": Route(status="302 Found", headers=(("Location", "/loop"),))}) as s:
        with pytest.raises(InputError, match="redirects are not allowed"):
            fetch(s.url("/metrics"), timeout_s=2, max_bytes=100)
        assert fetch(s.url("/metrics"), timeout_s=2, max_bytes=100, allow_redirects=True) == BODY
        with pytest.raises(InputError, match="another origin"):
            fetch(s.url("/away"), timeout_s=2, max_bytes=100, allow_redirects="same-origin")
        with pytest.raises(InputError, match="not an http"):
            fetch(s.url("/file"), timeout_s=2, max_bytes=100, allow_redirects="any")
        with pytest.raises(InputError, match="more than 5 redirects"):
            fetch(s.url("/loop"), timeout_s=2, max_bytes=100, allow_redirects=True)
        assert s.requests.count("/loop") == 6


def test_many_deadlines_share_one_watchdog_and_do_not_leak() -> None:
    import threading

    route = Route(body=b"y" * 100, trickle_s=0.05)
    with raw_server({"/slow": route, "/ok": Route(body=BODY)}) as s:
        before = threading.active_count()
        for _ in range(5):
            assert fetch(s.url("/ok"), timeout_s=2, max_bytes=100) == BODY
        with pytest.raises(UnreachableError):
            fetch(s.url("/slow"), timeout_s=0.2, max_bytes=1000)
        # Finished fetches leave at most the one watchdog thread behind (server threads aside).
        assert threading.active_count() <= before + 1 + 6
        names = [t.name for t in threading.enumerate() if t.name == "http-fetch-watchdog"]
        assert len(names) == 1


def test_tls_trickle_hits_the_deadline_too(tmp_path, monkeypatch) -> None:
    """The watchdog shuts a TLS socket down as well (a read blocked inside the TLS layer wakes up)."""
    import socket
    import ssl
    import subprocess
    import threading

    from conftest import require_binary

    openssl = require_binary("openssl")
    cert, key = tmp_path / "c.pem", tmp_path / "k.pem"
    subprocess.run([openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True, timeout=60)
    monkeypatch.setenv("SSL_CERT_FILE", str(cert))  # the client trusts this test CA only
    server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_ctx.load_cert_chain(str(cert), str(key))
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)
    port = listener.getsockname()[1]
    answer = b"HTTP/1.1 200 OK\r\nContent-Length: 50\r\nConnection: close\r\n\r\n" + b"x" * 50

    def serve(pause: float) -> None:
        conn, _ = listener.accept()
        with conn, ssl_wrap(conn) as tls:
            tls.recv(4096)
            try:
                for i in range(len(answer)):
                    tls.sendall(answer[i:i + 1])
                    time.sleep(pause)
            except OSError:
                pass

    def ssl_wrap(conn: socket.socket) -> ssl.SSLSocket:
        return server_ctx.wrap_socket(conn, server_side=True)

    try:
        for pause, expect_ok in ((0.0, True), (0.05, False)):
            worker = threading.Thread(target=serve, args=(pause,), daemon=True)
            worker.start()
            t0 = time.monotonic()
            if expect_ok:
                assert fetch(f"https://127.0.0.1:{port}/m", timeout_s=3, max_bytes=100) == b"x" * 50
            else:
                with pytest.raises(UnreachableError, match="total deadline"):
                    fetch(f"https://127.0.0.1:{port}/m", timeout_s=0.5, max_bytes=100)
                assert time.monotonic() - t0 < 1.5
            worker.join(timeout=10)
    finally:
        listener.close()
