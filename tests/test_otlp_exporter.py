"""In-process exporter: a real OpenTelemetry SDK tracer -> TriscopeSpanExporter -> chDB rows."""

from __future__ import annotations

import pytest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import Status, StatusCode

from triscope.collectors.otel_exporter import TriscopeSpanExporter
from triscope.schema import qualified


def test_sdk_tracer_to_store(store) -> None:
    exporter = TriscopeSpanExporter(store, interval_s=0.2)
    provider = TracerProvider(resource=Resource.create({
        "service.name": "vllm", "service.instance.id": "node-a:8000", "host.name": "node-a", "server.port": 8000}))
    provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=50))
    tracer = provider.get_tracer("vllm.llm_engine")
    for i in range(50):
        with tracer.start_as_current_span("llm_request") as span:
            span.set_attribute("gen_ai.request.id", f"r{i:02d}")
            span.set_attribute("gen_ai.response.model", "qwen")
            span.set_attribute("gen_ai.usage.input_tokens", 10 + i)  # newer semconv names
            span.set_attribute("gen_ai.usage.output_tokens", i)
            span.set_attribute("gen_ai.latency.e2e", i / 100)
            span.set_attribute("gen_ai.latency.time_to_first_token", i / 1000)
            span.set_attribute("gpu.id", str(i % 2))
            if i == 7:
                span.set_status(Status(StatusCode.ERROR))
    with tracer.start_as_current_span("healthcheck"):
        pass  # no gen_ai attributes: not a request span
    with tracer.start_as_current_span("llm_request") as span:
        span.set_attribute("gen_ai.usage.prompt_tokens", -3)  # rejected, others kept
    provider.force_flush()
    provider.shutdown()
    got = store.query(
        f"SELECT request_id, prompt_tokens, completion_tokens, latency_seconds, ttft_seconds, gpu, status, "
        f"backend, host, model, toUnixTimestamp64Nano(ts) AS ts_ns FROM {qualified(store, 'requests')} "
        "ORDER BY request_id").dicts()
    assert len(got) == 50
    assert exporter.rejected == 1
    assert [r["prompt_tokens"] for r in got] == [10 + i for i in range(50)]
    assert [r["completion_tokens"] for r in got] == list(range(50))
    assert [r["latency_seconds"] for r in got] == pytest.approx([i / 100 for i in range(50)])
    assert [r["ttft_seconds"] for r in got] == pytest.approx([i / 1000 for i in range(50)])
    assert {r["backend"] for r in got} == {"node-a:8000"} and {r["host"] for r in got} == {"node-a"}
    assert [r["status"] for r in got].count("error") == 1 and got[7]["status"] == "error"
    assert {r["gpu"] for r in got} == {"0", "1"}
    ts = [r["ts_ns"] for r in got]
    assert ts == sorted(ts) and ts[0] > 1_600_000_000 * 10**9


def test_shutdown_flushes_and_refuses_more(store) -> None:
    exporter = TriscopeSpanExporter(store, interval_s=60)  # only shutdown writes
    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(exporter))
    with provider.get_tracer("t").start_as_current_span("llm_request") as span:
        span.set_attribute("gen_ai.latency.e2e", 0.5)
    provider.shutdown()
    assert store.query(f"SELECT count() FROM {qualified(store, 'requests')}").scalar() == 1
    assert exporter.export([]).name == "FAILURE"


def test_callers_writer_is_used_and_left_open(store, tmp_path) -> None:
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    from triscope.writer import Writer

    writer = Writer(store, str(tmp_path / "spool"), flush_interval_s=3600)
    exporter = TriscopeSpanExporter(writer)
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    with provider.get_tracer("t").start_as_current_span("llm_request") as span:
        span.set_attribute("gen_ai.latency.e2e", 0.25)
    provider.shutdown()
    assert writer.snapshot()["rows_pending"] == 1  # spooled in the caller's writer, which stays open
    assert writer.close()
    assert store.query(f"SELECT latency_seconds FROM {qualified(store, 'requests')}").scalar() == 0.25


def test_backend_survives_restarts_and_parent_names_it(store) -> None:
    """In-process: the random ``service.instance.id`` of each (re)started provider never names the backend;
    a parent CLIENT span's ``server.address``/``server.port`` passes to its ``llm_request`` child."""
    import uuid

    from opentelemetry.trace import SpanKind

    exporter = TriscopeSpanExporter(store, interval_s=0.2)
    for restart in range(2):
        provider = TracerProvider(resource=Resource.create({
            "service.name": "vllm", "service.instance.id": str(uuid.uuid4()), "host.name": "node-b",
            "server.port": 8001}))
        provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=50))
        tracer = provider.get_tracer("vllm.tracing")
        with tracer.start_as_current_span("llm_request", kind=SpanKind.SERVER) as span:
            span.set_attribute("gen_ai.request.id", f"own-{restart}")
        gateway = {"server.address": "10.0.0.9", "server.port": 8000}
        with (tracer.start_as_current_span("POST", kind=SpanKind.CLIENT, attributes=gateway),
              tracer.start_as_current_span("llm_request", kind=SpanKind.SERVER) as span):
            span.set_attribute("gen_ai.request.id", f"routed-{restart}")
        provider.force_flush()
    exporter.shutdown()
    got = store.query(f"SELECT request_id, backend FROM {qualified(store, 'requests')} ORDER BY request_id").rows
    assert got == [("own-0", "node-b:8001"), ("own-1", "node-b:8001"),
                   ("routed-0", "10.0.0.9:8000"), ("routed-1", "10.0.0.9:8000")]
