"""Table definitions and migration steps, rendered for single-node or cluster mode.

Single node: ``MergeTree`` tables named as defined.
Cluster (``store.cluster`` set): every table ``T`` becomes ``T_local``
(``ReplicatedMergeTree`` created ``ON CLUSTER``) plus a ``Distributed`` table ``T``
over it, sharded by ``rand()``; reads and inserts go through ``T``.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from triscope.errors import InputError
from triscope.store.base import Store


def encode_ts(ns: int) -> str:
    """Epoch nanoseconds as the exact ``YYYY-MM-DD hh:mm:ss.nnnnnnnnn`` text a DateTime64(9) column parses.

    The one timestamp encoder for rows handed to the writer (text survives the spool's msgpack
    and both store backends unchanged, to the nanosecond).
    """
    sec, frac = divmod(int(ns), 1_000_000_000)
    base = dt.datetime.fromtimestamp(sec, dt.UTC).strftime("%Y-%m-%d %H:%M:%S")
    return f"{base}.{frac:09d}"


def default_for(ch_type: str) -> Any:
    """The value a column of ClickHouse type ``ch_type`` gets when a row does not set it."""
    t = ch_type
    while True:  # unwrap LowCardinality(...) / Nullable(...)
        if t.startswith("LowCardinality(") and t.endswith(")"):
            t = t[len("LowCardinality("):-1]
        elif t.startswith("Nullable("):
            return None
        else:
            break
    if t.startswith(("Array(", "Tuple(")):
        return []
    if t.startswith("Map("):
        return {}
    if t.startswith("Float"):
        return 0.0
    if t.startswith(("Int", "UInt", "Decimal", "DateTime", "Date")):
        return 0
    if t == "Bool":
        return False
    return ""


@dataclass(frozen=True)
class Column:
    """One column: ClickHouse type and a short description (units in the name or comment)."""

    name: str
    type: str
    comment: str = ""
    since: int = 1
    """The domain's schema version whose migration added this column."""
    codec: str = ""
    """Compression codec chain, e.g. ``DoubleDelta, ZSTD(1)`` (rendered ``CODEC(...)``); '' = the
    server's default (LZ4). Chosen by measurement (bench/fleet_day.py, docs/scaling.md)."""

    def ddl(self, codec: bool = True) -> str:
        """The column's definition; ``codec=False`` leaves the codec out (a Distributed table stores nothing)."""
        comment = self.comment.replace("\\", "\\\\").replace("'", "\\'")
        sql = f"`{self.name}` {self.type}" + (f" COMMENT '{comment}'" if comment else "")
        return sql + (f" CODEC({self.codec})" if codec and self.codec else "")


@dataclass(frozen=True, eq=False)
class Table:
    """A MergeTree-family table. Each is one object, defined once in its domain module: equal
    and hashed by identity, so it keys the rows a collector returns and is what ``submit`` takes."""

    name: str
    columns: Sequence[Column]
    order_by: str
    partition_by: str = ""
    engine: str = "MergeTree"  # or ReplacingMergeTree(version_col), etc.
    ttl: str = ""
    comment: str = ""
    settings: dict[str, str] = field(default_factory=dict)
    retention: str = ""
    """Which ``[store]`` retention applies: ``raw`` (``raw_ttl_days``), ``rollup`` (``rollup_ttl_days``)
    or '' (kept until deleted: per-run files such as traces). The TTL is on ``toDateTime(ts)``."""
    codec: str = ""
    """The codec of every column that declares none (e.g. ``ZSTD(1)``); '' = the server's default."""

    def __post_init__(self) -> None:
        if self.codec:  # the table's codec becomes each undeclared column's, so every renderer sees it
            object.__setattr__(self, "columns", [c if c.codec else dataclasses.replace(c, codec=self.codec)
                                                 for c in self.columns])

    def column_names(self) -> list[str]:
        """Current columns, in order."""
        return [c.name for c in self.columns]

    def columns_at(self, version: int) -> list[Column]:
        """The columns this table had at schema ``version`` of its domain."""
        return [c for c in self.columns if c.since <= version]

    def defaults(self) -> dict[str, Any]:
        """``{column: value a row gets when it does not set the column}``."""
        return dict(self._defaults)

    @cached_property
    def _defaults(self) -> dict[str, Any]:
        return {c.name: default_for(c.type) for c in self.columns}

    def empty_columns(self) -> dict[str, list[Any]]:
        """``{column: []}`` for every current column: a column-oriented batch to append to."""
        return {c.name: [] for c in self.columns}

    def columns_of(self, rows: Iterable[Mapping[str, Any]], *,
                   defaults: Mapping[str, Any] | None = None) -> dict[str, list[Any]]:
        """Row dicts as a column-oriented batch of every current column; a key that is not a
        column raises InputError (a typo must not vanish), a missing key takes its default."""
        base = {**self._defaults, **defaults} if defaults else self._defaults
        rows = list(rows)
        for row in rows:
            if not row.keys() <= base.keys():
                extra = row.keys() - base.keys()
                raise InputError(f"{self.name}: unknown column(s) {', '.join(sorted(extra))}")
        return {name: [row.get(name, default) for row in rows] for name, default in base.items()}


def qualified(store: Store, table: Table | str) -> str:
    """``database.name`` for a table of the schema."""
    return f"{store.database}.{table.name if isinstance(table, Table) else table}"


def _replicated(engine: str, table: str) -> str:
    base, _, args = engine.partition("(")
    args = args.rstrip(")")
    zk = f"'/clickhouse/tables/{{shard}}/{{database}}/{table}', '{{replica}}'"
    return f"Replicated{base}({zk}{', ' + args if args else ''})"


def create_table_sql(table: Table, database: str, cluster: str = "", version: int | None = None) -> list[str]:
    """DDL statements creating ``table`` (one for single node, two for cluster mode), with the
    columns it had at ``version`` (all current columns when None)."""
    columns = table.columns if version is None else table.columns_at(version)
    cols = ",\n  ".join(c.ddl() for c in columns)
    tail = f"ORDER BY ({table.order_by})"
    if table.partition_by:
        tail = f"PARTITION BY {table.partition_by}\n{tail}"
    if table.ttl:
        tail += f"\nTTL {table.ttl}"
    if table.settings:
        tail += "\nSETTINGS " + ", ".join(f"{k} = {v}" for k, v in table.settings.items())
    comment = table.comment.replace("'", "\\'")
    comment_sql = f"\nCOMMENT '{comment}'" if comment else ""
    if not cluster:
        return [f"CREATE TABLE IF NOT EXISTS {database}.{table.name} (\n  {cols}\n)\n"
                f"ENGINE = {table.engine}\n{tail}{comment_sql}"]
    local = f"{table.name}_local"
    return [
        f"CREATE TABLE IF NOT EXISTS {database}.{local} ON CLUSTER `{cluster}` (\n  {cols}\n)\n"
        f"ENGINE = {_replicated(table.engine, local)}\n{tail}{comment_sql}",
        f"CREATE TABLE IF NOT EXISTS {database}.{table.name} ON CLUSTER `{cluster}` "
        f"AS {database}.{local}\nENGINE = Distributed(`{cluster}`, {database}, {local}, rand())",
    ]


def add_column_sql(table: str, column: Column, database: str, cluster: str = "") -> list[str]:
    """DDL adding ``column`` to ``table`` (to the local and the distributed table in cluster mode)."""
    if not cluster:
        return [f"ALTER TABLE {database}.{table} ADD COLUMN IF NOT EXISTS {column.ddl()}"]
    return [
        f"ALTER TABLE {database}.{table}_local ON CLUSTER `{cluster}` ADD COLUMN IF NOT EXISTS {column.ddl()}",
        f"ALTER TABLE {database}.{table} ON CLUSTER `{cluster}` ADD COLUMN IF NOT EXISTS {column.ddl(codec=False)}",
    ]


def modify_codec_sql(table: str, column: Column, database: str, cluster: str = "") -> list[str]:
    """DDL setting ``column``'s codec on the table that stores it (``T_local`` ON CLUSTER in cluster
    mode: a Distributed table stores nothing). Parts written before keep their codec until merged."""
    codec = f"CODEC({column.codec})" if column.codec else "CODEC(Default)"
    if not cluster:
        return [f"ALTER TABLE {database}.{table} MODIFY COLUMN `{column.name}` {column.type} {codec}"]
    return [f"ALTER TABLE {database}.{table}_local ON CLUSTER `{cluster}` "
            f"MODIFY COLUMN `{column.name}` {column.type} {codec}"]


def ttl_expression(days: int) -> str:
    """The TTL clause of a time-series table kept ``days`` days."""
    return f"toDateTime(ts) + toIntervalDay({int(days)})"


def retention_sql(table: Table, database: str, cluster: str, days: int) -> list[str]:
    """DDL setting ``table``'s TTL to ``days`` days (0 = keep: the TTL is removed). Rows past it go
    at merges; ``ttl_only_drop_parts`` drops whole daily partitions instead of rewriting parts."""
    name = f"{database}.{table.name}_local ON CLUSTER `{cluster}`" if cluster else f"{database}.{table.name}"
    if days <= 0:
        return [f"ALTER TABLE {name} REMOVE TTL"]
    return [f"ALTER TABLE {name} MODIFY SETTING ttl_only_drop_parts = 1",
            f"ALTER TABLE {name} MODIFY TTL {ttl_expression(days)} SETTINGS materialize_ttl_after_modify = 0"]


@dataclass(frozen=True)
class Migration:
    """One schema step of a domain. ``statements`` renders DDL for (database, cluster)."""

    version: int
    description: str
    statements: Callable[[str, str], list[str]]


def create_tables(*tables: Table, version: int = 1) -> Callable[[str, str], list[str]]:
    """Migration body (step ``version`` of the domain) creating the given tables with the
    columns they had at that version."""
    def render(database: str, cluster: str) -> list[str]:
        return [sql for t in tables for sql in create_table_sql(t, database, cluster, version)]
    return render


def modify_type_sql(table: str, column: Column, database: str, cluster: str = "") -> list[str]:
    """DDL moving ``column`` to its declared type and codec (:func:`modify_codec_sql`, which names the type
    too): the stored parts are rewritten (a mutation); in cluster mode the Distributed table's type too."""
    local = modify_codec_sql(table, column, database, cluster)
    if not cluster:
        return local
    return [*local, f"ALTER TABLE {database}.{table} ON CLUSTER `{cluster}` "
                    f"MODIFY COLUMN `{column.name}` {column.type}"]


def set_types(table: Table, *names: str) -> Callable[[str, str], list[str]]:
    """Migration body moving the columns ``names`` of ``table`` to their declared types (idempotent)."""
    by_name = {c.name: c for c in table.columns}
    missing = [n for n in names if n not in by_name]
    if missing:
        raise ValueError(f"{table.name}: no column {missing}")

    def render(database: str, cluster: str) -> list[str]:
        return [sql for n in names for sql in modify_type_sql(table.name, by_name[n], database, cluster)]
    return render


def set_codecs(*tables: Table) -> Callable[[str, str], list[str]]:
    """Migration body moving every column of ``tables`` that declares a codec to it (idempotent)."""
    def render(database: str, cluster: str) -> list[str]:
        return [sql for t in tables for c in t.columns if c.codec
                for sql in modify_codec_sql(t.name, c, database, cluster)]
    return render


def add_columns(table: Table, version: int) -> Callable[[str, str], list[str]]:
    """Migration body (step ``version`` of the domain) adding the columns of ``table`` marked
    ``since=version``."""
    columns = [c for c in table.columns if c.since == version]
    if not columns:
        raise ValueError(f"{table.name}: no column has since={version}")

    def render(database: str, cluster: str) -> list[str]:
        return [sql for c in columns for sql in add_column_sql(table.name, c, database, cluster)]
    return render


def apply_retention(store: Store, tables: Iterable[Table], days: Mapping[str, int]) -> list[str]:
    """Bring every table's TTL to ``days[table.retention]`` (``[store] raw_ttl_days`` /
    ``rollup_ttl_days``; 0 = keep), touching only tables whose TTL differs; returns the DDL run."""
    targets = [t for t in tables if t.retention in days]
    if not targets:
        return []
    suffix = "_local" if store.cluster else ""
    res = store.query("SELECT name, create_table_query FROM system.tables WHERE database = {db:String}",
                      {"db": store.database})
    current = {name: sql for name, sql in res.rows}
    ran: list[str] = []
    for t in targets:
        ddl = current.get(t.name + suffix)
        if ddl is None:
            continue
        want = days[t.retention]
        has_ttl = " TTL " in ddl
        if (want > 0 and f"TTL {ttl_expression(want)}" in ddl) or (want <= 0 and not has_ttl):
            continue
        for sql in retention_sql(t, store.database, store.cluster, want):
            store.command(sql)
            ran.append(sql)
    return ran
