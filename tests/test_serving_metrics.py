"""Serving-metrics scraper: shared vLLM sample, real prometheus_client servers on 127.0.0.1, garbage."""

from __future__ import annotations

import logging
import math
import re
from collections import defaultdict

import pytest
from conftest import free_port, shared_data
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, start_http_server

from triscope.collectors.serving_metrics import ServingMetricsScraper, Target, create
from triscope.component import Context
from triscope.errors import InputError
from triscope.prom_text import bucket_delta, histogram_quantile, parse_exposition
from triscope.schema import SCRAPE_HEALTH, SERVING_METRICS, qualified

MODEL = "meta-llama/Llama-3.1-8B-Instruct"


def _plain_sums(text: str) -> dict[str, list[float]]:
    """Independent reading of the sample file: values per sample name by a regex, no parser."""
    values: dict[str, list[float]] = defaultdict(list)
    for line in text.splitlines():
        m = re.match(r"^([a-zA-Z_:][\w:]*)(\{[^}]*\})?\s+(\S+)$", line)
        if m:
            values[m.group(1)].append(float(m.group(3)))
    return values


def test_vllm_sample_two_engines_aggregated() -> None:
    path = shared_data("vllm", "vllm_0.33_v1_two_engines.prom")
    text = path.read_text()
    plain = _plain_sums(text)
    scraper = ServingMetricsScraper()
    rows = scraper.rows_from_text(Target(url="http://10.1.2.3:8000/metrics"), text, 10**18)
    assert rows["model"] == [MODEL] and rows["server"] == ["vllm"]
    assert rows["backend"] == ["10.1.2.3:8000"] and rows["host"] == ["10.1.2.3"]
    assert len(plain["vllm:num_requests_running"]) == 2  # two engines in one instance
    assert rows["running_requests"] == [sum(plain["vllm:num_requests_running"])]
    assert rows["queue_length"] == [sum(plain["vllm:num_requests_waiting"])]
    kv = plain["vllm:kv_cache_usage_perc"]
    assert rows["kv_cache_usage_ratio"] == [pytest.approx(sum(kv) / len(kv))]
    assert rows["requests_total"] == [sum(plain["vllm:request_success_total"])]
    assert math.isnan(rows["latency_p99_seconds"][0])  # first scrape: no delta yet


def test_old_vllm_gpu_cache_name() -> None:
    text = ('# TYPE vllm:gpu_cache_usage_perc gauge\n'
            'vllm:gpu_cache_usage_perc{model_name="m"} 0.25\n'
            '# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{model_name="m"} 4\n')
    rows = ServingMetricsScraper().rows_from_text(Target(url="http://h:1/metrics"), text, 1)
    assert rows["kv_cache_usage_ratio"] == [0.25] and rows["queue_length"] == [4.0]


def test_real_vllm_like_server_two_scrapes(store) -> None:
    """A real prometheus_client registry served over HTTP with vLLM's names and two engines."""
    registry = CollectorRegistry()
    labels = ["engine", "model_name"]
    running = Gauge("vllm:num_requests_running", "running", labels, registry=registry)
    waiting = Gauge("vllm:num_requests_waiting", "waiting", labels, registry=registry)
    kv = Gauge("vllm:kv_cache_usage_perc", "kv", labels, registry=registry)
    success = Counter("vllm:request_success", "ok", labels + ["finished_reason"], registry=registry)
    buckets = [0.1, 0.2, 0.5, 1.0]
    e2e = Histogram("vllm:e2e_request_latency_seconds", "e2e", labels, buckets=buckets, registry=registry)
    ttft = Histogram("vllm:time_to_first_token_seconds", "ttft", labels, buckets=buckets, registry=registry)
    port = free_port()
    server, thread = start_http_server(port, addr="127.0.0.1", registry=registry)
    try:
        for engine, (r, w, k) in {"0": (3, 1, 0.5), "1": (5, 2, 0.7)}.items():
            running.labels(engine, MODEL).set(r)
            waiting.labels(engine, MODEL).set(w)
            kv.labels(engine, MODEL).set(k)
        for _ in range(1000):  # before the first scrape: must not count in the deltas
            e2e.labels("0", MODEL).observe(0.05)
            ttft.labels("0", MODEL).observe(0.05)
        success.labels("0", MODEL, "stop").inc(1000)
        scraper = create({"serving_metrics": {"targets": [f"http://127.0.0.1:{port}/metrics"]}}, Context())
        scraper.start()
        first = scraper.collect()[SERVING_METRICS]
        assert first["running_requests"] == [8.0] and first["queue_length"] == [3.0]
        assert first["kv_cache_usage_ratio"] == [pytest.approx(0.6)]
        assert math.isnan(first["latency_p50_seconds"][0])
        # Between the scrapes: 50 at 0.15 s and 50 at 0.7 s, split over the two engines.
        for i in range(50):
            e2e.labels(str(i % 2), MODEL).observe(0.15)
            e2e.labels(str(i % 2), MODEL).observe(0.7)
            ttft.labels("1", MODEL).observe(0.3)
        success.labels("1", MODEL, "length").inc(100)
        second = scraper.collect()[SERVING_METRICS]
        # delta buckets {0.1: 0, 0.2: 50, 0.5: 50, 1.0: 100}: p50 = 0.1 + 0.1*50/50, p99 = 0.5 + 0.5*49/50
        assert second["latency_p50_seconds"] == [pytest.approx(0.2)]
        assert second["latency_p99_seconds"] == [pytest.approx(0.99)]
        # ttft delta: 50 in (0.2, 0.5]: p99 = 0.2 + 0.3 * 49.5/50
        assert second["ttft_p99_seconds"] == [pytest.approx(0.2 + 0.3 * 49.5 / 50)]
        assert second["requests_total"] == [1100.0]
        n = store.insert(qualified(store, "serving_metrics"), second)
        assert n == 1
        back = store.query(f"SELECT server, latency_p99_seconds FROM {qualified(store, 'serving_metrics')}").rows
        assert back[0][0] == "vllm" and back[0][1] == pytest.approx(0.99)
    finally:
        server.shutdown()
        thread.join(timeout=5)


@pytest.mark.parametrize("server", ["sglang", "tgi"])
def test_sglang_and_tgi_names(server: str) -> None:
    registry = CollectorRegistry()
    if server == "sglang":
        Gauge("sglang:num_queue_reqs", "q", ["model_name"], registry=registry).labels("qwen").set(7)
        Gauge("sglang:num_running_reqs", "r", ["model_name"], registry=registry).labels("qwen").set(9)
        Gauge("sglang:token_usage", "kv", ["model_name"], registry=registry).labels("qwen").set(0.42)
        Counter("sglang:num_requests", "n", ["model_name"], registry=registry).labels("qwen").inc(11)
        hist = Histogram("sglang:e2e_request_latency_seconds", "e2e", ["model_name"], buckets=[1, 2],
                         registry=registry).labels("qwen")
    else:
        Gauge("tgi_queue_size", "q", registry=registry).set(7)
        Gauge("tgi_batch_current_size", "r", registry=registry).set(9)
        Counter("tgi_request_success", "ok", registry=registry).inc(11)
        hist = Histogram("tgi_request_duration", "e2e", buckets=[1, 2], registry=registry)
    target = Target(url="http://127.0.0.1:9/metrics", model="qwen")
    scraper = ServingMetricsScraper()
    first = scraper.rows_from_text(target, generate_latest(registry).decode(), 1)
    for _ in range(10):
        hist.observe(1.5)
    second = scraper.rows_from_text(target, generate_latest(registry).decode(), 2)
    assert first["server"] == [server] and first["model"] == ["qwen"]
    assert first["queue_length"] == [7.0] and first["running_requests"] == [9.0]
    assert first["requests_total"] == [11.0]
    if server == "sglang":
        assert first["kv_cache_usage_ratio"] == [0.42]
    else:
        assert math.isnan(first["kv_cache_usage_ratio"][0])  # TGI exports no KV-cache gauge
    assert second["latency_p50_seconds"] == [pytest.approx(1.5)]


@pytest.mark.parametrize("text", ["hello world", "<html><body>502 Bad Gateway</body></html>", "a{b=} 1"])
def test_garbage_is_one_line_error(text: str) -> None:
    with pytest.raises(InputError) as err:
        ServingMetricsScraper().rows_from_text(Target(url="http://h:1/metrics"), text, 1)
    assert "\n" not in str(err.value) and "h:1" in str(err.value)


def test_unknown_metrics_and_parse_error_message() -> None:
    with pytest.raises(InputError, match="no vLLM, SGLang or TGI"):
        ServingMetricsScraper().rows_from_text(Target(url="http://h:1/m"), "node_load1 0.5\n", 1)
    with pytest.raises(InputError, match="not Prometheus text format"):
        parse_exposition("x y z")


def test_unreachable_target_is_skipped_not_raised_and_recorded_down() -> None:
    url = f"http://127.0.0.1:{free_port()}/metrics"
    scraper = ServingMetricsScraper({"serving_metrics": {"targets": [url], "http": {"timeout_s": 1}}})
    out = scraper.collect()
    assert set(out) == {SCRAPE_HEALTH}  # no serving rows, but the failure itself is a row
    health = out[SCRAPE_HEALTH]
    assert health["up"] == [0] and health["target"] == [url] and health["backend"] == [url.split("/")[2]]
    assert "scrape failed" in health["error"][0] and "\n" not in health["error"][0]
    assert 0 <= health["duration_seconds"][0] < 2
    assert "scrape failed" in next(iter(scraper.errors.values()))


def test_scrape_interval_shorter_than_its_timeout_is_warned(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="triscope.collectors.serving_metrics")
    ServingMetricsScraper({"serving_metrics": {"targets": ["http://h:1/m"], "interval_s": 2, "http": {"timeout_s": 3}}})
    assert "timeout_s 3 exceeds interval_s 2" in caplog.text
    caplog.clear()
    ServingMetricsScraper({"serving_metrics": {"targets": ["http://h:1/m"], "interval_s": 3, "http": {"timeout_s": 3}}})
    assert caplog.text == ""


def test_quantile_and_reset() -> None:
    assert histogram_quantile(0.5, {}) != histogram_quantile(0.5, {})  # NaN
    assert histogram_quantile(0.5, {1.0: 0, math.inf: 0}) != histogram_quantile(0.5, {1.0: 0, math.inf: 0})
    assert histogram_quantile(0.99, {1.0: 1, 2.0: 1, math.inf: 10}) == 2.0  # in +Inf: highest finite bound
    prev, cur = {1.0: 10, math.inf: 20}, {1.0: 2, math.inf: 3}  # restarted: counters went down
    assert bucket_delta(cur, prev) == cur
    assert bucket_delta({1.0: 12, math.inf: 25}, prev) == {1.0: 2, math.inf: 5}


@pytest.mark.parametrize(("section", "message"), [
    ({"targets": ["ftp://h/metrics"]}, "is not an http"),
    ({"targets": [{"url": "http://h:1/metrics", "sever": "vllm"}]}, "sever"),
    ({"targets": [{"url": "http://h:1/metrics", "server": "trtllm"}]}, "unknown server 'trtllm'"),
    ({"interval_s": -5}, r"\[serving_metrics\] interval_s must be > 0"),
    ({"timeout": 3}, r"\[serving_metrics\] has unknown keys: timeout"),
])
def test_config_mistakes_are_one_line(section: dict, message: str) -> None:
    from triscope.errors import ConfigError

    with pytest.raises(ConfigError, match=message) as err:
        create({"serving_metrics": section}, Context())
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(("section", "message"), [
    ({"http": {"redirects": "sometimes"}}, r"\[serving_metrics.http\] redirects must be one of none, same-origin, any"),
    ({"http": {"max_parallel": 0}}, r"\[serving_metrics.http\] max_parallel must be > 0"),
    ({"http": {"max_body": 1}}, r"\[serving_metrics.http\] has unknown keys: max_body \(known: max_body_bytes, "),
    ({"http": 3}, r"\[serving_metrics.http\] must be a table, got 3"),
    ({"max_models_per_target": -1}, r"\[serving_metrics\] max_models_per_target must be > 0"),
    ({"targets": [{"url": "http://h:1/metrics", "server": "tritonn"}]},
     "unknown server 'tritonn'; use one of vllm, sglang, tgi, triton, llamacpp"),
])
def test_new_config_keys_are_checked(section: dict, message: str) -> None:
    from triscope.errors import ConfigError

    with pytest.raises(ConfigError, match=message) as err:
        create({"serving_metrics": section}, Context())
    assert "\n" not in str(err.value)


def test_redirects_same_origin_by_default_never_elsewhere() -> None:
    """Starlette-style /metrics -> /metrics/ is followed; a redirect to another host is that target's error."""
    from scrape_helpers import Route, raw_server

    body = b'# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{model_name="m"} 2.0\n'
    with raw_server({"/metrics": Route(status="307 Temporary Redirect", headers=(("Location", "/metrics/"),)),
                     "/metrics/": Route(body=body),
                     "/away": Route(status="302 Found", headers=(("Location", "http://169.254.169.254/latest"),))
                     }) as s:
        scraper = ServingMetricsScraper({"serving_metrics": {"targets": [s.url("/metrics"), s.url("/away")]}})
        assert scraper.collect()[SERVING_METRICS]["running_requests"] == [2.0]
        assert "another origin" in scraper.errors[s.url("/away")]
        strict = ServingMetricsScraper({"serving_metrics": {"targets": [s.url("/metrics")],
                                                            "http": {"redirects": "none"}}})
        assert SERVING_METRICS not in strict.collect()
        assert "redirects are not allowed" in strict.errors[s.url("/metrics")]
    assert "/latest" not in s.requests
