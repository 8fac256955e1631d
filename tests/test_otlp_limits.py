"""OTLP receiver under hostile input: one bad span costs only itself, and memory
is bounded by bytes. Real HTTP on 127.0.0.1, the real receiver, writer and chDB store.

Peak memory is the VmHWM of a process of the attack's own (so the suite's order cannot move it), reset
through /proc/self/clear_refs before the attack (Linux).
Measured before these bounds (same attacks, this machine): a 58 KB gzip carrying a 60 MB attribute
added 240 MB at peak, 200k spans in 1.1 MB of gzip 390 MB (so 690k spans ~1.3 GB).
"""

from __future__ import annotations

import base64
import gc
import gzip
import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from google.protobuf import json_format
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from otlp_helpers import post

from triscope.collectors.otlp import create, receiver
from triscope.component import Context
from triscope.schema import qualified
from triscope.writer import Writer

T0 = 1_767_225_600_000_000_000  # 2026-01-01
Y2300 = 10_413_792_000 * 10**9  # 2300-01-01: fits OTLP's uint64, not the store's DateTime64(9)
MiB = 1 << 20


def span_request(n: int, *, first: int = 0, starts: dict[int, int] | None = None,
                 attrs: dict[str, object] | None = None) -> ExportTraceServiceRequest:
    """``n`` llm_request spans with request ids ``r{first + i}``; ``starts`` overrides some start times."""
    req = ExportTraceServiceRequest()
    rs = req.resource_spans.add()
    rs.resource.attributes.append(KeyValue(key="service.name", value=AnyValue(string_value="vllm")))
    scope = rs.scope_spans.add()
    for i in range(n):
        span = scope.spans.add()
        k = first + i + 1
        span.trace_id, span.span_id = k.to_bytes(16, "big"), k.to_bytes(8, "big")
        span.name = "llm_request"
        span.start_time_unix_nano = (starts or {}).get(i, T0 + k)
        span.end_time_unix_nano = span.start_time_unix_nano + 1000
        span.attributes.append(KeyValue(key="gen_ai.request.id", value=AnyValue(string_value=f"r{first + i}")))
        for key, value in (attrs or {}).items():
            span.attributes.append(KeyValue(key=key, value=AnyValue(string_value=str(value))))
    return req


@pytest.fixture()
def writer(store, tmp_path):
    w = Writer(store, str(tmp_path / "spool"), flush_interval_s=3600)  # one writer batch for every request
    w.start()
    yield w
    w.close()


@pytest.fixture()
def rx(writer):
    r = create({"otlp": {"port": 0}}, Context(submit=writer.submit))  # the defaults
    r.start()
    yield r
    r.close()


def request_ids(store, writer) -> list[str]:
    assert writer.flush(timeout_s=60)
    return [r[0] for r in store.query(f"SELECT request_id FROM {qualified(store, 'requests')}").rows]


def test_a_span_in_year_2300_is_rejected_alone(rx, writer, store, tmp_path) -> None:
    """24 spans, one starting in 2300, plus 5 from another client (JSON, also one in 2300) in the same
    writer batch: only the two bad spans are refused, each request says so with partialSuccess."""
    status, _, body = post(rx, span_request(24, starts={11: Y2300}).SerializeToString())
    assert status == 200
    answer = ExportTraceServiceResponse.FromString(body).partial_success
    assert answer.rejected_spans == 1 and "2262" in answer.error_message
    other = json_format.MessageToDict(span_request(6, first=100, starts={0: Y2300}))
    for span in other["resourceSpans"][0]["scopeSpans"][0]["spans"]:  # OTLP JSON ids are hex
        span["traceId"], span["spanId"] = (base64.b64decode(span[k]).hex() for k in ("traceId", "spanId"))
    status, _, body = post(rx, json.dumps(other).encode(), "application/json")
    assert status == 200 and json.loads(body)["partialSuccess"]["rejectedSpans"] == "1"
    got = request_ids(store, writer)
    assert sorted(got) == sorted([f"r{i}" for i in range(24) if i != 11] + [f"r{i}" for i in range(101, 106)])
    assert writer.stats["rows_rejected"] == 0 and not list((tmp_path / "spool").rglob("rejected/*"))
    assert rx.stats["rejected_spans"] == 2


def _reset_peak() -> int:
    """Resets this process's peak RSS; returns the current RSS in bytes."""
    gc.collect()
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pytest.skip("needs Linux /proc/self/clear_refs to reset the peak RSS")
    return _status("VmRSS")


def _status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise AssertionError(key)


def attribute_bomb(size: int = 60_000_000) -> bytes:
    """A gzip body of ~60 KB whose one span carries a 60 MB ``gen_ai.request.id`` (a column that is stored)."""
    raw = span_request(1, first=7, attrs={"gen_ai.request.id": "a" * size}).SerializeToString()
    return gzip.compress(raw, 6)


def span_flood(n: int = 690_000) -> bytes:
    """``n`` request spans (ids repeat: the receiver never gets to look at them) in a few MB of gzip."""
    one = span_request(1).resource_spans[0].scope_spans[0].spans[0].SerializeToString()
    entry = b"\x12" + _varint(len(one)) + one  # ScopeSpans.spans, field 2
    scope = entry * n
    scope_spans = b"\x12" + _varint(len(scope)) + scope  # ResourceSpans.scope_spans, field 2
    return gzip.compress(b"\x0a" + _varint(len(scope_spans)) + scope_spans, 6)


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not n:
            return bytes(out)


# Peak RSS is process-global: each attack runs in a Python process of its own (``python THIS_FILE ATTACK DIR``,
# :func:`attack_main`), so nothing else the suite did in this process can move the figure.


def _attack_bomb(rx, writer, store) -> dict:
    body = attribute_bomb()
    base = _reset_peak()
    status, _, _ = post(rx, body, headers={"Content-Encoding": "gzip"})
    growth = _status("VmHWM") - base
    assert writer.flush(timeout_s=60)
    lengths = store.query(f"SELECT length(request_id) FROM {qualified(store, 'requests')}").rows
    return {"growth": growth, "status": status, "body_bytes": len(body), "lengths": [r[0] for r in lengths]}


def _attack_flood(rx, writer, store) -> dict:
    from google.rpc.status_pb2 import Status

    body = span_flood()
    base = _reset_peak()
    status, _, data = post(rx, body, headers={"Content-Encoding": "gzip"})
    growth = _status("VmHWM") - base
    return {"growth": growth, "status": status, "body_bytes": len(body), "message": Status.FromString(data).message,
            "too_large": rx.stats["too_large"]}


def _attack_at_once(rx, writer, store) -> dict:
    bombs, flood = [attribute_bomb() for _ in range(3)], span_flood()
    results: list[int] = []

    def send(body: bytes) -> None:
        results.append(post(rx, body, headers={"Content-Encoding": "gzip"})[0])

    base = _reset_peak()
    threads = [threading.Thread(target=send, args=(b,)) for b in [*bombs, flood]]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    growth = _status("VmHWM") - base
    assert writer.flush()
    stored = store.query(f"SELECT count() FROM {qualified(store, 'requests')}").scalar()
    return {"growth": growth, "results": results, "stored": stored}


def _attack_shapes(rx, writer, store) -> dict:
    many = span_request(1, first=1).resource_spans[0].scope_spans[0].spans[0].SerializeToString()
    many += b"\x4a\x00" * 1_000_000  # Span.attributes (field 9), empty KeyValue
    bad = span_request(1, first=2).resource_spans[0].scope_spans[0].spans[0].SerializeToString()
    bad = bad.replace(b"llm_request", b"llm_r\xffquest")
    good = span_request(1, first=3).resource_spans[0].scope_spans[0].spans[0].SerializeToString()
    scope = b"".join(b"\x12" + _varint(len(s)) + s for s in (many, bad, good))
    rs = b"\x12" + _varint(len(scope)) + scope
    base = _reset_peak()
    status, _, body = post(rx, b"\x0a" + _varint(len(rs)) + rs)
    growth = _status("VmHWM") - base
    answer = ExportTraceServiceResponse.FromString(body).partial_success
    empty_entries = b"\x0a\x00" * 2_000_000  # 4 MB of empty ResourceSpans
    empty_status, _, _ = post(rx, gzip.compress(empty_entries), headers={"Content-Encoding": "gzip"})
    return {"growth": growth, "status": status, "rejected": answer.rejected_spans, "error": answer.error_message,
            "ids": sorted(request_ids(store, writer)), "empty_status": empty_status}


def _attack_series(rx, writer, store) -> dict:
    """Twelve rounds of the attacks at once; this process's RSS after each round (after a GC)."""
    bombs, flood = [attribute_bomb() for _ in range(3)], span_flood()
    rss = [_status("VmRSS")]
    for _ in range(12):
        threads = [threading.Thread(target=post, args=(rx, b), kwargs={"headers": {"Content-Encoding": "gzip"}})
                   for b in [*bombs, flood]]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        gc.collect()
        rss.append(_status("VmRSS"))
    return {"growth": max(rss) - rss[0], "rss": rss}


ATTACKS = {"series": _attack_series, "bomb": _attack_bomb, "flood": _attack_flood, "at_once": _attack_at_once,
           "shapes": _attack_shapes}


def attack_main(name: str, workdir: str) -> None:
    """Run one attack against a receiver, writer and embedded store of this process; print its JSON."""
    from triscope.schema import migrate
    from triscope.store.embedded import EmbeddedStore

    store = EmbeddedStore(str(Path(workdir) / "store"))
    migrate(store)
    writer = Writer(store, str(Path(workdir) / "spool"), flush_interval_s=3600)
    writer.start()
    rx = create({"otlp": {"port": 0}}, Context(submit=writer.submit))
    rx.start()
    try:
        print(json.dumps(ATTACKS[name](rx, writer, store)))
    finally:
        rx.close()
        writer.close()
        store.close()


def in_own_process(name: str, tmp_path: Path) -> dict:
    if not Path("/proc/self/clear_refs").exists():
        pytest.skip("needs Linux /proc/self/clear_refs to reset the peak RSS")
    done = subprocess.run([sys.executable, __file__, name, str(tmp_path)], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    doc = json.loads(done.stdout.strip().splitlines()[-1])
    print(f"{name}: peak RSS growth {doc['growth'] / MiB:.0f} MiB")
    return doc


def test_attribute_bomb_is_cut_and_memory_stays_bounded(tmp_path) -> None:
    doc = in_own_process("bomb", tmp_path)
    assert doc["body_bytes"] < 100_000 and doc["status"] == 200
    assert doc["lengths"] == [4096]  # [otlp] max_attribute_length
    assert doc["growth"] < 100 * MiB, f"peak RSS grew {doc['growth'] / MiB:.0f} MiB for a 60 MB attribute"


def test_span_flood_is_413_before_any_span_is_decoded(tmp_path) -> None:
    doc = in_own_process("flood", tmp_path)
    assert doc["body_bytes"] < 8 * MiB and doc["status"] == 413
    assert "max_spans_per_request" in doc["message"] and doc["too_large"] == 1
    assert doc["growth"] < 100 * MiB, f"peak RSS grew {doc['growth'] / MiB:.0f} MiB for 690k spans"


def test_attacks_at_once_stay_within_the_bound(tmp_path) -> None:
    """Three attribute bombs and a span flood at once (the issue measured 5 GB for three): two decode at a
    time, the rest wait for a slot (or get 503 + Retry-After), and the peak stays bounded."""
    doc = in_own_process("at_once", tmp_path)
    results = doc["results"]
    assert len(results) == 4 and set(results) <= {200, 413, 503} and results.count(413) <= 1, results
    assert doc["growth"] < 200 * MiB, f"peak RSS grew {doc['growth'] / MiB:.0f} MiB"
    assert doc["stored"] == results.count(200)


def test_busy_decoders_answer_503_with_retry_after(writer, monkeypatch) -> None:
    monkeypatch.setattr(receiver, "DECODE_WAIT_S", 0.2)
    r = create({"otlp": {"port": 0, "max_concurrent_decodes": 1}}, Context(submit=writer.submit))
    r.start()
    try:
        with r.decoding():  # the one slot is taken
            status, headers, _ = post(r, span_request(1).SerializeToString())
        assert status == 503 and headers["Retry-After"] == "1"
        assert post(r, span_request(1).SerializeToString())[0] == 200  # free again
        assert r.stats["busy"] == 1
    finally:
        r.close()


def test_bodies_held_at_once_are_bounded(writer) -> None:
    r = create({"otlp": {"port": 0, "max_buffered_bytes": 1 * MiB}}, Context(submit=writer.submit))
    r.start()
    try:
        with r.buffered(MiB - 10):  # a body being read holds most of the budget
            status, headers, _ = post(r, span_request(3).SerializeToString())
            assert status == 503 and headers["Retry-After"] == "1"
        assert post(r, span_request(3).SerializeToString())[0] == 200
    finally:
        r.close()


def test_json_has_its_own_smaller_bound(writer) -> None:
    r = create({"otlp": {"port": 0, "max_json_bytes": 64 * 1024}}, Context(submit=writer.submit))
    r.start()
    try:
        doc = {"resourceSpans": [{"scopeSpans": [{"spans": [{}] * 30_000}]}]}  # 60 KB inflating to 120 KB
        body = gzip.compress(json.dumps(doc).encode())
        status, _, data = post(r, body, "application/json", headers={"Content-Encoding": "gzip"})
        assert status == 413 and "exceeds 65536" in json.loads(data)["message"]
    finally:
        r.close()


def test_repeated_attacks_level_off_rather_than_leak(tmp_path) -> None:
    """The daemon's memory crept up over a series of attacks: retained or leaked? Twelve rounds in one
    process: RSS rises over the first rounds (allocator arenas and caches reach their working size), then
    stays flat; a leak would add the same every round."""
    rss = in_own_process("series", tmp_path)["rss"]
    later = rss[6:]
    print("RSS MiB per round:", [round(r / MiB) for r in rss])
    assert max(later) - min(later) < 16 * MiB, [round(r / MiB) for r in rss]
    assert rss[-1] - rss[0] < 100 * MiB, [round(r / MiB) for r in rss]


def test_hostile_shapes_cost_only_themselves(tmp_path) -> None:
    """A span of a million empty attributes (2 MB, ~100 MB once parsed whole) is read up to the attribute
    limit; a million empty entries above spans are refused; a span with bad UTF-8 is rejected alone."""
    doc = in_own_process("shapes", tmp_path)
    assert doc["status"] == 200 and doc["rejected"] == 1 and "not an OTLP Span" in doc["error"]
    assert doc["ids"] == ["r1", "r3"]
    assert doc["growth"] < 50 * MiB, f"peak RSS grew {doc['growth'] / MiB:.0f} MiB"
    assert doc["empty_status"] == 413


def test_multi_member_gzip_is_read_whole(rx, writer, store) -> None:
    body = gzip.compress(span_request(2).SerializeToString()) + gzip.compress(span_request(3, first=2)
                                                                              .SerializeToString())
    assert post(rx, body, headers={"Content-Encoding": "gzip"})[0] == 200
    assert sorted(request_ids(store, writer)) == ["r0", "r1", "r2", "r3", "r4"]


if __name__ == "__main__":
    attack_main(sys.argv[1], sys.argv[2])
