"""Which ``/metrics`` families each serving engine exposes, and how they map to ``serving_metrics`` columns.

Names come from each engine's source (docs/run.md, "Serving engines"): vLLM
``vllm/v1/metrics/loggers.py`` (and V0 ``vllm/engine/metrics.py``), SGLang
``python/sglang/srt/metrics/collector.py``, TGI ``router/src``, Triton ``docs/user_guide/metrics.md``
with the TensorRT-LLM backend's ``custom_metrics_reporter.cc``, llama.cpp ``tools/server``.
For every field the first sample name present wins (engines renamed families across versions).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from triscope.errors import InputError
from triscope.prom_text import Series

GAUGE_SUM = "gauge_sum"
"""Summed over data-parallel shards (vLLM ``engine``, SGLang ``dp_rank``); one value across TP/PP ranks."""
GAUGE_MEAN = "gauge_mean"
"""A ratio: the mean over shards (KV-cache usage)."""
GAUGE_MAX = "gauge_max"
"""The worst shard (a quantile from a summary)."""
COUNTER = "counter"
"""Summed over shards (and over other labels such as ``finished_reason``)."""
HISTOGRAM = "histogram"
"""Cumulative buckets summed over shards; quantiles come from the change since the previous scrape."""
SLEEP = "vllm_sleep"
"""vLLM ``engine_sleep_state{sleep_state=awake|weights_offloaded|discard_all}`` -> 0 awake, 1 or 2 the sleep level."""

REPLICA_LABELS = ("tp_rank", "pp_rank", "moe_ep_rank")
"""Labels of ranks that mirror one scheduler (SGLang ``--enable-metrics-for-all-schedulers``): one value is taken."""


@dataclass(frozen=True)
class Field:
    """One figure: its kind, candidate sample names (histograms: the base name), a label filter and a unit scale."""

    kind: str
    names: tuple[str, ...]
    where: tuple[tuple[str, str], ...] = ()
    scale: float = 1.0


@dataclass(frozen=True)
class Engine:
    """How to read one engine: its fields by snapshot key, the labels naming the model, how to detect it."""

    name: str
    prefixes: tuple[str, ...]
    fields: dict[str, Field] = field(default_factory=dict)
    model_labels: tuple[str, ...] = ("model_name",)
    target_model_wins: bool = False
    """The model label names a repository entry (Triton's ``tensorrt_llm``): the target's ``model`` replaces it."""
    llm_prefix: str = ""
    """When set, only models with a series of this prefix are rows (not Triton's pre/post-processing models)."""


def _g(*names: str, where: tuple[tuple[str, str], ...] = (), kind: str = GAUGE_SUM, scale: float = 1.0) -> Field:
    return Field(kind, names, where, scale)


def _h(*names: str, scale: float = 1.0) -> Field:
    return Field(HISTOGRAM, names, (), scale)


def _c(*names: str) -> Field:
    return Field(COUNTER, names)


def _q(name: str, quantile: str, scale: float) -> Field:
    return Field(GAUGE_MAX, (name,), (("quantile", quantile),), scale)


_TRT_REQ = "nv_trt_llm_request_metrics"
_TRT_KV = "nv_trt_llm_kv_cache_block_metrics"

ENGINES: dict[str, Engine] = {
    "vllm": Engine("vllm", ("vllm:",), {
        "queue_length": _g("vllm:num_requests_waiting"),
        "running_requests": _g("vllm:num_requests_running"),
        "kv_cache_usage_ratio": _g("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", kind=GAUGE_MEAN),
        "requests_total": _c("vllm:request_success_total"),
        # V1 registers the counter as vllm:num_preemptions (exposed with _total); V0 named it num_preemptions_total.
        "preemptions_total": _c("vllm:num_preemptions_total", "vllm:num_preemptions"),
        "sleep_state": Field(SLEEP, ("vllm:engine_sleep_state",)),
        "waiting_capacity": _g("vllm:num_requests_waiting_by_reason", where=(("reason", "capacity"),)),
        "waiting_deferred": _g("vllm:num_requests_waiting_by_reason", where=(("reason", "deferred"),)),
        "swapped_requests": _g("vllm:num_requests_swapped"),
        "latency": _h("vllm:e2e_request_latency_seconds"),
        "ttft": _h("vllm:time_to_first_token_seconds"),
        "queue_time": _h("vllm:request_queue_time_seconds"),
        # inter_token_latency_seconds since 0.11; V0 and older V1 named it time_per_output_token_seconds.
        "itl": _h("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"),
        # Tokens, not requests; V1 before 0.10 named them gpu_prefix_cache_{queries,hits}.
        "prefix_cache_queries_total": _c("vllm:prefix_cache_queries_total", "vllm:gpu_prefix_cache_queries_total"),
        "prefix_cache_hits_total": _c("vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total"),
    }),
    "sglang": Engine("sglang", ("sglang:",), {
        "queue_length": _g("sglang:num_queue_reqs"),
        "running_requests": _g("sglang:num_running_reqs"),
        "kv_cache_usage_ratio": _g("sglang:token_usage", kind=GAUGE_MEAN),
        "requests_total": _c("sglang:num_requests_total"),
        # SGLang's preemption is a retraction (the request goes back to the queue and its KV is freed).
        "preemptions_total": _c("sglang:num_retracted_requests_total"),
        "latency": _h("sglang:e2e_request_latency_seconds"),
        "ttft": _h("sglang:time_to_first_token_seconds"),
        "queue_time": _h("sglang:queue_time_seconds"),
        "itl": _h("sglang:inter_token_latency_seconds"),
        # Every prompt token is looked up in the radix cache; cached_tokens sums its sources (device, host, storage).
        "prefix_cache_queries_total": _c("sglang:prompt_tokens_total"),
        "prefix_cache_hits_total": _c("sglang:cached_tokens_total"),
    }, model_labels=("model_name", "name")),
    "tgi": Engine("tgi", ("tgi_",), {
        "queue_length": _g("tgi_queue_size"),
        "running_requests": _g("tgi_batch_current_size"),
        "requests_total": _c("tgi_request_success", "tgi_request_success_total"),
        "latency": _h("tgi_request_duration"),
        "queue_time": _h("tgi_request_queue_duration"),
        # No ITL: tgi_request_mean_time_per_token_duration is a per-request mean that includes the prefill.
    }, model_labels=()),
    "triton": Engine("triton", ("nv_trt_llm_", "nv_inference_"), {
        # TensorRT-LLM backend (Triton >= 23.11; "waiting" and "fraction" in later releases).
        "queue_length": _g(_TRT_REQ, where=(("request_type", "waiting"),)),
        "running_requests": _g(_TRT_REQ, where=(("request_type", "scheduled"),)),
        "kv_cache_usage_ratio": _g(_TRT_KV, where=(("kv_cache_block_type", "fraction"),), kind=GAUGE_MEAN),
        "kv_used_blocks": _g(_TRT_KV, where=(("kv_cache_block_type", "used"),)),
        "kv_max_blocks": _g(_TRT_KV, where=(("kv_cache_block_type", "max"),)),
        "pending": _g("nv_inference_pending_request_count"),
        "requests_total": _c("nv_inference_request_success"),
        # Triton core: summaries in microseconds (--metrics-config summary_latencies=true), first-response
        # histogram in milliseconds (histogram_latencies=true); the default counters give no quantile.
        "latency_p50_seconds": _q("nv_inference_request_summary_us", "0.5", 1e-6),
        "latency_p99_seconds": _q("nv_inference_request_summary_us", "0.99", 1e-6),
        "queue_time_p99_seconds": _q("nv_inference_queue_summary_us", "0.99", 1e-6),
        "ttft": _h("nv_inference_first_response_histogram_ms", scale=1e-3),
    }, model_labels=("model",), target_model_wins=True, llm_prefix="nv_trt_llm_"),
    "llamacpp": Engine("llamacpp", ("llamacpp:",), {
        "queue_length": _g("llamacpp:requests_deferred"),
        "running_requests": _g("llamacpp:requests_processing"),
        "kv_cache_usage_ratio": _g("llamacpp:kv_cache_usage_ratio", kind=GAUGE_MEAN),  # builds before mid-2025
    }, model_labels=()),
}


def detect_server(series: Series, source: str = "metrics") -> str:
    """The engine whose sample names appear (in :data:`ENGINES` order); InputError when none does."""
    names = list(series)
    for engine in ENGINES.values():
        if any(n.startswith(engine.prefixes) for n in names):
            return engine.name
    raise InputError(f"{source}: no vLLM, SGLang or TGI metrics found, nor Triton / TensorRT-LLM or llama.cpp ones "
                     "(expected vllm:*, sglang:*, tgi_*, nv_trt_llm_* / nv_inference_* or llamacpp:* names)")


def first_present(series: Series, candidates: Iterable[str]) -> list[tuple[dict[str, str], float]]:
    """The samples of the first candidate name the exposition has."""
    for name in candidates:
        if name in series:
            return series[name]
    return []


__all__ = ["COUNTER", "ENGINES", "GAUGE_MAX", "GAUGE_MEAN", "GAUGE_SUM", "HISTOGRAM", "REPLICA_LABELS", "SLEEP",
           "Engine", "Field", "detect_server", "first_present"]
