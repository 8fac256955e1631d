"""The ``Store`` interface shared by the embedded (chDB) and server (clickhouse-connect) backends.

Every value reaches ClickHouse as a query parameter written ``{name:Type}`` in the SQL;
both backends bind them server-side, so no value is ever spliced into SQL text.
Identifiers (table names) come only from the schema module.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Result:
    """Rows of a query with their column names."""

    columns: list[str]
    rows: list[tuple[Any, ...]]

    def dicts(self) -> list[dict[str, Any]]:
        """Rows as dictionaries keyed by column name."""
        return [dict(zip(self.columns, row, strict=True)) for row in self.rows]

    def scalar(self) -> Any:
        """The first column of the first row, or None when there are no rows."""
        return self.rows[0][0] if self.rows else None


class Store(ABC):
    """A ClickHouse database reachable through one SQL dialect."""

    database: str
    cluster: str

    @abstractmethod
    def command(self, sql: str, params: Mapping[str, Any] | None = None) -> None:
        """Run a statement that returns no rows (DDL, DELETE, INSERT ... SELECT)."""

    @abstractmethod
    def query(self, sql: str, params: Mapping[str, Any] | None = None) -> Result:
        """Run a SELECT and return its rows."""

    @abstractmethod
    def query_columns(self, sql: str, params: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """Run a SELECT and return ``{column: numpy array}`` (fast path for analyzers)."""

    @abstractmethod
    def insert(self, table: str, columns: Mapping[str, Sequence[Any]],
               settings: Mapping[str, str | int] | None = None) -> int:
        """Insert column-oriented data (all sequences the same length); returns the row count.

        ``settings`` are ClickHouse settings for this one INSERT (e.g. ``insert_deduplication_token``).
        """

    @abstractmethod
    def insert_from_json(self, insert_sql: str, structure: str, data: bytes,
                         params: Mapping[str, Any] | None = None) -> None:
        """Run an ``INSERT ... SELECT ... FROM json_input`` over ``data`` parsed by ClickHouse itself.

        ``json_input`` in ``insert_sql`` stands for the rows of ``data`` (JSONEachRow: one object
        per line, or a JSON array of objects) with columns ``structure`` (e.g. ``"a String, b Int64"``;
        nested objects read as String when so typed). Not atomic: rows parsed before a parse error
        may already be written, so callers tag rows (e.g. a block id) to remove them on failure.
        """

    def releasing_memory(self) -> AbstractContextManager[None]:
        """Context for heavy work (ingest, analysis): an embedded engine hands the memory it frees
        back to the OS as it goes; other stores do nothing."""
        return nullcontext()

    reads_local_files = False
    """True when ClickHouse runs in this process and :meth:`insert_from_json_file` reads the file
    (or named pipe) itself instead of loading it."""

    def insert_from_json_file(self, insert_sql: str, structure: str, path: Path,
                              params: Mapping[str, Any] | None = None,
                              settings: Mapping[str, int] | None = None) -> None:
        """:meth:`insert_from_json` over the contents of the local file ``path``, with extra
        query ``settings`` where the backend takes them (see :attr:`reads_local_files`)."""
        self.insert_from_json(insert_sql, structure, Path(path).read_bytes(), params)

    def ensure_dedup_window(self, table: str, window: int) -> None:
        """Let a single-node MergeTree ``table`` drop a repeated insert block (same
        ``insert_deduplication_token``) among its last ``window`` blocks; Replicated tables do
        so already, other engines are left alone."""
        res = self.query("SELECT engine, create_table_query FROM system.tables "
                         "WHERE database = {db:String} AND name = {t:String}",
                         {"db": self.database, "t": table})
        if res.rows:
            engine, ddl = res.rows[0]
            if (engine.endswith("MergeTree") and not engine.startswith("Replicated")
                    and "non_replicated_deduplication_window" not in ddl):
                self.command(f"ALTER TABLE {self.database}.{table} MODIFY SETTING "
                             f"non_replicated_deduplication_window = {int(window)}")

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections."""

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @staticmethod
    def row_count(columns: Mapping[str, Sequence[Any]]) -> int:
        """Length shared by all columns; raises ValueError when they differ."""
        lengths = {len(v) for v in columns.values()}
        if len(lengths) > 1:
            raise ValueError(f"columns have different lengths: {sorted(lengths)}")
        return lengths.pop() if lengths else 0
