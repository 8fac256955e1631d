"""Newest-row tables, the last hours by time and time-sorted projections (``triscope.schema.latest``):
rendered DDL (single node, ON CLUSTER), rows equal to the raw table's newest row per key on the embedded
store (chDB), whatever order the rows arrive in, backfilled for rows stored before, and a window query
reading the last hours' table."""

from __future__ import annotations

import math
import re
import time
from typing import Any

import numpy as np
import pytest

from triscope.schema import REQUESTS, SCRAPE_HEALTH, SERVING_METRICS, encode_ts, qualified
from triscope.schema.gpu import GPU_LATEST
from triscope.schema.latest import Recent, add_projection_sql, create_latest_sql, create_recent_sql, replace_projections
from triscope.schema.requests import (
    REQUESTS_BY_TIME,
    REQUESTS_RECENT,
    SCRAPES_LATEST,
    SERVING_BY_TIME,
    SERVING_LATEST,
    SERVING_RECENT,
)

NOW = float(int(time.time()))


def test_cluster_ddl_keeps_each_shards_newest_rows_and_projection_on_its_local_table() -> None:
    local, dist, view, backfill = create_latest_sql(GPU_LATEST, "db", "c1")
    assert local.startswith("CREATE TABLE IF NOT EXISTS db.gpu_samples_latest_local ON CLUSTER `c1`")
    assert "ReplicatedAggregatingMergeTree('/clickhouse/tables/{shard}/{database}/gpu_samples_latest_local'" in local
    assert "`memory_used_bytes` AggregateFunction(argMax, Float64, DateTime64(9, 'UTC'))" in local
    assert "ORDER BY (host, gpu)" in local and "PARTITION BY toYYYYMMDD(ts)" in local
    assert "Distributed(`c1`, db, gpu_samples_latest_local, rand())" in dist
    assert view.startswith("CREATE MATERIALIZED VIEW IF NOT EXISTS db.gpu_samples_latest_mv ON CLUSTER `c1` "
                           "TO db.gpu_samples_latest_local AS SELECT ")
    assert "FROM db.gpu_samples_local) GROUP BY `host`, `gpu`" in view
    assert backfill.startswith("INSERT INTO db.gpu_samples_latest SELECT ") and "FROM db.gpu_samples)" in backfill
    add, build = add_projection_sql(REQUESTS_BY_TIME, "db", "c1")
    assert add.startswith("ALTER TABLE db.requests_local ON CLUSTER `c1` ADD PROJECTION IF NOT EXISTS by_time "
                          "(SELECT `ts`, `backend`")
    assert add.endswith("ORDER BY ts)") and build == "ALTER TABLE db.requests_local ON CLUSTER `c1` " \
                                                     "MATERIALIZE PROJECTION by_time"
    assert [s.split(" (")[0] for s in create_latest_sql(SERVING_LATEST, "db")[:1]] == [
        "CREATE TABLE IF NOT EXISTS db.serving_metrics_latest"]
    assert add_projection_sql(REQUESTS_BY_TIME, "db")[0].startswith("ALTER TABLE db.requests ADD PROJECTION")
    local, dist, view, backfill = create_recent_sql(SERVING_RECENT, "db", "c1")
    assert local.startswith("CREATE TABLE IF NOT EXISTS db.serving_metrics_recent_local ON CLUSTER `c1`")
    assert "ReplicatedMergeTree('/clickhouse/tables/{shard}/{database}/serving_metrics_recent_local'" in local
    assert "PARTITION BY toStartOfHour(ts)\nORDER BY (ts)\nTTL toDateTime(ts) + toIntervalHour(2)" in local
    assert "ttl_only_drop_parts = 1" in local and "`requests_total` Float64" in local and "CODEC(" in local
    assert "Distributed(`c1`, db, serving_metrics_recent_local, rand())" in dist
    assert view == ("CREATE MATERIALIZED VIEW IF NOT EXISTS db.serving_metrics_recent_mv ON CLUSTER `c1` TO "
                    "db.serving_metrics_recent_local AS SELECT `ts`, `backend`, `requests_total`, "
                    "`preemptions_total` FROM db.serving_metrics_local")
    assert "FROM db.serving_metrics WHERE ts >= now() - toIntervalHour(2) AND ts < (SELECT " in backfill
    assert REQUESTS_RECENT.covers(NOW - 3600, NOW) and not REQUESTS_RECENT.covers(NOW - 3601, NOW)
    for bad in (("ts", "nope"), ("backend",)):
        with pytest.raises(ValueError, match="no column"):
            Recent(REQUESTS, bad)
    with pytest.raises(ValueError, match="whole hours"):
        Recent(REQUESTS, ("ts",), held_s=3600)


def _insert(store: Any, table: Any, rows: list[dict[str, Any]]) -> None:
    for r in rows:
        r["ts"] = encode_ts(int(round(r["ts"] * 1e9)))
    store.insert(qualified(store, table), table.columns_of(rows))


def _newest(store: Any) -> tuple[dict, dict, dict, dict]:
    """(from the latest tables, from the raw rows) of the serving gauges and the scrape outcomes per key."""
    db = store.database
    q = lambda sql: dict(sorted((r[0], tuple(r[1:])) for r in store.query(sql).rows))  # noqa: E731
    serving = ("SELECT backend, toUnixTimestamp64Nano({t}), {f}(kv_cache_usage_ratio{a}), {f}(sleep_state{a}) "
               "FROM {db}.{table} GROUP BY backend")
    scrapes = ("SELECT concat(backend, ' ', target), toUnixTimestamp64Nano({t}), {f}(up{a}), {f}(error{a}), "
               "toUnixTimestamp64Nano({ok}) FROM {db}.{table} GROUP BY backend, target")
    latest = {"f": "argMaxMerge", "a": "", "t": "max(ts)", "db": db}
    raw = {"f": "argMax", "a": ", ts", "t": "max(ts)", "db": db}
    return (q(serving.format(table="serving_metrics_latest", **latest)),
            q(serving.format(table="serving_metrics", **raw)),
            q(scrapes.format(table="scrape_health_latest", ok="max(ok_ts)", **latest)),
            q(scrapes.format(table="scrape_health", ok="maxIf(ts, up = 1)", **raw)))


def test_latest_rows_are_the_raw_newest_row_per_key_in_any_arrival_order(store: Any) -> None:
    rng = np.random.default_rng(3)
    serving = [{"ts": NOW - 100 + t + i / 10, "backend": f"b{i}", "kv_cache_usage_ratio": float(rng.uniform()),
                "sleep_state": math.nan if t % 7 == 0 or (i % 4, t) == (0, 99) else float(t % 2)}
               for i in range(20) for t in range(100)]
    scrapes = [{"ts": NOW - 100 + t + i / 10, "backend": f"b{i % 5}", "target": f"http://b{i % 5}/{i}",
                "up": int(rng.random() < 0.7 or i == 3), "error": f"e{t}"} for i in range(10) for t in range(100)]
    scrapes = [r for r in scrapes if not (r["target"].endswith("/4") and r["up"])]  # a target never answered
    for rows, table in ((serving, SERVING_METRICS), (scrapes, SCRAPE_HEALTH)):
        order = rng.permutation(len(rows))  # a key's newest row comes in any of the inserts
        for part in np.array_split(order, 4):
            _insert(store, table, [dict(rows[j]) for j in part])
    s_latest, s_raw, h_latest, h_raw = _newest(store)
    assert len(s_raw) == 20 and len(h_raw) == 10
    assert repr(s_latest) == repr(s_raw) and repr(h_latest) == repr(h_raw)
    assert any(v[2] is None or math.isnan(v[2]) for v in s_raw.values()) and h_raw["b4 http://b4/4"][3] == 0
    # a store that held rows before the migration gets them from its backfill
    for latest in (SERVING_LATEST, SCRAPES_LATEST):
        store.command(f"DROP VIEW {store.database}.{latest.table.name}_mv")
        store.command(f"DROP TABLE {store.database}.{latest.table.name}")
        for sql in create_latest_sql(latest, store.database):
            store.command(sql)
    assert repr(_newest(store)) == repr((s_latest, s_raw, h_latest, h_raw))


def test_a_window_query_reads_the_last_hours_table_only(store: Any) -> None:
    """200 backends, 300 spans each over 300 s: sorted by backend, every granule of the raw table holds the
    window's spans of some backend; in the last hours' table, sorted by time, only the window's granules
    do, and they hold the same rows. No projection is left on the raw tables."""
    rng = np.random.default_rng(4)
    _insert(store, REQUESTS, [{"ts": float(t), "backend": f"10.0.{i // 256}.{i % 256}:8000", "request_class": "c",
                               "latency_seconds": float(rng.lognormal(-1, 0.5)), "status": "ok"}
                              for i in range(200) for t in NOW - 300 + np.sort(rng.uniform(0, 300, 300))])
    store.command(f"OPTIMIZE TABLE {qualified(store, REQUESTS_RECENT.table)} FINAL")
    sql = ("SELECT backend, count(), quantileExact(0.99)(latency_seconds) FROM {table} "
           "WHERE ts >= fromUnixTimestamp64Nano({wstart:Int64}) AND ts <= fromUnixTimestamp64Nano({until:Int64}) "
           "GROUP BY backend ORDER BY backend")
    p = {"wstart": int((NOW - 10) * 1e9), "until": int(NOW * 1e9)}
    read = {}
    for table in (REQUESTS, REQUESTS_RECENT.table):
        q = sql.replace("{table}", qualified(store, table))
        plan = "\n".join(r[0] for r in store.query(f"EXPLAIN indexes = 1 {q}", p).rows)
        read[table.name] = [int(x.split("/")[0]) for x in re.findall(r"Granules: (\d+/\d+)", plan)][-1]
        rows = store.query(q, p).rows
        assert len(rows) > 150 and repr(rows) == repr(read.get("rows", rows))
        read["rows"] = rows
    assert read["requests_recent"] <= 2 < read["requests"], read
    for table in (REQUESTS, SERVING_METRICS):
        assert "PROJECTION" not in store.query(f"SHOW CREATE TABLE {qualified(store, table)}").rows[0][0]


def test_the_last_hours_table_drops_what_is_past_its_hours(store: Any) -> None:
    """Rows 1 and 5 hours old in both tables: once merged, the last hours' table keeps the recent ones
    only (a partition wholly past its 2 hours goes), the raw table keeps both."""
    _insert(store, SERVING_METRICS, [{"ts": NOW - age, "backend": f"b{i}", "requests_total": float(i)}
                                     for age in (3600.0, 5 * 3600.0) for i in range(50)])
    recent, raw = qualified(store, SERVING_RECENT.table), qualified(store, SERVING_METRICS)
    store.command(f"OPTIMIZE TABLE {recent} FINAL")
    old = f"ts < fromUnixTimestamp64Nano({int((NOW - 2 * 3600) * 1e9)})"
    assert store.query(f"SELECT countIf({old}), count() FROM {recent}").rows[0] == (0, 50)
    assert store.query(f"SELECT countIf({old}), count() FROM {raw}").rows[0] == (50, 100)


def test_a_store_with_the_projections_loses_them_and_keeps_its_recent_rows(store: Any) -> None:
    """A store made before the last-hours tables: the projections on both raw tables, rows of the last
    hour stored. The migration's statements (run twice: migrations are idempotent) drop the projections
    and leave the last-hours tables holding those rows (their backfill) once."""
    for projection in (SERVING_BY_TIME, REQUESTS_BY_TIME):
        for sql in add_projection_sql(projection, store.database):
            store.command(sql)
    for recent in (SERVING_RECENT, REQUESTS_RECENT):
        store.command(f"DROP VIEW {store.database}.{recent.table.name}_mv")
        store.command(f"DROP TABLE {store.database}.{recent.table.name}")
    _insert(store, SERVING_METRICS, [{"ts": NOW - 600 + t, "backend": "b", "requests_total": float(t)}
                                     for t in range(100)])
    raw = qualified(store, SERVING_METRICS)
    assert "PROJECTION by_time" in store.query(f"SHOW CREATE TABLE {raw}").rows[0][0]
    migration = replace_projections((SERVING_BY_TIME, SERVING_RECENT), (REQUESTS_BY_TIME, REQUESTS_RECENT))
    for sql in migration(store.database, "") * 2:
        store.command(sql)
    for table in (SERVING_METRICS, REQUESTS):
        assert "PROJECTION" not in store.query(f"SHOW CREATE TABLE {qualified(store, table)}").rows[0][0]
    recent = qualified(store, SERVING_RECENT.table)
    assert store.query(f"SELECT count(), sum(requests_total) FROM {recent}").rows[0] == (100, 4950.0)
