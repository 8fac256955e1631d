"""Routing-weight history: one row per backend per engine update of the weight feed."""

from triscope.schema.model import Column, Migration, Table, create_tables

DOMAIN = "weights"

WEIGHTS_HISTORY = Table(
    name="weights_history",
    columns=[
        Column("ts", "DateTime64(9, 'UTC')", "engine update time"),
        Column("backend", "LowCardinality(String)"),
        Column("weight", "Float64", "damped weight 0..1 (0 = drained)"),
        Column("target", "Float64", "undamped target 0..1"),
        Column("lb_weight", "UInt32", "integer weight published to load balancers"),
        Column("state", "LowCardinality(String)", "ready, drain or down"),
        Column("reasons", "String", "comma-separated drain / down / stale reasons"),
        Column("factor_memory", "Float64"),
        Column("factor_kv_cache", "Float64"),
        Column("factor_load", "Float64"),
        Column("factor_latency", "Float64"),
        Column("memory_used_ratio", "Float64"),
        Column("kv_cache_usage_ratio", "Float64"),
        Column("qps", "Float64"),
        Column("input_age_seconds", "Float64"),
        Column("stale", "UInt8", "1 when the fleet fell back to equal weights (no backend had fresh inputs)"),
        Column("version", "UInt64", "published weights version"),
    ],
    order_by="backend, ts",
    partition_by="toYYYYMMDD(ts)",
    retention="raw",
)

MIGRATIONS = [Migration(1, "weights history", create_tables(WEIGHTS_HISTORY))]
