"""Requests that never reached an engine: a gateway's failed CLIENT span with no engine span under it is
stored as that backend's failed request, so a dead backend's error ratio is not 0.

The real OpenTelemetry SDK and its OTLP/HTTP exporter send to the real receiver, writer and chDB store;
the gateway spans follow the OTel HTTP client conventions (``server.address`` / ``server.port``, status
ERROR and the exception recorded when the connection is refused). Addresses are synthetic.
"""

from __future__ import annotations

from typing import Any

import pytest
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, Status, StatusCode
from test_otlp_identity import gateway_call, start_receiver, vllm_provider, vllm_request_span

from triscope.schema import qualified
from triscope.writer import Writer

DEAD = ("10.0.0.7", 8000)
LIVE = ("10.0.0.5", 8000)


@pytest.fixture()
def writer(store: Any, tmp_path: Any) -> Any:
    w = Writer(store, str(tmp_path / "spool"), flush_interval_s=3600)
    w.start()
    yield w
    w.close()


def _gateway() -> tuple[TracerProvider, InMemorySpanExporter]:
    memory = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": "gateway", "host.name": "gw-1"}))
    provider.add_span_processor(SimpleSpanProcessor(memory))
    return provider, memory


def _refused(provider: TracerProvider, address: str, port: int) -> None:
    """The router's call to a backend whose port refuses: status ERROR, the exception recorded."""
    _, span = gateway_call(provider.get_tracer("router"), address, port)
    span.record_exception(ConnectionRefusedError(111, "Connection refused"))
    span.set_attribute("error.type", "ConnectionRefusedError")
    span.set_status(Status(StatusCode.ERROR))
    span.end()


def _rows(store: Any, writer: Any) -> list[dict[str, Any]]:
    assert writer.flush(timeout_s=30)
    return store.query(f"SELECT backend, status, span_name, latency_seconds FROM {qualified(store, 'requests')} "
                       "ORDER BY backend, span_name").dicts()


def _send(writer: Any, *batches: list[ReadableSpan]) -> dict[str, int]:
    rx = start_receiver(writer)
    try:
        exporter = OTLPSpanExporter(endpoint=rx.url)
        for batch in batches:
            assert exporter.export(batch).name == "SUCCESS"
        return dict(rx.stats)
    finally:
        rx.close()


def test_calls_refused_by_a_dead_backend_are_its_failed_requests(store: Any, writer: Any) -> None:
    gateway, memory = _gateway()
    for _ in range(5):
        _refused(gateway, *DEAD)
    _, ok = gateway_call(gateway.get_tracer("router"), *LIVE)
    ok.end()  # a successful call with no engine span: still not a request row
    stats = _send(writer, list(memory.get_finished_spans()))
    rows = _rows(store, writer)
    assert [(r["backend"], r["status"]) for r in rows] == [("10.0.0.7:8000", "error")] * 5
    assert all(r["latency_seconds"] >= 0 for r in rows)
    assert stats["unreached_spans"] == 5


@pytest.mark.parametrize("order", ["one_batch", "child_first"])
def test_a_failed_call_the_engine_did_answer_counts_once(store: Any, writer: Any, monkeypatch: Any,
                                                         order: str) -> None:
    """The engine's span is the request's row; its failed gateway parent adds none."""
    monkeypatch.setenv("OTEL_SERVICE_NAME", "vllm")
    gateway, gw_memory = _gateway()
    engine_memory = InMemorySpanExporter()
    engine = vllm_provider(SimpleSpanProcessor(engine_memory))
    for i in range(3):
        headers, span = gateway_call(gateway.get_tracer("router"), *LIVE)
        vllm_request_span(engine.get_tracer("vllm.tracing"), f"r{i}", headers)
        span.set_status(Status(StatusCode.ERROR))  # e.g. the client went away: the gateway marks it failed
        span.end()
    parents, children = list(gw_memory.get_finished_spans()), list(engine_memory.get_finished_spans())
    stats = _send(writer, parents + children) if order == "one_batch" else _send(writer, children, parents)
    rows = _rows(store, writer)
    assert [r["span_name"] for r in rows] == ["llm_request"] * 3
    # A child stored before its parent arrived cannot take the parent's address (docs/run.md).
    assert {r["backend"] for r in rows} == ({"10.0.0.5:8000"} if order == "one_batch" else {"vllm"})
    assert stats["unreached_spans"] == 0


def test_only_a_failed_client_call_naming_its_backend_on_the_span_is_counted(store: Any, writer: Any) -> None:
    gateway, memory = _gateway()
    tracer = gateway.get_tracer("router")
    server = tracer.start_span("POST /v1/completions", kind=SpanKind.SERVER,  # the gateway's own address
                               attributes={"server.address": "gw-1", "server.port": 443})
    server.set_status(Status(StatusCode.ERROR))
    server.end()
    anonymous = tracer.start_span("POST", kind=SpanKind.CLIENT, attributes={"http.request.method": "POST"})
    anonymous.set_status(Status(StatusCode.ERROR))  # no backend named: the resource's host is the gateway's
    anonymous.end()
    _send(writer, list(memory.get_finished_spans()))
    assert _rows(store, writer) == []
