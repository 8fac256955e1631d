"""Prometheus exporter: derived metrics from a seeded store, promtool lint, a real Prometheus scraping it,
and the pipeline counters of an in-process ``triscope run`` (serving-metrics collector -> writer -> store).

The serving engine of the daemon test is a prometheus_client server exposing vLLM's metric names
(a stand-in for vLLM, which needs a GPU); everything after it is the real pipeline.
"""

from __future__ import annotations

import os
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, Gauge, start_http_server
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import free_port, require_binary
from triscope.component import Context
from triscope.errors import ConfigError
from triscope.exporters.prometheus import PrometheusExporter, create, prometheus_config
from triscope.schema import IO_LATENCY, encode_ts, qualified

MS = 1_000_000
LAT_B1 = [0.010 * (i + 1) for i in range(50)]  # 10 ms .. 500 ms
LAT_B2 = [0.2, 0.4, 0.9]


def _t0() -> int:
    return (time.time_ns() // 10**9 - 10) * 10**9  # 10 s ago, on the 100 ms grid


def _seed(store: Any, t0: int) -> None:
    """Request spans for b1/b2, serving metrics, GPU samples: 2 s compute-bound then 2 s idle."""
    lat = LAT_B1 + LAT_B2
    backends = ["b1"] * len(LAT_B1) + ["b2"] * len(LAT_B2)
    n = len(lat)
    store.insert(qualified(store, "requests"), {
        "ts": [encode_ts(t0 + i * 10 * MS) for i in range(n)], "host": ["h1"] * n, "backend": backends,
        "model": ["llama"] * n, "latency_seconds": lat, "status": ["ok"] * n,
    })
    store.insert(qualified(store, "requests"), {  # a span without a measured latency counts, but not in P99
        "ts": [encode_ts(t0)], "host": ["h1"], "backend": ["b2"], "model": ["llama"], "latency_seconds": [float("nan")],
    })
    store.insert(qualified(store, "serving_metrics"), {
        "ts": [encode_ts(t0 + k * 10**9) for k in range(3)], "host": ["h1"] * 3, "backend": ["b1"] * 3,
        "server": ["vllm"] * 3, "model": ["llama"] * 3, "kv_cache_usage_ratio": [0.5, 0.9, 0.72],
        "latency_p99_seconds": [0.3, 0.45, float("nan")],
    })
    idx = list(range(40))
    busy = [i < 20 for i in idx]
    store.insert(qualified(store, "gpu_samples"), {
        "ts": [encode_ts(t0 + i * 100 * MS + 50 * MS) for i in idx], "host": ["h1"] * 40, "gpu": [0] * 40,
        "gpu_model": ["H100"] * 40, "source": ["dcgm"] * 40,
        "memory_used_bytes": [float((30 + i) << 30) for i in idx], "memory_total_bytes": [float(80 << 30)] * 40,
        "sm_active_ratio": [0.99 if b else 0.01 for b in busy], "dram_active_ratio": [0.3 if b else 0.01 for b in busy],
        "l2_bandwidth_ratio": [0.3 if b else 0.01 for b in busy], "gpu_util_ratio": [0.99 if b else 0.01 for b in busy],
    })


def _scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as resp:
        assert resp.status == 200
        return resp.read().decode()


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _get(samples: dict, name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


@pytest.fixture()
def exporter(store: Any) -> Iterator[PrometheusExporter]:
    _seed(store, _t0())
    exp = create({"prometheus": {"port": 0, "cache_s": 0}, "store": {}}, Context(open_store=lambda: store))
    exp.start()
    try:
        yield exp
    finally:
        exp.close()


def test_config_is_checked() -> None:
    assert prometheus_config({})["listen"] == "127.0.0.1"
    with pytest.raises(ConfigError, match="unknown keys: lisen"):
        prometheus_config({"prometheus": {"lisen": "0.0.0.0"}})
    with pytest.raises(ConfigError, match="not in 0..65535"):
        prometheus_config({"prometheus": {"port": 70000}})
    with pytest.raises(ConfigError, match="bad value"):
        prometheus_config({"prometheus": {"port": "http"}})
    with pytest.raises(ConfigError, match="window_s must be > 0"):
        prometheus_config({"prometheus": {"window_s": 0}})


def test_derived_metrics_match_the_seeded_store(exporter: PrometheusExporter) -> None:
    assert exporter.url.startswith("http://127.0.0.1:")
    s = _samples(_scrape(exporter.url))
    window = 60.0
    assert _get(s, "triscope_backend_requests_per_second", backend="b1") == pytest.approx(len(LAT_B1) / window)
    assert _get(s, "triscope_backend_requests_per_second", backend="b2") == pytest.approx((len(LAT_B2) + 1) / window)
    for backend, lat in (("b1", LAT_B1), ("b2", LAT_B2)):
        assert _get(s, "triscope_backend_request_latency_p99_seconds", backend=backend, source="requests") == \
            pytest.approx(float(np.quantile(lat, 0.99)), rel=1e-6)
    # the engine's own P99: the latest finite sample (the NaN one is skipped)
    assert _get(s, "triscope_backend_request_latency_p99_seconds", backend="b1", source="serving_metrics") == 0.45
    assert _get(s, "triscope_backend_kv_cache_usage_ratio", backend="b1", model="llama") == pytest.approx(0.72)
    assert _get(s, "triscope_gpu_memory_used_bytes", host="h1", gpu="0") == float(69 << 30)
    assert _get(s, "triscope_gpu_memory_total_bytes", host="h1", gpu="0") == float(80 << 30)
    assert _get(s, "triscope_gpu_memory_used_ratio", host="h1", gpu="0") == pytest.approx(69 / 80)
    assert _get(s, "triscope_stall_time_ratio", **{"class": "compute"}) == pytest.approx(0.5)
    assert _get(s, "triscope_stall_time_ratio", **{"class": "idle"}) == pytest.approx(0.5)
    assert _get(s, "triscope_store_up") == 1.0
    assert all(_get(s, "triscope_exporter_store_query_errors_total", query=q) == 0
               for q in ("requests", "serving_metrics", "gpu_samples", "stalls"))
    assert ("triscope_writer_rows_written_total", ()) not in s  # no daemon stats given: no writer families


def test_promtool_finds_nothing_to_lint(store: Any, tmp_path: Path) -> None:
    """Every family (derived, writer, collectors, exporter) passes ``promtool check metrics``."""
    from triscope.writer import Writer

    promtool = require_binary("promtool")
    _seed(store, _t0())
    writer = Writer(store, str(tmp_path / "spool"), flush_interval_s=0.05)
    writer.submit(IO_LATENCY, {"ts": [encode_ts(_t0())], "host": ["h1"], "device": ["nvme0n1"]})
    assert writer.flush(timeout_s=10)

    def stats() -> dict[str, Any]:
        return {"writer": writer.snapshot(), "collectors": {"blockio": {
                    "rows": 1, "errors": 0, "tables": {"io_latency": 1},
                    "gaps": {"missed_probe_runs": 3, "late_windows": 1}}},
                "not_started": {"nvml": "NVML not available"},
                "exporters": {"epp": {  # the per-request picker's counters, as EppService.stats() has them
                    "picks": {"b0": 7, "b1": 5, "status:503": 2, "status:400": 1}, "in_flight": {"b0": 1, "b1": 0},
                    "refused": {"offline_video:break": 2, "interactive_image_text:degrade": 1},
                    "scrapes_total": 40, "scrape_errors": {}, "scrape_failures": {"b0": 0, "b1": 3},
                    "scrape_periods_s": {"b0": 0.25, "b1": 0.5}, "weights_version": 12, "weights_error": "",
                    "tables_served": 9}}}

    exp = create({"prometheus": {"port": 0, "cache_s": 0}}, Context(open_store=lambda: store, stats=stats))
    exp.start()
    try:
        text = _scrape(exp.url)
    finally:
        exp.close()
        writer.close()
    s = _samples(text)
    assert _get(s, "triscope_writer_rows_written_total") == 1
    assert _get(s, "triscope_collector_up", collector="nvml") == 0
    assert _get(s, "triscope_collector_gaps_total", collector="blockio", kind="late_windows") == 1
    assert _get(s, "triscope_collector_gaps_total", collector="blockio", kind="missed_probe_runs") == 3
    assert _get(s, "triscope_epp_picks_total", backend="b0") == 7
    assert _get(s, "triscope_epp_answered_total", status="503") == 2
    assert _get(s, "triscope_epp_refused_total", request_class="offline_video", level="break") == 2
    assert _get(s, "triscope_epp_scrape_failures_total", backend="b1") == 3
    assert _get(s, "triscope_epp_scrape_period_seconds", backend="b1") == 0.5
    assert _get(s, "triscope_epp_pick_tables_served_total") == 9
    families = {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE")}
    helps = {line.split()[2] for line in text.splitlines() if line.startswith("# HELP")}
    assert families == helps and len(families) >= 25
    res = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=30)
    assert res.returncode == 0 and res.stdout.strip() == "" and res.stderr.strip() == "", res.stdout + res.stderr


def test_only_get_metrics_is_served(exporter: PrometheusExporter) -> None:
    base = exporter.url.removesuffix("/metrics")
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(base + "/admin", timeout=5)
    assert err.value.code == 404
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(urllib.request.Request(exporter.url, data=b"x" * 1000, method="POST"), timeout=5)
    assert err.value.code == 405


def test_cache_serves_old_values_until_it_expires(store: Any) -> None:
    t0 = _t0()
    _seed(store, t0)
    exp = create({"prometheus": {"port": 0, "cache_s": 1.0}}, Context(open_store=lambda: store))
    exp.start()
    try:
        first = _get(_samples(_scrape(exp.url)), "triscope_backend_requests_per_second", backend="b1")
        store.insert(qualified(store, "requests"), {
            "ts": [encode_ts(t0 + 5 * 10**9)] * 6, "backend": ["b1"] * 6, "latency_seconds": [0.1] * 6})
        cached = _get(_samples(_scrape(exp.url)), "triscope_backend_requests_per_second", backend="b1")
        time.sleep(1.1)
        later = _get(_samples(_scrape(exp.url)), "triscope_backend_requests_per_second", backend="b1")
    finally:
        exp.close()
    assert first == cached == pytest.approx(50 / 60)
    assert later == pytest.approx(56 / 60)


def test_a_failing_store_is_counted_not_raised(tmp_path: Path) -> None:
    def opener() -> Any:
        from triscope.errors import StoreError

        raise StoreError("cannot reach ClickHouse at http://127.0.0.1:1: connection refused")

    exp = create({"prometheus": {"port": 0, "cache_s": 0}}, Context(open_store=opener))
    exp.start()
    try:
        s = _samples(_scrape(exp.url))
        s2 = _samples(_scrape(exp.url))
    finally:
        exp.close()
    assert _get(s, "triscope_store_up") == 0.0
    assert _get(s, "triscope_exporter_store_query_errors_total", query="requests") == 1
    assert _get(s2, "triscope_exporter_store_query_errors_total", query="stalls") == 2


@pytest.mark.slow
def test_real_prometheus_scrapes_the_exporter(exporter: PrometheusExporter, tmp_path: Path) -> None:
    binary = require_binary("prometheus")
    port = free_port()
    (tmp_path / "prometheus.yml").write_text(
        "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\nscrape_configs:\n"
        f"  - job_name: triscope\n    static_configs:\n      - targets: ['127.0.0.1:{exporter.port}']\n")
    proc = subprocess.Popen([binary, f"--config.file={tmp_path / 'prometheus.yml'}",
                             f"--storage.tsdb.path={tmp_path / 'tsdb'}", f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    expected = float(np.quantile(LAT_B1, 0.99))
    query = 'triscope_backend_request_latency_p99_seconds{backend="b1",source="requests",job="triscope"}'
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": query})
    got: list[Any] = []
    try:
        deadline = time.monotonic() + 25
        while time.monotonic() < deadline and not got:
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            try:
                import json

                doc = json.loads(_scrape(url))
                got = doc["data"]["result"]
            except (OSError, ValueError):
                pass
            if not got:
                time.sleep(0.3)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    assert got, "Prometheus never returned the exporter's metric"
    assert len(got) == 1 and float(got[0]["value"][1]) == pytest.approx(expected, rel=1e-9)
    assert got[0]["metric"]["instance"] == f"127.0.0.1:{exporter.port}"
    assert proc.returncode == 0  # SIGTERM: a clean shutdown


def _vllm(kv: float) -> tuple[int, Any]:
    registry = CollectorRegistry()
    labels = ["model_name", "engine"]
    Gauge("vllm:num_requests_waiting", "waiting", labels, registry=registry).labels("llama", "0").set(1)
    Gauge("vllm:kv_cache_usage_perc", "kv", labels, registry=registry).labels("llama", "0").set(kv)
    port = free_port()
    server, _ = start_http_server(port, addr="127.0.0.1", registry=registry)
    return port, server


@pytest.mark.slow
def test_daemon_pipeline_counters(store_path: Path, tmp_path: Path) -> None:
    from triscope.daemon import Daemon
    from triscope.store import open_store

    vllm_port, vllm = _vllm(0.61)
    database = f"prom{os.getpid()}"
    config = {
        "store": {"backend": "embedded", "path": str(store_path), "database": database},
        "run": {"collectors": ["serving_metrics"], "exporters": ["prometheus"], "status_interval_s": 0},
        "writer": {"spool_dir": str(tmp_path / "spool"), "flush_interval_s": 0.2},
        "serving_metrics": {"interval_s": 0.2, "targets": [f"http://127.0.0.1:{vllm_port}/metrics"]},
        "prometheus": {"port": 0, "cache_s": 0, "poll_s": 0.1, "stalls": False},
    }
    daemon = Daemon(config)
    started = time.time()
    daemon.start()
    try:
        url = daemon.exporters[0].url
        deadline = time.monotonic() + 20
        s: dict = {}
        while time.monotonic() < deadline:
            s = _samples(_scrape(url))
            if s.get(("triscope_writer_rows_written_total", ()), 0) >= 5 and any(
                    k[0] == "triscope_backend_kv_cache_usage_ratio" for k in s):
                break
            time.sleep(0.2)
        live = s
        daemon.stop.set()  # collectors stop; the writer and the exporter keep running
        for loop in daemon.loops:
            loop.join(timeout=5)
        assert daemon.writer.flush(timeout_s=10)
        s = _samples(_scrape(url))  # steady state: every counter is exact
    finally:
        summary = daemon.shutdown()
        vllm.shutdown()
    with open_store(config) as check:
        in_store = check.query(f"SELECT count() FROM {database}.serving_metrics").scalar()
        in_store += check.query(f"SELECT count() FROM {database}.scrape_health").scalar()  # one row per scrape
        check.command(f"DROP DATABASE IF EXISTS {database}")
    assert _get(live, "triscope_writer_rows_written_total") >= 5
    written = _get(s, "triscope_writer_rows_written_total")
    assert written == _get(s, "triscope_writer_rows_submitted_total") == _get(
        s, "triscope_collector_rows_total", collector="serving_metrics", table="serving_metrics") + _get(
        s, "triscope_collector_rows_total", collector="serving_metrics", table="scrape_health")
    assert _get(s, "triscope_collector_rows_total", collector="serving_metrics", table="scrape_health") == _get(
        s, "triscope_collector_rows_total", collector="serving_metrics", table="serving_metrics")  # all up
    assert summary["writer"]["rows_written"] == in_store >= written  # shutdown takes one last sample
    assert _get(s, "triscope_writer_pending_rows") == 0
    assert _get(s, "triscope_writer_spool_bytes") == 0
    assert _get(s, "triscope_writer_batches_written_total") >= 1
    assert _get(s, "triscope_collector_up", collector="serving_metrics") == 1.0
    assert _get(s, "triscope_collector_errors_total", collector="serving_metrics") == 0
    assert _get(s, "triscope_store_up") == 1.0
    assert started <= _get(s, "triscope_writer_last_write_timestamp_seconds") <= time.time()
    assert _get(s, "triscope_writer_rows_replayed_total") == 0
    kv = [v for (name, _labels), v in live.items() if name == "triscope_backend_kv_cache_usage_ratio"]
    assert kv == [pytest.approx(0.61)]  # vLLM gauge -> collector -> writer -> store -> derived metric


def test_a_failing_query_blanks_only_its_families(store: Any) -> None:
    _seed(store, _t0())
    store.command(f"DROP TABLE {qualified(store, 'gpu_samples')}")
    exp = create({"prometheus": {"port": 0, "cache_s": 0}}, Context(open_store=lambda: store))
    exp.start()
    try:
        s = _samples(_scrape(exp.url))
    finally:
        exp.close()
    errors = {q: _get(s, "triscope_exporter_store_query_errors_total", query=q)
              for q in ("requests", "serving_metrics", "gpu_samples", "stalls")}
    assert errors == {"requests": 0, "serving_metrics": 0, "gpu_samples": 1, "stalls": 1}
    assert not any(name.startswith(("triscope_gpu_", "triscope_stall_")) for name, _ in s)
    assert _get(s, "triscope_backend_requests_per_second", backend="b1") == pytest.approx(len(LAT_B1) / 60)
    assert _get(s, "triscope_store_up") == 1.0


def test_one_owner_per_metric_name(exporter: PrometheusExporter, store: Any) -> None:
    """The run's exporter owns the triscope_backend_* telemetry; the weight feed publishes its engine
    inputs under triscope_weights_input_*, so ``sum by (backend)`` over both jobs counts nothing twice."""
    from triscope.analyzers.routing import WeightParams
    from triscope.exporters.feed import WeightFeed

    run = {f.name: f for f in text_string_to_metric_families(_scrape(exporter.url))}
    feed = WeightFeed(WeightParams.from_config({"weights": {"history": False}}), store=store)
    feed.update()
    fed = {f.name: f for f in text_string_to_metric_families(feed.metrics_response()[2].decode())}
    assert not set(run) & set(fed), set(run) & set(fed)
    kv = {s.labels["backend"]: s.value for s in run["triscope_backend_kv_cache_usage_ratio"].samples}
    kv_in = {s.labels["backend"]: s.value for s in fed["triscope_weights_input_kv_cache_usage_ratio"].samples}
    assert kv == kv_in == {"b1": pytest.approx(0.72)}  # the same number, one name each
    assert "triscope_backend_requests_per_second" in run and "triscope_weights_input_requests_per_second" in fed


def test_a_collectors_own_gaps_reach_metrics(store: Any, tmp_path: Path) -> None:
    """A collector's ``gaps()`` (blockio's skipped probe runs and late windows) travel through its loop's
    counters to ``triscope_collector_gaps_total``; a collector without one shows none."""
    import threading

    from triscope.collector_loop import CollectorLoop
    from triscope.writer import Writer

    class Source:  # the smallest collectors, one counting gaps (blockio's need root and bpftrace)
        interval_s = 1.0

        def __init__(self, name: str) -> None:
            self.name = name

        def start(self) -> None: ...
        def collect(self) -> dict[str, Any]:
            return {}
        def close(self) -> None: ...

    class GappySource(Source):
        def gaps(self) -> dict[str, int]:
            return {"late_windows": 2}

    writer = Writer(store, str(tmp_path / "spool"))
    loops = [CollectorLoop(GappySource("gappy"), writer, threading.Event()),
             CollectorLoop(Source("whole"), writer, threading.Event())]
    stats = lambda: {"writer": writer.snapshot(), "collectors": {lp.collector.name: lp.counters() for lp in loops},  # noqa: E731
                     "not_started": {}}
    exp = create({"prometheus": {"port": 0, "cache_s": 0}}, Context(open_store=lambda: store, stats=stats))
    exp.start()
    try:
        s = _samples(_scrape(exp.url))
    finally:
        exp.close()
        writer.close()
    assert _get(s, "triscope_collector_gaps_total", collector="gappy", kind="late_windows") == 2
    assert not [k for k in s if k[0] == "triscope_collector_gaps_total" and ("collector", "whole") in k[1]]
