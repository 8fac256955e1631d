"""Insert-time views of a raw table for readers that want each key's newest values or the last minutes.

:class:`Latest`: each key's newest row (its time, and chosen columns as ``argMax`` states), kept by a
materialized view on every insert, so a reader of "the latest value per backend" reads one row per key
and part instead of the raw rows of a look-back. :class:`Recent`: a copy of some columns sorted by
``ts`` for the last hours only, so a query bounded to the last seconds reads only their granules (a
raw table sorted by key then time cannot skip any granule when thousands of keys share each one).
:class:`Projection` did that inside the table for its whole history; stores made before :class:`Recent`
drop it. All render for single node and ``ON CLUSTER`` (each shard keeps its own rows; readers merge the
states across shards). Why the weight engine uses them: docs/weights.md ("Store reader").
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property

from triscope.schema.model import Column, Table, create_table_sql

TS_TYPE = "DateTime64(9, 'UTC')"


@dataclass(frozen=True)
class Latest:
    """Per ``keys`` of ``source``: ``ts``, the newest row's time; for each of ``values`` an
    ``argMax(value, ts)`` state (read with ``argMaxMerge``); for each ``last_if`` entry
    ``{column: condition}`` the time of the newest row meeting the condition (1970 when none).

    An AggregatingMergeTree partitioned by day: a key's rows of one day merge into one, and the
    raw retention drops old days. Exact for a reader whose bound ``until`` is at or after a key's
    ``ts``; a key with rows after ``until`` must be read from the raw table."""

    source: Table
    keys: Sequence[str]
    values: Sequence[str] = ()
    last_if: Mapping[str, str] = field(default_factory=dict)

    @cached_property
    def table(self) -> Table:
        types = {c.name: c.type for c in self.source.columns}
        cols = [Column("ts", f"SimpleAggregateFunction(max, {TS_TYPE})", "time of the key's newest row")]
        cols += [Column(k, types[k]) for k in self.keys]
        cols += [Column(v, f"AggregateFunction(argMax, {types[v]}, {TS_TYPE})", f"{v} of the newest row (argMax state)")
                 for v in self.values]
        cols += [Column(name, f"SimpleAggregateFunction(max, {TS_TYPE})", f"time of the newest row where {cond}")
                 for name, cond in self.last_if.items()]
        return Table(name=f"{self.source.name}_latest", columns=cols, order_by=", ".join(self.keys),
                     partition_by="toYYYYMMDD(ts)", engine="AggregatingMergeTree", retention="raw",
                     codec="ZSTD(1)", comment=f"{self.source.name}: newest row per {', '.join(self.keys)}")

    def select(self, source: str) -> str:
        """The table's rows from the raw rows of ``source`` (a qualified table name); the inner query
        renames the row time, which the outer ``max(...) AS ts`` would otherwise shadow."""
        inner = ", ".join(["ts AS row_ts", *[f"`{c}`" for c in (*self.keys, *self.values)],
                           *[f"({cond}) AS `{name}_hit`" for name, cond in self.last_if.items()]])
        parts = ["max(row_ts) AS ts", *[f"`{k}`" for k in self.keys],
                 *[f"argMaxState(`{v}`, row_ts) AS `{v}`" for v in self.values],
                 *[f"maxIf(row_ts, `{name}_hit`) AS `{name}`" for name in self.last_if]]
        return (f"SELECT {', '.join(parts)} FROM (SELECT {inner} FROM {source}) "
                f"GROUP BY {', '.join(f'`{k}`' for k in self.keys)}")


def create_latest_sql(latest: Latest, database: str, cluster: str = "") -> list[str]:
    """The table (local + Distributed in cluster mode), its materialized view (ON CLUSTER, on each
    node's local tables) and a backfill from the rows already stored."""
    return _table_view_backfill(latest.table, latest.source, latest.select, database, cluster)


def _table_view_backfill(table: Table, source: Table, select: Callable[[str], str], database: str, cluster: str,
                         backfill_where: str = "") -> list[str]:
    """``table`` (local + Distributed in cluster mode), a materialized view filling it with ``select`` of
    each insert into ``source`` (ON CLUSTER, on each node's local tables) and a backfill of ``select`` over
    the rows already stored (``backfill_where`` appended)."""
    suffix, on = ("_local", f" ON CLUSTER `{cluster}`") if cluster else ("", "")
    return [
        *create_table_sql(table, database, cluster),
        f"CREATE MATERIALIZED VIEW IF NOT EXISTS {database}.{table.name}_mv{on} TO {database}.{table.name}{suffix} "
        f"AS {select(f'{database}.{source.name}{suffix}')}",
        f"INSERT INTO {database}.{table.name} {select(f'{database}.{source.name}')}{backfill_where}",
    ]


def _stored(table: Table, database: str, cluster: str) -> str:
    """The table that holds ``table``'s rows, for ALTERs: ``T_local ON CLUSTER`` in cluster mode (a
    Distributed table stores nothing)."""
    return f"{database}.{table.name}" + (f"_local ON CLUSTER `{cluster}`" if cluster else "")


def create_latest(*latest: Latest) -> Callable[[str, str], list[str]]:
    """Migration body creating each :class:`Latest` (table, view, backfill)."""
    def render(database: str, cluster: str) -> list[str]:
        return [sql for x in latest for sql in create_latest_sql(x, database, cluster)]
    return render


@dataclass(frozen=True)
class Recent:
    """``columns`` of ``source`` sorted by ``ts``, in a table of their own that keeps only the last hours
    (partitions by hour, dropped whole once ``held_s`` past): a reader of the last minutes reads only
    their granules without a time-sorted copy of the whole history. Rows are present for every ``ts``
    from ``held_s`` before the store's clock; :meth:`covers` says whether a range starts late enough
    for that, leaving an hour for clocks that disagree."""

    source: Table
    columns: Sequence[str]
    held_s: int = 7200

    def __post_init__(self) -> None:
        missing = set(self.columns) - set(self.source.column_names())
        if missing or "ts" not in self.columns:
            raise ValueError(f"{self.source.name}: no column {sorted(missing or {'ts'})}")
        if self.held_s < 7200 or self.held_s % 3600:
            raise ValueError(f"{self.source.name}: held_s must be whole hours, at least 2")

    @cached_property
    def table(self) -> Table:
        by_name = {c.name: c for c in self.source.columns}
        return Table(name=f"{self.source.name}_recent", columns=[by_name[c] for c in self.columns], order_by="ts",
                     partition_by="toStartOfHour(ts)",
                     ttl=f"toDateTime(ts) + toIntervalHour({self.held_s // 3600})",
                     # a part goes whole once all its rows are past; checked every 10 minutes, not ClickHouse's 4 h
                     settings={"ttl_only_drop_parts": "1", "merge_with_ttl_timeout": "600"},
                     comment=f"{self.source.name}: {', '.join(self.columns[1:])} by time, the last "
                             f"{self.held_s // 3600} hours")

    def covers(self, since_s: float, clock_s: float) -> bool:
        """Whether every row from ``since_s`` on is held, by a store whose clock reads about ``clock_s``."""
        return since_s >= clock_s - (self.held_s - 3600)

    def select(self, source: str) -> str:
        """The table's rows from ``source``'s."""
        return f"SELECT {', '.join(f'`{c}`' for c in self.columns)} FROM {source}"


def create_recent_sql(recent: Recent, database: str, cluster: str = "") -> list[str]:
    """The table (local + Distributed in cluster mode), its materialized view (ON CLUSTER, on each
    node's local tables) and a backfill of the rows already stored within its hours. The backfill takes
    only rows older than the table's oldest, so a migration run again adds nothing twice (readers count
    rows); a row that the view wrote older than rows stored before it holds the backfill back to it."""
    oldest = (f"(SELECT if(count() = 0, toDateTime64('2200-01-01 00:00:00', 9, 'UTC'), min(ts)) "
              f"FROM {database}.{recent.table.name})")
    return _table_view_backfill(recent.table, recent.source, recent.select, database, cluster,
                                f" WHERE ts >= now() - toIntervalHour({recent.held_s // 3600}) AND ts < {oldest}")


def replace_projections(*pairs: tuple[Projection, Recent]) -> Callable[[str, str], list[str]]:
    """Migration body: each :class:`Recent` created, then the :class:`Projection` it replaces dropped."""
    def render(database: str, cluster: str) -> list[str]:
        out = []
        for projection, recent in pairs:
            out += [*create_recent_sql(recent, database, cluster),
                    f"ALTER TABLE {_stored(projection.source, database, cluster)} "
                    f"DROP PROJECTION IF EXISTS {projection.name}"]
        return out
    return render


@dataclass(frozen=True)
class Projection:
    """``columns`` of ``source`` sorted by ``order_by``, stored in each part beside its columns
    (ClickHouse picks it when it reads fewer granules than the table's own order)."""

    source: Table
    name: str
    columns: Sequence[str]
    order_by: str = "ts"

    def __post_init__(self) -> None:
        missing = set(self.columns) - set(self.source.column_names())
        if missing:
            raise ValueError(f"{self.source.name}: no column {sorted(missing)}")


def add_projection_sql(projection: Projection, database: str, cluster: str = "") -> list[str]:
    """DDL adding the projection and building it for the parts already stored (a mutation, run in
    the background; queries read the parts without it from the table's own order meanwhile). In
    cluster mode on each shard's local table: a Distributed table stores nothing."""
    table = _stored(projection.source, database, cluster)
    cols = ", ".join(f"`{c}`" for c in projection.columns)
    return [f"ALTER TABLE {table} ADD PROJECTION IF NOT EXISTS {projection.name} "
            f"(SELECT {cols} ORDER BY {projection.order_by})",
            f"ALTER TABLE {table} MATERIALIZE PROJECTION {projection.name}"]


def add_projections(*projections: Projection) -> Callable[[str, str], list[str]]:
    """Migration body adding each :class:`Projection`."""
    def render(database: str, cluster: str) -> list[str]:
        return [sql for p in projections for sql in add_projection_sql(p, database, cluster)]
    return render
