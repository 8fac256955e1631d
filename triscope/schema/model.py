"""Table definitions and migration steps, rendered for single-node or cluster mode.

Single node: ``MergeTree`` tables named as defined.
Cluster (``store.cluster`` set): every table ``T`` becomes ``T_local``
(``ReplicatedMergeTree`` created ``ON CLUSTER``) plus a ``Distributed`` table ``T``
over it, sharded by ``rand()``; reads and inserts go through ``T``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from triscope.store.base import Store


@dataclass(frozen=True)
class Column:
    """One column: ClickHouse type and a short description (units in the name or comment)."""

    name: str
    type: str
    comment: str = ""

    def ddl(self) -> str:
        comment = self.comment.replace("\\", "\\\\").replace("'", "\\'")
        return f"`{self.name}` {self.type}" + (f" COMMENT '{comment}'" if comment else "")


@dataclass(frozen=True)
class Table:
    """A MergeTree-family table."""

    name: str
    columns: Sequence[Column]
    order_by: str
    partition_by: str = ""
    engine: str = "MergeTree"  # or ReplacingMergeTree(version_col), etc.
    ttl: str = ""
    comment: str = ""
    settings: dict[str, str] = field(default_factory=dict)

    def column_names(self) -> list[str]:
        return [c.name for c in self.columns]


def qualified(store: Store, name: str) -> str:
    """``database.name`` for a table name from the schema."""
    return f"{store.database}.{name}"


def _replicated(engine: str, table: str) -> str:
    base, _, args = engine.partition("(")
    args = args.rstrip(")")
    zk = f"'/clickhouse/tables/{{shard}}/{{database}}/{table}', '{{replica}}'"
    return f"Replicated{base}({zk}{', ' + args if args else ''})"


def create_table_sql(table: Table, database: str, cluster: str = "") -> list[str]:
    """DDL statements creating ``table`` (one for single node, two for cluster mode)."""
    cols = ",\n  ".join(c.ddl() for c in table.columns)
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


def create_tables(*tables: Table) -> Callable[[str, str], list[str]]:
    """Migration body creating the given tables."""
    def render(database: str, cluster: str) -> list[str]:
        return [sql for t in tables for sql in create_table_sql(t, database, cluster)]
    return render


def add_columns(table: str, *columns: Column) -> Callable[[str, str], list[str]]:
    """Migration body adding columns to an existing table."""
    def render(database: str, cluster: str) -> list[str]:
        return [sql for c in columns for sql in add_column_sql(table, c, database, cluster)]
    return render
