"""OTLP/HTTP trace receiver: ``POST /v1/traces`` (protobuf or JSON, optionally gzip) into ``requests``.

Request spans (vLLM ``llm_request`` and any span with ``gen_ai.*`` attributes; every span with
``all_spans = true``) are mapped by :mod:`triscope.collectors.span_mapping` and buffered. Spans that
cannot be mapped are reported back with OTLP ``partial_success`` (``rejected_spans`` and a message);
the rest of the request is kept. Protocol details follow the OTLP specification:

* ``Content-Type: application/x-protobuf`` or ``application/json`` (OTLP JSON: lowerCamelCase keys,
  hex trace/span ids, 64-bit integers as strings or numbers); the response uses the same type.
* ``Content-Encoding: gzip`` is accepted; both the body on the wire (``max_body_bytes``) and the
  decompressed body (``max_decompressed_bytes``) are bounded, answering 413 beyond.
* Errors answer a ``google.rpc.Status`` (code and a one-line message) in the request's encoding:
  400 malformed, 401 bad or missing bearer token, 404/405 wrong path or method, 411 no length,
  413 too large, 415 unknown content type, 503 (retryable, ``Retry-After``) when the buffer is full.

Binds 127.0.0.1:4318 unless configured otherwise. Under ``triscope run`` the daemon drains rows via
:meth:`OtlpReceiver.collect`; given a ``store``, the receiver writes batches itself (FlushLoop).
"""

from __future__ import annotations

import base64
import hmac
import logging
import threading
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from triscope.collectors.row_buffer import FlushLoop, RowBuffer
from triscope.collectors.span_mapping import COLUMNS, SpanRejected, SpanView, is_request_span, map_span
from triscope.errors import ConfigError, InputError
from triscope.store import Store

log = logging.getLogger(__name__)

TRACES_PATH = "/v1/traces"
PROTOBUF = "application/x-protobuf"
JSON = "application/json"
TABLE = "requests"

DEFAULTS: dict[str, Any] = {
    "host": "127.0.0.1",
    "port": 4318,
    "max_body_bytes": 8 * 1024 * 1024,
    "max_decompressed_bytes": 64 * 1024 * 1024,
    "token": "",
    "all_spans": False,
    "buffer_rows": 1_000_000,
    "interval_s": 1.0,
    "batch_rows": 100_000,
}

# google.rpc.Code values used in error bodies.
_RPC_CODE = {400: 3, 401: 16, 404: 5, 405: 12, 411: 3, 413: 8, 415: 3, 503: 14}


# ---------------------------------------------------------------- decoding

def _any_value(value: Any) -> Any:
    kind = value.WhichOneof("value")
    if kind is None:
        return None
    if kind == "array_value":
        return [_any_value(v) for v in value.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: _any_value(kv.value) for kv in value.kvlist_value.values}
    return getattr(value, kind)


def _attributes(kvs: Any) -> dict[str, Any]:
    return {kv.key: _any_value(kv.value) for kv in kvs}


def spans_of(request: Any) -> list[SpanView]:
    """Every span of an ``ExportTraceServiceRequest`` with its resource attributes."""
    out: list[SpanView] = []
    for resource_spans in request.resource_spans:
        resource = _attributes(resource_spans.resource.attributes)
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                out.append(SpanView(
                    name=span.name, trace_id=bytes(span.trace_id), span_id=bytes(span.span_id),
                    start_ns=int(span.start_time_unix_nano), end_ns=int(span.end_time_unix_nano),
                    attributes=_attributes(span.attributes), resource=resource,
                    error=span.status.code == 2,  # STATUS_CODE_ERROR
                ))
    return out


def _hex_to_b64(value: Any) -> str:
    """OTLP JSON carries ids as hex; protobuf's JSON mapping wants base64. Bad hex becomes empty (rejected later)."""
    if not isinstance(value, str):
        return ""
    try:
        return base64.b64encode(bytes.fromhex(value)).decode()
    except ValueError:
        return ""


def _fix_json_ids(doc: Any) -> None:
    if not isinstance(doc, dict):
        raise ValueError("top level must be a JSON object")
    for rs in doc.get("resourceSpans", doc.get("resource_spans", [])) or []:
        if not isinstance(rs, dict):
            continue
        for ss in rs.get("scopeSpans", rs.get("scope_spans", [])) or []:
            if not isinstance(ss, dict):
                continue
            for span in ss.get("spans", []) or []:
                if not isinstance(span, dict):
                    continue
                for key in ("traceId", "spanId", "parentSpanId", "trace_id", "span_id", "parent_span_id"):
                    if key in span:
                        span[key] = _hex_to_b64(span[key])
                for link in span.get("links", []) or []:
                    if isinstance(link, dict):
                        for key in ("traceId", "spanId", "trace_id", "span_id"):
                            if key in link:
                                link[key] = _hex_to_b64(link[key])


def decode_request(body: bytes, content_type: str) -> Any:
    """Parse an OTLP trace export body; raises InputError with a one-line message."""
    from google.protobuf import json_format
    from google.protobuf.message import DecodeError
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    request = ExportTraceServiceRequest()
    if content_type == PROTOBUF:
        try:
            request.ParseFromString(body)
        except DecodeError as exc:
            raise InputError(f"body is not an OTLP protobuf ExportTraceServiceRequest: {exc}") from None
        return request
    import orjson

    try:
        doc = orjson.loads(body)
        _fix_json_ids(doc)
        json_format.ParseDict(doc, request, ignore_unknown_fields=True)
    except orjson.JSONDecodeError as exc:
        raise InputError(f"body is not JSON: {exc}") from None
    except (ValueError, json_format.ParseError) as exc:
        text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise InputError(f"body is not an OTLP JSON ExportTraceServiceRequest: {text}") from None
    return request


def map_request(request: Any, all_spans: bool = False) -> tuple[list[dict[str, Any]], int, str]:
    """Rows for the request spans, the number rejected and the first rejection reason."""
    rows: list[dict[str, Any]] = []
    rejected, first_error = 0, ""
    for span in spans_of(request):
        if not (all_spans or is_request_span(span)):
            continue
        try:
            rows.append(map_span(span))
        except SpanRejected as exc:
            rejected += 1
            first_error = first_error or f"span {span.name!r}: {exc}"
    return rows, rejected, first_error


def encode_response(rejected: int, message: str, content_type: str) -> bytes:
    """A serialized ExportTraceServiceResponse; ``partial_success`` only when spans were rejected."""
    from google.protobuf import json_format
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse

    response = ExportTraceServiceResponse()
    if rejected or message:
        response.partial_success.rejected_spans = rejected
        response.partial_success.error_message = message
    if content_type == JSON:
        return json_format.MessageToJson(response, indent=None).encode()
    return response.SerializeToString()


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def encode_status(code: int, message: str, content_type: str) -> bytes:
    """``google.rpc.Status{code, message}`` in JSON or protobuf wire format (field 1 varint, field 2 string)."""
    if content_type == JSON:
        import orjson

        return orjson.dumps({"code": code, "message": message})
    text = message.encode()
    return b"\x08" + _varint(code) + b"\x12" + _varint(len(text)) + text


def gunzip_bounded(body: bytes, limit: int) -> bytes:
    """Decompress gzip ``body``; InputError when invalid, OverflowError when it would exceed ``limit``."""
    inflater = zlib.decompressobj(wbits=16 + zlib.MAX_WBITS)
    try:
        out = inflater.decompress(body, limit + 1)
        if len(out) > limit or inflater.unconsumed_tail:
            raise OverflowError(f"decompressed body exceeds {limit} bytes")
        out += inflater.flush()
    except zlib.error as exc:
        raise InputError(f"body is not valid gzip: {exc}") from None
    if len(out) > limit:
        raise OverflowError(f"decompressed body exceeds {limit} bytes")
    if not inflater.eof:
        raise InputError("body is not valid gzip: truncated stream")
    return out


# ---------------------------------------------------------------- HTTP

class _HttpError(Exception):
    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.headers = headers or {}


class _Handler(BaseHTTPRequestHandler):
    server_version = "triscope-otlp"
    protocol_version = "HTTP/1.1"
    receiver: OtlpReceiver  # set on the subclass made per receiver

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("otlp %s " + format, self.address_string(), *args)

    def _send(self, status: int, body: bytes, content_type: str, headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.end_headers()
        self.wfile.write(body)

    def _content_type(self) -> str:
        return (self.headers.get("Content-Type") or "").split(";")[0].strip().lower()

    def _fail(self, err: _HttpError) -> None:
        kind = self._content_type()
        kind = kind if kind in (PROTOBUF, JSON) else "text/plain; charset=utf-8"
        message = str(err).replace("\n", " ")
        body = (encode_status(_RPC_CODE.get(err.status, 2), message, kind)
                if kind in (PROTOBUF, JSON) else (message + "\n").encode())
        self._send(err.status, body, kind, err.headers)

    def do_POST(self) -> None:
        try:
            self._post()
        except _HttpError as err:
            if err.status in (411, 413):
                self.close_connection = True  # the unread body cannot be skipped safely
            self._fail(err)

    def _reject_method(self) -> None:
        self.close_connection = True
        self._fail(_HttpError(405, f"method {self.command} not allowed; POST {TRACES_PATH}", {"Allow": "POST"}))

    do_GET = do_PUT = do_DELETE = do_PATCH = _reject_method

    def _post(self) -> None:
        rx = self.receiver
        if self.path.split("?")[0] != TRACES_PATH:
            self.close_connection = True
            raise _HttpError(404, f"unknown path {self.path}; traces go to POST {TRACES_PATH}")
        if rx.token:
            given = self.headers.get("Authorization") or ""
            if not hmac.compare_digest(given.encode(), f"Bearer {rx.token}".encode()):
                self.close_connection = True
                raise _HttpError(401, "missing or wrong bearer token", {"WWW-Authenticate": "Bearer"})
        kind = self._content_type()
        if kind not in (PROTOBUF, JSON):
            self.close_connection = True
            raise _HttpError(415, f"unsupported Content-Type {kind or '(none)'}; use {PROTOBUF} or {JSON}")
        length_text = self.headers.get("Content-Length")
        if length_text is None:
            raise _HttpError(411, "Content-Length is required")
        try:
            length = int(length_text)
        except ValueError:
            raise _HttpError(411, f"bad Content-Length {length_text!r}") from None
        if length < 0:
            raise _HttpError(411, f"bad Content-Length {length_text!r}")
        if length > rx.max_body_bytes:
            raise _HttpError(413, f"body of {length} bytes exceeds the limit of {rx.max_body_bytes}")
        body = self.rfile.read(length)
        encoding = (self.headers.get("Content-Encoding") or "identity").strip().lower()
        try:
            if encoding == "gzip":
                body = gunzip_bounded(body, rx.max_decompressed_bytes)
            elif encoding != "identity":
                raise _HttpError(415, f"unsupported Content-Encoding {encoding}; use gzip or none")
            if len(body) > rx.max_decompressed_bytes:
                raise _HttpError(413, f"body exceeds {rx.max_decompressed_bytes} bytes")
            rows, rejected, message = map_request(decode_request(body, kind), rx.all_spans)
        except OverflowError as exc:
            raise _HttpError(413, str(exc)) from None
        except InputError as exc:
            rx.stats["bad_requests"] += 1
            raise _HttpError(400, str(exc)) from None
        if rows and not rx.buffer.add(TABLE, rows):
            raise _HttpError(503, "receiver buffer is full; retry later", {"Retry-After": "1"})
        rx.stats["spans"] += len(rows)
        rx.stats["rejected_spans"] += rejected
        if rejected:
            message = f"{rejected} span(s) rejected; first: {message}"
        self._send(200, encode_response(rejected, message if rejected else "", kind), kind)


class OtlpReceiver:
    """OTLP/HTTP trace receiver implementing the :class:`triscope.component.Collector` protocol."""

    name = "otlp"

    def __init__(self, config: dict[str, Any] | None = None, store: Store | None = None) -> None:
        cfg = {**DEFAULTS, **((config or {}).get("otlp", {}))}
        try:
            self.host = str(cfg["host"])
            self.port = int(cfg["port"])
            self.max_body_bytes = int(cfg["max_body_bytes"])
            self.max_decompressed_bytes = int(cfg["max_decompressed_bytes"])
            self.interval_s = float(cfg["interval_s"])
            batch_rows, buffer_rows = int(cfg["batch_rows"]), int(cfg["buffer_rows"])
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"[otlp] has a bad value: {exc}") from None
        self.token = str(cfg["token"] or "")
        self.all_spans = bool(cfg["all_spans"])
        self.buffer = RowBuffer({TABLE: COLUMNS}, max_rows=buffer_rows)
        self.buffer.batch_rows = batch_rows
        self.flusher = FlushLoop(store, self.buffer, self.interval_s, batch_rows) if store is not None else None
        self.stats = {"spans": 0, "rejected_spans": 0, "bad_requests": 0}
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def address(self) -> tuple[str, int]:
        """The bound (host, port); the port is the real one when configured as 0."""
        if self._server is None:
            return self.host, self.port
        host, port = self._server.server_address[:2]
        return str(host), int(port)

    @property
    def url(self) -> str:
        host, port = self.address
        return f"http://{host}:{port}{TRACES_PATH}"

    def start(self) -> None:
        """Bind and serve in a background thread."""
        if self._server is not None:
            return
        handler = type("OtlpHandler", (_Handler,), {"receiver": self})
        try:
            self._server = ThreadingHTTPServer((self.host, self.port), handler)
        except OSError as exc:
            raise ConfigError(f"cannot bind OTLP receiver to {self.host}:{self.port}: {exc.strerror}") from None
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.05,), name="triscope-otlp", daemon=True)
        self._thread.start()
        if self.flusher is not None:
            self.flusher.start()

    def collect(self) -> dict[str, dict[str, list[Any]]]:
        """Rows received since the last call (empty when a store-backed flush loop owns writing)."""
        if self.flusher is not None:
            return {}
        return self.buffer.drain()

    def flush(self) -> int:
        """Write buffered rows now (store-backed mode); returns rows written."""
        return self.flusher.flush() if self.flusher is not None else 0

    def close(self) -> None:
        """Stop serving and write what is buffered; safe to call twice."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        if self.flusher is not None:
            self.flusher.close()


def factory(config: dict[str, Any]) -> OtlpReceiver:
    """Collector factory for ``triscope run``."""
    return OtlpReceiver(config)


__all__ = ["OtlpReceiver", "decode_request", "encode_response", "factory", "map_request"]
