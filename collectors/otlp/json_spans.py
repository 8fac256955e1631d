"""OTLP JSON ``ExportTraceServiceRequest`` to :class:`SpanView`, one span at a time.

OTLP JSON differs from protobuf's JSON mapping: trace and span ids are hex, 64-bit integers may
be strings, and both camelCase and snake_case keys occur. The structure above spans must be right
(else InputError, answered 400); a span with a bad field is rejected alone. JSON costs up to ~24x
its size in Python objects, which is why its bodies have their own bound (``max_json_bytes``).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from typing import Any

from triscope.collectors.otlp.wire import MAX_ATTRIBUTES, Limits, TooManySpans
from triscope.collectors.span_mapping import VLLM_SPAN_NAME, SpanView
from triscope.errors import InputError


def _get(doc: Mapping[str, Any], camel: str, snake: str) -> Any:
    return doc.get(camel, doc.get(snake))


def _list(doc: Mapping[str, Any], camel: str, snake: str, where: str) -> list[Any]:
    value = _get(doc, camel, snake)
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
        raise InputError(f"body is not an OTLP JSON ExportTraceServiceRequest: {where}.{camel} must be a list of "
                         "objects")
    return value


def _id(value: Any, name: str) -> bytes:
    if value in (None, ""):
        return b""
    try:
        return bytes.fromhex(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} {str(value)[:40]!r} is not hex") from None


def _uint64(value: Any, name: str) -> int:
    if value in (None, ""):
        return 0
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ValueError(f"{name} must be an integer")
    try:
        number = int(value)
    except ValueError:
        raise ValueError(f"{name} {str(value)[:40]!r} is not an integer") from None
    if not 0 <= number < 2**64:
        raise ValueError(f"{name} {number} is outside 0..2**64-1")
    return number


def _value(value: Any, limit: int) -> Any:
    if not isinstance(value, dict):
        return None
    if isinstance(text := _get(value, "stringValue", "string_value"), str):
        return text[:limit]
    if isinstance(flag := _get(value, "boolValue", "bool_value"), bool):
        return flag
    number = _get(value, "intValue", "int_value")
    if number is not None and not isinstance(number, bool):
        try:
            return int(number)
        except (TypeError, ValueError):
            return str(number)[:limit]  # the mapping names the attribute when it needs a number
    real = _get(value, "doubleValue", "double_value")
    if isinstance(real, int | float) and not isinstance(real, bool):
        return float(real)
    if isinstance(real, str):
        return {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}.get(real, real[:limit])
    return None


def _attributes(items: Any, limits: Limits) -> tuple[dict[str, Any], bool]:
    attrs: dict[str, Any] = {}
    gen_ai = False
    if not isinstance(items, list):
        return attrs, gen_ai
    for item in items[:MAX_ATTRIBUTES]:
        if not isinstance(item, dict) or not isinstance(key := item.get("key"), str):
            continue
        gen_ai = gen_ai or key.startswith("gen_ai.")
        if key in limits.wanted:
            attrs[key] = _value(item.get("value"), limits.max_attribute_length)
    return attrs, gen_ai


def _span(doc: dict[str, Any], resource: dict[str, Any], limits: Limits) -> SpanView:
    name = doc.get("name")
    name = name[:limits.max_attribute_length] if isinstance(name, str) else ""
    attrs, gen_ai = _attributes(doc.get("attributes"), limits)
    status = doc.get("status")
    code = status.get("code") if isinstance(status, dict) else None
    kind = doc.get("kind")
    return SpanView(
        name=name, trace_id=_id(_get(doc, "traceId", "trace_id"), "traceId"),
        span_id=_id(_get(doc, "spanId", "span_id"), "spanId"),
        parent_span_id=_id(_get(doc, "parentSpanId", "parent_span_id"), "parentSpanId"),
        start_ns=_uint64(_get(doc, "startTimeUnixNano", "start_time_unix_nano"), "startTimeUnixNano"),
        end_ns=_uint64(_get(doc, "endTimeUnixNano", "end_time_unix_nano"), "endTimeUnixNano"),
        attributes=attrs, resource=resource, error=code in (2, "STATUS_CODE_ERROR"),
        kind=kind if isinstance(kind, int) and not isinstance(kind, bool) else 0,
        request=gen_ai or name == VLLM_SPAN_NAME,
    )


def json_spans(doc: Any, limits: Limits) -> Iterator[SpanView | str]:
    """Each span of a parsed OTLP JSON document as a SpanView, or the reason it cannot be read (that span
    only). InputError for a wrong structure and TooManySpans past the limit, before any span is read."""
    if not isinstance(doc, dict):
        raise InputError("body is not an OTLP JSON ExportTraceServiceRequest: top level must be a JSON object")
    layout: list[tuple[Any, list[list[Any]]]] = []
    total = 0
    for rs in _list(doc, "resourceSpans", "resource_spans", "request"):
        scopes = [_list(ss, "spans", "spans", "scopeSpans[]")
                  for ss in _list(rs, "scopeSpans", "scope_spans", "resourceSpans[]")]
        total += sum(len(spans) for spans in scopes)
        if total > limits.max_spans:
            raise TooManySpans(f"more than {limits.max_spans} spans in one request ([otlp] max_spans_per_request); "
                               "send smaller batches")
        layout.append((rs.get("resource"), scopes))
    return _read(layout, limits)


def _read(layout: list[tuple[Any, list[list[Any]]]], limits: Limits) -> Iterator[SpanView | str]:
    for resource_doc, scopes in layout:
        resource, _ = _attributes(resource_doc.get("attributes") if isinstance(resource_doc, dict) else None, limits)
        for spans in scopes:
            for span in spans:
                try:
                    yield _span(span, resource, limits)
                except ValueError as exc:
                    yield str(exc)
