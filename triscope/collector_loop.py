"""One collector's thread: call ``collect()`` every ``interval_s`` and hand the rows to the writer.

Nothing a source or the disk does stops the loop: a failing ``collect()`` is counted and logged
once per new message; rows the writer cannot take (spool disk full, out of file descriptors)
stay in memory, up to ``max_pending_rows`` (oldest dropped and counted past it), and are handed
over again with a backoff of at most ``retry_max_s`` (1 s) until the spool works, so they reach it
within a second or two of space returning. The last collect at shutdown hands them over whatever
the backoff; what the spool still refuses then is counted as lost.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

from triscope.component import MAX_INTERVAL_S, Collector, ReportsErrors, ReportsGaps, Rows, Submit
from triscope.errors import InputError, SpoolUnavailable, one_line
from triscope.schema import Table
from triscope.writer import Writer

log = logging.getLogger(__name__)


def _length(columns: Rows) -> int:
    return max((len(v) for v in columns.values()), default=0)


class RowCounter:
    """Rows one collector handed to the writer, per table: whether the daemon submitted them
    from ``collect()`` or the collector itself through ``context.submit`` (push receivers)."""

    def __init__(self, submit: Submit) -> None:
        self._submit = submit
        self._lock = threading.Lock()
        self.rows = 0
        self.by_table: dict[str, int] = {}

    def add(self, table: Table, n: int) -> None:
        with self._lock:
            self.rows += n
            self.by_table[table.name] = self.by_table.get(table.name, 0) + n

    def submit(self, table: Table, columns: Rows) -> int:
        """``Context.submit`` for this collector: the writer's, counted."""
        n = self._submit(table, columns)
        self.add(table, n)
        return n


class CollectorLoop(threading.Thread):
    """Calls one collector every ``interval_s`` and submits its rows."""

    def __init__(self, collector: Collector, writer: Writer, stop: threading.Event,
                 max_pending_rows: int = 200_000, retry_max_s: float = 1.0,
                 counter: RowCounter | None = None) -> None:
        super().__init__(name=f"collect-{collector.name}", daemon=True)
        self.collector, self.writer, self.stop = collector, writer, stop
        self.counter = counter or RowCounter(writer.submit)
        self.interval_s = min(max(0.001, float(collector.interval_s)), MAX_INTERVAL_S)
        self.max_pending_rows = max_pending_rows
        self.retry_max_s = retry_max_s
        self.errors = 0
        self.last_error = ""
        self.rows_dropped = 0
        self.pending: list[tuple[Table, Rows]] = []
        self.pending_rows = 0
        self._retry_at = 0.0
        self._backoff = 0.0

    def _error(self, message: str) -> None:
        self.errors += 1
        if message != self.last_error:  # one line per new problem, not one per tick
            log.warning("collector %s: %s", self.collector.name, message)
        self.last_error = message

    def collect_once(self, final: bool = False) -> int:
        """One collect() and submit; errors are logged and counted, never raised. ``final`` (shutdown):
        the held rows are handed over now, whatever the backoff."""
        try:
            out = self.collector.collect()
        except Exception as exc:
            self._error(f"collect failed: {one_line(exc)}")
            out = {}
        # Per-source failures of a collector that still returned rows (one target of many): counted
        # here, logged by the collector once per change of state.
        if isinstance(self.collector, ReportsErrors):
            for message in self.collector.take_errors():
                self.errors += 1
                self.last_error = message
        for table, columns in (out or {}).items():
            if not isinstance(table, Table):  # a contract slip: say so once, never hand it on
                self._error(f"collect() must key rows by triscope.schema Table, got {type(table).__name__} "
                            f"{str(table)[:80]!r}")
            elif _length(columns):
                self.pending.append((table, columns))
                self.pending_rows += _length(columns)
        return self._hand_over(force=final)

    def _hand_over(self, force: bool = False) -> int:
        """Submit pending rows oldest first; keep what the writer cannot take (bounded)."""
        if time.monotonic() < self._retry_at and not force:
            self._bound_pending()
            return 0
        n = 0
        while self.pending:
            table, columns = self.pending[0]
            try:
                k = self.writer.submit(table, columns)
            except InputError as exc:
                self._error(str(exc))
                k = 0
            except (SpoolUnavailable, OSError) as exc:
                self._error(one_line(exc))
                self._backoff = min(self.retry_max_s, max(self.interval_s, self._backoff * 2 or 0.5))
                self._retry_at = time.monotonic() + self._backoff
                break
            except Exception as exc:
                self._error(f"submit failed: {one_line(exc)}")
                k = 0
            self.pending.pop(0)
            self.pending_rows -= _length(columns)
            n += k
            self.counter.add(table, k)
        else:
            self._backoff = 0.0
        self._bound_pending()
        return n

    def _bound_pending(self) -> None:
        while self.pending_rows > self.max_pending_rows and len(self.pending) > 1:
            _table, columns = self.pending.pop(0)
            lost = _length(columns)
            self.pending_rows -= lost
            self.rows_dropped += lost
            self._error(f"{self.rows_dropped} rows dropped: the writer could not take them "
                        f"and more than {self.max_pending_rows} were waiting")

    def run(self) -> None:
        deadline = time.monotonic()
        while not self.stop.is_set():
            self.collect_once()
            deadline += self.interval_s
            now = time.monotonic()
            if deadline < now:  # overran: skip the missed ticks rather than bursting
                deadline = now + self.interval_s
            self.stop.wait(deadline - now)

    @property
    def rows(self) -> int:
        return self.counter.rows

    @property
    def rows_lost(self) -> int:
        """Rows the writer never took: dropped past the bound, or still held at the end."""
        return self.rows_dropped + self.pending_rows

    def counters(self) -> dict[str, Any]:
        """rows, errors, last error, rows waiting for the writer, rows dropped, rows per table, and the
        collector's own count of the gaps it knows of in its rows (``gaps()``, where it has one)."""
        gaps = dict(self.collector.gaps()) if isinstance(self.collector, ReportsGaps) else {}
        return {"rows": self.rows, "errors": self.errors, "last_error": self.last_error,
                "pending_rows": self.pending_rows, "rows_dropped": self.rows_dropped,
                "tables": dict(self.counter.by_table), "gaps": gaps}


__all__: Sequence[str] = ["CollectorLoop", "RowCounter"]
