"""OTLP/HTTP receiver: real HTTP on 127.0.0.1 against the real receiver and a real chDB store."""

from __future__ import annotations

import gzip
import http.client
import json
import time

import pytest
from google.protobuf import json_format
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue

from triscope.collectors.otlp import OtlpReceiver, create, encode_status
from triscope.component import Context
from triscope.errors import SpoolUnavailable
from triscope.schema import Table, qualified
from triscope.writer import Writer

T0 = 1_767_225_600_123_456_789  # 2026-01-01T00:00:00.123456789Z


def _kv(key: str, value: object) -> KeyValue:
    if isinstance(value, bool):
        return KeyValue(key=key, value=AnyValue(bool_value=value))
    if isinstance(value, int):
        return KeyValue(key=key, value=AnyValue(int_value=value))
    if isinstance(value, float):
        return KeyValue(key=key, value=AnyValue(double_value=value))
    return KeyValue(key=key, value=AnyValue(string_value=str(value)))


def vllm_request(n: int = 3, bad: int = 0, extra_plain: int = 1) -> ExportTraceServiceRequest:
    """``n`` vLLM llm_request spans (attribute names as vLLM sets them), ``bad`` with a zero trace id,
    and ``extra_plain`` HTTP spans without gen_ai attributes (not request spans)."""
    req = ExportTraceServiceRequest()
    rs = req.resource_spans.add()
    rs.resource.attributes.extend([_kv("service.name", "vllm"), _kv("service.instance.id", "gpu-node-1:8000"),
                                   _kv("host.name", "gpu-node-1"), _kv("server.port", 8000), _kv("gpu.id", "3")])
    ss = rs.scope_spans.add()
    ss.scope.name = "vllm.llm_engine"
    for i in range(n + bad):
        span = ss.spans.add()
        span.trace_id = bytes(16) if i >= n else bytes([1 + i]) * 16
        span.span_id = bytes([2 + i]) * 8
        span.name = "llm_request"
        span.kind = 2
        span.start_time_unix_nano = T0 + i * 1_000_000
        span.end_time_unix_nano = T0 + i * 1_000_000 + 900_000_000
        span.attributes.extend([
            _kv("gen_ai.response.model", "meta-llama/Llama-3.1-8B-Instruct"),
            _kv("gen_ai.request.id", f"cmpl-{i}"),
            _kv("gen_ai.usage.prompt_tokens", 100 + i),
            _kv("gen_ai.usage.completion_tokens", 20 + i),
            _kv("gen_ai.latency.time_to_first_token", 0.05 + i / 100),
            _kv("gen_ai.latency.e2e", 0.8 + i / 10),
            _kv("gen_ai.latency.time_in_queue", 0.01),
            _kv("gen_ai.latency.time_in_model_prefill", 0.04),
            _kv("gen_ai.latency.time_in_model_decode", 0.7),
        ])
    for j in range(extra_plain):
        span = ss.spans.add()
        span.trace_id = bytes([9]) * 16
        span.span_id = bytes([10 + j]) * 8
        span.name = "POST /v1/chat/completions"
        span.start_time_unix_nano = T0
        span.end_time_unix_nano = T0 + 10
    return req


def _otlp_json(req: ExportTraceServiceRequest) -> bytes:
    """The OTLP JSON encoding: camelCase, hex ids, int64 as strings (what collectors send)."""
    doc = json_format.MessageToDict(req)
    for rs in doc["resourceSpans"]:
        for ss in rs["scopeSpans"]:
            for span in ss["spans"]:
                for key in ("traceId", "spanId"):
                    import base64
                    span[key] = base64.b64decode(span[key]).hex()
    return json.dumps(doc).encode()


@pytest.fixture()
def writer(store, tmp_path):
    w = Writer(store, str(tmp_path / "spool"), flush_interval_s=0.2)
    w.start()
    yield w
    w.close()


@pytest.fixture()
def receiver(writer):
    rx = create({"otlp": {"port": 0, "max_body_bytes": 64 * 1024, "max_decompressed_bytes": 256 * 1024,
                          "token": "s3cret", "interval_s": 0.2}}, Context(submit=writer.submit))
    rx.start()
    yield rx
    rx.close()


def post(rx: OtlpReceiver, body: bytes, content_type: str = "application/x-protobuf",
         token: str | None = "s3cret", headers: dict[str, str] | None = None) -> tuple[int, dict, bytes]:
    host, port = rx.address
    conn = http.client.HTTPConnection(host, port, timeout=10)
    hdrs = {"Content-Type": content_type, **(headers or {})}
    if token is not None:
        hdrs["Authorization"] = f"Bearer {token}"
    conn.request("POST", "/v1/traces", body=body, headers=hdrs)
    resp = conn.getresponse()
    data = resp.read()
    conn.close()
    return resp.status, dict(resp.getheaders()), data


def rows(store) -> list[dict]:
    return store.query(f"SELECT *, toUnixTimestamp64Nano(ts) AS ts_ns FROM {qualified(store, 'requests')} "
                       "ORDER BY request_id").dicts()


def test_binds_localhost_by_default() -> None:
    assert create({}, Context()).address == ("127.0.0.1", 4318)


def test_protobuf_export_maps_vllm_spans(receiver, writer, store) -> None:
    status, headers, body = post(receiver, vllm_request(3).SerializeToString())
    assert status == 200
    assert headers["Content-Type"] == "application/x-protobuf"
    resp = ExportTraceServiceResponse.FromString(body)
    assert not resp.HasField("partial_success")
    writer.flush()
    got = rows(store)
    assert len(got) == 3  # the plain HTTP span is not a request span
    first = got[0]
    assert first["ts_ns"] == T0  # nanosecond-exact start time
    assert first["backend"] == "gpu-node-1:8000" and first["host"] == "gpu-node-1" and first["gpu"] == "3"
    assert first["model"] == "meta-llama/Llama-3.1-8B-Instruct"
    assert first["span_name"] == "llm_request" and first["service_name"] == "vllm"
    assert first["trace_id"] == "01" * 16 and first["span_id"] == "02" * 8
    assert [r["prompt_tokens"] for r in got] == [100, 101, 102]
    assert [r["completion_tokens"] for r in got] == [20, 21, 22]
    assert [r["latency_seconds"] for r in got] == pytest.approx([0.8, 0.9, 1.0])
    assert [r["ttft_seconds"] for r in got] == pytest.approx([0.05, 0.06, 0.07])
    assert first["queue_seconds"] == pytest.approx(0.01)
    assert first["prefill_seconds"] == pytest.approx(0.04) and first["decode_seconds"] == pytest.approx(0.7)
    assert first["modality"] == "text" and first["status"] == "ok"


def test_json_export_with_gzip(receiver, writer, store) -> None:
    body = gzip.compress(_otlp_json(vllm_request(2)))
    status, headers, data = post(receiver, body, "application/json", headers={"Content-Encoding": "gzip"})
    assert status == 200, data
    assert headers["Content-Type"] == "application/json"
    assert json.loads(data) == {}
    writer.flush()
    got = rows(store)
    assert [r["request_id"] for r in got] == ["cmpl-0", "cmpl-1"]
    assert got[1]["ts_ns"] == T0 + 1_000_000
    assert got[0]["trace_id"] == "01" * 16


def test_json_int64_as_strings_and_generic_span(receiver, writer, store) -> None:
    doc = {"resourceSpans": [{
        "resource": {"attributes": [{"key": "service.name", "value": {"stringValue": "imagegen"}}]},
        "scopeSpans": [{"spans": [{
            "traceId": "5b8efff798038103d269b633813fc60c", "spanId": "eee19b7ec3c1b174",
            "name": "generate", "kind": 2,
            "startTimeUnixNano": str(T0), "endTimeUnixNano": str(T0 + 250_000_000),
            "attributes": [
                {"key": "gen_ai.request.model", "value": {"stringValue": "sdxl"}},
                {"key": "gen_ai.usage.input_tokens", "value": {"intValue": "77"}},
                {"key": "gen_ai.usage.output_tokens", "value": {"intValue": 5}},
                {"key": "image.width", "value": {"intValue": "1024"}},
                {"key": "image.height", "value": {"intValue": "768"}},
                {"key": "server.address", "value": {"stringValue": "10.0.0.7"}},
                {"key": "server.port", "value": {"intValue": "8080"}},
                {"key": "triscope.request_class", "value": {"stringValue": "interactive_image_text"}},
            ],
            "status": {"code": 2},
            "unknownFutureField": 1,
        }]}],
    }]}
    status, _, data = post(receiver, json.dumps(doc).encode(), "application/json")
    assert status == 200, data
    writer.flush()
    (row,) = rows(store)
    assert row["trace_id"] == "5b8efff798038103d269b633813fc60c" and row["span_id"] == "eee19b7ec3c1b174"
    assert row["backend"] == "10.0.0.7:8080" and row["model"] == "sdxl"
    assert (row["prompt_tokens"], row["completion_tokens"]) == (77, 5)
    assert row["image_pixels"] == 1024 * 768 and row["input_resolution"] == "1024x768"
    assert row["modality"] == "image" and row["status"] == "error"
    assert row["request_class"] == "interactive_image_text"
    assert row["latency_seconds"] == pytest.approx(0.25)  # no gen_ai.latency.e2e: end - start
    not_measured = store.query(f"SELECT isNaN(ttft_seconds) FROM {qualified(store, 'requests')}").scalar()
    assert not_measured == 1  # NaN = not measured


def test_partial_success_keeps_good_spans(receiver, writer, store) -> None:
    status, _, body = post(receiver, vllm_request(2, bad=1).SerializeToString())
    assert status == 200
    resp = ExportTraceServiceResponse.FromString(body)
    assert resp.partial_success.rejected_spans == 1
    assert "trace_id" in resp.partial_success.error_message
    writer.flush()
    assert len(rows(store)) == 2


def test_partial_success_json(receiver, store) -> None:
    req = vllm_request(1)
    span = req.resource_spans[0].scope_spans[0].spans[0]
    span.attributes.append(_kv("gen_ai.latency.e2e", "fast"))  # later duplicate key wins in the dict
    status, _, body = post(receiver, _otlp_json(req), "application/json")
    assert status == 200
    doc = json.loads(body)
    assert doc["partialSuccess"]["rejectedSpans"] == "1"
    assert "gen_ai.latency.e2e" in doc["partialSuccess"]["errorMessage"]


def test_bad_token_and_missing_token(receiver, writer, store) -> None:
    body = vllm_request(1).SerializeToString()
    status, headers, _ = post(receiver, body, token="wrong")
    assert status == 401 and headers["WWW-Authenticate"] == "Bearer"
    status, _, _ = post(receiver, body, token=None)
    assert status == 401
    writer.flush()
    assert rows(store) == []


def test_oversized_body_is_413(receiver) -> None:
    big = vllm_request(1).SerializeToString() + b"\x00" * (70 * 1024)
    status, _, body = post(receiver, big)
    assert status == 413
    from google.rpc.status_pb2 import Status

    message = Status.FromString(body).message
    assert "exceeds" in message and "\n" not in message


def test_gzip_bomb_is_413(receiver) -> None:
    bomb = gzip.compress(b"\x00" * (10 * 1024 * 1024))  # ~10 KiB on the wire, 10 MiB inflated
    assert len(bomb) < 64 * 1024
    status, _, _ = post(receiver, bomb, headers={"Content-Encoding": "gzip"})
    assert status == 413


@pytest.mark.parametrize(("body", "kind", "encoding"), [
    (b"\xff\xfe not protobuf at all", "application/x-protobuf", None),
    (b"{not json", "application/json", None),
    (b'["a list"]', "application/json", None),
    (b'{"resourceSpans": "nope"}', "application/json", None),
    (b"plain text, not gzip", "application/x-protobuf", "gzip"),
])
def test_garbage_is_400_with_one_line(receiver, body, kind, encoding) -> None:
    status, headers, data = post(receiver, body, kind, headers={"Content-Encoding": encoding} if encoding else None)
    assert status == 400
    assert headers["Content-Type"] == kind
    if kind == "application/json":
        message = json.loads(data)["message"]
    else:
        from google.rpc.status_pb2 import Status

        message = Status.FromString(data).message
    assert message and "\n" not in message
    assert receiver.stats["bad_requests"] == 1


def test_unsupported_type_path_and_method(receiver) -> None:
    status, _, _ = post(receiver, b"x", "text/plain")
    assert status == 415
    host, port = receiver.address
    conn = http.client.HTTPConnection(host, port, timeout=5)
    conn.request("GET", "/v1/traces")
    assert conn.getresponse().status == 405
    conn.close()
    conn = http.client.HTTPConnection(host, port, timeout=5)
    conn.request("POST", "/v1/metrics", body=b"", headers={"Authorization": "Bearer s3cret"})
    assert conn.getresponse().status == 404
    conn.close()


def test_status_encoding_matches_google_rpc() -> None:
    from google.rpc.status_pb2 import Status

    status = Status.FromString(encode_status(3, "x" * 300, "application/x-protobuf"))
    assert (status.code, status.message) == (3, "x" * 300)


def test_flush_loop_writes_without_explicit_flush(receiver, store) -> None:
    assert post(receiver, vllm_request(2).SerializeToString())[0] == 200
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and len(rows(store)) < 2:
        time.sleep(0.1)
    assert len(rows(store)) == 2


def test_collect_drains_when_hosted_by_daemon() -> None:
    batch: dict = {}  # what the receiver handed to the daemon's writer before answering 200

    def submit(table: Table, columns) -> int:
        batch[table.name] = columns
        return len(columns["request_id"])

    rx = create({"otlp": {"port": 0}}, Context(submit=submit))
    rx.start()
    try:
        assert post(rx, vllm_request(2).SerializeToString(), token=None)[0] == 200
        assert list(batch) == ["requests"]
        assert batch["requests"]["request_id"] == ["cmpl-0", "cmpl-1"]
        assert rx.collect() == {}
    finally:
        rx.close()


def test_full_buffer_answers_503() -> None:
    taken: list[int] = []

    def submit(table: Table, columns) -> int:  # a spool that takes two rows, then its disk is full
        n = len(columns["request_id"])
        if sum(taken) + n > 2:
            raise SpoolUnavailable("writer: spool not writable: No space left on device")
        taken.append(n)
        return n

    rx = create({"otlp": {"port": 0}}, Context(submit=submit))
    rx.start()
    try:
        assert post(rx, vllm_request(2).SerializeToString(), token=None)[0] == 200
        status, headers, _ = post(rx, vllm_request(1).SerializeToString(), token=None)
        assert status == 503 and headers["Retry-After"] == "1"
    finally:
        rx.close()


def test_real_otlp_http_exporter_to_receiver(receiver, writer, store) -> None:
    """The OpenTelemetry SDK's own OTLP/HTTP exporter (protobuf, gzip) as the client."""
    from opentelemetry.exporter.otlp.proto.http import Compression
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    exporter = OTLPSpanExporter(endpoint=receiver.url, headers={"Authorization": "Bearer s3cret"},
                                compression=Compression.Gzip)
    provider = TracerProvider(resource=Resource.create({"service.name": "vllm", "host.name": "h1"}))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("test")
    with tracer.start_as_current_span("llm_request") as span:
        span.set_attribute("gen_ai.request.id", "sdk-1")
        span.set_attribute("gen_ai.latency.e2e", 0.42)
        span.set_attribute("gen_ai.usage.prompt_tokens", 12)
    provider.shutdown()
    writer.flush()
    (row,) = rows(store)
    assert row["request_id"] == "sdk-1" and row["latency_seconds"] == pytest.approx(0.42)
    instance = provider.resource.attributes.get("service.instance.id")
    assert instance and row["host"] == "h1" and row["backend"] == "h1"  # the SDK's random id never names it


@pytest.mark.parametrize(("section", "message"), [
    ({"prot": 1}, r"\[otlp\] has unknown keys: prot"),
    ({"port": 70000}, r"\[otlp\] port must be a port 0-65535, got 70000"),
    ({"interval_s": -1}, r"\[otlp\] interval_s must be > 0"),
    ({"max_body_bytes": 0}, r"\[otlp\] max_body_bytes must be > 0"),
    ({"token": 5}, r"\[otlp\] has a bad value for token: must be a string"),
    ({"max_concurrent_decodes": 0}, r"\[otlp\] max_concurrent_decodes must be > 0"),
    ({"max_spans_per_request": -1}, r"\[otlp\] max_spans_per_request must be > 0"),
    ({"address_attributes": "host.name"}, r"\[otlp\] has a bad value for address_attributes: must be a list"),
    ({"models": {"a:1": 1}}, r"\[otlp\] has a bad value for models.a:1: must be a string"),
])
def test_config_mistakes_are_one_line(section, message) -> None:
    from triscope.errors import ConfigError

    with pytest.raises(ConfigError, match=message) as err:
        create({"otlp": section}, Context())
    assert "\n" not in str(err.value)


def test_acknowledged_spans_are_already_spooled(store, tmp_path) -> None:
    """200 means durable: the rows are in the writer's spool before the answer, not in a buffer."""
    writer = Writer(store, str(tmp_path / "spool"), flush_interval_s=3600)  # never flushes by itself
    rx = create({"otlp": {"port": 0}}, Context(submit=writer.submit))
    rx.start()
    try:
        assert post(rx, vllm_request(3).SerializeToString(), token=None)[0] == 200
        assert writer.snapshot()["rows_submitted"] == 3 and writer.snapshot()["rows_pending"] == 3
        assert rx.collect() == {}
        assert rows(store) == []
    finally:
        rx.close()
        writer.close()
    assert len(rows(store)) == 3
    assert rx.stats["spans"] == 3
