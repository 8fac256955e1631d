"""10 s / 1 min rollups of GPU samples and engine metrics: rendered DDL (single node, ON CLUSTER) and
numbers equal to the raw table's on the embedded store."""

from __future__ import annotations

import math
import time

import numpy as np
import pytest

from triscope.schema import GPU_SAMPLES, qualified
from triscope.schema.gpu import GPU_GAUGES, GPU_SAMPLES_1M, GPU_SAMPLES_10S
from triscope.schema.requests import SERVING_METRICS_1M
from triscope.schema.rollup import add_gauge_sql, create_rollup_sql


def test_cluster_rollup_ddl_rolls_up_each_shard_into_its_local_table():
    local, dist, view, backfill = create_rollup_sql(GPU_SAMPLES_1M, "db", "c1")
    assert local.startswith("CREATE TABLE IF NOT EXISTS db.gpu_samples_1m_local ON CLUSTER `c1`")
    assert "ReplicatedAggregatingMergeTree('/clickhouse/tables/{shard}/{database}/gpu_samples_1m_local'" in local
    assert "`power_watts_max` SimpleAggregateFunction(max, Float64) CODEC(ZSTD(1))" in local
    assert "Distributed(`c1`, db, gpu_samples_1m_local, rand())" in dist
    assert view.startswith("CREATE MATERIALIZED VIEW IF NOT EXISTS db.gpu_samples_1m_mv ON CLUSTER `c1` "
                           "TO db.gpu_samples_1m_local AS SELECT ")
    assert view.endswith("FROM db.gpu_samples_local GROUP BY ts, `host`, `gpu`, `mig_instance`, `source`")
    assert backfill.startswith("INSERT INTO db.gpu_samples_1m (`ts`, `host`, `gpu`, `mig_instance`, `source`, "
                               "`memory_used_bytes_sum`, ") and "FROM db.gpu_samples GROUP BY" in backfill
    single = create_rollup_sql(SERVING_METRICS_1M, "db")
    assert [s.split(" (")[0].split(" AS ")[0] for s in single[:2]] == [
        "CREATE TABLE IF NOT EXISTS db.serving_metrics_1m",
        "CREATE MATERIALIZED VIEW IF NOT EXISTS db.serving_metrics_1m_mv TO db.serving_metrics_1m"]
    assert GPU_SAMPLES_1M.table.retention == "rollup" and GPU_SAMPLES_10S.table.name == "gpu_samples_10s"


def _raw(store, minutes: int = 3) -> int:
    """10 Hz samples of 2 GPUs over ``minutes`` whole minutes, some gauges NaN (unmeasured); Float32 gauges
    compare at float32 precision (the raw avg sums them as read, the rollup as Float64)."""
    rng = np.random.default_rng(5)
    t0 = (int(time.time()) // 3600 - 1) * 3600.0
    n = minutes * 600
    cols: dict[str, list] = {"ts": [], "host": [], "gpu": [], "source": []}
    for g in GPU_GAUGES:
        cols[g] = []
    for gpu in (0, 1):
        cols["ts"] += list(t0 + np.arange(n) / 10 + 0.0123)
        cols["host"] += ["h"] * n
        cols["gpu"] += [gpu] * n
        cols["source"] += ["nvml"] * n
        for g in GPU_GAUGES:
            v = rng.uniform(0, 100, n)
            v[rng.random(n) < 0.1] = math.nan
            cols[g] += list(v)
    return store.insert(qualified(store, GPU_SAMPLES), cols)


def _per_minute_raw(store) -> dict:
    sel = ", ".join(f"avgIf({g}, isFinite({g})), minIf({g}, isFinite({g})), maxIf({g}, isFinite({g}))"
                    for g in GPU_GAUGES)
    rows = store.query(f"SELECT toStartOfMinute(ts) AS m, gpu, {sel} FROM {qualified(store, GPU_SAMPLES)} "
                       "GROUP BY m, gpu ORDER BY m, gpu").rows
    return {(r[0], r[1]): r[2:] for r in rows}


def _per_minute_rollup(store, table: str) -> dict:
    sel = ", ".join(f"sum({g}_sum) / sum({g}_count), min({g}_min), max({g}_max)" for g in GPU_GAUGES)
    rows = store.query(f"SELECT toStartOfMinute(ts) AS m, gpu, {sel} FROM {store.database}.{table} "
                       "GROUP BY m, gpu ORDER BY m, gpu").rows
    return {(r[0], r[1]): r[2:] for r in rows}


def test_rollups_equal_raw_within_their_resolution(store):
    assert _raw(store) == 2 * 3 * 600
    store.command(f"OPTIMIZE TABLE {store.database}.gpu_samples_10s FINAL")
    raw = _per_minute_raw(store)
    assert len(raw) == 6
    for table in ("gpu_samples_10s", "gpu_samples_1m"):
        rolled = _per_minute_rollup(store, table)
        assert rolled.keys() == raw.keys()
        for key, values in raw.items():
            assert rolled[key] == pytest.approx(values, rel=1e-6), (table, key)
    # a store that had rows before its rollup existed gets them from the migration's backfill
    store.command(f"DROP VIEW {store.database}.gpu_samples_1m_mv")
    store.command(f"DROP TABLE {store.database}.gpu_samples_1m")
    for sql in create_rollup_sql(GPU_SAMPLES_1M, store.database):
        store.command(sql)
    rolled = _per_minute_rollup(store, "gpu_samples_1m")
    for key, values in raw.items():
        assert rolled[key] == pytest.approx(values, rel=1e-6)


def test_a_gauge_added_later_renders_its_columns_view_and_backfill():
    old = create_rollup_sql(GPU_SAMPLES_1M, "db", "", version=6)
    assert "l2_bandwidth_ratio" not in " ".join(old) and "dram_active_ratio_max" in old[0]
    steps = add_gauge_sql(GPU_SAMPLES_1M, 9, "db", "c1")
    assert steps[0] == ("ALTER TABLE db.gpu_samples_1m_local ON CLUSTER `c1` ADD COLUMN IF NOT EXISTS "
                        "`l2_bandwidth_ratio_sum` SimpleAggregateFunction(sum, Float64) "
                        "COMMENT 'sum of finite l2_bandwidth_ratio' CODEC(ZSTD(1))")
    assert "`l2_bandwidth_ratio_min` SimpleAggregateFunction(min, Float64) DEFAULT inf CODEC" in steps[4]
    assert len(steps) == 4 * 2 + 3 and steps[8] == "DROP VIEW IF EXISTS db.gpu_samples_1m_mv ON CLUSTER `c1`"
    assert steps[9].startswith("CREATE MATERIALIZED VIEW IF NOT EXISTS db.gpu_samples_1m_mv ON CLUSTER `c1` TO "
                               "db.gpu_samples_1m_local AS SELECT ") and "`l2_bandwidth_ratio_max`" in steps[9]
    # the backfill fills the new gauge and leaves the others' aggregates untouched (neutral values)
    assert "toUInt64(0) AS `power_watts_count`, inf AS `power_watts_min`, -inf AS `power_watts_max`" in steps[10]
    assert "sumIf(toFloat64(`l2_bandwidth_ratio`), isFinite(`l2_bandwidth_ratio`))" in steps[10]
    with pytest.raises(ValueError, match="no gauge added at version 8"):
        add_gauge_sql(GPU_SAMPLES_1M, 8, "db")


def test_a_rollup_created_before_a_gauge_gets_it_from_the_migration(store):
    """A store whose 1 min rollup predates the L2 gauge (domain version 6) and holds rows: the step
    adding the gauge backfills it and keeps every other gauge's numbers; new rows reach all of them."""
    assert _raw(store, minutes=2) == 2 * 2 * 600
    store.command(f"DROP VIEW {store.database}.gpu_samples_1m_mv")
    store.command(f"DROP TABLE {store.database}.gpu_samples_1m")
    for sql in create_rollup_sql(GPU_SAMPLES_1M, store.database, version=6):
        store.command(sql)
    columns = {r[0] for r in store.query(f"DESCRIBE TABLE {store.database}.gpu_samples_1m").rows}
    assert "l2_bandwidth_ratio_sum" not in columns and "power_watts_sum" in columns
    for sql in add_gauge_sql(GPU_SAMPLES_1M, 9, store.database):
        store.command(sql)
    _raw(store, minutes=1)  # through the replaced view: same minutes, so the buckets merge with the backfill
    raw = _per_minute_raw(store)
    rolled = _per_minute_rollup(store, "gpu_samples_1m")
    assert rolled.keys() == raw.keys() and len(raw) == 4
    for key, values in raw.items():
        assert rolled[key] == pytest.approx(values, rel=1e-6), key
