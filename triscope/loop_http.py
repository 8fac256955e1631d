"""HTTP/1.1 on the event-loop kit (:mod:`triscope.loop_server`): one request parser for every server of
the daemon that speaks HTTP on the loop (the weight feed, its table servers, the pick table, ``/metrics``).

Just what these servers need is parsed (request line, ``Content-Length``, ``Transfer-Encoding``,
``Connection``, and the other headers by lower-case name): request heads over ``MAX_HEAD_BYTES`` get
431, bodies over the server's ``max_body_bytes`` 413 (nothing more read), chunked bodies 411 unless the
server takes them (``accept_chunked``: then read within the same bound), a malformed request line or
chunk 400; each then closes the connection (the rest of the stream cannot be framed).

A handler that answers from memory answers on the loop (:meth:`HttpConnection.respond`). One that
blocks (a store query, a collector's scrape) runs on a worker thread (:class:`BlockingHttpConnection`):
the server's ``dispatch`` looks at the request on the loop and answers it there or hands back a future
of the answer; the connection stops reading meanwhile (one request in flight per connection, so the
workers' queue is bounded by the connection cap) and is not evicted while its request runs. The
finished future wakes the loop once (no intermediate asyncio future), and an answer over 64 KiB goes
out after its head without being copied into one buffer.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from triscope.errors import one_line
from triscope.loop_server import LoopConnection, LoopServer

log = logging.getLogger(__name__)

MAX_HEAD_BYTES = 16 * 1024
JSON_TYPE = "application/json"
REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed", 411: "Length Required",
           413: "Payload Too Large", 431: "Request Header Fields Too Large", 500: "Internal Server Error",
           503: "Service Unavailable", 504: "Gateway Timeout"}
Answer = tuple[int, str, bytes, Iterable[tuple[str, str]]]
"""(status, content type, body, extra headers) of a blocking handler."""


COPY_MAX_BYTES = 64 * 1024
"""Answers up to this size go out as one buffer (head + body); larger ones as two, the body uncopied."""


def encode_head(status: int, ctype: str, size: int, close: bool, server: str = "triscope",
                headers: Iterable[tuple[str, str]] = ()) -> bytes:
    """The head of an HTTP/1.1 answer whose body is ``size`` bytes."""
    extra = "".join(f"{name}: {value}\r\n" for name, value in headers)
    return (f"HTTP/1.1 {status} {REASONS.get(status, 'Error')}\r\nServer: {server}\r\n"
            f"Content-Type: {ctype}\r\nContent-Length: {size}\r\nCache-Control: no-store\r\n{extra}"
            + ("Connection: close\r\n" if close else "") + "\r\n").encode("latin-1")


def encode(status: int, ctype: str, body: bytes, close: bool, server: str = "triscope",
           headers: Iterable[tuple[str, str]] = ()) -> bytes:
    """One whole HTTP/1.1 answer."""
    return encode_head(status, ctype, len(body), close, server, headers) + body


def json_error(message: str) -> bytes:
    """``{"error": message}`` on one line."""
    return json.dumps({"error": message}).encode() + b"\n"


class HttpConnection(LoopConnection):
    """One HTTP/1.1 connection; subclasses answer in :meth:`respond`. The server has ``max_body_bytes``
    and ``body_limit_key`` (the config key named in a 413)."""

    server: Any
    method = ""
    target = ""
    """The request's target as sent (path and query)."""
    headers: dict[str, str] = {}
    """The request's headers by lower-case name (the last of repeated ones)."""
    checked = False
    """:meth:`check_head` passed for the request whose body is arriving."""
    close_after = False
    """Close once the answer is out (a handler that refused a request whose body it did not read)."""

    def check_head(self, method: str, path: str, size: int) -> bool:
        """Called once a request's head is in, before its body (``size`` bytes) is waited for: False
        after answering it (and closing) without reading the body. Default: every request goes on."""
        return True

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while self.transport is not None and not self.transport.is_closing() and not self.busy:
            end = self.buffer.find(b"\r\n\r\n")
            if end < 0:
                if len(self.buffer) > MAX_HEAD_BYTES:
                    self._fail(431, "request head too large")
                return
            if end > MAX_HEAD_BYTES:
                self._fail(431, "request head too large")
                return
            if not self._one(end):
                return

    def _one(self, end: int) -> bool:
        """Answer the request whose head ends at ``end``; False when its body has not fully arrived."""
        lines = self.buffer[:end].decode("latin-1").split("\r\n")
        parts = lines[0].split(" ")
        if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
            self._fail(400, "malformed request line")
            return False
        method, target, version = parts
        headers: dict[str, str] = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        self.method, self.target, self.headers = method, target, headers
        length, connection = headers.get("content-length", "0"), headers.get("connection", "").lower()
        limit = self.server.max_body_bytes
        if headers.get("transfer-encoding", "identity").lower() != "identity":
            if not getattr(self.server, "accept_chunked", False):
                self._fail(411, "chunked bodies are not accepted; send Content-Length")
                return False
            chunked = self._chunked(end + 4, limit)
            if chunked is None:
                return False
            body, stop = chunked
        else:
            try:
                size = int(length)
            except ValueError:
                size = -1
            if size < 0:
                self._fail(400, f"bad Content-Length {length!r}")
                return False
            if size > limit:
                self._fail(413, f"body of {size} bytes exceeds the limit of {limit} ({self.server.body_limit_key})")
                return False
            if not self.checked and not self.check_head(method, target.split("?", 1)[0], size):
                return False
            self.checked = True
            if len(self.buffer) < end + 4 + size:
                return False
            body, stop = self.buffer[end + 4:end + 4 + size], end + 4 + size
        raw, self.buffer = self.buffer[:stop], self.buffer[stop:]
        self.checked = False
        close = connection == "close" or (version == "HTTP/1.0" and connection != "keep-alive")
        return self.respond(method, target.split("?", 1)[0], body, close, raw)

    def _chunked(self, pos: int, limit: int) -> tuple[bytes, int] | None:
        """(body, end of the request in the buffer) of a chunked body from ``pos``; None when it has not
        all arrived or was refused (413 past ``limit``, 400 a bad chunk; trailers are skipped)."""
        parts: list[bytes] = []
        total, buf = 0, self.buffer
        while True:
            eol = buf.find(b"\r\n", pos)
            if eol < 0 or eol - pos > 256:
                if eol - pos > 256 or (eol < 0 and len(buf) - pos > 256):
                    self._fail(400, f"bad chunk size line {buf[pos:pos + 40]!r}")
                return None
            try:
                size = int(buf[pos:eol].split(b";", 1)[0].strip(), 16)
            except ValueError:
                self._fail(400, f"bad chunk size line {buf[pos:eol][:40]!r}")
                return None
            if size == 0:
                if buf[eol + 2:eol + 4] == b"\r\n":
                    return b"".join(parts), eol + 4
                trailers = buf.find(b"\r\n\r\n", eol)
                if trailers < 0 and len(buf) - eol > MAX_HEAD_BYTES:
                    self._fail(431, "chunked trailers too large")
                return (b"".join(parts), trailers + 4) if trailers >= 0 else None
            total += size
            if total > limit:
                self._fail(413, f"body exceeds the limit of {limit} ({self.server.body_limit_key})")
                return None
            if len(buf) < eol + 4 + size:
                return None
            if buf[eol + 2 + size:eol + 4 + size] != b"\r\n":
                self._fail(400, "body ended inside a chunk")
                return None
            parts.append(buf[eol + 2:eol + 2 + size])
            pos = eol + 4 + size

    def respond(self, method: str, path: str, body: bytes, close: bool, raw: bytes) -> bool:
        """Answer one parsed request (``raw``: its bytes as sent); False when nothing more is to be read now."""
        raise NotImplementedError

    def answered(self, close: bool) -> bool:
        """After an answer: close, or wait for the next request; False once closed."""
        self.answered_total += 1
        if close:
            assert self.transport is not None
            self.transport.close()
            return False
        self.since = asyncio.get_running_loop().time()
        self._arm()
        return True

    def _fail(self, status: int, message: str) -> None:
        """An error answer (in the server's shape when it has ``error_answer``), then close."""
        assert self.transport is not None
        shape = getattr(self.server, "error_answer", None)
        ctype, body, extra = shape(self, status, message) if shape is not None else (
            JSON_TYPE, json_error(message), ())
        self.transport.write(encode(status, ctype, body, True, self.server.server_header, extra))
        self.transport.close()


class BlockingHttpServer(LoopServer):
    """A loop server whose handler blocks: ``handle(connection, method, path, body) -> Answer`` runs on
    ``workers`` threads."""

    connection: type[LoopConnection]
    server_header = "triscope"
    body_limit_key = "max_body_bytes"
    max_body_bytes = 1 << 20
    accept_chunked = False

    def __init__(self, bind: str, port: int, max_connections: int, max_per_client: int, timeout_s: float,
                 workers: int = 4) -> None:
        self.executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=self.thread_name)
        try:
            super().__init__(bind, port, max_connections, max_per_client, timeout_s)
        except BaseException:  # the address is taken: nothing stays open
            self.executor.shutdown(wait=False)
            loop = getattr(self, "_loop", None)
            if loop is not None:
                loop.close()
            raise

    answer_timeout_s: float | None = None
    """A dispatched request not answered this long after it was read gets :meth:`late_answer` instead (its
    worker's answer, when it comes, is dropped); None: no deadline."""

    def dispatch(self, conn: BlockingHttpConnection, method: str, path: str, body: bytes) -> Answer | Future[Answer]:
        """On the loop: the answer, or a future of it computed off the loop. Default: :meth:`handle` on
        the executor."""
        return self.executor.submit(self.handle, conn, method, path, body)

    def handle(self, conn: BlockingHttpConnection, method: str, path: str, body: bytes) -> Answer:
        raise NotImplementedError

    def late_answer(self, conn: BlockingHttpConnection) -> Answer:
        """The answer sent when ``answer_timeout_s`` passes first."""
        return 504, JSON_TYPE, json_error(f"no answer within {self.answer_timeout_s:g} s"), ()

    in_flight = 0
    """Requests being answered on a worker now."""

    def close(self, drain_s: float = 0.0) -> None:
        """Stop; with ``drain_s``, first stop accepting and let requests in flight be answered (that long at most)."""
        if drain_s > 0 and self._thread is not None and self._thread.is_alive():
            def stop_listening() -> None:
                if self._server is not None:
                    self._server.close()
            self._loop.call_soon_threadsafe(stop_listening)
            deadline = time.monotonic() + drain_s
            while self.in_flight and time.monotonic() < deadline:
                time.sleep(0.01)
        super().close()
        self.executor.shutdown(wait=False, cancel_futures=True)


class BlockingHttpConnection(HttpConnection):
    """A connection of a :class:`BlockingHttpServer`: each request dispatched on the loop, answered there
    or on a worker (reading paused meanwhile)."""

    server: BlockingHttpServer
    request_seq = 0
    """Requests dispatched on this connection: a worker's answer for an earlier one (answered late) is dropped."""

    def respond(self, method: str, path: str, body: bytes, close: bool, raw: bytes) -> bool:
        assert self.transport is not None
        try:
            pending = self.server.dispatch(self, method, path, body)
        except Exception as exc:
            pending = self._failed(method, exc)
        if isinstance(pending, tuple):  # answered from memory, on the loop
            return self._send(pending, method, close)
        self.busy = True  # not evicted, not expired, no further request read until this one is answered
        self.transport.pause_reading()
        self.server.in_flight += 1
        self.request_seq += 1
        seq = self.request_seq
        loop = asyncio.get_running_loop()
        self._arm_answer(loop, seq, method, close)

        def wake(future: Future[Answer]) -> None:  # on the worker: one wake-up of the loop
            if not loop.is_closed():
                with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                    loop.call_soon_threadsafe(self._done, future, seq, method, close)
        pending.add_done_callback(wake)
        return False

    def _arm_answer(self, loop: asyncio.AbstractEventLoop, seq: int, method: str, close: bool) -> None:
        """While the request runs the connection's timer is the answer's deadline (or off)."""
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if self.server.answer_timeout_s is not None:
            self.timer = loop.call_later(self.server.answer_timeout_s, self._late, seq, method, close)

    def _late(self, seq: int, method: str, close: bool) -> None:
        self.timer = None
        if self.busy and seq == self.request_seq and self.transport is not None and not self.transport.is_closing():
            self._finish(self.server.late_answer(self), method, close)

    def _done(self, future: Future[Answer], seq: int, method: str, close: bool) -> None:
        self.server.in_flight -= 1
        if not self.busy or seq != self.request_seq:
            return  # answered late already
        if future.cancelled() or self.transport is None or self.transport.is_closing():
            self.busy = False
            return
        try:
            answer = future.result()
        except Exception as exc:
            answer = self._failed(method, exc)
        self._finish(answer, method, close)

    def _failed(self, method: str, exc: Exception) -> Answer:
        log.warning("%s %s %s failed: %s", self.server.thread_name, method, self.target, one_line(exc))
        shape = getattr(self.server, "error_answer", None)
        ctype, payload, extra = shape(self, 500, one_line(exc)) if shape is not None else (
            JSON_TYPE, json_error(one_line(exc)), ())
        return 500, ctype, payload, extra

    def _finish(self, answer: Answer, method: str, close: bool) -> None:
        """Send a worker's (or the late) answer, then read on."""
        self.busy = False
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if self._send(answer, method, close):
            assert self.transport is not None
            self.transport.resume_reading()
            self.data_received(b"")  # a pipelined request already in the buffer

    def _send(self, answer: Answer, method: str, close: bool) -> bool:
        """Write one answer; False once the connection is closed."""
        assert self.transport is not None
        status, ctype, payload, extra = answer
        close = close or self.close_after
        head = encode_head(status, ctype, len(payload), close, self.server.server_header, extra)
        if method == "HEAD" or not payload:
            self.transport.write(head)
        elif len(payload) > COPY_MAX_BYTES:
            self.transport.writelines((head, payload))
        else:
            self.transport.write(head + payload)
        return self.answered(close)


BlockingHttpServer.connection = BlockingHttpConnection

__all__ = ["COPY_MAX_BYTES", "JSON_TYPE", "MAX_HEAD_BYTES", "Answer", "BlockingHttpConnection", "BlockingHttpServer",
           "HttpConnection", "encode", "encode_head", "json_error"]
