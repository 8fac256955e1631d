"""Map one request span (vLLM ``llm_request`` or any span with ``gen_ai.*`` attributes) to a ``requests`` row.

Both the OTLP receiver (protobuf and JSON) and the in-process OpenTelemetry exporter reduce a span
to :class:`SpanView` (plain Python values) and call :func:`map_span`. Attribute names follow the OTel
GenAI semantic conventions plus the ``gen_ai.latency.*`` names vLLM emits (vllm/tracing SpanAttributes).
Which attributes name the backend and the model is configurable (:class:`SpanRules`, docs/run.md);
the SDK's random ``service.instance.id`` is never used: it changes on every restart.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from triscope.collectors.request_classes import ClassRule, classify, rule_attributes
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
MODEL_VERSION_ATTRS = ("gen_ai.model.version", "model.version")
REQUEST_ID_ATTRS = ("gen_ai.request.id", "gen_ai.response.id")
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
INT64_MAX = 2**63 - 1
"""The largest count the store takes (chDB converts Python ints below 2**63 only) and the latest
DateTime64(9) time in nanoseconds (2262-04-11T23:47:16.854775807Z)."""


@dataclass(frozen=True)
class SpanRules:
    """Which attributes name a span's backend and model; the defaults are documented in docs/run.md.

    The backend is ``address:port``: the first of ``address_attributes`` present on the span, its
    parent span (a gateway's CLIENT span carries the backend's ``server.address``/``server.port``)
    or the resource, with the first of ``port_attributes`` (same place first). The model is the first
    of ``model_attributes`` (span, parent, resource), else ``models[backend]`` or
    ``models[service.name]``, else ``model``. Strings longer than ``max_attribute_length`` are cut.
    """

    address_attributes: tuple[str, ...] = ("server.address", "net.host.name", "k8s.pod.ip", "host.name",
                                           "service.name")
    port_attributes: tuple[str, ...] = ("server.port", "net.host.port", "host.port")
    model_attributes: tuple[str, ...] = ("gen_ai.response.model", "gen_ai.request.model")
    models: Mapping[str, str] = field(default_factory=dict)
    model: str = ""
    max_attribute_length: int = 4096
    class_rules: tuple[ClassRule, ...] = ()
    """How spans that name no request class get one (:mod:`triscope.collectors.request_classes`)."""
    default_class: str = ""
    """The class of spans no rule matches ("" = the weight engine's ``[weights] default_class``)."""

    @property
    def link_keys(self) -> frozenset[str]:
        """Attributes a parent span passes to its request-span child."""
        return (frozenset(self.address_attributes + self.port_attributes + self.model_attributes)
                | rule_attributes(self.class_rules))

    @property
    def wanted(self) -> frozenset[str]:
        """Every attribute :func:`map_span` reads (decoders keep only these)."""
        names = [n for group in (*LATENCY_ATTRS.values(), *TOKEN_ATTRS.values()) for n in group]
        names += [*MODEL_VERSION_ATTRS, *REQUEST_ID_ATTRS, *OPERATION_ATTRS, *MODALITY_ATTRS, *REQUEST_CLASS_ATTRS,
                  *GPU_ATTRS, *HOST_ATTRS, *IMAGE_WIDTH_ATTRS, *IMAGE_HEIGHT_ATTRS, *IMAGE_PIXELS_ATTRS,
                  *RESOLUTION_ATTRS, "service.name"]
        return self.link_keys | frozenset(names)


DEFAULT_RULES = SpanRules()


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
    parent_span_id: bytes = b""
    kind: int = 0
    """OTLP SpanKind: 1 internal, 2 server, 3 client, 4 producer, 5 consumer (0 unspecified)."""
    parent: Mapping[str, Any] = field(default_factory=dict)
    """Identity and model attributes of the parent span (same trace), filled in by the linker."""
    request: bool | None = None
    """Whether it is a request span, when a decoder kept only some attributes (None: look at them)."""


def is_request_span(span: SpanView) -> bool:
    """True for vLLM's ``llm_request`` span and any span carrying ``gen_ai.*`` attributes."""
    if span.request is not None:
        return span.request
    return span.name == VLLM_SPAN_NAME or any(k.startswith("gen_ai.") for k in span.attributes)


def _present(attrs: Mapping[str, Any], name: str) -> Any:
    value = attrs.get(name)
    return None if value in (None, "") else value


def _first(span: SpanView, names: tuple[str, ...], resource_too: bool = True, parent_too: bool = False) -> Any:
    sources = [span.attributes, *([span.parent] if parent_too else []), *([span.resource] if resource_too else [])]
    for attrs in sources:
        for name in names:
            value = _present(attrs, name)
            if value is not None:
                return value
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


def _text(value: Any, limit: int = DEFAULT_RULES.max_attribute_length) -> str:
    return "" if value is None else str(value)[:limit]


def _port(value: Any) -> int | None:
    try:
        port = int(value)
    except (TypeError, ValueError):
        return None
    return port if 0 < port < 65536 and not isinstance(value, bool) else None


def _join(address: str, port: int | None) -> str:
    """``address:port`` as a URL's netloc spells it (IPv6 in brackets); an address with a port is kept."""
    has_port = address.count(":") == 1 or (address.startswith("[") and "]:" in address)
    if port is None or has_port:
        return address
    return f"[{address}]:{port}" if ":" in address and not address.startswith("[") else f"{address}:{port}"


def address_of(span: SpanView, rules: SpanRules = DEFAULT_RULES) -> tuple[str, str]:
    """``(address, backend)`` from ``rules`` (see :class:`SpanRules`); ``("", "")`` when nothing names one."""
    sources = (span.attributes, span.parent, span.resource)
    for name in rules.address_attributes:
        for i, attrs in enumerate(sources):
            value = _present(attrs, name)
            if value is None or (name == "service.name" and str(value).startswith("unknown_service")):
                continue
            address = _text(value, rules.max_attribute_length)
            for where in (attrs, *sources[:i], *sources[i + 1:]):
                ports = [p for p in (_port(where.get(n)) for n in rules.port_attributes) if p is not None]
                if ports:
                    return address, _join(address, ports[0])
            return address, address
    return "", ""


def backend_of(span: SpanView, rules: SpanRules = DEFAULT_RULES) -> str:
    """The backend id (``address:port``, see :class:`SpanRules`); never ``service.instance.id``."""
    return address_of(span, rules)[1]


def model_of(span: SpanView, backend: str, rules: SpanRules = DEFAULT_RULES) -> str:
    """The model: span, parent, resource attributes, then ``rules.models`` by backend / service name, then
    ``rules.model`` (vLLM's ``llm_request`` span names no model)."""
    value = _first(span, rules.model_attributes, parent_too=True)
    if value is not None:
        return _text(value, rules.max_attribute_length)
    service = _text(span.resource.get("service.name"))
    return rules.models.get(backend) or rules.models.get(service) or rules.model


def map_span(span: SpanView, rules: SpanRules = DEFAULT_RULES) -> dict[str, Any]:
    """One ``requests`` row for ``span``; raises :class:`SpanRejected` with a one-line reason."""
    if len(span.trace_id) != 16 or not any(span.trace_id):
        raise SpanRejected("trace_id must be 16 non-zero bytes")
    if len(span.span_id) != 8 or not any(span.span_id):
        raise SpanRejected("span_id must be 8 non-zero bytes")
    if span.start_ns <= 0:
        raise SpanRejected("start_time_unix_nano is missing")
    if span.start_ns > INT64_MAX:  # one such row would make the store refuse the writer's whole batch
        raise SpanRejected(f"start_time_unix_nano {span.start_ns} is after 2262-04-11T23:47:16Z, "
                           "the latest time the store holds")
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
        row["image_pixels"] = _count(pixels, IMAGE_PIXELS_ATTRS[0], INT64_MAX)
    elif width is not None and height is not None:
        w, h = _count(width, IMAGE_WIDTH_ATTRS[0], _UINT32_MAX), _count(height, IMAGE_HEIGHT_ATTRS[0], _UINT32_MAX)
        row["image_pixels"] = w * h  # < 2**64 but may pass INT64_MAX: checked below
        resolution = resolution or f"{w}x{h}"
    else:
        row["image_pixels"] = 0
    if row["image_pixels"] > INT64_MAX:
        raise SpanRejected(f"image of {row['image_pixels']} pixels is more than the store holds")
    limit = rules.max_attribute_length
    row["input_resolution"] = _text(resolution, limit)
    modality = _text(_first(span, MODALITY_ATTRS), limit).lower()
    if not modality:
        modality = "image" if row["image_pixels"] else ("text" if row["prompt_tokens"] else "")
    address, backend = address_of(span, rules)
    row.update(
        host=_text(_first(span, HOST_ATTRS), limit) or address,
        backend=backend,
        gpu=_text(_first(span, GPU_ATTRS), limit),
        model=model_of(span, backend, rules),
        model_version=_text(_first(span, MODEL_VERSION_ATTRS), limit),
        modality=modality,
        request_class=_text(_first(span, REQUEST_CLASS_ATTRS), limit),
        request_id=_text(_first(span, REQUEST_ID_ATTRS, False), limit),
        trace_id=span.trace_id.hex(),
        span_id=span.span_id.hex(),
        span_name=_text(span.name, limit),
        status="error" if span.error else "ok",
        service_name=_text(span.resource.get("service.name"), limit),
        operation=_text(_first(span, OPERATION_ATTRS, False), limit),
    )
    if not row["request_class"]:
        row["request_class"] = _text(classify(row, lambda names: _first(span, names, parent_too=True),
                                              rules.class_rules, rules.default_class), limit)
    return row
