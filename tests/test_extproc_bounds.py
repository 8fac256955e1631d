"""The picker's gRPC port under abuse (real grpc.aio server and client on 127.0.0.1): a body streamed on
after its 413 is not read, streams are bounded per process (not per connection), connections are capped.

The chooser is a stand-in that routes every request to one address: the bounds are the server's, not the
picker's."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from triscope.exporters.extproc import PB, SERVICE, Choice, ExtProcServer


class OneBackend:
    def __init__(self) -> None:
        self.done_total = 0

    def choose(self, body: bytes | None, headers: Any) -> Choice:
        return Choice("b0", "127.0.0.1:9")

    def answered(self, choice: Choice, status: int) -> None:
        pass

    def done(self, choice: Choice) -> None:
        self.done_total += 1


def _headers() -> Any:
    return PB["ProcessingRequest"](request_headers=PB["HttpHeaders"](headers=PB["HeaderMap"](
        headers=[PB["HeaderValue"](key=":path", value="/v1/completions")])))


def _body(chunk: bytes, end: bool = False) -> Any:
    return PB["ProcessingRequest"](request_body=PB["HttpBody"](body=chunk, end_of_stream=end))


@pytest.fixture()
def server() -> Iterator[ExtProcServer]:
    srv = ExtProcServer(OneBackend(), max_body_bytes=64 * 1024, max_streams=4, max_connections=8).start()
    try:
        yield srv
    finally:
        srv.stop()


def _stub(port: int) -> tuple[grpc.Channel, Any]:
    # a connection of its own per channel (channels to one target share one by default)
    channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.use_local_subchannel_pool", 1)])
    call = channel.stream_stream(f"/{SERVICE}/Process", request_serializer=lambda m: m.SerializeToString(),
                                 response_deserializer=PB["ProcessingResponse"].FromString)
    return channel, call


def test_a_body_streamed_on_after_the_413_ends_the_stream(server: ExtProcServer) -> None:
    sent = {"chunks": 0}

    def requests() -> Iterator[Any]:
        yield _headers()
        for _ in range(2000):  # 2000 x 64 KiB = 125 MiB offered; the stream must end long before
            sent["chunks"] += 1
            yield _body(b"x" * 65536)

    channel, call = _stub(server.port)
    with channel:
        answers = list(call(requests(), timeout=30))
    assert answers[-1].HasField("immediate_response") and answers[-1].immediate_response.status.code == 413
    assert server.counts == {"status:413": 1}  # one request, one 413
    assert sent["chunks"] < 200, sent  # the stream ended: the client stopped being read
    assert server.streams == 0


def test_streams_are_bounded_over_all_connections(server: ExtProcServer) -> None:
    """Four streams held open over four connections fill the process's bound; a fifth is refused."""
    release = threading.Event()
    calls = []

    def held() -> Iterator[Any]:
        yield _headers()
        release.wait(20)

    channels = [_stub(server.port) for _ in range(5)]
    try:
        for _channel, call in channels[:4]:
            calls.append(call(held(), timeout=30))
            deadline = time.monotonic() + 5
            while server.streams < len(calls):
                assert time.monotonic() < deadline, server.streams
                time.sleep(0.01)
        with pytest.raises(grpc.RpcError) as refused:
            list(channels[4][1](iter([_headers(), _body(b"{}", True)]), timeout=10))
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert server.streams_refused_total == 1 and server.streams == 4
    finally:
        release.set()
        for c in calls:
            c.cancel()
        for channel, _ in channels:
            channel.close()


def test_idle_connections_beyond_the_cap_are_closed_at_accept(server: ExtProcServer) -> None:
    socks = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(40)]
    try:
        time.sleep(1.0)
        closed = 0
        for s in socks:
            s.setblocking(False)
            try:
                closed += s.recv(1) == b""
            except BlockingIOError:
                pass
            except OSError:
                closed += 1
        assert closed >= 40 - 8, closed
        channel, call = _stub(server.port)  # the picker still answers once the idle ones go
        for s in socks:
            s.close()
        time.sleep(0.5)
        with channel:
            answers = list(call(iter([_headers(), _body(b"{}", True)]), timeout=10))
        assert answers[-1].HasField("request_body")
    finally:
        for s in socks:
            s.close()
