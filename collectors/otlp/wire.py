"""OTLP protobuf ``ExportTraceServiceRequest`` to :class:`SpanView` with memory bounded by bytes.

Parsing a whole request with protobuf costs ~170 bytes per span even for a 2-byte empty span (1M
spans in 1.9 MB took 165 MB), so the levels above spans are walked here in Python, counting spans
before any is decoded. A span up to ``FAST_SPAN_BYTES`` is decoded by protobuf (its cost is then
bounded by its size); a bigger one (a 60 MB attribute) is walked too, so a long string is cut to
``max_attribute_length`` without being copied. Only the attributes the mapping reads are kept.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from triscope.collectors.span_mapping import VLLM_SPAN_NAME, SpanView
from triscope.errors import InputError

FAST_SPAN_BYTES = 64 * 1024
MAX_ATTRIBUTES = 1024
"""Attributes read per span or resource; later ones are ignored (the OTel SDK keeps 128 by default)."""


Buffer = bytes | bytearray
"""A request body (a gzip body is inflated into a bytearray)."""


class TooManySpans(OverflowError):
    """The request holds more spans (or container entries) than allowed: answered 413."""


@dataclass(frozen=True)
class Limits:
    max_spans: int = 50_000
    max_attribute_length: int = 4096
    wanted: frozenset[str] = frozenset()


class _BadSpan(ValueError):
    pass


def _varint(buf: Buffer, pos: int, end: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= end or shift > 63:
            raise InputError("body is not an OTLP protobuf ExportTraceServiceRequest: truncated or bad varint")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if b < 0x80:
            return result, pos
        shift += 7


def _fields(buf: Buffer, pos: int, end: int) -> Iterator[tuple[int, int, int, int]]:
    """``(field, wire type, a, b)``: a varint's value in ``a``; otherwise the value is ``buf[a:b]``."""
    while pos < end:
        tag, pos = _varint(buf, pos, end)
        number, wire = tag >> 3, tag & 7
        if number == 0:
            raise InputError("body is not an OTLP protobuf ExportTraceServiceRequest: field number 0")
        if wire == 0:
            value, pos = _varint(buf, pos, end)
            yield number, wire, value, pos
            continue
        if wire == 2:
            size, pos = _varint(buf, pos, end)
        elif wire in (1, 5):
            size = 8 if wire == 1 else 4
        else:
            raise InputError(f"body is not an OTLP protobuf ExportTraceServiceRequest: wire type {wire}")
        if pos + size > end:
            raise InputError("body is not an OTLP protobuf ExportTraceServiceRequest: truncated field")
        yield number, wire, pos, pos + size
        pos += size


def _text(buf: Buffer, a: int, b: int, limit: int) -> str:
    if b - a <= limit:  # a long string is cut before it is decoded: a 60 MB value is never copied
        return bytes(buf[a:b]).decode()
    return bytes(buf[a:a + 4 * limit]).decode(errors="ignore")[:limit]


def _any_value(buf: Buffer, a: int, b: int, limit: int) -> Any:
    value: Any = None
    for number, wire, x, y in _fields(buf, a, b):
        if number == 1 and wire == 2:
            value = _text(buf, x, y, limit)
        elif number == 2 and wire == 0:
            value = bool(x)
        elif number == 3 and wire == 0:
            value = x - (1 << 64) if x >= 1 << 63 else x
        elif number == 4 and wire == 1:
            value = struct.unpack_from("<d", buf, x)[0]
        elif number in (5, 6, 7):
            value = None  # arrays, maps, bytes: the mapping reads none of them
    return value


def _attributes_walked(buf: Buffer, a: int, b: int, limits: Limits, attrs: dict[str, Any]) -> bool:
    """One KeyValue into ``attrs`` when wanted; True when its key is ``gen_ai.*``."""
    key, value = "", None
    span = (0, 0)
    for number, wire, x, y in _fields(buf, a, b):
        if number == 1 and wire == 2:
            key = _text(buf, x, y, 256)
        elif number == 2 and wire == 2:
            span = (x, y)
    if key in limits.wanted:
        value = _any_value(buf, span[0], span[1], limits.max_attribute_length)
        attrs[key] = value
    return key.startswith("gen_ai.")


def _fast_attributes(kvs: Any, limits: Limits, attrs: dict[str, Any]) -> bool:
    gen_ai = False
    for i, kv in enumerate(kvs):
        if i == MAX_ATTRIBUTES:
            break
        key = kv.key
        gen_ai = gen_ai or key.startswith("gen_ai.")
        if key in limits.wanted:
            kind = kv.value.WhichOneof("value")
            value = getattr(kv.value, kind) if kind in ("string_value", "bool_value", "int_value",
                                                         "double_value") else None
            attrs[key] = value[:limits.max_attribute_length] if isinstance(value, str) else value
    return gen_ai


def _span_fast(raw: Buffer, resource: dict[str, Any], limits: Limits) -> SpanView:
    from google.protobuf.message import DecodeError
    from opentelemetry.proto.trace.v1.trace_pb2 import Span

    try:
        span = Span.FromString(raw)
    except DecodeError as exc:
        raise _BadSpan(f"not an OTLP Span: {exc}") from None
    attrs: dict[str, Any] = {}
    gen_ai = _fast_attributes(span.attributes, limits, attrs)
    name = span.name[:limits.max_attribute_length]
    return SpanView(name=name, trace_id=bytes(span.trace_id), span_id=bytes(span.span_id),
                    start_ns=int(span.start_time_unix_nano), end_ns=int(span.end_time_unix_nano),
                    attributes=attrs, resource=resource, error=span.status.code == 2,
                    parent_span_id=bytes(span.parent_span_id), kind=int(span.kind),
                    request=gen_ai or name == VLLM_SPAN_NAME)


_SPAN_IDS = {1: "trace_id", 2: "span_id", 4: "parent_span_id"}


def _span_walked(buf: Buffer, a: int, b: int, resource: dict[str, Any], limits: Limits) -> SpanView:
    parts: dict[str, Any] = {"name": "", "trace_id": b"", "span_id": b"", "parent_span_id": b"",
                             "start_ns": 0, "end_ns": 0, "kind": 0, "error": False}
    attrs: dict[str, Any] = {}
    gen_ai = False
    seen = 0
    try:
        for number, wire, x, y in _fields(buf, a, b):
            seen += 1
            if seen > MAX_ATTRIBUTES + 64:
                break  # a hostile span of millions of empty fields: the rest is not read
            if number in _SPAN_IDS and wire == 2:
                parts[_SPAN_IDS[number]] = bytes(buf[x:y])
            elif number == 5 and wire == 2:
                parts["name"] = _text(buf, x, y, limits.max_attribute_length)
            elif number == 6 and wire == 0:
                parts["kind"] = x
            elif number in (7, 8) and wire == 1:
                parts["start_ns" if number == 7 else "end_ns"] = struct.unpack_from("<Q", buf, x)[0]
            elif number == 9 and wire == 2:
                gen_ai = _attributes_walked(buf, x, y, limits, attrs) or gen_ai
            elif number == 15 and wire == 2:
                parts["error"] = any(n == 3 and w == 0 and v == 2 for n, w, v, _ in _fields(buf, x, y))
    except (InputError, UnicodeDecodeError) as exc:
        raise _BadSpan(f"not an OTLP Span: {exc}") from None
    return SpanView(**parts, attributes=attrs, resource=resource,
                    request=gen_ai or parts["name"] == VLLM_SPAN_NAME)


def _resource(buf: Buffer, a: int, b: int, limits: Limits) -> dict[str, Any]:
    """The wanted attributes of a ``Resource`` (field 1 of it: attributes)."""
    attrs: dict[str, Any] = {}
    for i, (number, wire, x, y) in enumerate(_fields(buf, a, b)):
        if i > MAX_ATTRIBUTES:
            break
        if number == 1 and wire == 2:
            _attributes_walked(buf, x, y, limits, attrs)
    return attrs


def _layout(body: Buffer, limits: Limits) -> list[tuple[tuple[int, int], list[tuple[int, int]]]]:
    """Per ResourceSpans: the resource's byte range and its spans' byte ranges. TooManySpans past the
    limit, before any span is decoded; every entry of these levels counts, so the walk is bounded."""
    budget = [8 * limits.max_spans + 1024]

    def entries(a: int, b: int) -> Iterator[tuple[int, int, int, int]]:
        for item in _fields(body, a, b):
            budget[0] -= 1
            if budget[0] < 0:
                raise TooManySpans(f"more than {8 * limits.max_spans + 1024} protobuf entries in one request; "
                                   "send smaller batches")
            yield item

    out: list[tuple[tuple[int, int], list[tuple[int, int]]]] = []
    spans = 0
    for number, wire, a, b in entries(0, len(body)):
        if number != 1 or wire != 2:
            continue
        resource, ranges = (0, 0), []
        for n2, w2, a2, b2 in entries(a, b):
            if n2 == 1 and w2 == 2:
                resource = (a2, b2)
            elif n2 == 2 and w2 == 2:
                for n3, w3, a3, b3 in entries(a2, b2):
                    if n3 == 2 and w3 == 2:
                        spans += 1
                        if spans > limits.max_spans:
                            raise TooManySpans(f"more than {limits.max_spans} spans in one request "
                                               "([otlp] max_spans_per_request); send smaller batches")
                        ranges.append((a3, b3))
        out.append((resource, ranges))
    return out


def protobuf_spans(body: Buffer, limits: Limits) -> Iterator[SpanView | str]:
    """Each span of the request as a SpanView, or the reason it cannot be decoded (that span only).
    Raises InputError for a malformed request and TooManySpans past the limit, before any span is decoded."""
    return _decode(body, _layout(body, limits), limits)


def _decode(body: Buffer, layout: list[tuple[tuple[int, int], list[tuple[int, int]]]], limits: Limits
            ) -> Iterator[SpanView | str]:
    for (ra, rb), ranges in layout:
        try:
            resource = _resource(body, ra, rb, limits)
        except (InputError, UnicodeDecodeError) as exc:
            for _ in ranges:
                yield f"its resource is not an OTLP Resource: {exc}"
            continue
        for a, b in ranges:
            try:
                if b - a <= FAST_SPAN_BYTES:
                    yield _span_fast(body[a:b], resource, limits)
                else:
                    yield _span_walked(body, a, b, resource, limits)
            except _BadSpan as exc:
                yield str(exc)
