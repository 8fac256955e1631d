"""Engine spans name the right backend: the real OpenTelemetry SDK and its real OTLP/HTTP
exporter send spans shaped like vLLM's to the real receiver, writer and chDB store.

The spans copy vLLM's ``llm_request`` (vllm/tracing.py SpanAttributes, and what a real vLLM 0.32 emits per
../shared/notes/vllm-cpu.md): a SERVER span with ``gen_ai.request.*``, ``gen_ai.usage.*`` and
``gen_ai.latency.*`` attributes, no ``gen_ai.response.model``, no host attribute; the resource has
``service.name`` (OTEL_SERVICE_NAME), ``vllm.process_kind``/``vllm.process_id`` and the SDK's random
``service.instance.id``. The values (tokens, latencies, addresses) are synthetic.
"""

from __future__ import annotations

import json
import os
import time
import uuid

import pytest
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.propagate import extract, inject
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, set_span_in_context
from otlp_helpers import post

from triscope.collectors.otlp import create
from triscope.component import Context
from triscope.schema import qualified
from triscope.writer import Writer


def vllm_provider(exporter) -> TracerProvider:
    """What ``vllm serve --otlp-traces-endpoint`` sets up: TracerProvider() whose resource comes from the
    environment (OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES) plus vLLM's process attributes. The SDK draws
    ``service.instance.id`` once per process; a new one is given here as a restarted server would draw."""
    provider = TracerProvider(resource=Resource.create({"vllm.process_kind": "api_server",
                                                        "vllm.process_id": os.getpid(),
                                                        "service.instance.id": str(uuid.uuid4())}))
    provider.add_span_processor(exporter)
    return provider


def vllm_request_span(tracer, request_id: str, headers: dict[str, str] | None = None) -> None:
    """One ``llm_request`` span as vLLM's output processor makes it (context from the request's trace headers)."""
    attrs = {
        "gen_ai.request.id": request_id, "gen_ai.request.top_p": 1.0, "gen_ai.request.max_tokens": 16,
        "gen_ai.request.temperature": 0.0, "gen_ai.request.n": 1,
        "gen_ai.usage.prompt_tokens": 12, "gen_ai.usage.completion_tokens": 7,
        "gen_ai.latency.time_in_queue": 0.001, "gen_ai.latency.time_to_first_token": 0.02,
        "gen_ai.latency.e2e": 0.1, "gen_ai.latency.time_in_model_prefill": 0.01,
        "gen_ai.latency.time_in_model_decode": 0.07, "gen_ai.latency.time_in_model_inference": 0.08,
    }
    context = extract(headers) if headers else None
    with tracer.start_as_current_span("llm_request", kind=SpanKind.SERVER, context=context,
                                      start_time=time.time_ns(), attributes=attrs):
        pass


def gateway_call(tracer, address: str, port: int) -> tuple[dict[str, str], object]:
    """A router's HTTP CLIENT span to a backend (OTel HTTP client semconv); its traceparent goes to the engine."""
    span = tracer.start_span("POST", kind=SpanKind.CLIENT, attributes={
        "http.request.method": "POST", "server.address": address, "server.port": port,
        "url.full": f"http://{address}:{port}/v1/chat/completions"})
    headers: dict[str, str] = {}
    inject(headers, context=set_span_in_context(span))
    return headers, span


@pytest.fixture()
def writer(store, tmp_path):
    w = Writer(store, str(tmp_path / "spool"), flush_interval_s=3600)
    w.start()
    yield w
    w.close()


def start_receiver(writer, **section):
    rx = create({"otlp": {"port": 0, **section}}, Context(submit=writer.submit))
    rx.start()
    return rx


def stored(store, writer) -> list[dict]:
    assert writer.flush(timeout_s=30)
    return store.query(f"SELECT request_id, backend, host, model, service_name, span_name, prompt_tokens "
                       f"FROM {qualified(store, 'requests')} ORDER BY request_id").dicts()


def test_vllm_backend_is_stable_across_sdk_restarts(store, writer, monkeypatch) -> None:
    """The deployment docs/run.md gives for vLLM: OTEL_RESOURCE_ATTRIBUTES names host and port; the model
    comes from ``[otlp] models`` because the span names none."""
    monkeypatch.setenv("OTEL_SERVICE_NAME", "vllm")
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "host.name=gpu-node-1,server.port=8000")
    rx = start_receiver(writer, models={"gpu-node-1:8000": "Qwen/Qwen3-0.6B"})
    instances = []
    try:
        for restart in range(3):  # each a new process: a new random service.instance.id
            provider = vllm_provider(BatchSpanProcessor(OTLPSpanExporter(endpoint=rx.url),
                                                        schedule_delay_millis=50))
            tracer = provider.get_tracer("vllm.tracing")
            for i in range(4):
                vllm_request_span(tracer, f"cmpl-{restart}-{i}")
            provider.shutdown()
            instances.append(provider.resource.attributes["service.instance.id"])
    finally:
        rx.close()
    assert len(set(instances)) == 3
    got = stored(store, writer)
    assert len(got) == 12
    assert {r["backend"] for r in got} == {"gpu-node-1:8000"}
    assert {r["host"] for r in got} == {"gpu-node-1"} and {r["service_name"] for r in got} == {"vllm"}
    assert {r["model"] for r in got} == {"Qwen/Qwen3-0.6B"}
    assert [r["request_id"] for r in got] == sorted(f"cmpl-{r}-{i}" for r in range(3) for i in range(4))
    assert not any(inst in r["backend"] for r in got for inst in instances)


def test_vllm_as_shipped_names_no_random_backend(store, writer, monkeypatch) -> None:
    """Nothing set but OTEL_SERVICE_NAME: the backend is the service name (stable), never the random id;
    the model comes from the resource when the operator puts it there."""
    monkeypatch.setenv("OTEL_SERVICE_NAME", "vllm-llama")
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "gen_ai.request.model=llama-3.1-8b")
    monkeypatch.delenv("OTEL_SERVICE_INSTANCE_ID", raising=False)
    rx = start_receiver(writer)
    try:
        for restart in range(2):
            provider = vllm_provider(SimpleSpanProcessor(OTLPSpanExporter(endpoint=rx.url)))
            vllm_request_span(provider.get_tracer("vllm.tracing"), f"r{restart}")
            provider.shutdown()
    finally:
        rx.close()
    got = stored(store, writer)
    assert [(r["backend"], r["model"]) for r in got] == [("vllm-llama", "llama-3.1-8b")] * 2


def _gateway_and_engine(n: int) -> tuple[list[ReadableSpan], list[ReadableSpan]]:
    """``n`` requests: a gateway CLIENT span to 10.0.0.5:8000 and the engine's llm_request child, each
    process with its own provider (spans kept in memory, then exported as the test says)."""
    gw_mem, engine_mem = InMemorySpanExporter(), InMemorySpanExporter()
    gateway = TracerProvider(resource=Resource.create({"service.name": "gateway"}))
    gateway.add_span_processor(SimpleSpanProcessor(gw_mem))
    engine = vllm_provider(SimpleSpanProcessor(engine_mem))
    for i in range(n):
        headers, span = gateway_call(gateway.get_tracer("router"), "10.0.0.5", 8000)
        vllm_request_span(engine.get_tracer("vllm.tracing"), f"gw-{i}", headers)
        span.end()
    return list(gw_mem.get_finished_spans()), list(engine_mem.get_finished_spans())


@pytest.mark.parametrize("order", ["one_request", "parent_first"])
def test_gateway_span_names_the_backend_of_its_llm_request_child(store, writer, monkeypatch, order) -> None:
    monkeypatch.setenv("OTEL_SERVICE_NAME", "vllm")
    monkeypatch.delenv("OTEL_RESOURCE_ATTRIBUTES", raising=False)
    parents, children = _gateway_and_engine(3)
    pairs = zip(parents, children, strict=True)
    assert all(c.parent is not None and c.parent.span_id == p.context.span_id for p, c in pairs)
    rx = start_receiver(writer, model="llama")
    try:
        exporter = OTLPSpanExporter(endpoint=rx.url)
        if order == "one_request":  # as an OTel Collector forwards both services' spans in one batch
            assert exporter.export(parents + children).name == "SUCCESS"
        else:
            assert exporter.export(parents).name == "SUCCESS"
            assert exporter.export(children).name == "SUCCESS"
    finally:
        rx.close()
    got = stored(store, writer)
    assert [r["request_id"] for r in got] == ["gw-0", "gw-1", "gw-2"]  # the HTTP span is not a request
    assert {r["backend"] for r in got} == {"10.0.0.5:8000"}
    assert {r["model"] for r in got} == {"llama"} and {r["host"] for r in got} == {"10.0.0.5"}


@pytest.mark.parametrize("order", ["one_request", "child_first"])
def test_all_spans_counts_http_parent_and_child_once(store, writer, monkeypatch, order) -> None:
    monkeypatch.setenv("OTEL_SERVICE_NAME", "vllm")
    parents, children = _gateway_and_engine(3)
    lone = TracerProvider(resource=Resource.create({"service.name": "gateway"}))
    mem = InMemorySpanExporter()
    lone.add_span_processor(SimpleSpanProcessor(mem))
    gateway_call(lone.get_tracer("router"), "10.0.0.6", 8000)[1].end()  # a call with no engine span
    rx = start_receiver(writer, all_spans=True)
    try:
        exporter = OTLPSpanExporter(endpoint=rx.url)
        if order == "one_request":
            assert exporter.export(parents + children + list(mem.get_finished_spans())).name == "SUCCESS"
        else:  # in one process the child ends, and is exported, first
            assert exporter.export(children).name == "SUCCESS"
            assert exporter.export(parents + list(mem.get_finished_spans())).name == "SUCCESS"
        assert rx.stats["merged_spans"] == 3
    finally:
        rx.close()
    got = stored(store, writer)
    assert len(got) == 4  # 3 requests, one row each, and the lone call
    assert [r["span_name"] for r in got].count("llm_request") == 3
    assert sorted(r["backend"] for r in got if r["span_name"] == "POST") == ["10.0.0.6:8000"]


def test_json_parent_link_and_response_id(store, writer) -> None:
    """OTLP JSON (hex ids, ``parentSpanId``): a span with only ``gen_ai.response.id`` keeps it as its request id."""
    def attr(key, value):
        kind = "intValue" if isinstance(value, int) else "stringValue"
        return {"key": key, "value": {kind: str(value) if kind == "intValue" else value}}

    t0 = 1_767_225_600_000_000_000
    doc = {"resourceSpans": [
        {"resource": {"attributes": [attr("service.name", "router")]}, "scopeSpans": [{"spans": [{
            "traceId": "aa" * 16, "spanId": "bb" * 8, "name": "POST", "kind": 3,
            "startTimeUnixNano": str(t0), "endTimeUnixNano": str(t0 + 10**9),
            "attributes": [attr("server.address", "fd00::5"), attr("server.port", 9000),
                           attr("http.request.method", "POST")]}]}]},
        {"resource": {"attributes": [attr("service.name", "tgi")]}, "scopeSpans": [{"spans": [{
            "traceId": "aa" * 16, "spanId": "cc" * 8, "parentSpanId": "bb" * 8, "name": "chat llama",
            "kind": 2, "startTimeUnixNano": str(t0 + 1000), "endTimeUnixNano": str(t0 + 9 * 10**8),
            "attributes": [attr("gen_ai.response.id", "chatcmpl-77"), attr("gen_ai.usage.input_tokens", 5),
                           attr("gen_ai.request.model", "llama")]}]}]},
    ]}
    rx = start_receiver(writer)
    try:
        status, _, body = post(rx, json.dumps(doc).encode(), "application/json")
    finally:
        rx.close()
    assert status == 200 and json.loads(body) == {}
    (row,) = stored(store, writer)
    assert row["request_id"] == "chatcmpl-77" and row["backend"] == "[fd00::5]:9000"
    assert row["model"] == "llama" and row["service_name"] == "tgi" and row["prompt_tokens"] == 5


def test_identity_attributes_are_configurable(store, writer) -> None:
    """A fleet whose engines carry ``k8s.pod.name`` and ``app.port`` (the k8sattributes processor's names)."""
    provider = TracerProvider(resource=Resource.create({"service.name": "sglang", "k8s.pod.name": "sglang-0",
                                                        "app.port": 30000, "host.name": "node-7"}))
    rx = start_receiver(writer, address_attributes=["k8s.pod.name"], port_attributes=["app.port"])
    try:
        provider.add_span_processor(SimpleSpanProcessor(OTLPSpanExporter(endpoint=rx.url)))
        vllm_request_span(provider.get_tracer("t"), "k1")
        provider.shutdown()
    finally:
        rx.close()
    (row,) = stored(store, writer)
    assert row["backend"] == "sglang-0:30000" and row["host"] == "node-7"


def test_request_classes_come_from_the_documented_mapping(store, writer, monkeypatch) -> None:
    """vLLM's spans name no class: ``[otlp] class_rules`` give one by model, by the gateway's header attribute
    (on the parent span) and by prompt size; the rest get ``default_class``; a span's own class wins."""
    monkeypatch.setenv("OTEL_SERVICE_NAME", "vllm")
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "host.name=gpu-1,server.port=8000")
    rules = [{"class": "realtime_speech", "model": "whisper*"},
             {"class": "offline_video", "attribute": "http.request.header.x-priority", "value": "batch*"},
             {"class": "offline_video", "min_prompt_tokens": 4000}]
    rx = start_receiver(writer, class_rules=rules, default_class="interactive_image_text",
                        models={"gpu-1:8000": "llama"})
    mem = InMemorySpanExporter()
    gateway = TracerProvider(resource=Resource.create({"service.name": "gateway"}))
    gateway.add_span_processor(SimpleSpanProcessor(mem))
    engine = vllm_provider(SimpleSpanProcessor(mem))
    tracer = engine.get_tracer("vllm.tracing")
    try:
        vllm_request_span(tracer, "plain")
        _, span = gateway_call(gateway.get_tracer("router"), "gpu-1", 8000)
        span.set_attribute("http.request.header.x-priority", "batch-nightly")
        headers = {}
        inject(headers, context=set_span_in_context(span))
        vllm_request_span(tracer, "batch", headers)
        span.end()
        with tracer.start_as_current_span("llm_request", kind=SpanKind.SERVER, attributes={
                "gen_ai.request.id": "speech", "gen_ai.request.model": "whisper-large-v3",
                "gen_ai.usage.prompt_tokens": 5000, "gen_ai.latency.e2e": 0.1}):
            pass  # the model rule comes first: speech, though 5000 tokens
        with tracer.start_as_current_span("llm_request", kind=SpanKind.SERVER, attributes={
                "gen_ai.request.id": "long", "gen_ai.usage.prompt_tokens": 4096, "gen_ai.latency.e2e": 3.0}):
            pass
        with tracer.start_as_current_span("llm_request", kind=SpanKind.SERVER, attributes={
                "gen_ai.request.id": "tagged", "triscope.request_class": "realtime_speech",
                "gen_ai.usage.prompt_tokens": 9000, "gen_ai.latency.e2e": 0.1}):
            pass
        assert OTLPSpanExporter(endpoint=rx.url).export(list(mem.get_finished_spans())).name == "SUCCESS"
    finally:
        rx.close()
    assert writer.flush(timeout_s=30)
    got = dict(store.query(f"SELECT request_id, request_class FROM {qualified(store, 'requests')}").rows)
    assert got == {"plain": "interactive_image_text", "batch": "offline_video", "speech": "realtime_speech",
                   "long": "offline_video", "tagged": "realtime_speech"}


@pytest.mark.parametrize(("rules", "message"), [
    ([{"class": "x", "modle": "a"}], r"\[otlp\] class_rules\[0\] has unknown keys: modle \(known: "),
    ([{"model": "a"}], r"class_rules\[0\] needs class"),
    ([{"class": "x"}], r"sets no condition: use default_class"),
    ([{"class": "x", "value": "a"}], r"value needs attribute"),
    ([{"class": "x", "min_prompt_tokens": -1}], r"must be integers >= 0"),
    (["x"], r"class_rules\[0\]: must be a table"),
])
def test_class_rule_mistakes_are_one_line_errors(rules, message) -> None:
    from triscope.collectors.otlp import OtlpConfig
    from triscope.errors import ConfigError

    with pytest.raises(ConfigError, match=message) as err:
        OtlpConfig.from_config({"otlp": {"class_rules": rules}})
    assert "\n" not in str(err.value)
