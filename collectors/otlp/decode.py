"""OTLP trace export bodies: protobuf or JSON (optionally gzip) in, ``requests`` rows and OTLP answers out.

OTLP JSON differs from protobuf's JSON mapping in one way that matters here: trace and span ids
are hex, not base64 (:func:`decode_request` converts them). Errors are one-line
:class:`~triscope.errors.InputError`; a gzip body that inflates past the limit raises OverflowError.
"""

from __future__ import annotations

import base64
import zlib
from typing import Any

from triscope.collectors.span_mapping import SpanRejected, SpanView, is_request_span, map_span
from triscope.errors import InputError

PROTOBUF = "application/x-protobuf"
JSON = "application/json"

# google.rpc.Code values used in error bodies.
RPC_CODE = {400: 3, 401: 16, 404: 5, 405: 12, 411: 3, 413: 8, 415: 3, 500: 13, 503: 14}


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
