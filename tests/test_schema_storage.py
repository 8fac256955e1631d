"""Column codecs and [store] retention: rendered DDL (single node and ON CLUSTER) and its effect on chDB."""

from __future__ import annotations

import os
import time

import pytest

from triscope.errors import ConfigError
from triscope.schema import domains, qualified
from triscope.schema.model import (
    Column,
    Table,
    add_column_sql,
    apply_retention,
    create_table_sql,
    modify_codec_sql,
    retention_sql,
    set_codecs,
    set_types,
)
from triscope.store import StoreConfig

TS = Column("ts", "DateTime64(9, 'UTC')", "it's the time", codec="DoubleDelta, ZSTD(1)")
GAUGE = Column("v", "Float32", codec="Gorilla, ZSTD(1)")
PLAIN = Column("n", "UInt16")
SERIES = Table("series_check", [TS, GAUGE, PLAIN], order_by="ts", partition_by="toYYYYMMDD(ts)", retention="raw")


def test_codec_renders_after_the_comment_and_only_when_set():
    assert TS.ddl() == "`ts` DateTime64(9, 'UTC') COMMENT 'it\\'s the time' CODEC(DoubleDelta, ZSTD(1))"
    assert TS.ddl(codec=False) == "`ts` DateTime64(9, 'UTC') COMMENT 'it\\'s the time'"
    assert PLAIN.ddl() == "`n` UInt16"


def test_cluster_ddl_carries_codecs_on_the_local_table():
    local, dist = create_table_sql(SERIES, "db", cluster="c1")
    assert "CODEC(DoubleDelta, ZSTD(1))" in local and "CODEC(Gorilla, ZSTD(1))" in local
    assert dist.startswith("CREATE TABLE IF NOT EXISTS db.series_check ON CLUSTER `c1` AS db.series_check_local")
    to_local, to_dist = add_column_sql("series_check", GAUGE, "db", cluster="c1")
    assert to_local.startswith("ALTER TABLE db.series_check_local ON CLUSTER `c1` ADD COLUMN IF NOT EXISTS")
    assert "CODEC(Gorilla, ZSTD(1))" in to_local and "CODEC" not in to_dist
    assert modify_codec_sql("series_check", GAUGE, "db", cluster="c1") == [
        "ALTER TABLE db.series_check_local ON CLUSTER `c1` MODIFY COLUMN `v` Float32 CODEC(Gorilla, ZSTD(1))"]
    assert modify_codec_sql("series_check", PLAIN, "db") == [
        "ALTER TABLE db.series_check MODIFY COLUMN `n` UInt16 CODEC(Default)"]
    assert set_codecs(SERIES)("db", "") == [
        "ALTER TABLE db.series_check MODIFY COLUMN `ts` DateTime64(9, 'UTC') CODEC(DoubleDelta, ZSTD(1))",
        "ALTER TABLE db.series_check MODIFY COLUMN `v` Float32 CODEC(Gorilla, ZSTD(1))"]


def test_retention_ddl_single_node_and_cluster():
    assert retention_sql(SERIES, "db", "", 7) == [
        "ALTER TABLE db.series_check MODIFY SETTING ttl_only_drop_parts = 1",
        "ALTER TABLE db.series_check MODIFY TTL toDateTime(ts) + toIntervalDay(7) "
        "SETTINGS materialize_ttl_after_modify = 0"]
    assert retention_sql(SERIES, "db", "c1", 0) == ["ALTER TABLE db.series_check_local ON CLUSTER `c1` REMOVE TTL"]
    assert all(s.startswith("ALTER TABLE db.series_check_local ON CLUSTER `c1` ")
               for s in retention_sql(SERIES, "db", "c1", 90))


def _create_query(store, name):
    return store.query("SELECT create_table_query FROM system.tables WHERE database = {d:String} AND name = {n:String}",
                       {"d": store.database, "n": name}).scalar()


def test_retention_is_applied_changed_and_removed_on_the_engine(store):
    for sql in create_table_sql(SERIES, store.database):
        store.command(sql)
    assert len(apply_retention(store, [SERIES], {"raw": 7})) == 2
    assert "TTL toDateTime(ts) + toIntervalDay(7)" in _create_query(store, "series_check")
    assert apply_retention(store, [SERIES], {"raw": 7}) == []  # idempotent at every start
    apply_retention(store, [SERIES], {"raw": 30})
    assert "toIntervalDay(30)" in _create_query(store, "series_check")
    apply_retention(store, [SERIES], {"raw": 0})
    assert " TTL " not in _create_query(store, "series_check")
    assert apply_retention(store, [SERIES], {"raw": 0}) == []


def test_opened_store_has_the_default_retention_and_the_declared_codecs(store_path):
    from triscope.store import open_store

    store = open_store({"store": {"path": str(store_path), "database": f"ret{os.getpid()}"}})
    try:
        _check_retention_and_codecs(store)
    finally:
        store.command(f"DROP DATABASE {store.database}")
        store.close()


def _check_retention_and_codecs(store):
    tables = [t for m in domains().values() for t in vars(m).values() if isinstance(t, Table)]
    raw = [t for t in tables if t.retention == "raw"]
    assert {"gpu_samples", "serving_metrics", "requests", "io_latency", "weights_history"} <= {t.name for t in raw}
    for t in raw:
        assert f"TTL toDateTime(ts) + toIntervalDay({StoreConfig().raw_ttl_days})" in _create_query(store, t.name)
    for name in ("gpu_samples_latest", "serving_metrics_latest", "scrape_health_latest", "requests_latest"):
        assert f"TTL toDateTime(ts) + toIntervalDay({StoreConfig().raw_ttl_days})" in _create_query(store, name)
    for name in ("serving_metrics_recent", "requests_recent"):  # the last hours only, whatever [store] says
        assert "TTL toDateTime(ts) + toIntervalHour(2)" in _create_query(store, name)
    for name in ("gpu_samples_10s", "gpu_samples_1m", "serving_metrics_10s", "serving_metrics_1m"):
        assert f"TTL toDateTime(ts) + toIntervalDay({StoreConfig().rollup_ttl_days})" in _create_query(store, name)
    declared = {(t.name, c.name): c.codec for t in tables for c in t.columns if c.codec}
    found = store.query("SELECT table, name, compression_codec FROM system.columns WHERE database = {d:String}",
                        {"d": store.database}).rows
    for table, name, codec in found:
        if (table, name) in declared:
            assert codec.replace(" ", "").startswith("CODEC("), (table, name, codec)
    assert store.query(f"SELECT count() FROM {qualified(store, 'gpu_samples')}").scalar() == 0


def test_retention_settings_are_typed_and_checked():
    cfg = StoreConfig.from_config({"store": {"raw_ttl_days": 14, "rollup_ttl_days": 0}})
    assert (cfg.raw_ttl_days, cfg.rollup_ttl_days) == (14, 0)
    assert (StoreConfig().raw_ttl_days, StoreConfig().rollup_ttl_days) == (7, 90)
    with pytest.raises(ConfigError):
        StoreConfig.from_config({"store": {"raw_ttl_days": -1}})
    with pytest.raises(ConfigError):
        StoreConfig.from_config({"store": {"raw_ttl_day": 7}})
    with pytest.raises(ConfigError):
        StoreConfig.from_config({"store": {"raw_ttl_days": "7"}})


def _codecs(store, table):
    return dict(store.query("SELECT name, compression_codec FROM system.columns WHERE database = {d:String} "
                            "AND table = {t:String}", {"d": store.database, "t": table}).rows)


def test_codec_migration_moves_a_store_created_before_codecs(store):
    """A store whose columns have the default codec (created before the step) gets every declared codec
    from the domain's codec migration; the rows and column comments stay."""
    from triscope.schema import GPU_SAMPLES, encode_ts, migrate
    from triscope.schema import gpu as gpu_schema

    table = qualified(store, GPU_SAMPLES)
    for c in GPU_SAMPLES.columns:
        for sql in modify_codec_sql(GPU_SAMPLES.name, Column(c.name, c.type), store.database):
            store.command(sql)
    assert set(_codecs(store, "gpu_samples").values()) == {"CODEC(Default)"}
    store.insert(table, GPU_SAMPLES.columns_of([{"ts": encode_ts(time.time_ns()), "host": "h",
                                                  "gpu": 1, "power_watts": 512.5}]))
    step = next(m.version for m in gpu_schema.MIGRATIONS if "codecs" in m.description)
    store.command(f"ALTER TABLE {qualified(store, 'schema_migrations')} DELETE WHERE domain = 'gpu' "
                  f"AND version >= {step} SETTINGS mutations_sync = 2")
    assert migrate(store)["gpu"] == gpu_schema.MIGRATIONS[-1].version
    found = _codecs(store, "gpu_samples")
    for c in GPU_SAMPLES.columns:
        assert all(part.split("(")[0] in found[c.name] for part in c.codec.split(", ")), (c.name, found[c.name])
    assert found["ts"] == "CODEC(Delta(8), ZSTD(1))"
    assert store.query(f"SELECT power_watts FROM {table}").scalar() == 512.5
    comment = store.query("SELECT comment FROM system.columns WHERE database = {d:String} AND table = 'gpu_samples' "
                          "AND name = 'gpu'", {"d": store.database}).scalar()
    assert comment == "device index on the host"


def test_type_change_ddl_single_node_and_cluster():
    rate = Column("rate", "Float32", codec="ZSTD(1)")
    table = Table("rates_check", [TS, rate], order_by="ts")
    assert set_types(table, "rate")("db", "") == [
        "ALTER TABLE db.rates_check MODIFY COLUMN `rate` Float32 CODEC(ZSTD(1))"]
    assert set_types(table, "rate")("db", "c1") == [
        "ALTER TABLE db.rates_check_local ON CLUSTER `c1` MODIFY COLUMN `rate` Float32 CODEC(ZSTD(1))",
        "ALTER TABLE db.rates_check ON CLUSTER `c1` MODIFY COLUMN `rate` Float32"]
    with pytest.raises(ValueError, match="no column"):
        set_types(table, "nope")


def test_a_stored_float64_column_moves_to_float32_with_its_rows(store):
    """The migration path of an existing store: rows written as Float64 read back at Float32 precision."""
    old = Table("rates_move", [TS, Column("rate", "Float64", codec="Gorilla, ZSTD(1)")], order_by="ts")
    new = Table("rates_move", [TS, Column("rate", "Float32", codec="ZSTD(1)")], order_by="ts")
    for sql in create_table_sql(old, store.database):
        store.command(sql)
    values = [123456789.0, 0.1, float("nan"), 2.5e10]
    store.insert(f"{store.database}.rates_move", {"ts": [f"2026-01-01 00:00:0{i}.000000000" for i in range(4)],
                                                  "rate": values})
    for sql in set_types(new, "rate")(store.database, ""):
        store.command(sql)
    (kind,) = store.query("SELECT type FROM system.columns WHERE database = {db:String} AND table = 'rates_move' "
                          "AND name = 'rate'", {"db": store.database}).rows[0]
    assert kind == "Float32"
    got = [r[0] for r in store.query(f"SELECT toFloat64(rate) FROM {store.database}.rates_move ORDER BY ts").rows]
    assert got[0] == pytest.approx(123456789.0, rel=1e-7) and got[1] == pytest.approx(0.1, rel=1e-7)
    assert got[2] is None or got[2] != got[2]  # NaN stays NaN (JSON writes it as null)
    assert got[3] == pytest.approx(2.5e10, rel=1e-7)
