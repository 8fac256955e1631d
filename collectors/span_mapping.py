"""Map one request span (vLLM ``llm_request`` or any span with ``gen_ai.*`` attributes) to a ``requests`` row.

Both the OTLP receiver (protobuf and JSON) and the in-process OpenTelemetry exporter reduce a span
to :class:`SpanView` (plain Python values) and call :func:`map_span`. Attribute names follow the OTel
GenAI semantic conventions plus the ``gen_ai.latency.*`` names vLLM emits (vllm/tracing SpanAttributes).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from triscope.schema import encode_ts

VLLM_SPAN_NAME = "llm_request"

# Column -> attribute names, first present wins (span attributes, then resource attributes).
LATENCY_ATTRS: dict[str, tuple[str, ...]] = {
    "latency_seconds": ("gen_ai.latency.e2e",),
    "ttft_seconds": ("gen_ai.latency.time_to_first_token",),
    "queue_seconds": ("gen_ai.latency.time_in_queue",),
    "prefill_seconds": ("gen_ai.latency.time_in_model_prefill",),
    "decode_seconds": ("gen_ai.latency.time_in_model_decode",),
}
TOKEN_ATTRS: dict[str, tuple[str, ...]] = {
    "prompt_tokens": ("gen_ai.usage.prompt_tokens", "gen_ai.usage.input_tokens"),
    "completion_tokens": ("gen_ai.usage.completion_tokens", "gen_ai.usage.output_tokens"),
}
MODEL_ATTRS = ("gen_ai.response.model", "gen_ai.request.model")
MODEL_VERSION_ATTRS = ("gen_ai.model.version", "model.version")
REQUEST_ID_ATTRS = ("gen_ai.request.id",)
OPERATION_ATTRS = ("gen_ai.operation.name",)
MODALITY_ATTRS = ("gen_ai.request.modality", "triscope.modality", "modality")
REQUEST_CLASS_ATTRS = ("triscope.request_class", "request.class")
GPU_ATTRS = ("triscope.gpu", "gpu.id", "gpu.index", "gpu.uuid", "gpu")
HOST_ATTRS = ("host.name",)
IMAGE_WIDTH_ATTRS = ("gen_ai.request.image.width", "image.width")
IMAGE_HEIGHT_ATTRS = ("gen_ai.request.image.height", "image.height")
IMAGE_PIXELS_ATTRS = ("gen_ai.request.image.pixels", "image.pixels")
RESOLUTION_ATTRS = ("gen_ai.request.image.resolution", "image.resolution", "input_resolution")

_UINT32_MAX = 2**32 - 1
_UINT64_MAX = 2**64 - 1


class SpanRejected(ValueError):
    """The span cannot become a row (bad ids, times or attribute values); the message says why."""


@dataclass
class SpanView:
    """The parts of a span the mapping reads, as plain Python values."""

    name: str
    trace_id: bytes
    span_id: bytes
    start_ns: int
    end_ns: int
    attributes: Mapping[str, Any] = field(default_factory=dict)
    resource: Mapping[str, Any] = field(default_factory=dict)
    error: bool = False


def is_request_span(span: SpanView) -> bool:
    """True for vLLM's ``llm_request`` span and any span carrying ``gen_ai.*`` attributes."""
    return span.name == VLLM_SPAN_NAME or any(k.startswith("gen_ai.") for k in span.attributes)


def _first(span: SpanView, names: tuple[str, ...], resource_too: bool = True) -> Any:
    for name in names:
        if name in span.attributes and span.attributes[name] not in (None, ""):
            return span.attributes[name]
    if resource_too:
        for name in names:
            if name in span.resource and span.resource[name] not in (None, ""):
                return span.resource[name]
    return None


def _number(value: Any, name: str) -> float:
    if isinstance(value, bool):
        raise SpanRejected(f"attribute {name} is a bool, expected a number")
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise SpanRejected(f"attribute {name} = {value!r} is not a number") from None
    if not math.isfinite(number) or number < 0:
        raise SpanRejected(f"attribute {name} = {value!r} must be a finite number >= 0")
    return number


def _count(value: Any, name: str, limit: int) -> int:
    number = _number(value, name)
    if number != int(number) or number > limit:
        raise SpanRejected(f"attribute {name} = {value!r} is not a count")
    return int(number)


def _text(value: Any) -> str:
    return "" if value is None else str(value)


def backend_of(span: SpanView) -> str:
    """``server.address:server.port`` when present, else ``service.instance.id``, else ``host.name``."""
    address = _first(span, ("server.address",))
    if address:
        port = _first(span, ("server.port",))
        return f"{address}:{port}" if port not in (None, "") else str(address)
    return _text(_first(span, ("service.instance.id",)) or _first(span, HOST_ATTRS))


def map_span(span: SpanView) -> dict[str, Any]:
    """One ``requests`` row for ``span``; raises :class:`SpanRejected` with a one-line reason."""
    if len(span.trace_id) != 16 or not any(span.trace_id):
        raise SpanRejected("trace_id must be 16 non-zero bytes")
    if len(span.span_id) != 8 or not any(span.span_id):
        raise SpanRejected("span_id must be 8 non-zero bytes")
    if span.start_ns <= 0:
        raise SpanRejected("start_time_unix_nano is missing")
    if span.end_ns and span.end_ns < span.start_ns:
        raise SpanRejected("end_time_unix_nano is before start_time_unix_nano")
    row: dict[str, Any] = {"ts": encode_ts(span.start_ns)}
    for column, names in LATENCY_ATTRS.items():
        value = _first(span, names, resource_too=False)
        row[column] = _number(value, names[0]) if value is not None else math.nan
    if math.isnan(row["latency_seconds"]) and span.end_ns:
        row["latency_seconds"] = (span.end_ns - span.start_ns) / 1e9
    for column, names in TOKEN_ATTRS.items():
        value = _first(span, names, resource_too=False)
        row[column] = _count(value, names[0], _UINT32_MAX) if value is not None else 0
    width, height = _first(span, IMAGE_WIDTH_ATTRS, False), _first(span, IMAGE_HEIGHT_ATTRS, False)
    pixels = _first(span, IMAGE_PIXELS_ATTRS, False)
    resolution = _text(_first(span, RESOLUTION_ATTRS, False))
    if pixels is not None:
        row["image_pixels"] = _count(pixels, IMAGE_PIXELS_ATTRS[0], _UINT64_MAX)
    elif width is not None and height is not None:
        w, h = _count(width, IMAGE_WIDTH_ATTRS[0], _UINT32_MAX), _count(height, IMAGE_HEIGHT_ATTRS[0], _UINT32_MAX)
        row["image_pixels"] = w * h
        resolution = resolution or f"{w}x{h}"
    else:
        row["image_pixels"] = 0
    row["input_resolution"] = resolution
    modality = _text(_first(span, MODALITY_ATTRS)).lower()
    if not modality:
        modality = "image" if row["image_pixels"] else ("text" if row["prompt_tokens"] else "")
    row.update(
        host=_text(_first(span, HOST_ATTRS)) or _text(_first(span, ("server.address",))),
        backend=backend_of(span),
        gpu=_text(_first(span, GPU_ATTRS)),
        model=_text(_first(span, MODEL_ATTRS)),
        model_version=_text(_first(span, MODEL_VERSION_ATTRS)),
        modality=modality,
        request_class=_text(_first(span, REQUEST_CLASS_ATTRS)),
        request_id=_text(_first(span, REQUEST_ID_ATTRS, False)),
        trace_id=span.trace_id.hex(),
        span_id=span.span_id.hex(),
        span_name=span.name,
        status="error" if span.error else "ok",
        service_name=_text(span.resource.get("service.name")),
        operation=_text(_first(span, OPERATION_ATTRS, False)),
    )
    return row
