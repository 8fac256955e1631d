"""Routing-weight history: one row per backend per engine update of the weight feed."""

from triscope.schema.model import Column, Migration, Table, create_tables, set_codecs

DOMAIN = "weights"

WEIGHTS_HISTORY = Table(
    name="weights_history",
    columns=[
        Column("ts", "DateTime64(9, 'UTC')", "engine update time", codec="Delta, ZSTD(1)"),
        Column("backend", "LowCardinality(String)"),
        Column("weight", "Float64", "damped weight 0..1 (0 = drained)", codec="ZSTD(3)"),
        Column("target", "Float64", "undamped target 0..1", codec="Gorilla, ZSTD(1)"),
        Column("lb_weight", "UInt32", "integer weight published to load balancers", codec="T64, ZSTD(1)"),
        Column("state", "LowCardinality(String)", "ready, drain or down"),
        Column("reasons", "String", "comma-separated drain / down / stale reasons"),
        Column("factor_memory", "Float64"),
        Column("factor_kv_cache", "Float64", codec="Gorilla, ZSTD(1)"),
        Column("factor_load", "Float64", codec="Gorilla, ZSTD(1)"),
        Column("factor_latency", "Float64"),
        Column("memory_used_ratio", "Float64", codec="Gorilla, ZSTD(1)"),
        Column("kv_cache_usage_ratio", "Float64"),
        Column("qps", "Float64"),
        Column("input_age_seconds", "Float64", codec="Gorilla, ZSTD(1)"),
        Column("stale", "UInt8", "1 when the fleet fell back to equal weights (no backend had fresh inputs)"),
        Column("version", "UInt64", "published weights version", codec="DoubleDelta, ZSTD(1)"),
    ],
    order_by="backend, ts",
    partition_by="toYYYYMMDD(ts)",
    retention="raw",
    codec="ZSTD(1)",
)

MIGRATIONS = [
    Migration(1, "weights history", create_tables(WEIGHTS_HISTORY)),
    Migration(2, "weights history: per-column codecs", set_codecs(WEIGHTS_HISTORY)),
]
