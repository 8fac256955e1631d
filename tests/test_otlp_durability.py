"""Acknowledged means durable: ``triscope run`` with the OTLP receiver is SIGKILLed right
after a 200, restarted, and every acknowledged span is in the store exactly once.

Real subprocesses, real SIGKILL, real chDB (the daemon's own directory, read back by another subprocess).
Each round sends requests one after another (no request is in flight at the kill), so the store must
hold exactly the acknowledged spans: none lost (spooled before the 200), none doubled (spool replay).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import free_port
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from run_helpers import clean_env, start_run

pytestmark = pytest.mark.slow

T0 = 1_767_225_600_000_000_000
QUERY = r'''
import json, sys
from triscope.store import open_store
s = open_store({"store": {"backend": "embedded", "path": sys.argv[1], "database": "otlpkill"}})
print(json.dumps([r[0] for r in s.query("SELECT request_id FROM otlpkill.requests").rows]))
'''


def _request(ids: list[str]) -> bytes:
    req = ExportTraceServiceRequest()
    scope = req.resource_spans.add().scope_spans.add()
    for rid in ids:
        k = int(rid.split("-")[1]) + 1
        span = scope.spans.add()
        span.trace_id, span.span_id, span.name = k.to_bytes(16, "big"), k.to_bytes(8, "big"), "llm_request"
        span.start_time_unix_nano, span.end_time_unix_nano = T0 + k, T0 + k + 1000
        span.attributes.append(KeyValue(key="gen_ai.request.id", value=AnyValue(string_value=rid)))
    return req.SerializeToString()


def _post(port: int, body: bytes) -> int:
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("POST", "/v1/traces", body=body, headers={"Content-Type": "application/x-protobuf"})
        return conn.getresponse().status
    finally:
        conn.close()


def _wait_ready(proc: subprocess.Popen[str], port: int, log: list[str]) -> None:
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        assert proc.poll() is None, "".join(log)
        try:
            if _post(port, b"") == 200:  # an empty export: no spans
                return
        except OSError:
            time.sleep(0.1)
    raise AssertionError("triscope run did not answer OTLP in 90 s:\n" + "".join(log))


def test_kill_9_right_after_200_loses_no_acknowledged_span(tmp_path: Path) -> None:
    rng = random.Random(23)
    port = free_port()
    cfg = tmp_path / "triscope.toml"
    acked: list[str] = []
    next_id = 0
    for round_ in range(4):
        # round 0 keeps every span in the spool only (no flush before the kill); later rounds flush
        # often, so a kill may also land in the middle of an insert
        flush = 3600 if round_ == 0 else 0.05
        cfg.write_text(f"""
[store]
path = "{tmp_path / 'chdb'}"
database = "otlpkill"

[run]
collectors = ["otlp"]

[writer]
spool_dir = "{tmp_path / 'spool'}"
flush_interval_s = {flush}

[otlp]
port = {port}
""")
        proc, log, reader = start_run(cfg, clean_env())
        try:
            _wait_ready(proc, port, log)
            if round_ == 3:  # the last start only replays what the kills left in the spool
                proc.send_signal(signal.SIGTERM)
                out, _ = proc.communicate(timeout=120)
                assert proc.returncode == 0, "".join(log)
                assert json.loads(out)["writer"]["rows_pending"] == 0
                break
            for _ in range(rng.randint(5, 15)):
                n = rng.randint(1, 40)
                ids = [f"k-{next_id + i}" for i in range(n)]
                next_id += n
                assert _post(port, _request(ids)) == 200
                acked.extend(ids)
            os.kill(proc.pid, signal.SIGKILL)  # at once after the last 200
            proc.wait(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)
            reader.join(timeout=5)
    query = tmp_path / "query.py"
    query.write_text(QUERY)
    res = subprocess.run([sys.executable, str(query), str(tmp_path / "chdb")], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr
    stored = json.loads(res.stdout)
    assert len(acked) > 0
    assert len(stored) == len(set(stored)), "a span was stored twice"
    assert sorted(stored) == sorted(acked), f"{len(set(acked) - set(stored))} acknowledged span(s) lost"
