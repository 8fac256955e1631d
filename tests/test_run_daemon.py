"""``triscope run`` as a real subprocess: diskstats, a real prometheus_client /metrics, OTLP/HTTP, SIGTERM.

The daemon has its own chDB directory, so the rows are read back by a second subprocess after it
exits (the pytest process keeps to its one shared chDB path).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from conftest import free_port
from disk_helpers import synced_write
from prometheus_client import CollectorRegistry, Gauge, Histogram, start_http_server
from run_helpers import clean_env, running_daemon, written_counts

pytestmark = pytest.mark.slow

T0 = 1_764_000_000_000_000_000
QUERY = r'''
import json, sys
from triscope.store import open_store
s = open_store({"store": {"backend": "embedded", "path": sys.argv[1], "database": "runtest"}})
out = {}
for t in ("io_latency", "serving_metrics", "requests", "scrape_health"):
    out[t] = s.query(f"SELECT count() FROM runtest.{t}").scalar()
out["served"] = s.query("SELECT groupUniqArray(model), max(queue_length), max(kv_cache_usage_ratio) "
                        "FROM runtest.serving_metrics").rows[0]
out["sources"] = s.query("SELECT groupUniqArray(source) FROM runtest.io_latency").scalar()
out["span"] = s.query("SELECT model, prompt_tokens FROM runtest.requests").rows
print(json.dumps(out))
'''


def _vllm_server() -> tuple[int, object]:
    registry = CollectorRegistry()
    labels = ["model_name", "engine"]
    Gauge("vllm:num_requests_waiting", "waiting", labels, registry=registry).labels("llama", "0").set(3)
    Gauge("vllm:num_requests_running", "running", labels, registry=registry).labels("llama", "0").set(5)
    Gauge("vllm:kv_cache_usage_perc", "kv", labels, registry=registry).labels("llama", "0").set(0.42)
    Histogram("vllm:e2e_request_latency_seconds", "e2e", labels, buckets=[0.1, 1.0],
              registry=registry).labels("llama", "0").observe(0.3)
    port = free_port()
    server, _ = start_http_server(port, addr="127.0.0.1", registry=registry)
    return port, server


def _span_doc() -> bytes:
    return json.dumps({"resourceSpans": [{"scopeSpans": [{"spans": [{
        "traceId": "5b8efff798038103d269b633813fc60c", "spanId": "eee19b7ec3c1b174", "name": "llm_request",
        "kind": 2, "startTimeUnixNano": str(T0), "endTimeUnixNano": str(T0 + 250_000_000),
        "attributes": [{"key": "gen_ai.request.model", "value": {"stringValue": "llama"}},
                       {"key": "gen_ai.usage.input_tokens", "value": {"intValue": "77"}}]}]}]}]}).encode()


def test_run_collects_writes_and_stops_cleanly_on_sigterm(tmp_path: Path) -> None:
    metrics_port, server = _vllm_server()
    otlp_port = free_port()
    cfg = tmp_path / "triscope.toml"
    cfg.write_text(f"""
[store]
path = "{tmp_path / 'chdb'}"
database = "runtest"

[run]
collectors = ["blockio_diskstats", "serving_metrics", "otlp"]
status_interval_s = 0.3

[writer]
spool_dir = "{tmp_path / 'spool'}"
flush_interval_s = 0.2

[blockio]
interval_s = 0.2

[serving_metrics]
interval_s = 0.2
targets = ["http://127.0.0.1:{metrics_port}/metrics"]

[otlp]
port = {otlp_port}
""")
    try:
        with running_daemon(cfg, clean_env()) as daemon:
            deadline = time.monotonic() + 60
            posted = False
            while time.monotonic() < deadline:
                daemon.assert_alive()
                synced_write(tmp_path / "io.bin", 1 << 20)  # real disk writes for diskstats to see
                if not posted:
                    try:
                        req = urllib.request.Request(f"http://127.0.0.1:{otlp_port}/v1/traces", data=_span_doc(),
                                                     headers={"Content-Type": "application/json"})
                        posted = urllib.request.urlopen(req, timeout=2).status == 200
                    except OSError:
                        pass
                written = written_counts(daemon.log_lines)
                if posted and written and written[-1] >= 10:
                    break
                time.sleep(0.2)
            assert posted and written and written[-1] >= 10, daemon.log
            summary = daemon.stop()
    finally:
        server.shutdown()
    assert summary["flushed"] and summary["writer"]["rows_pending"] == 0
    assert summary["writer"]["rows_written"] == summary["writer"]["rows_submitted"] > 0
    assert set(summary["collectors"]) == {"blockio_diskstats", "serving_metrics", "otlp"}
    assert summary["collectors"]["otlp"]["rows"] == 1
    assert list((tmp_path / "spool").glob("*.batch")) == list((tmp_path / "spool").glob("*.open")) == []

    query = tmp_path / "query.py"
    query.write_text(QUERY)
    res = subprocess.run([sys.executable, str(query), str(tmp_path / "chdb")], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr
    got = json.loads(res.stdout)
    assert got["io_latency"] == summary["collectors"]["blockio_diskstats"]["rows"] > 0
    assert got["serving_metrics"] + got["scrape_health"] == summary["collectors"]["serving_metrics"]["rows"]
    assert got["serving_metrics"] == got["scrape_health"] > 0  # one health row per scrape, every one up
    assert got["served"] == [["llama"], 3.0, 0.42]
    assert got["sources"] == ["diskstats"]
    assert got["requests"] == 1 and got["span"] == [["llama", 77]]


def test_unknown_collector_is_a_one_line_error(tmp_path: Path) -> None:
    cfg = tmp_path / "bad.toml"
    cfg.write_text(f'[store]\npath = "{tmp_path / "chdb"}"\n[run]\ncollectors = ["nope"]\n')
    res = subprocess.run([sys.executable, "-m", "triscope", "run", "--config", str(cfg)], capture_output=True,
                         text=True, timeout=60)
    assert res.returncode == 2
    assert res.stderr.strip().splitlines()[-1].startswith("triscope: error: unknown collector 'nope'")


def test_rows_a_collector_yields_on_close_are_written(store_path: Path, tmp_path: Path) -> None:
    """The daemon's shutdown honours ``ROWS_AFTER_CLOSE``: the row a collector only yields once
    closed (bpftrace's END window) reaches the store beside the one collected while running."""
    from triscope.daemon import Daemon
    from triscope.store import open_store

    config = {"store": {"backend": "embedded", "path": str(store_path), "database": "lastrows",
                        "raw_ttl_days": 0, "rollup_ttl_days": 0},  # the collector's rows are dated 2026-01-01
              "run": {"collectors": ["run_helpers:create_last_rows"], "status_interval_s": 0},
              "writer": {"spool_dir": str(tmp_path / "spool"), "flush_interval_s": 0.1}}
    daemon = Daemon(config)
    daemon.start()
    try:
        time.sleep(0.5)
    finally:
        summary = daemon.shutdown()
    assert summary["flushed"] and summary["collectors"]["last_rows"]["rows"] == 2, summary
    with open_store(config) as store:
        hosts = store.query("SELECT host FROM lastrows.io_latency ORDER BY ts").rows
        store.command("DROP DATABASE IF EXISTS lastrows")
    assert hosts == [("open",), ("closed",)]


def test_run_bpftrace_blockio_flushes_last_window_on_sigterm(tmp_path: Path) -> None:
    """``blockio`` as root under ``triscope run``: bpftrace rows reach the store, and the window still
    open at SIGTERM (printed by bpftrace's END probe, collected after close) is written too."""
    import shutil

    from conftest import require, require_binary

    require_binary("bpftrace")
    require(os.geteuid() == 0, "bpftrace needs root")
    cfg = tmp_path / "bt.toml"
    cfg.write_text(f"""
[store]
path = "{tmp_path / 'chdb'}"
database = "runtest"
[run]
collectors = ["blockio"]
status_interval_s = 0.3
[writer]
spool_dir = "{tmp_path / 'spool'}"
flush_interval_s = 0.2
[blockio]
interval_s = 0.5
""")
    with running_daemon(cfg, clean_env()) as daemon:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            daemon.assert_alive()
            synced_write(tmp_path / "io.bin", 256 << 10)
            written = written_counts(daemon.log_lines)
            if written and written[-1] >= 2:
                break
            time.sleep(0.2)
        else:
            pytest.fail("no bpftrace rows written in 60 s:\n" + daemon.log)
        synced_write(tmp_path / "io.bin", 256 << 10)  # inside the open window: only END reports it
        stop_wall = time.time()
        summary = daemon.stop()
    w = summary["writer"]
    assert summary["flushed"] and w["rows_written"] == w["rows_submitted"] == summary["collectors"][
        "blockio_bpftrace"]["rows"] > 0
    assert shutil.which("bpftrace") and "falling back" not in daemon.log
    query = tmp_path / "q.py"
    query.write_text(
        "import json, sys\nfrom triscope.store import open_store\n"
        "s = open_store({'store': {'backend': 'embedded', 'path': sys.argv[1], 'database': 'runtest'}})\n"
        "print(json.dumps(s.query(\"SELECT count(), groupUniqArray(source), "
        "max(toUnixTimestamp64Nano(ts)) / 1e9 + argMax(window_seconds, ts) FROM runtest.io_latency "
        "WHERE op = 'write'\").rows[0]))\n")
    res = subprocess.run([sys.executable, str(query), str(tmp_path / "chdb")], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr
    count, sources, last_end = json.loads(res.stdout)
    assert count > 0 and sources == ["bpftrace"]
    assert last_end >= stop_wall - 0.05, (last_end, stop_wall)  # the window open at SIGTERM is there
