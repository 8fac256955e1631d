"""Table definitions and migration steps, rendered for single-node or cluster mode.

Single node: ``MergeTree`` tables named as defined.
Cluster (``store.cluster`` set): every table ``T`` becomes ``T_local``
(``ReplicatedMergeTree`` created ``ON CLUSTER``) plus a ``Distributed`` table ``T``
over it, sharded by ``rand()``; reads and inserts go through ``T``.
"""

from __future__ import annotations

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

    def ddl(self) -> str:
        comment = self.comment.replace("\\", "\\\\").replace("'", "\\'")
        return f"`{self.name}` {self.type}" + (f" COMMENT '{comment}'" if comment else "")


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
        f"ALTER TABLE {database}.{name} ON CLUSTER `{cluster}` ADD COLUMN IF NOT EXISTS {column.ddl()}"
        for name in (f"{table}_local", table)
    ]


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


def add_columns(table: Table, version: int) -> Callable[[str, str], list[str]]:
    """Migration body (step ``version`` of the domain) adding the columns of ``table`` marked
    ``since=version``."""
    columns = [c for c in table.columns if c.since == version]
    if not columns:
        raise ValueError(f"{table.name}: no column has since={version}")

    def render(database: str, cluster: str) -> list[str]:
        return [sql for c in columns for sql in add_column_sql(table.name, c, database, cluster)]
    return render
