"""Serving-metrics scraper under hostile targets, on real sockets (127.0.0.1): a body trickled at 1 byte/s,
a malformed bucket, a target failing tick after tick, label churn. Each bad target is its own error
only; the good targets' rows arrive on time."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest
from scrape_helpers import Route, raw_server
from serving_samples import TRITON_TRTLLM, llamacpp, sglang_tp4_dp2

from triscope.collectors.serving_metrics import ServingMetricsScraper
from triscope.schema import SCRAPE_HEALTH, SERVING_METRICS

VLLM = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 4.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 1.0
# HELP vllm:e2e_request_latency_seconds Histogram of e2e request latency in seconds.
# TYPE vllm:e2e_request_latency_seconds histogram
vllm:e2e_request_latency_seconds_bucket{engine="0",le="0.3",model_name="m"} 1.0
vllm:e2e_request_latency_seconds_bucket{engine="0",le="+Inf",model_name="m"} 2.0
"""
"""vLLM V1 names (vllm/v1/metrics/loggers.py); SYNTHETIC values."""


def _scraper(urls: list[str], http: dict | None = None, **extra: object) -> ServingMetricsScraper:
    return ServingMetricsScraper({"serving_metrics": {"targets": urls, "http": http or {}, **extra}})


@pytest.mark.parametrize("round_", range(3))
def test_a_trickling_target_costs_only_itself(round_: int) -> None:
    """A body at 1 byte/s used to hold every target's rows (per-read timeout)."""
    routes = {"/good-vllm": Route(body=VLLM.encode()), "/good-sglang": Route(body=sglang_tp4_dp2().encode()),
              "/good-llamacpp": Route(body=llamacpp().encode()),
              "/slow": Route(body=TRITON_TRTLLM.encode(), trickle_s=1.0)}
    with raw_server(routes) as s:
        urls = [s.url(p) for p in ("/good-vllm", "/slow", "/good-sglang", "/good-llamacpp")]
        scraper = _scraper(urls, {"timeout_s": 1.0})
        try:
            for _ in range(2):  # the second tick too: the slow fetch ended at its deadline
                t0 = time.monotonic()
                out = scraper.collect()[SERVING_METRICS]
                took = time.monotonic() - t0
                assert took < 1.0 + 1.5, took  # one deadline (+ grace), not one per target
                assert sorted(out["server"]) == ["llamacpp", "sglang", "vllm"]
                assert "total deadline" in scraper.errors[urls[1]]
                assert scraper.take_errors() == [scraper.errors[urls[1]]]
        finally:
            scraper.close()


def test_many_slow_targets_are_fetched_concurrently() -> None:
    routes = {f"/slow{i}": Route(body=VLLM.encode(), trickle_s=0.5) for i in range(6)}
    routes["/good"] = Route(body=VLLM.encode())
    with raw_server(routes) as s:
        scraper = _scraper([s.url(p) for p in routes], {"timeout_s": 0.8})
        t0 = time.monotonic()
        out = scraper.collect()[SERVING_METRICS]
        took = time.monotonic() - t0
        t1 = time.monotonic()
        scraper.close()
        closing = time.monotonic() - t1
    assert out["backend"] == [f"127.0.0.1:{s.port}"] and len(scraper.errors) == 6
    assert took < 0.8 + 1.5, took  # 7 targets, 16 threads: one deadline, not six
    assert closing < 0.5


def test_a_malformed_bucket_is_that_targets_error_only() -> None:
    """le="abc" from one target made every target write 0 rows."""
    bad = VLLM.replace('le="0.3"', 'le="abc"')
    with raw_server({"/good": Route(body=VLLM.encode()), "/bad": Route(body=bad.encode())}) as s:
        scraper = _scraper([s.url("/bad"), s.url("/good")])
        out = scraper.collect()[SERVING_METRICS]
        assert out["running_requests"] == [4.0] and len(out["model"]) == 1
        assert scraper.errors == {s.url("/bad"): f"{s.url('/bad')}: vllm:e2e_request_latency_seconds: "
                                                 "bucket le='abc' is not a number"}


def test_failures_logged_once_per_state_change_and_counted_every_tick(caplog: pytest.LogCaptureFixture) -> None:
    answer = {"route": Route(body=b"node_load1 0.5\n")}  # a node_exporter, not a serving engine
    with raw_server({"/m": lambda: answer["route"]}) as s:
        scraper = _scraper([s.url("/m")])
        caplog.set_level(logging.WARNING, logger="triscope.collectors.serving_metrics")
        for _ in range(5):
            assert scraper.collect()[SCRAPE_HEALTH]["up"] == [0]
        assert scraper.errors_total == 5 and len(scraper.take_errors()) == 5 and scraper.take_errors() == []
        answer["route"] = Route(body=VLLM.encode())
        for _ in range(3):
            assert scraper.collect()
        answer["route"] = Route(status="503 Service Unavailable", body=b"loading\n")
        for _ in range(4):
            scraper.collect()
    lines = [r.getMessage() for r in caplog.records if r.name == "triscope.collectors.serving_metrics"]
    assert lines == [f"serving_metrics: {s.url('/m')}: no vLLM, SGLang or TGI metrics found, nor Triton / "
                     "TensorRT-LLM or llama.cpp ones (expected vllm:*, sglang:*, tgi_*, nv_trt_llm_* / "
                     "nv_inference_* or llamacpp:* names)",
                     f"serving_metrics: {s.url('/m')} answers again",
                     f"serving_metrics: {s.url('/m')}: HTTP 503 Service Unavailable"]
    assert scraper.errors_total == 9


def test_label_churn_keeps_the_histogram_baselines_bounded() -> None:
    """A new model label per scrape grew the baselines without bound."""
    tick = {"n": 0}

    def churning() -> Route:
        tick["n"] += 1
        return Route(body=VLLM.replace('model_name="m"', f'model_name="lora-{tick["n"]}"').encode())

    many = "".join(VLLM.replace('model_name="m"', f'model_name="m{i}"') for i in range(100))
    with raw_server({"/churn": churning, "/many": Route(body=many.encode())}) as s:
        scraper = _scraper([s.url("/churn"), s.url("/many")], max_models_per_target=10)
        for _ in range(30):
            scraper.collect()
        baselines = {url: len(state.previous) for url, state in scraper._state.items()}
    assert baselines == {s.url("/churn"): 1, s.url("/many"): 10}
    assert "100 models exposed, more than max_models_per_target = 10; 90 dropped" in scraper.errors[s.url("/many")]


def test_daemon_counts_target_errors_and_stops_promptly(store_path: Path, tmp_path: Path) -> None:
    """The whole run: the good target's rows reach the store, the trickling one is counted as errors,
    and SIGTERM-style shutdown (whose last collect runs on the main thread) is bounded."""
    from triscope.daemon import Daemon
    from triscope.store import open_store

    database = f"smfault{int(time.time() * 1000) % 10**8}"
    routes = {"/good": Route(body=VLLM.encode()), "/slow": Route(body=VLLM.encode(), trickle_s=1.0)}
    with raw_server(routes) as s:
        config = {
            "store": {"backend": "embedded", "path": str(store_path), "database": database},
            "run": {"collectors": ["serving_metrics"], "status_interval_s": 0},
            "writer": {"spool_dir": str(tmp_path / "spool"), "flush_interval_s": 0.2},
            "serving_metrics": {"interval_s": 0.3, "http": {"timeout_s": 1.0},
                                "targets": [s.url("/slow"), s.url("/good")]},
        }
        daemon = Daemon(config)
        daemon.start()
        try:
            time.sleep(1.5)
        finally:
            t0 = time.monotonic()
            summary = daemon.shutdown()
            stopping = time.monotonic() - t0
    with open_store(config) as check:
        rows = check.query(f"SELECT backend, count() FROM {database}.serving_metrics GROUP BY backend").rows
        health = dict(check.query(f"SELECT target, countIf(up = 1) FROM {database}.scrape_health GROUP BY target").rows)
        failed = check.query(f"SELECT count() FROM {database}.scrape_health WHERE up = 0").rows[0][0]
        check.command(f"DROP DATABASE IF EXISTS {database}")
    counters = summary["collectors"]["serving_metrics"]
    assert stopping < 1.0 + 1.5 + 1.0, stopping  # the loop's collect, then one bounded last collect
    served = rows[0][1]
    assert rows == [(f"127.0.0.1:{s.port}", served)] and served >= 2
    assert health == {s.url("/good"): served, s.url("/slow"): 0} and failed >= 2  # one health row per scrape
    assert counters["rows"] == served + sum(health.values()) + failed
    assert counters["errors"] >= 2 and "total deadline" in counters["last_error"]


def test_a_garbage_target_is_logged_escaped_and_rarely(caplog: pytest.LogCaptureFixture) -> None:
    """Binary garbage that differs on every scrape: every failure counted, the log line escaped (no control
    bytes) and written when the target starts failing, not once per tick."""
    import os as _os

    routes = {"/g": lambda: Route(body=b"vllm:x " + _os.urandom(64) + b"\n\x1b[2J\x00garbage\n")}
    with raw_server(routes) as s:
        scraper = _scraper([s.url("/g")])
        caplog.set_level(logging.WARNING, logger="triscope.collectors.serving_metrics")
        for _ in range(10):
            assert scraper.collect()[SCRAPE_HEALTH]["up"] == [0]
    assert scraper.errors_total == 10
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1, lines
    assert all(c.isprintable() for c in lines[0]) and len(lines[0]) < 400
