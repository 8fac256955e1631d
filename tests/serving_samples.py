"""Realistic ``/metrics`` expositions of serving engines for the scraper tests.

Every family name, label name, type and HELP text is taken from the engine's source (quoted per
sample); the VALUES are SYNTHETIC, chosen so the expected rows can be worked out by hand. Bucket
lists are abridged to a few of the engine's real bounds.
"""

from __future__ import annotations

import re

SGLANG_MODEL = "Qwen/Qwen2.5-72B-Instruct"


def _sglang_labels(dp: int, tp: int) -> str:
    # python/sglang/srt/managers/scheduler_metrics_mixin.py: labels = {model_name, engine_type, tp_rank,
    # pp_rank, moe_ep_rank} (+ dp_rank when data parallel), in that order.
    return (f'model_name="{SGLANG_MODEL}",engine_type="unified",tp_rank="{tp}",pp_rank="0",'
            f'moe_ep_rank="{tp}",dp_rank="{dp}"')


def sglang_tp4_dp2(queue_extra: dict[int, int] | None = None, retracted: dict[int, int] | None = None,
                   requests_total: int = 120) -> str:
    """SGLang ``--tp 4 --dp 2 --enable-metrics --enable-metrics-for-all-schedulers``: every scheduler (8 =
    2 DP groups x 4 TP ranks) reports its own series; the ranks of one DP group agree. Names from
    python/sglang/srt/metrics/collector.py (SchedulerMetricsCollector, TokenizerMetricsCollector).

    SYNTHETIC values: DP 0 has 3 queued / 10 running / token usage 0.5, DP 1 has 5 / 12 / 0.7;
    queue-time buckets per DP group are cumulative counts plus ``queue_extra[dp]`` added from le=1 (dp 0)
    or le=2 (dp 1) on.
    """
    extra = queue_extra or {0: 0, 1: 0}
    retracted = retracted or {0: 4, 1: 6}
    per_dp = {0: (3, 10, 0.5), 1: (5, 12, 0.7)}
    lines = ["# HELP sglang:num_running_reqs The number of running requests.",
             "# TYPE sglang:num_running_reqs gauge"]
    lines += [f"sglang:num_running_reqs{{{_sglang_labels(dp, tp)}}} {per_dp[dp][1]}.0"
              for dp in (0, 1) for tp in range(4)]
    lines += ["# HELP sglang:num_queue_reqs The number of requests in the waiting queue.",
              "# TYPE sglang:num_queue_reqs gauge"]
    lines += [f"sglang:num_queue_reqs{{{_sglang_labels(dp, tp)}}} {per_dp[dp][0]}.0"
              for dp in (0, 1) for tp in range(4)]
    lines += ["# HELP sglang:token_usage The token usage.", "# TYPE sglang:token_usage gauge"]
    lines += [f"sglang:token_usage{{{_sglang_labels(dp, tp)}}} {per_dp[dp][2]}"
              for dp in (0, 1) for tp in range(4)]
    lines += ["# HELP sglang:num_retracted_requests_total Total number of retracted requests.",
              "# TYPE sglang:num_retracted_requests_total counter"]
    lines += [f"sglang:num_retracted_requests_total{{{_sglang_labels(dp, tp)}}} {retracted[dp]}.0"
              for dp in (0, 1) for tp in range(4)]
    lines += ["# HELP sglang:queue_time_seconds Histogram of queueing time in seconds.",
              "# TYPE sglang:queue_time_seconds histogram"]
    start = {0: 1.0, 1: 2.0}
    for dp in (0, 1):
        for tp in range(4):
            for le in (0.0, 0.1, 0.5, 1.0, 2.0, 5.0, float("inf")):
                count = 100 + (extra[dp] if le >= start[dp] else 0)
                bound = "+Inf" if le == float("inf") else repr(le)
                lines.append(f'sglang:queue_time_seconds_bucket{{{_sglang_labels(dp, tp)},le="{bound}"}} {count}.0')
    # The tokenizer process has no rank labels: one series per model.
    lines += ["# HELP sglang:num_requests_total Number of requests processed.",
              "# TYPE sglang:num_requests_total counter",
              f'sglang:num_requests_total{{model_name="{SGLANG_MODEL}"}} {requests_total}.0']
    return "\n".join(lines) + "\n"


TRITON_TRTLLM = """\
# HELP nv_trt_llm_request_metrics TRT LLM request metrics
# TYPE nv_trt_llm_request_metrics gauge
nv_trt_llm_request_metrics{model="tensorrt_llm",request_type="waiting",version="1"} 1
nv_trt_llm_request_metrics{model="tensorrt_llm",request_type="context",version="1"} 1
nv_trt_llm_request_metrics{model="tensorrt_llm",request_type="scheduled",version="1"} 1
nv_trt_llm_request_metrics{model="tensorrt_llm",request_type="max",version="1"} 512
nv_trt_llm_request_metrics{model="tensorrt_llm",request_type="active",version="1"} 0
# HELP nv_trt_llm_kv_cache_block_metrics TRT LLM KV cache block metrics
# TYPE nv_trt_llm_kv_cache_block_metrics gauge
nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="fraction",model="tensorrt_llm",version="1"} 0.4875
nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="tokens_per",model="tensorrt_llm",version="1"} 64
nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="used",model="tensorrt_llm",version="1"} 1
nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="free",model="tensorrt_llm",version="1"} 6239
nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="max",model="tensorrt_llm",version="1"} 6239
# HELP nv_inference_request_success Number of successful inference requests, all batch sizes
# TYPE nv_inference_request_success counter
nv_inference_request_success{model="ensemble",version="1"} 40
nv_inference_request_success{model="preprocessing",version="1"} 40
nv_inference_request_success{model="tensorrt_llm",version="1"} 40
nv_inference_request_success{model="postprocessing",version="1"} 40
# HELP nv_inference_pending_request_count Instantaneous number of pending requests awaiting execution per-model.
# TYPE nv_inference_pending_request_count gauge
nv_inference_pending_request_count{model="ensemble",version="1"} 0
nv_inference_pending_request_count{model="tensorrt_llm",version="1"} 2
# HELP nv_inference_request_summary_us Summary of inference request duration in microseconds (includes cached requests)
# TYPE nv_inference_request_summary_us summary
nv_inference_request_summary_us_count{model="tensorrt_llm",version="1"} 40
nv_inference_request_summary_us_sum{model="tensorrt_llm",version="1"} 52000000
nv_inference_request_summary_us{model="tensorrt_llm",version="1",quantile="0.5"} 1200000
nv_inference_request_summary_us{model="tensorrt_llm",version="1",quantile="0.9"} 2100000
nv_inference_request_summary_us{model="tensorrt_llm",version="1",quantile="0.99"} 2900000
# HELP nv_inference_queue_summary_us Summary of inference queuing duration in microseconds (includes cached requests)
# TYPE nv_inference_queue_summary_us summary
nv_inference_queue_summary_us_count{model="tensorrt_llm",version="1"} 40
nv_inference_queue_summary_us_sum{model="tensorrt_llm",version="1"} 11110
nv_inference_queue_summary_us{model="tensorrt_llm",version="1",quantile="0.5"} 55
nv_inference_queue_summary_us{model="tensorrt_llm",version="1",quantile="0.99"} 101
"""
"""Triton + TensorRT-LLM backend: the nv_trt_llm_* lines as printed in the tensorrtllm_backend README
("Triton Metrics", inflight batcher model, Triton >= 23.11; values are the README's); base Triton
families and the summaries' format from triton-inference-server/server docs/user_guide/metrics.md
(``--metrics-config summary_latencies=true``), with an ensemble's four models. SYNTHETIC values:
request counts, pending counts and the summary quantiles."""

TRITON_TRTLLM_OLD = """\
# HELP nv_trt_llm_request_metrics TRT LLM request metrics
# TYPE nv_trt_llm_request_metrics gauge
nv_trt_llm_request_metrics{model="tensorrt_llm",request_type="context",version="1"} 1
nv_trt_llm_request_metrics{model="tensorrt_llm",request_type="scheduled",version="1"} 6
nv_trt_llm_request_metrics{model="tensorrt_llm",request_type="max",version="1"} 512
nv_trt_llm_request_metrics{model="tensorrt_llm",request_type="active",version="1"} 6
# HELP nv_trt_llm_kv_cache_block_metrics TRT LLM KV cache block metrics
# TYPE nv_trt_llm_kv_cache_block_metrics gauge
nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="max",model="tensorrt_llm",version="1"} 8000
nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="free",model="tensorrt_llm",version="1"} 6000
nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="used",model="tensorrt_llm",version="1"} 2000
nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="tokens_per",model="tensorrt_llm",version="1"} 64
# HELP nv_inference_pending_request_count Instantaneous number of pending requests awaiting execution per-model.
# TYPE nv_inference_pending_request_count gauge
nv_inference_pending_request_count{model="tensorrt_llm",version="1"} 3
"""
"""An older TensorRT-LLM backend (custom_metrics_reporter.cc before "waiting" and "fraction"):
request_labels_ {active, max, scheduled, context}, kv_cache_labels_ {max, free, used, tokens_per}.
SYNTHETIC values."""


def llamacpp(processing: int = 3, deferred: int = 2, kv_ratio: float | None = None) -> str:
    """llama-server ``--metrics``, printed as tools/server/server-context.cpp does (``# HELP llamacpp:<name>``,
    ``# TYPE``, the bare sample, no labels); ``kv_ratio``: builds that still exported
    ``llamacpp:kv_cache_usage_ratio`` (tools/server/server.cpp before mid-2025). SYNTHETIC values."""
    out = []
    families = [("counter", "prompt_tokens_total", "Number of prompt tokens processed.", 51234),
                ("counter", "prompt_seconds_total", "Prompt process time", 12.5),
                ("counter", "tokens_predicted_total", "Number of generation tokens processed.", 20480),
                ("counter", "tokens_predicted_seconds_total", "Predict process time", 410.25),
                ("counter", "n_decode_total", "Total number of llama_decode() calls", 20991),
                ("counter", "n_busy_slots_per_decode", "Average number of busy slots per llama_decode() call", 2.7),
                ("gauge", "prompt_tokens_seconds", "Average prompt throughput in tokens/s.", 4098.7),
                ("gauge", "predicted_tokens_seconds", "Average generation throughput in tokens/s.", 49.9)]
    if kv_ratio is not None:
        families.append(("gauge", "kv_cache_usage_ratio", "KV-cache usage. 1 means 100 percent usage.", kv_ratio))
    families += [("gauge", "requests_processing", "Number of requests processing.", processing),
                 ("gauge", "requests_deferred", "Number of requests deferred.", deferred)]
    for kind, name, help_text, value in families:
        out += [f"# HELP llamacpp:{name} {help_text}", f"# TYPE llamacpp:{name} {kind}", f"llamacpp:{name} {value}"]
    return "\n".join(out) + "\n"


def bump_buckets(text: str, family: str, engine: str, from_le: float, by: int) -> str:
    """``text`` with ``by`` added to every ``<family>_bucket`` of ``engine`` whose le >= ``from_le``
    (cumulative buckets: ``by`` observations between the previous bound and ``from_le``)."""
    pattern = re.compile(rf'^({re.escape(family)}_bucket\{{([^}}]*)\}}) (\S+)$')

    def fix(line: str) -> str:
        m = pattern.match(line)
        if not m or f'engine="{engine}"' not in m.group(2):
            return line
        le = re.search(r'le="([^"]+)"', m.group(2))
        assert le is not None
        bound = float("inf") if le.group(1) == "+Inf" else float(le.group(1))
        return f"{m.group(1)} {float(m.group(3)) + by}" if bound >= from_le else line

    return "\n".join(fix(line) for line in text.splitlines()) + "\n"
