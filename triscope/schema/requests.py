"""Request spans (OTLP / in-process exporter) and serving-engine metrics (vLLM, SGLang, TGI)."""

from triscope.schema.latest import Latest, Projection, Recent, add_projections, create_latest, replace_projections
from triscope.schema.model import (
    Column,
    Migration,
    Table,
    add_columns,
    create_tables,
    set_codecs,
    set_types,
)
from triscope.schema.rollup import Rollup, create_rollups

DOMAIN = "requests"

REQUESTS = Table(
    name="requests",
    columns=[
        Column("ts", "DateTime64(9, 'UTC')", "span start", codec="Delta, ZSTD(1)"),
        Column("host", "LowCardinality(String)"),
        Column("backend", "LowCardinality(String)",
               "serving instance: address:port from span attributes (never service.instance.id)"),
        Column("gpu", "LowCardinality(String)", "GPU index/uuid serving it when known"),
        Column("model", "LowCardinality(String)", "gen_ai.request.model / response model"),
        Column("model_version", "LowCardinality(String)"),
        Column("modality", "LowCardinality(String)", "text, image, audio, video, speech, mixed"),
        Column("request_class", "LowCardinality(String)",
               "e.g. realtime_speech, interactive_image_text, offline_video"),
        Column("request_id", "String", "gen_ai.request.id"),
        Column("trace_id", "String"),
        Column("span_id", "String"),
        Column("span_name", "LowCardinality(String)"),
        Column("latency_seconds", "Float64", "end-to-end"),
        Column("ttft_seconds", "Float64", "time to first token", codec="Gorilla, ZSTD(1)"),
        Column("queue_seconds", "Float64", "time in queue", codec="Gorilla, ZSTD(1)"),
        Column("prefill_seconds", "Float64", codec="Gorilla, ZSTD(1)"),
        Column("decode_seconds", "Float64"),
        Column("prompt_tokens", "UInt32", codec="T64, ZSTD(1)"),
        Column("completion_tokens", "UInt32", codec="T64, ZSTD(1)"),
        Column("image_pixels", "UInt64", "width*height of the input image(s), 0 when none", codec="T64, ZSTD(1)"),
        Column("input_resolution", "LowCardinality(String)", "e.g. 1024x768"),
        Column("status", "LowCardinality(String)", "ok or error"),
        Column("service_name", "LowCardinality(String)", "resource service.name", since=2),
        Column("operation", "LowCardinality(String)", "gen_ai.operation.name, e.g. chat, embeddings", since=2),
    ],
    order_by="backend, ts",
    partition_by="toYYYYMMDD(ts)",
    retention="raw",
    codec="ZSTD(1)",
)

QUANTILE_NOTE = ("interpolated within a histogram bucket, so far coarser than Float32's 7 significant digits "
                 "(half the bytes of a Float64, docs/scaling.md)")

SERVING_METRICS = Table(
    name="serving_metrics",
    columns=[
        Column("ts", "DateTime64(9, 'UTC')", codec="Delta, ZSTD(1)"),
        Column("host", "LowCardinality(String)"),
        Column("backend", "LowCardinality(String)", "the scraped instance"),
        Column("server", "LowCardinality(String)", "vllm, sglang, tgi, triton, llamacpp"),
        Column("model", "LowCardinality(String)"),
        Column("queue_length", "Float64", "requests waiting"),
        Column("running_requests", "Float64"),
        Column("kv_cache_usage_ratio", "Float32", "0..1 (a multiple of 1 / KV blocks: Float32 holds it to 6e-8)"),
        Column("requests_total", "Float64", "finished requests counter", codec="Gorilla, ZSTD(1)"),
        Column("latency_p50_seconds", "Float32", "from histogram deltas since the last scrape; " + QUANTILE_NOTE),
        Column("latency_p99_seconds", "Float32", QUANTILE_NOTE),
        Column("ttft_p99_seconds", "Float32", QUANTILE_NOTE),
        Column("preemptions_total", "Float64", "engine preemptions counter (vllm:num_preemptions); NaN when unknown",
               since=3, codec="Gorilla, ZSTD(1)"),
        Column("sleep_state", "Float64", "vllm:engine_sleep_state: 0 awake, > 0 sleeping (level); NaN when unknown",
               since=3),
        Column("waiting_capacity", "Float64",
               "requests waiting, not deferred: no batch slot, token budget or KV yet "
               "(vllm:num_requests_waiting_by_reason{reason=capacity})", since=3),
        Column("waiting_deferred", "Float64",
               "requests deferred by the scheduler (vllm:num_requests_waiting_by_reason{reason=deferred})", since=3),
        Column("swapped_requests", "Float64", "V0 vllm:num_requests_swapped; NaN when unknown", since=3),
        Column("queue_time_p99_seconds", "Float32", "from the queue-time histogram's deltas since the last scrape",
               since=3),
        Column("itl_p99_seconds", "Float32", "inter-token latency P99 from histogram deltas since the last scrape",
               since=3),
        Column("prefix_cache_queries_total", "Float64",
               "prompt tokens looked up in the engine's prefix cache (counter: vllm:prefix_cache_queries, "
               "sglang:prompt_tokens); NaN when unknown", since=5),
        Column("prefix_cache_hits_total", "Float64",
               "of those, tokens found cached (counter: vllm:prefix_cache_hits, sglang:cached_tokens); "
               "NaN when unknown", since=5),
    ],
    order_by="backend, ts",
    partition_by="toYYYYMMDD(ts)",
    retention="raw",
    codec="ZSTD(1)",
)

SCRAPE_HEALTH = Table(
    name="scrape_health",
    columns=[
        Column("ts", "DateTime64(9, 'UTC')", "when the scrape started", since=4, codec="Delta, ZSTD(1)"),
        Column("host", "LowCardinality(String)", since=4),
        Column("backend", "LowCardinality(String)", "the scraped instance, as in serving_metrics.backend", since=4),
        Column("target", "String", "the scraped URL", since=4),
        Column("up", "UInt8", "1: the scrape answered and parsed (Prometheus' synthetic up); 0: it failed", since=4),
        Column("error", "String", "one line naming the failure; empty when up", since=4),
        Column("duration_seconds", "Float64", "time to the answer or the failure", since=4),
    ],
    order_by="backend, ts",
    partition_by="toYYYYMMDD(ts)",
    retention="raw",
    codec="ZSTD(1)",
)

SERVING_GAUGES = ("queue_length", "running_requests", "kv_cache_usage_ratio", "waiting_capacity",
                  "latency_p50_seconds", "latency_p99_seconds", "ttft_p99_seconds", "itl_p99_seconds")
SERVING_KEYS = ("backend", "host", "model")
SERVING_METRICS_10S = Rollup(SERVING_METRICS, 10, SERVING_KEYS, SERVING_GAUGES)
SERVING_METRICS_1M = Rollup(SERVING_METRICS, 60, SERVING_KEYS, SERVING_GAUGES)

SERVING_LATEST = Latest(SERVING_METRICS, ("backend",), ("kv_cache_usage_ratio", "latency_p99_seconds", "sleep_state"))
"""Each engine's newest gauges: what the weight engine takes as its latest values."""
SCRAPES_LATEST = Latest(SCRAPE_HEALTH, ("backend", "target"), ("up", "error"), {"ok_ts": "up = 1"})
"""Each scrape target's newest outcome and the time of its newest answered scrape."""
REQUESTS_LATEST = Latest(REQUESTS, ("backend", "host", "gpu"))
"""The time of each backend's newest span per GPU it names: the backends and GPUs of a look-back."""
SERVING_BY_TIME = Projection(SERVING_METRICS, "by_time", ("ts", "backend", "requests_total", "preemptions_total"))
"""The counters the weight engine reads over its window and preemption look-back, sorted by time."""
REQUESTS_BY_TIME = Projection(REQUESTS, "by_time", ("ts", "backend", "request_class", "latency_seconds", "status"))
"""What the weight engine reads of the spans in its window, sorted by time."""
SERVING_RECENT = Recent(SERVING_METRICS, SERVING_BY_TIME.columns)
"""The counters the weight engine reads over its window and preemption look-back: the last hours, by time."""
REQUESTS_RECENT = Recent(REQUESTS, REQUESTS_BY_TIME.columns)
"""What the weight engine reads of the spans in its window: the last hours, by time."""


MIGRATIONS = [
    Migration(1, "requests and serving metrics", create_tables(REQUESTS, SERVING_METRICS, version=1)),
    Migration(2, "requests: service name and gen_ai operation", add_columns(REQUESTS, 2)),
    Migration(3, "serving metrics: preemptions, sleep state, waiting by reason, swapped, queue time, ITL",
              add_columns(SERVING_METRICS, 3)),
    Migration(4, "scrape health: one row per target and scrape, failed ones included",
              create_tables(SCRAPE_HEALTH, version=4)),
    Migration(5, "serving metrics: prefix-cache queries and hits", add_columns(SERVING_METRICS, 5)),
    Migration(6, "requests, serving metrics, scrape health: per-column codecs (Delta timestamps, ZSTD, T64 tokens)",
              set_codecs(REQUESTS, SERVING_METRICS, SCRAPE_HEALTH)),
    Migration(7, "serving metrics: 10 s and 1 min rollups (materialized views, backfilled)",
              create_rollups(SERVING_METRICS_10S, SERVING_METRICS_1M, version=7)),
    Migration(8, "serving metrics: KV usage and histogram quantiles as Float32",
              set_types(SERVING_METRICS, "kv_cache_usage_ratio", "latency_p50_seconds", "latency_p99_seconds",
                        "ttft_p99_seconds", "queue_time_p99_seconds", "itl_p99_seconds")),
    Migration(9, "serving metrics, scrape health, requests: newest row per key (materialized views, backfilled)",
              create_latest(SERVING_LATEST, SCRAPES_LATEST, REQUESTS_LATEST)),
    Migration(10, "serving metrics, requests: the weight engine's window columns sorted by time (projections)",
              add_projections(SERVING_BY_TIME, REQUESTS_BY_TIME)),
    Migration(11, "serving metrics, requests: the window columns of the last hours in tables of their own "
                  "(materialized views), replacing the projections that copied the whole history",
              replace_projections((SERVING_BY_TIME, SERVING_RECENT), (REQUESTS_BY_TIME, REQUESTS_RECENT))),
]
