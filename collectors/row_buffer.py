"""A bounded, thread-safe row buffer and a small flush loop that writes it to the store in batches.

Used by the OTLP receiver and the in-process span exporter. Under ``triscope run`` the daemon
drains the buffer through the Collector protocol and hands batches to its writer; standalone
(tests, embedding in a serving process) :class:`FlushLoop` writes batches itself: every
``interval_s`` or as soon as ``batch_rows`` rows are waiting. A failed insert puts its rows back
(up to the buffer bound) so a store outage loses nothing until the buffer is full.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Mapping
from typing import Any

from triscope.schema import qualified
from triscope.store import Store

log = logging.getLogger(__name__)


class RowBuffer:
    """Row dictionaries per table, at most ``max_rows`` in all."""

    def __init__(self, columns: Mapping[str, list[str]], max_rows: int = 1_000_000) -> None:
        self._columns = {t: list(c) for t, c in columns.items()}
        self._rows: dict[str, list[dict[str, Any]]] = {t: [] for t in columns}
        self._lock = threading.Lock()
        self.max_rows = max_rows
        self.dropped = 0
        self.ready = threading.Event()
        self.batch_rows = max_rows

    def __len__(self) -> int:
        with self._lock:
            return sum(len(r) for r in self._rows.values())

    def room(self) -> int:
        """Rows that still fit."""
        return max(0, self.max_rows - len(self))

    def add(self, table: str, rows: Iterable[dict[str, Any]], front: bool = False) -> int:
        """Append rows (all or nothing); returns the count added, 0 when they do not fit."""
        rows = list(rows)
        with self._lock:
            total = sum(len(r) for r in self._rows.values())
            if total + len(rows) > self.max_rows:
                self.dropped += len(rows) if front else 0
                return 0
            if front:
                self._rows[table][:0] = rows
            else:
                self._rows[table].extend(rows)
            if total + len(rows) >= self.batch_rows:
                self.ready.set()
        return len(rows)

    def drain(self) -> dict[str, dict[str, list[Any]]]:
        """Everything buffered, column-oriented per table; tables with no rows are left out."""
        with self._lock:
            taken, self._rows = self._rows, {t: [] for t in self._rows}
            self.ready.clear()
        out: dict[str, dict[str, list[Any]]] = {}
        for table, rows in taken.items():
            if rows:
                out[table] = {c: [r[c] for r in rows] for c in self._columns[table]}
        return out

    def restore(self, table: str, columns: Mapping[str, list[Any]]) -> None:
        """Put a drained batch back at the front (after a failed write)."""
        names = list(columns)
        n = len(columns[names[0]]) if names else 0
        self.add(table, ({c: columns[c][i] for c in names} for i in range(n)), front=True)


class FlushLoop:
    """Background thread writing a :class:`RowBuffer` to ``store``."""

    def __init__(self, store: Store, buffer: RowBuffer, interval_s: float = 1.0,
                 batch_rows: int = 100_000) -> None:
        self.store = store
        self.buffer = buffer
        self.interval_s = interval_s
        buffer.batch_rows = batch_rows
        self.written = 0
        self.failures = 0
        self.last_error = ""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._flush_lock = threading.Lock()

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="triscope-flush", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.buffer.ready.wait(self.interval_s)
            self.flush()

    def flush(self) -> int:
        """Write everything buffered now; returns rows written. Failed batches go back to the buffer."""
        written = 0
        with self._flush_lock:
            for table, columns in self.buffer.drain().items():
                try:
                    written += self.store.insert(qualified(self.store, table), columns)
                except Exception as exc:
                    self.failures += 1
                    self.last_error = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                    log.warning("store write of %s failed, will retry: %s", table, self.last_error)
                    self.buffer.restore(table, columns)
        self.written += written
        return written

    def close(self) -> None:
        """Stop the thread and write what is left; safe to call twice."""
        self._stop.set()
        self.buffer.ready.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None
        self.flush()
