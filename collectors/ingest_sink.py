"""The one write path of file ingest (Kineto traces, NCCL dumps and outputs).

Rule: files go straight to the store, keyed by run id, and are idempotent on re-ingest (the
earlier rows of the key are deleted first), because a 1 GB trace must not pass through the
writer's spool; streaming telemetry goes through the writer (``context.submit``,
:mod:`triscope.writer`). NCCL rows are small but follow the same rule: a re-ingest must replace
them synchronously, which the writer's append-only batches cannot do.

A trace's events are parsed by ClickHouse itself straight from the file
(``Store.insert_from_json_file``, :mod:`triscope.collectors.kineto.pipeline`); every other write
of file ingest is one of the functions here. Tables are named through the schema's objects.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from triscope.schema import Table, qualified
from triscope.store.base import Store


def has_rows(store: Store, tables: Iterable[Table], where: str, params: Mapping[str, Any]) -> bool:
    """True when any of ``tables`` holds a row matching ``where`` (one query for all of them)."""
    counts = " + ".join(f"(SELECT count() FROM {qualified(store, t)} WHERE {where})" for t in tables)
    return bool(store.query(f"SELECT {counts}", params).scalar())


def delete_rows(store: Store, table: Table, where: str, params: Mapping[str, Any]) -> None:
    """Delete matching rows synchronously (``ALTER ... DELETE`` on the local tables in cluster mode)."""
    if store.cluster:
        store.command(f"ALTER TABLE {qualified(store, table)}_local ON CLUSTER `{store.cluster}` "
                      f"DELETE WHERE {where} SETTINGS mutations_sync = 2", params)
    else:
        store.command(f"DELETE FROM {qualified(store, table)} WHERE {where}", params)


def insert_columns(store: Store, table: Table, columns: Mapping[str, Sequence[Any]]) -> int:
    """Insert a column-oriented batch (``table.columns_of(rows)``); returns the row count."""
    return store.insert(qualified(store, table), columns)


def _param_type(ch_type: str) -> str:
    return ch_type[len("LowCardinality("):-1] if ch_type.startswith("LowCardinality(") else ch_type


def insert_values(store: Store, table: Table, rows: Sequence[Mapping[str, Any]],
                  expressions: Mapping[str, str] | None = None) -> int:
    """Insert ``rows`` as one parameterized ``INSERT ... VALUES`` (one part for all of them).

    For a few rows this is cheaper than :func:`insert_columns` on the embedded store, whose
    ``Python()`` table function costs ~0.3 s on its first use in a process. A column named in
    ``expressions`` takes that SQL expression (``{"ingested_at": "now64(3)"}``) instead of a value.
    """
    if not rows:
        return 0
    expressions = expressions or {}
    data = table.columns_of(rows)
    columns = [c for c in table.columns if c.name not in expressions]
    names = [c.name for c in columns] + list(expressions)
    values, params = [], {}
    for i in range(len(rows)):
        fields = [f"{{{c.name}_{i}:{_param_type(c.type)}}}" for c in columns] + list(expressions.values())
        values.append(f"({', '.join(fields)})")
        params.update({f"{c.name}_{i}": data[c.name][i] for c in columns})
    store.command(f"INSERT INTO {qualified(store, table)} ({', '.join(names)}) VALUES {', '.join(values)}", params)
    return len(rows)


def copy_rows(store: Store, table: Table, where: str, params: Mapping[str, Any], changes: Mapping[str, str]) -> None:
    """Insert a copy of the matching rows with the columns in ``changes`` set to SQL expressions."""
    names = table.column_names()
    select = ", ".join(changes.get(c, c) for c in names)
    # Explicit column list: chDB silently inserts nothing for a self-INSERT ... SELECT * without it.
    store.command(f"INSERT INTO {qualified(store, table)} ({', '.join(names)}) "
                  f"SELECT {select} FROM {qualified(store, table)} WHERE {where}", params)


def replace_rows(store: Store, table: Table, where: str, params: Mapping[str, Any],
                 columns: Mapping[str, Sequence[Any]]) -> int:
    """Delete the rows matching ``where``, then insert ``columns``: a re-ingest replaces, never duplicates."""
    delete_rows(store, table, where, params)
    return insert_columns(store, table, columns)
