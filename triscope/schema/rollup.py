"""Time rollups of a raw table: their tables, the materialized views that fill them, and the migration
steps that create them or add a gauge to them (single node or ON CLUSTER)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property

from triscope.schema.model import Column, Table, add_column_sql, create_table_sql


@dataclass(frozen=True)
class Rollup:
    """A time rollup of ``source``: per ``bucket_s`` and key, each gauge's sum and count of finite
    values, min and max (an AggregatingMergeTree of SimpleAggregateFunctions, filled by a
    materialized view on every insert into ``source``). ``avg = sum / count`` over any interval that
    is a multiple of ``bucket_s`` equals the raw table's ``avgIf(g, isFinite(g))``; min / max are
    +inf / -inf where a bucket had no finite value. ``since`` names the gauges added after the
    rollup was created, with the domain version whose migration added them."""

    source: Table
    bucket_s: int
    keys: Sequence[str]
    gauges: Sequence[str]
    since: tuple[tuple[str, int], ...] = ()

    def gauges_at(self, version: int | None) -> list[str]:
        """The gauges the rollup held at domain ``version`` (all of them when None)."""
        added = dict(self.since)
        return [g for g in self.gauges if version is None or added.get(g, 0) <= version]

    @cached_property
    def table(self) -> Table:
        types = {c.name: c.type for c in self.source.columns}
        added = dict(self.since)
        cols = [Column("ts", "DateTime('UTC')", f"start of the {self.bucket_s} s bucket", codec="Delta, ZSTD(1)")]
        cols += [Column(k, types[k]) for k in self.keys]
        for g in self.gauges:
            v = added.get(g, 1)
            cols += [Column(f"{g}_sum", "SimpleAggregateFunction(sum, Float64)", f"sum of finite {g}", since=v),
                     Column(f"{g}_count", "SimpleAggregateFunction(sum, UInt64)", f"finite {g} values", since=v),
                     Column(f"{g}_min", "SimpleAggregateFunction(min, Float64)", since=v),
                     Column(f"{g}_max", "SimpleAggregateFunction(max, Float64)", since=v)]
        return Table(name=f"{self.source.name}_{self.label}", columns=cols,
                     order_by=", ".join([*self.keys, "ts"]), partition_by="toYYYYMMDD(ts)",
                     engine="AggregatingMergeTree", retention="rollup", codec="ZSTD(1)",
                     comment=f"{self.source.name} per {self.label}: sum, count, min, max of each gauge")

    @property
    def label(self) -> str:
        return f"{self.bucket_s}s" if self.bucket_s < 60 else f"{self.bucket_s // 60}m"

    def select(self, source: str, gauges: Sequence[str] | None = None, filled: Sequence[str] | None = None) -> str:
        """The rollup's rows of ``gauges`` (default: every gauge) from the raw rows of ``source`` (a
        qualified table name). Gauges in ``filled`` but not in ``gauges`` get the aggregates' neutral
        values (sum 0, count 0, min +inf, max -inf), so those rows add nothing to them."""
        gauges = list(self.gauges if gauges is None else gauges)
        parts = [f"toStartOfInterval(toDateTime(ts, 'UTC'), toIntervalSecond({self.bucket_s})) AS ts",
                 *[f"`{k}`" for k in self.keys]]
        for g in (gauges if filled is None else filled):
            if g in gauges:
                parts += [f"sumIf(toFloat64(`{g}`), isFinite(`{g}`)) AS `{g}_sum`",
                          f"toUInt64(countIf(isFinite(`{g}`))) AS `{g}_count`",
                          f"min(if(isFinite(`{g}`), toFloat64(`{g}`), inf)) AS `{g}_min`",
                          f"max(if(isFinite(`{g}`), toFloat64(`{g}`), -inf)) AS `{g}_max`"]
            else:
                parts += [f"toFloat64(0) AS `{g}_sum`", f"toUInt64(0) AS `{g}_count`", f"inf AS `{g}_min`",
                          f"-inf AS `{g}_max`"]
        keys = ", ".join(["ts", *[f"`{k}`" for k in self.keys]])
        return f"SELECT {', '.join(parts)} FROM {source} GROUP BY {keys}"


def _backfill_sql(rollup: Rollup, database: str, gauges: Sequence[str], filled: Sequence[str]) -> str:
    """INSERT of the rollup's rows of ``gauges`` from every stored raw row, naming its columns (a store
    re-running an earlier step holds the columns of later ones: they take their defaults)."""
    names = ["ts", *rollup.keys, *(f"{g}_{a}" for g in filled for a in ("sum", "count", "min", "max"))]
    columns = ", ".join(f"`{n}`" for n in names)
    return (f"INSERT INTO {database}.{rollup.table.name} ({columns}) "
            f"{rollup.select(f'{database}.{rollup.source.name}', gauges, filled)}")


def _view_sql(rollup: Rollup, database: str, cluster: str, gauges: Sequence[str]) -> str:
    target, source = rollup.table.name, rollup.source.name
    suffix, on = ("_local", f" ON CLUSTER `{cluster}`") if cluster else ("", "")
    return (f"CREATE MATERIALIZED VIEW IF NOT EXISTS {database}.{target}_mv{on} TO {database}.{target}{suffix} "
            f"AS {rollup.select(f'{database}.{source}{suffix}', gauges)}")


def create_rollup_sql(rollup: Rollup, database: str, cluster: str = "", version: int | None = None) -> list[str]:
    """The rollup table (local + Distributed in cluster mode), its materialized view (ON CLUSTER on
    each node's local tables: every shard rolls up the rows it holds, readers aggregate across
    shards) and a backfill from the rows already stored, as they were at domain ``version``."""
    gauges = rollup.gauges_at(version)
    return [
        *create_table_sql(rollup.table, database, cluster, version),
        _view_sql(rollup, database, cluster, gauges),
        _backfill_sql(rollup, database, gauges, gauges),
    ]


def add_gauge_sql(rollup: Rollup, version: int, database: str, cluster: str = "") -> list[str]:
    """The columns of the gauges added at ``version``, the view replaced by one that fills them, and
    their backfill from the rows already stored (the other gauges' columns get neutral values).
    Run before writers start, as every migration is: rows inserted while the view is replaced would
    miss the rollup."""
    new = [g for g, v in rollup.since if v == version]
    if not new:
        raise ValueError(f"{rollup.table.name}: no gauge added at version {version}")
    # rows rolled up before the gauge existed must read as "no finite value": sum and count 0 (the
    # type's default), min +inf and max -inf (not 0, which would win every later min / max)
    neutral = {"_min": " DEFAULT inf", "_max": " DEFAULT -inf"}
    columns = [dataclasses.replace(c, type=c.type + neutral.get(c.name[-4:], ""))
               for c in rollup.table.columns if c.since == version]
    on = f" ON CLUSTER `{cluster}`" if cluster else ""
    name = rollup.table.name
    return [
        *(sql for c in columns for sql in add_column_sql(name, c, database, cluster)),
        f"DROP VIEW IF EXISTS {database}.{name}_mv{on}",
        _view_sql(rollup, database, cluster, rollup.gauges_at(version)),
        _backfill_sql(rollup, database, new, rollup.gauges_at(version)),
    ]


def create_rollups(*rollups: Rollup, version: int) -> Callable[[str, str], list[str]]:
    """Migration body (step ``version`` of the domain) creating ``rollups`` (tables, views, backfill)."""
    def render(database: str, cluster: str) -> list[str]:
        return [sql for r in rollups for sql in create_rollup_sql(r, database, cluster, version)]
    return render


def add_rollup_gauges(*rollups: Rollup, version: int) -> Callable[[str, str], list[str]]:
    """Migration body (step ``version`` of the domain) adding the gauges marked with ``version`` in
    each rollup's ``since``."""
    for r in rollups:
        if not any(v == version for _, v in r.since):
            raise ValueError(f"{r.table.name}: no gauge added at version {version}")

    def render(database: str, cluster: str) -> list[str]:
        return [sql for r in rollups for sql in add_gauge_sql(r, version, database, cluster)]
    return render
