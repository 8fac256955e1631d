"""Serving-metrics rows from each engine's real exposition shape: vLLM (V1 and V0 names, sleep state,
waiting by reason, preemptions, queue time, ITL), SGLang with one series per TP rank, Triton with the
TensorRT-LLM backend, llama.cpp. Where the samples come from: tests/serving_samples.py."""

from __future__ import annotations

import math

import pytest
from conftest import shared_data
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from serving_samples import (
    SGLANG_MODEL,
    TRITON_TRTLLM,
    TRITON_TRTLLM_OLD,
    bump_buckets,
    llamacpp,
    sglang_tp4_dp2,
)

from triscope.collectors.serving_metrics import ServingMetricsScraper, Target
from triscope.schema import SERVING_METRICS, qualified

VLLM_MODEL = "meta-llama/Llama-3.1-8B-Instruct"
NEW_COLUMNS = ("preemptions_total", "sleep_state", "waiting_capacity", "waiting_deferred", "swapped_requests",
               "queue_time_p99_seconds", "itl_p99_seconds")


def _one(rows: dict[str, list], column: str) -> float:
    assert len(rows[column]) == 1, rows
    return float(rows[column][0])


def test_vllm_v1_fields_from_the_shared_sample() -> None:
    text = shared_data("vllm", "vllm_0.33_v1_two_engines.prom").read_text()
    scraper = ServingMetricsScraper()
    target = Target(url="http://10.1.2.3:8000/metrics")
    first = scraper.rows_from_text(target, text, 1)
    assert _one(first, "preemptions_total") == 307.0 + 704.0  # vllm:num_preemptions_total, two engines
    assert _one(first, "sleep_state") == 0.0  # both engines awake=1
    assert _one(first, "waiting_capacity") == 3.0 and _one(first, "waiting_deferred") == 0.0
    assert math.isnan(_one(first, "swapped_requests"))  # V1 has no swapping
    assert math.isnan(_one(first, "queue_time_p99_seconds")) and math.isnan(_one(first, "itl_p99_seconds"))
    # Between the scrapes: 10 queued 0.3-0.5 s on engine 0 and 10 queued 0.5-0.8 s on engine 1;
    # 100 inter-token gaps of 25-50 ms on engine 0.
    second_text = bump_buckets(text, "vllm:request_queue_time_seconds", "0", 0.5, 10)
    second_text = bump_buckets(second_text, "vllm:request_queue_time_seconds", "1", 0.8, 10)
    second_text = bump_buckets(second_text, "vllm:inter_token_latency_seconds", "0", 0.05, 100)
    second = scraper.rows_from_text(target, second_text, 2)
    assert _one(second, "queue_time_p99_seconds") == pytest.approx(0.5 + 0.3 * (19.8 - 10) / 10)
    assert _one(second, "itl_p99_seconds") == pytest.approx(0.025 + 0.025 * 99 / 100)


@pytest.mark.parametrize(("states", "level"), [
    ({"0": (0, 1, 0), "1": (1, 0, 0)}, 1.0),  # engine 0 at sleep level 1 (weights offloaded)
    ({"0": (0, 0, 1), "1": (0, 1, 0)}, 2.0),  # level 2 (discard all) wins over level 1
    ({"0": (0, 0, 0), "1": (1, 0, 0)}, 1.0),  # asleep, level not reported
])
def test_vllm_sleep_state_levels(states: dict[str, tuple[int, int, int]], level: float) -> None:
    text = shared_data("vllm", "vllm_0.33_v1_two_engines.prom").read_text()
    for engine, values in states.items():
        for state, value in zip(("awake", "weights_offloaded", "discard_all"), values, strict=True):
            old = f'vllm:engine_sleep_state{{engine="{engine}",model_name="{VLLM_MODEL}",sleep_state="{state}"}}'
            assert old in text
            text = "\n".join(f"{old} {value}.0" if line.startswith(old) else line for line in text.splitlines())
    rows = ServingMetricsScraper().rows_from_text(Target(url="http://h:1/metrics"), text, 1)
    assert _one(rows, "sleep_state") == level


def test_vllm_v0_names() -> None:
    """V0 (vllm/engine/metrics.py, <= 0.10): num_requests_swapped, gpu_cache_usage_perc, the counter
    registered as vllm:num_preemptions_total, time_per_output_token_seconds. SYNTHETIC values."""
    reg = CollectorRegistry()
    labels = ["model_name"]
    Gauge("vllm:num_requests_swapped", "Number of requests swapped to CPU.", labels, registry=reg).labels("m").set(4)
    Gauge("vllm:gpu_cache_usage_perc", "GPU KV-cache usage.", labels, registry=reg).labels("m").set(0.9)
    pre = Counter("vllm:num_preemptions_total", "Cumulative number of preemption from the engine.", labels,
                  registry=reg).labels("m")
    tpot = Histogram("vllm:time_per_output_token_seconds", "Histogram of time per output token in seconds.",
                     labels, buckets=[0.01, 0.025, 0.05, 0.075, 0.1], registry=reg).labels("m")
    pre.inc(7)
    scraper = ServingMetricsScraper()
    target = Target(url="http://h:1/metrics")
    scraper.rows_from_text(target, generate_latest(reg).decode(), 1)
    for _ in range(50):
        tpot.observe(0.06)
    rows = scraper.rows_from_text(target, generate_latest(reg).decode(), 2)
    assert _one(rows, "swapped_requests") == 4.0 and _one(rows, "kv_cache_usage_ratio") == 0.9
    assert _one(rows, "preemptions_total") == 7.0
    assert _one(rows, "itl_p99_seconds") == pytest.approx(0.05 + 0.025 * 49.5 / 50)
    assert math.isnan(_one(rows, "sleep_state")) and math.isnan(_one(rows, "waiting_capacity"))


def test_sglang_one_series_per_tp_rank_counts_once() -> None:
    scraper = ServingMetricsScraper()
    target = Target(url="http://sglang-0:30000/metrics")
    first = scraper.rows_from_text(target, sglang_tp4_dp2(), 1)
    assert first["model"] == [SGLANG_MODEL] and first["server"] == ["sglang"]
    # Summed over the two DP groups, once per group (not x4 for the TP ranks).
    assert _one(first, "queue_length") == 3 + 5 and _one(first, "running_requests") == 10 + 12
    assert _one(first, "kv_cache_usage_ratio") == pytest.approx((0.5 + 0.7) / 2)
    assert _one(first, "preemptions_total") == 4 + 6  # sglang:num_retracted_requests_total
    assert _one(first, "requests_total") == 120  # tokenizer counter, no ranks
    second = scraper.rows_from_text(target, sglang_tp4_dp2({0: 10, 1: 10}, {0: 5, 1: 9}, 150), 2)
    assert _one(second, "preemptions_total") == 5 + 9
    # queue-time delta: DP 0 added 10 in (0.5, 1], DP 1 added 10 in (1, 2]; one TP rank per group.
    assert _one(second, "queue_time_p99_seconds") == pytest.approx(1 + 1 * (19.8 - 10) / 10)


def test_prefix_cache_counters_from_vllm_and_sglang() -> None:
    """vLLM counts prefix-cache lookups and hits in tokens per engine (the shared 0.33 sample; the external
    connector's own counters are not the engine's cache); SGLang counts every prompt token as a lookup and
    the cached ones by source. SGLang values SYNTHETIC, names from its TokenizerMetricsCollector."""
    vllm = ServingMetricsScraper().rows_from_text(
        Target(url="http://h:1/metrics"), shared_data("vllm", "vllm_0.33_v1_two_engines.prom").read_text(), 1)
    assert _one(vllm, "prefix_cache_queries_total") == 2652 + 1235
    assert _one(vllm, "prefix_cache_hits_total") == 3234 + 395
    labels = f'model_name="{SGLANG_MODEL}"'
    sglang = sglang_tp4_dp2() + "\n".join([
        "# TYPE sglang:prompt_tokens_total counter", f"sglang:prompt_tokens_total{{{labels}}} 4096.0",
        "# TYPE sglang:cached_tokens_total counter",
        f'sglang:cached_tokens_total{{{labels},cache_source="device"}} 3000.0',
        f'sglang:cached_tokens_total{{{labels},cache_source="host"}} 168.0']) + "\n"
    rows = ServingMetricsScraper().rows_from_text(Target(url="http://h:2/metrics"), sglang, 1)
    assert _one(rows, "prefix_cache_queries_total") == 4096 and _one(rows, "prefix_cache_hits_total") == 3168
    llama = ServingMetricsScraper().rows_from_text(Target(url="http://h:3/metrics"), llamacpp(), 1)
    assert math.isnan(_one(llama, "prefix_cache_queries_total"))  # an engine that does not say: unknown, not 0

def test_sglang_single_scheduler_series_unchanged() -> None:
    """Without --enable-metrics-for-all-schedulers only TP rank 0 reports: the same rows."""
    text = "\n".join(line for line in sglang_tp4_dp2().splitlines()
                     if 'tp_rank="' not in line or 'tp_rank="0"' in line) + "\n"
    rows = ServingMetricsScraper().rows_from_text(Target(url="http://h:1/metrics"), text, 1)
    assert _one(rows, "queue_length") == 8 and _one(rows, "running_requests") == 22
    assert _one(rows, "preemptions_total") == 10


def test_triton_tensorrt_llm(store) -> None:
    scraper = ServingMetricsScraper()
    rows = scraper.rows_from_text(Target(url="http://triton-0:8002/metrics"), TRITON_TRTLLM, 1)
    # One row: the TRT-LLM model, not the ensemble's pre/post-processing steps.
    assert rows["server"] == ["triton"] and rows["model"] == ["tensorrt_llm"]
    assert _one(rows, "queue_length") == 1 and _one(rows, "running_requests") == 1  # waiting / scheduled
    assert _one(rows, "kv_cache_usage_ratio") == 0.4875  # kv_cache_block_type="fraction"
    assert _one(rows, "requests_total") == 40  # tensorrt_llm's own nv_inference_request_success only
    assert _one(rows, "latency_p50_seconds") == pytest.approx(1.2)  # summary quantiles, microseconds
    assert _one(rows, "latency_p99_seconds") == pytest.approx(2.9)
    assert _one(rows, "queue_time_p99_seconds") == pytest.approx(101e-6)
    named = scraper.rows_from_text(Target(url="http://triton-1:8002/metrics", model="llama-3.1-70b"),
                                   TRITON_TRTLLM, 1)
    assert named["model"] == ["llama-3.1-70b"] and _one(named, "requests_total") == 40
    table = qualified(store, SERVING_METRICS)
    assert store.insert(table, rows) == 1
    back = store.query(f"SELECT server, model, kv_cache_usage_ratio, latency_p99_seconds FROM {table}").rows
    assert back == [("triton", "tensorrt_llm", 0.4875, pytest.approx(2.9))]


def test_triton_older_backend_falls_back() -> None:
    rows = ServingMetricsScraper().rows_from_text(Target(url="http://h:8002/metrics"), TRITON_TRTLLM_OLD, 1)
    assert _one(rows, "kv_cache_usage_ratio") == pytest.approx(2000 / 8000)  # used / max
    assert _one(rows, "queue_length") == 3  # nv_inference_pending_request_count
    assert _one(rows, "running_requests") == 6
    assert math.isnan(_one(rows, "latency_p99_seconds"))  # counters only: no quantile made up


def test_llamacpp_server(store) -> None:
    target = Target(url="http://127.0.0.1:8080/metrics", model="qwen2.5-7b-instruct-q4_k_m")
    rows = ServingMetricsScraper().rows_from_text(target, llamacpp(processing=3, deferred=2), 1)
    assert rows["server"] == ["llamacpp"] and rows["model"] == ["qwen2.5-7b-instruct-q4_k_m"]
    assert _one(rows, "running_requests") == 3 and _one(rows, "queue_length") == 2
    assert math.isnan(_one(rows, "kv_cache_usage_ratio")) and math.isnan(_one(rows, "requests_total"))
    old = ServingMetricsScraper().rows_from_text(target, llamacpp(kv_ratio=0.62), 1)
    assert _one(old, "kv_cache_usage_ratio") == 0.62
    table = qualified(store, SERVING_METRICS)
    assert store.insert(table, old) == 1
    got = store.query(f"SELECT server, running_requests, {', '.join(NEW_COLUMNS)} FROM {table}").rows[0]
    # Not exposed: NaN (the query answers NaN as null), never 0.
    assert got[:2] == ("llamacpp", 3.0) and all(v is None or math.isnan(v) for v in got[2:])
