"""Embedded ClickHouse through chDB: a data directory, no server.

chDB allows one data path per process and one connection per thread, so this backend
keeps a connection per thread (created lazily, after a warm-up query on the creating
thread) and takes an exclusive ``flock`` on the directory so a second process gets a
clear error instead of a corrupted store.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import tempfile
import threading
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

from triscope.errors import ConfigError, StoreError, one_line
from triscope.store.base import Result, Store
from triscope.store.codec import column_to_numpy, literal, param_text, rows_of_json_compact

_process_path: str | None = None
_process_lock = threading.Lock()


def _to_insertable(values: Sequence[Any]) -> Any:
    import numpy as np  # numpy and pyarrow are imported where used: a plain query needs neither (CLI start-up)

    if isinstance(values, np.ndarray):
        return values.tolist()
    return values if isinstance(values, list) else list(values)


RELEASE_MEMORY_PERIOD_S = 0.05
"""136 MB trace, ingest + breakdown: peak RSS 389 MB instead of 430, time within noise."""
RELEASE_MEMORY_AFTER_S = 0.5
"""The first purge: short work (a 27 MB trace ingests in ~0.3 s) frees little and would pay a
connection and purges (~30 ms of a 0.8 s ``triscope diagnose``) for nothing."""


class EmbeddedStore(Store):
    """Store backed by chDB on a local directory."""

    def __init__(self, path: str | os.PathLike[str], database: str = "triscope", cluster: str = "") -> None:
        global _process_path
        from triscope.store.chdb_engine import engine  # here: chDB start-up is heavy, not every command needs it

        self._engine = engine()
        self.path = str(Path(path).resolve())
        self.database = database
        self.cluster = cluster
        try:
            Path(self.path).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"store path {self.path} cannot be a data directory: {exc.strerror or exc}") from None
        with _process_lock:
            if _process_path not in (None, self.path):
                raise StoreError(
                    f"this process already opened the embedded store at {_process_path}; "
                    f"chDB allows one data path per process (asked for {self.path})"
                )
            # Held while the store is open: the flock keeps a second process off this data path.
            lock = open(Path(self.path) / ".triscope.lock", "a+")  # noqa: SIM115
            self._lock_file: IO[str] | None = lock
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                lock.close()
                if _process_path == self.path:
                    # Same process re-opening its own path: the flock is already ours.
                    self._lock_file = None
                else:
                    raise StoreError(
                        f"embedded store {self.path} is in use by another process "
                        "(chDB allows one process per data directory); stop it or use a server store"
                    ) from None
            _process_path = self.path
        self._local = threading.local()
        self._connections: list[Any] = []
        self._conn_lock = threading.Lock()
        self.command(f"CREATE DATABASE IF NOT EXISTS {database}")

    def _conn(self) -> Any:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            try:
                conn = self._engine.connect(self.path)
                conn.query("SELECT 1", "CSV")  # warm-up on this thread before use
                # LowCardinality columns come out of Arrow queries as dictionaries (see _column_to_numpy)
                conn.query("SET output_format_arrow_low_cardinality_as_dictionary = 1", "CSV")
            except Exception as exc:  # chDB raises bare RuntimeError subclasses
                raise StoreError(f"cannot open embedded store {self.path}: {one_line(exc)}") from None
            self._local.conn = conn
            with self._conn_lock:
                self._connections.append(conn)
        return conn

    def _run(self, sql: str, fmt: str, params: Mapping[str, Any] | None) -> Any:
        try:
            bound = {k: param_text(v) for k, v in params.items()} if params else None
            return self._conn().query(sql, fmt, params=bound or {})
        except StoreError:
            raise
        except Exception as exc:
            raise StoreError(f"query failed: {one_line(exc)}") from None

    def command(self, sql: str, params: Mapping[str, Any] | None = None) -> None:
        self._run(sql, "CSV", params)

    def query(self, sql: str, params: Mapping[str, Any] | None = None) -> Result:
        return rows_of_json_compact(self._run(sql, "JSONCompact", params).bytes())

    def query_raw(self, sql: str, fmt: str, params: Mapping[str, Any] | None = None) -> bytes:
        """The answer as chDB writes it in ``fmt`` (any ClickHouse output format; a FORMAT clause wins)."""
        res = self._run(sql, fmt, params)
        return res.bytes() if res is not None else b""

    def query_columns(self, sql: str, params: Mapping[str, Any] | None = None) -> dict[str, Any]:
        import pyarrow as pa

        # Read chDB's Arrow bytes directly: its "ArrowTable" helper imports pandas (~0.3 s, ~60 MB).
        res = self._run(sql, "Arrow", params)
        if len(res) == 0:
            return {}
        table = pa.ipc.open_file(pa.py_buffer(res.get_memview().view())).read_all()
        return {name: column_to_numpy(table.column(name)) for name in table.column_names}

    def insert(self, table: str, columns: Mapping[str, Sequence[Any]],
               settings: Mapping[str, str | int] | None = None) -> int:
        n = self.row_count(columns)
        if n == 0:
            return 0
        # chDB's Python() table function reads a dict of lists in the calling frame.
        payload = {name: _to_insertable(values) for name, values in columns.items()}
        names = ", ".join(f"`{c}`" for c in payload)
        self._run(f"INSERT INTO {table} ({names}){_settings_clause(settings)} SELECT {names} FROM Python(payload)",
                  "CSV", None)
        return n

    def insert_from_json(self, insert_sql: str, structure: str, data: bytes,
                         params: Mapping[str, Any] | None = None) -> None:
        fd, tmp = tempfile.mkstemp(prefix="triscope-json-", suffix=".json")
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
            self.insert_from_json_file(insert_sql, structure, Path(tmp), params)
        finally:
            os.unlink(tmp)

    reads_local_files = True

    @contextlib.contextmanager
    def releasing_memory(self, period_s: float = RELEASE_MEMORY_PERIOD_S,
                         after_s: float = RELEASE_MEMORY_AFTER_S) -> Iterator[None]:
        """Purge the allocator's freed pages every ``period_s`` from ``after_s`` on while the block runs (as the
        ClickHouse server's memory worker does; chDB runs none). jemalloc keeps freed pages ~5 s,
        and inserts and merges free memory in one thread's arena while another allocates, so
        without this resident memory grows to about twice what the queries hold."""
        stop = threading.Event()

        def purge() -> None:
            if stop.wait(max(0.0, after_s - period_s)):
                return
            while not stop.wait(period_s):
                try:
                    self.command("SYSTEM JEMALLOC PURGE")
                except StoreError:  # an engine without the command: keep its pages
                    return

        thread = threading.Thread(target=purge, name="triscope-release-memory", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join()

    def insert_from_json_file(self, insert_sql: str, structure: str, path: Path,
                              params: Mapping[str, Any] | None = None,
                              settings: Mapping[str, int] | None = None) -> None:
        if not _SAFE_STRUCTURE.fullmatch(structure):
            raise ValueError(f"unsupported characters in structure {structure!r}")
        source = f"file({literal(str(Path(path).resolve()))}, 'JSONEachRow', '{structure}')"
        clause = _settings_clause({**_JSON_SETTINGS, **(settings or {})})
        self._run(insert_sql.replace("json_input", source) + clause, "CSV", params)

    def close(self) -> None:
        global _process_path
        with self._conn_lock:
            for conn in self._connections:
                with contextlib.suppress(Exception):  # closing is best-effort
                    conn.close()
            self._connections.clear()
        self._local = threading.local()


_SETTING_NAME = re.compile(r"[a-z_][a-z0-9_]*")


def _settings_clause(settings: Mapping[str, str | int] | None) -> str:
    """`` SETTINGS k = v, ...`` for one statement (names checked, values as escaped literals)."""
    if not settings:
        return ""
    for name, value in settings.items():
        if not _SETTING_NAME.fullmatch(name) or not isinstance(value, (str, int)):
            raise ValueError(f"bad insert setting {name!r}={value!r}")
    return " SETTINGS " + ", ".join(f"{k} = {literal(v)}" for k, v in settings.items())


_SAFE_STRUCTURE = re.compile(r"[A-Za-z0-9_ ,()]+")
_JSON_SETTINGS = {"input_format_json_read_objects_as_strings": 1}


