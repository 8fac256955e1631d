"""OTLP trace export bodies: protobuf or JSON (optionally gzip) in, spans and OTLP answers out.

Protobuf is read by :mod:`.wire` and JSON by :mod:`.json_spans`, both one span at a time with the
span count checked first (:class:`~.wire.TooManySpans`, answered 413). Errors are one-line
:class:`~triscope.errors.InputError`; a gzip body that inflates past the limit raises OverflowError.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator

from triscope.collectors.otlp.json_spans import json_spans
from triscope.collectors.otlp.wire import Buffer, Limits, TooManySpans, protobuf_spans
from triscope.collectors.span_mapping import SpanView
from triscope.errors import InputError

PROTOBUF = "application/x-protobuf"
JSON = "application/json"

# google.rpc.Code values used in error bodies.
RPC_CODE = {400: 3, 401: 16, 404: 5, 405: 12, 411: 3, 413: 8, 415: 3, 429: 8, 500: 13, 503: 14}


def decode_spans(body: Buffer, content_type: str, limits: Limits) -> Iterator[SpanView | str]:
    """The spans of an OTLP trace export body (a string for a span that cannot be read: the reason).
    InputError (one line) for a malformed body, TooManySpans past ``limits.max_spans``."""
    if content_type == PROTOBUF:
        return protobuf_spans(body, limits)
    import orjson

    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise InputError(f"body is not JSON: {exc}") from None
    return json_spans(doc, limits)


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


_CHUNK = 1 << 20


def gunzip_bounded(body: Buffer, limit: int) -> bytearray:
    """Decompress gzip ``body``, every member of a multi-member stream; InputError when invalid,
    OverflowError as soon as the output would exceed ``limit`` (it is never inflated further).
    Inflated a chunk at a time into one buffer: zlib's one-shot call holds the output twice."""
    out = bytearray()
    data = body
    try:
        while True:
            inflater = zlib.decompressobj(wbits=16 + zlib.MAX_WBITS)
            while not inflater.eof:
                chunk = inflater.decompress(data, _CHUNK)
                if len(out) + len(chunk) > limit:
                    raise OverflowError(f"decompressed body exceeds {limit} bytes")
                out += chunk
                data = inflater.unconsumed_tail
                if not chunk and not data and not inflater.eof:
                    raise InputError("body is not valid gzip: truncated stream")
            data = inflater.unused_data
            if not data:
                return out
    except zlib.error as exc:
        raise InputError(f"body is not valid gzip: {exc}") from None


__all__ = ["JSON", "PROTOBUF", "RPC_CODE", "Limits", "TooManySpans", "decode_spans", "encode_response",
           "encode_status", "gunzip_bounded"]
