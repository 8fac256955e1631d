"""The OTLP receiver's HTTP side on the daemon's server kit (:mod:`triscope.loop_http`).

A request's head is checked on the event loop before its body is read (path, method, bearer token,
content type, length; the bytes it will hold against ``max_buffered_bytes``): a refused one is
answered and its connection closed, nothing of the body read. The body is then decoded, mapped and
handed to the writer on a worker thread (``max_concurrent_decodes`` of them decode at once), and
the answer goes out once the spans are spooled.
"""

from __future__ import annotations

import hmac
from typing import TYPE_CHECKING

from triscope.collectors.otlp.decode import (
    JSON,
    PROTOBUF,
    RPC_CODE,
    TooManySpans,
    decode_spans,
    encode_response,
    encode_status,
    gunzip_bounded,
)
from triscope.collectors.otlp.links import MappedBatch
from triscope.errors import InputError
from triscope.http_body import HttpError
from triscope.loop_http import Answer, BlockingHttpConnection, BlockingHttpServer, encode
from triscope.loop_server import DEFAULT_HEADER_TIMEOUT_S

if TYPE_CHECKING:
    from triscope.collectors.otlp.receiver import OtlpReceiver

TRACES_PATH = "/v1/traces"
BODY_TIMEOUT_S = 60.0
"""A request whose head is in has this long for its body (a slow link, a large batch)."""


def _kind(headers: dict[str, str]) -> str:
    return headers.get("content-type", "").split(";")[0].strip().lower()


def error_body(headers: dict[str, str], err: HttpError) -> tuple[str, bytes, list[tuple[str, str]]]:
    """A ``google.rpc.Status`` in the request's encoding (plain text for other types)."""
    kind = _kind(headers)
    if kind in (PROTOBUF, JSON):
        return kind, encode_status(RPC_CODE.get(err.status, 2), str(err), kind), list(err.headers.items())
    return "text/plain; charset=utf-8", (str(err) + "\n").encode(), list(err.headers.items())


class OtlpServer(BlockingHttpServer):
    """``POST /v1/traces`` on the server kit; decoding on worker threads."""

    thread_name = "triscope-otlp"
    server_header = "triscope-otlp"
    body_limit_key = "[otlp] max_body_bytes"

    def __init__(self, receiver: OtlpReceiver) -> None:
        cfg = receiver.config
        self.receiver = receiver
        self.max_body_bytes = cfg.max_body_bytes
        # decodes wait for a slot on these threads (then 503); one more answers the shutdown's 503s
        super().__init__(cfg.host, cfg.port, cfg.max_connections, 0, DEFAULT_HEADER_TIMEOUT_S,
                         workers=2 * cfg.max_concurrent_decodes + 1)

    def error_answer(self, conn: BlockingHttpConnection, status: int,
                     message: str) -> tuple[str, bytes, list[tuple[str, str]]]:
        return error_body(conn.headers, HttpError(status, message))

    def handle(self, conn: BlockingHttpConnection, method: str, path: str, body: bytes) -> Answer:
        assert isinstance(conn, OtlpConnection)
        rx, kind = self.receiver, _kind(conn.headers)
        try:
            try:
                with rx.decoding():
                    batch = decode(rx, body, kind, conn.headers.get("content-encoding", "identity"))
                del body
            finally:
                rx.unreserve(conn.take_reserved())
            rx.store(batch)
        except HttpError as err:
            conn.close_after = True
            ctype, payload, extra = error_body(conn.headers, err)
            return err.status, ctype, payload, extra
        message = f"{batch.rejected} span(s) rejected; first: {batch.first_error}" if batch.rejected else ""
        return 200, kind, encode_response(batch.rejected, message, kind), ()


class OtlpConnection(BlockingHttpConnection):
    """One OTLP client: the head checked before the body is read; the body's bytes reserved meanwhile."""

    server: OtlpServer
    reserved = 0

    def check_head(self, method: str, path: str, size: int) -> bool:
        rx = self.server.receiver
        try:
            if path != TRACES_PATH:
                raise HttpError(404, f"unknown path {self.target}; traces go to POST {TRACES_PATH}")
            if method != "POST":
                raise HttpError(405, f"method {method} not allowed; POST {TRACES_PATH}", {"Allow": "POST"})
            if rx.config.token and not hmac.compare_digest(self.headers.get("authorization", "").encode(),
                                                           f"Bearer {rx.config.token}".encode()):
                raise HttpError(401, "missing or wrong bearer token", {"WWW-Authenticate": "Bearer"})
            kind = _kind(self.headers)
            if kind not in (PROTOBUF, JSON):
                raise HttpError(415, f"unsupported Content-Type {kind or '(none)'}; use {PROTOBUF} or {JSON}")
            if "content-length" not in self.headers:
                raise HttpError(411, "Content-Length is required")
            rx.reserve(size)
        except HttpError as err:
            assert self.transport is not None
            ctype, body, extra = error_body(self.headers, err)
            self.transport.write(self._encode(err.status, ctype, body, extra))
            self.transport.close()
            return False
        self.reserved = size
        self._arm(BODY_TIMEOUT_S)
        return True

    def _encode(self, status: int, ctype: str, body: bytes, extra: list[tuple[str, str]]) -> bytes:
        return encode(status, ctype, body, True, self.server.server_header, extra)

    def take_reserved(self) -> int:
        """The body bytes this connection holds against ``max_buffered_bytes``, now given up (once)."""
        with self.server.receiver.reserve_lock:
            size, self.reserved = self.reserved, 0
        return size

    def drop(self, abort: bool) -> None:
        super().drop(abort)
        self.server.receiver.unreserve(self.take_reserved())  # gone before its body was decoded


OtlpServer.connection = OtlpConnection


def decode(rx: OtlpReceiver, body: bytes | bytearray, kind: str, encoding: str) -> MappedBatch:
    """The mapped spans of one body; HttpError 413/415/400 (one line) when it cannot be read."""
    encoding = encoding.strip().lower() or "identity"
    limit = rx.config.max_decompressed_bytes if kind == PROTOBUF else rx.config.max_json_bytes
    try:
        if encoding == "gzip":
            body = gunzip_bounded(body, limit)
        elif encoding != "identity":
            raise HttpError(415, f"unsupported Content-Encoding {encoding}; use gzip or none")
        if len(body) > limit:
            raise HttpError(413, f"{'JSON ' if kind == JSON else ''}body exceeds {limit} bytes")
        views = decode_spans(body, kind, rx.limits)
        del body  # JSON is parsed by now; the protobuf walk holds its own reference
        return rx.mapper.map(views)
    except (OverflowError, TooManySpans) as exc:
        rx.count("too_large")
        raise HttpError(413, str(exc)) from None
    except InputError as exc:
        rx.count("bad_requests")
        raise HttpError(400, str(exc)) from None


__all__ = ["TRACES_PATH", "OtlpConnection", "OtlpServer", "decode", "error_body"]
