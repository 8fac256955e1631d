"""The batching writer between collectors and the store: bounded memory, disk spool, exactly-once replay.

This is the one write path for streaming telemetry. :meth:`Writer.submit` never blocks on the
store and returns once the rows are in the spool (:mod:`triscope.spool`), so a ``kill -9`` loses
no submitted row. A background thread seals a batch at ``batch_rows`` rows or
``flush_interval_s`` seconds and inserts it with ``insert_deduplication_token = <batch id>``, so
a batch replayed after a crash is dropped by ClickHouse itself. Store down: batches stay spooled
and are retried oldest first with backoff; a batch the store refuses while ``SELECT 1`` works is
bad data and moves to ``spool/rejected/``. Memory (``max_memory_rows``) and spool size
(``spool_max_bytes``, oldest dropped and counted) are bounded. Details: docs/run.md.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from triscope.backlog import Backlog, Queued
from triscope.component import ComponentConfig, non_negative, positive
from triscope.errors import ConfigError, InputError, SpoolUnavailable, StoreError
from triscope.schema import Table, known_tables
from triscope.spool import TABLE_NAME, OpenBatch, Spool
from triscope.store.base import Store
from triscope.store_link import StoreLink, one_line

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WriterConfig(ComponentConfig):
    """``[writer]``: batching, memory bound, spool and retry settings (see the module docstring)."""

    section = "writer"
    spool_dir: str = "var/triscope-spool"
    batch_rows: int = 100_000
    flush_interval_s: float = 1.0
    max_memory_rows: int = 2_000_000
    spool_max_bytes: int = 2 << 30
    fsync: bool = True
    retry_max_s: float = 30.0
    dedup_window: int = 1000

    def validate(self, where: str) -> None:
        if not self.spool_dir:
            raise ConfigError(f"{where} spool_dir must not be empty")
        positive(where, batch_rows=self.batch_rows, flush_interval_s=self.flush_interval_s,
                 max_memory_rows=self.max_memory_rows, spool_max_bytes=self.spool_max_bytes,
                 retry_max_s=self.retry_max_s)
        non_negative(where, dedup_window=self.dedup_window)


_DEFAULT = WriterConfig()
STAT_NAMES = ("rows_submitted", "rows_written", "rows_replayed", "rows_dropped", "rows_rejected",
              "batches_written", "insert_failures", "spool_failures")


class _Building:
    """The batch being filled for one (table, column set)."""

    def __init__(self, batch: OpenBatch, names: tuple[str, ...]) -> None:
        self.batch = batch
        self.columns: dict[str, list[Any]] = {n: [] for n in names}


class Writer:
    """Buffers, batches, spools and writes rows to a store (see the module docstring).

    ``store`` is a :class:`Store` or a zero-argument callable opening one; a callable is called
    again after a failure, so a server that is down at start is picked up when it comes back.
    ``tables`` are the tables it takes rows for: :func:`triscope.schema.known_tables` unless given.
    """

    def __init__(self, store: Store | Callable[[], Store], spool_dir: str, *,
                 batch_rows: int = _DEFAULT.batch_rows, flush_interval_s: float = _DEFAULT.flush_interval_s,
                 max_memory_rows: int = _DEFAULT.max_memory_rows, spool_max_bytes: int = _DEFAULT.spool_max_bytes,
                 fsync: bool = _DEFAULT.fsync, retry_max_s: float = _DEFAULT.retry_max_s,
                 dedup_window: int = _DEFAULT.dedup_window, tables: Iterable[Table] | None = None) -> None:
        self.tables = known_tables() if tables is None else {t.name: t for t in tables}
        self.link = StoreLink(store, float(retry_max_s), int(dedup_window))
        self.spool = Spool(spool_dir, fsync=fsync)
        self.batch_rows = max(1, int(batch_rows))
        self.flush_interval_s = float(flush_interval_s)
        self.fsync = fsync
        self.stats: dict[str, int] = dict.fromkeys(STAT_NAMES, 0)
        self.spool_error = ""  # the last spool (disk) failure, "" once the spool works again
        self._building: dict[tuple[str, tuple[str, ...]], _Building] = {}
        self._to_seal: list[_Building] = []
        self.backlog = Backlog(self.spool, max(self.batch_rows, int(max_memory_rows)), int(spool_max_bytes), self.stats)
        self._lock = threading.Lock()
        self._seal_lock = threading.Lock()
        self._wake = threading.Event()
        self._idle = threading.Condition(self._lock)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._recover()

    @classmethod
    def from_config(cls, config: Mapping[str, Any], store: Store | Callable[[], Store]) -> Writer:
        """A writer configured by the ``[writer]`` section (:class:`WriterConfig`)."""
        cfg = WriterConfig.from_config(config)
        kwargs = cfg.as_dict()
        return cls(store, kwargs.pop("spool_dir"), **kwargs)

    # ---- recovery -----------------------------------------------------------------------------
    def _recover(self) -> None:
        for item in self.spool.recover():
            self.backlog.items.append(Queued(item, None, replayed=True))
            self.backlog.spool_bytes += item.size
        if self.backlog.items:
            n = self.backlog.rows()
            log.info("writer: %d batch(es), %d rows in spool %s to replay", len(self.backlog.items), n, self.spool.dir)

    # ---- producer side ------------------------------------------------------------------------
    def submit(self, table: Table, columns: Mapping[str, Sequence[Any]]) -> int:
        """Queue rows for ``table`` (a :mod:`triscope.schema` table); durable in the spool when this returns.

        Raises InputError (nothing queued) when ``table`` is not one of the writer's tables or the
        columns differ in length, SpoolUnavailable (nothing queued; keep the rows and retry) when
        the disk fails. The spool records the table's name.
        """
        self.check_table(table)
        lengths = {len(v) for v in columns.values()}
        if len(lengths) > 1:
            raise InputError(f"writer: {table.name}: columns have different lengths {sorted(lengths)}")
        n = lengths.pop() if lengths else 0
        if n == 0:
            return 0
        names = tuple(columns)
        with self._lock:
            key = (table.name, names)
            try:
                building = self._building.get(key)
                if building is None:
                    building = self._building[key] = _Building(self.spool.open_batch(table.name), names)
                self.backlog.spool_bytes += building.batch.append(columns, n)
            except OSError as exc:  # disk full, out of descriptors: nothing taken, the caller keeps the rows
                self._spool_failed(exc)
                raise SpoolUnavailable(f"writer: spool {self.spool.dir} not writable: {one_line(exc)}") from None
            self.spool_error = ""
            for name in names:
                building.columns[name].extend(columns[name])
            self.backlog.memory_rows += n
            self.stats["rows_submitted"] += n
            if building.batch.rows >= self.batch_rows:
                del self._building[key]
                self._to_seal.append(building)
                self._wake.set()
        return n

    def check_table(self, table: object) -> None:
        """InputError (one line) unless ``table`` is one of the :class:`Table` objects this writer takes."""
        if not isinstance(table, Table):
            raise InputError(f"writer: rows must be submitted with a triscope.schema Table, "
                             f"got {type(table).__name__} {str(table)[:80]!r}")
        if self.tables.get(table.name) is not table or not TABLE_NAME.fullmatch(table.name):
            raise InputError(f"writer: {table.name!r} is not a table of triscope.schema "
                             f"(known: {', '.join(sorted(self.tables))})")

    # ---- consumer side ------------------------------------------------------------------------
    def start(self) -> None:
        """Start the background thread that seals and writes batches."""
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="triscope-writer", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        pause = 0.0
        while not self._stop.is_set():
            self._wake.wait(max(pause, self._next_wait()))
            self._wake.clear()
            try:
                self._seal_due(force=False)
                self._drain()
                pause = 0.0
            except OSError as exc:  # the disk failed under the spool: keep going, retry with backoff
                self._spool_failed(exc)
                pause = min(self.link.retry_max_s, max(0.5, pause * 2))

    def _spool_failed(self, exc: OSError) -> None:
        self.stats["spool_failures"] += 1
        message = one_line(exc)
        if message != self.spool_error:
            log.error("writer: spool %s failed: %s; retrying", self.spool.dir, message)
        self.spool_error = message

    def _next_wait(self) -> float:
        wait = self.flush_interval_s
        with self._lock:
            if self._building:
                oldest = min(b.batch.created for b in self._building.values())
                wait = min(wait, max(0.0, oldest + self.flush_interval_s - time.monotonic()))
            if self.backlog.items and not self.link.up:
                wait = min(wait, max(0.0, self.link.retry_at - time.monotonic()))
            elif self.backlog.items:
                wait = 0.0
        return max(wait, 0.005)

    def _seal_due(self, force: bool) -> None:
        # One sealer at a time (the writer thread, flush, close): batches reach the queue in the
        # order they filled, which the spool cap relies on, and a flush that returns has seen every
        # batch sealed, none still on its way into the queue.
        with self._seal_lock:
            now = time.monotonic()
            with self._lock:
                for key, building in list(self._building.items()):
                    if force or now - building.batch.created >= self.flush_interval_s:
                        del self._building[key]
                        self._to_seal.append(building)
                sealing, self._to_seal = self._to_seal, []
            for i, building in enumerate(sealing):
                try:
                    item = building.batch.seal(self.fsync)
                except OSError:
                    with self._lock:  # seal again on the next pass; nothing is lost
                        self._to_seal[:0] = sealing[i:]
                    raise
                with self._lock:
                    self.backlog.add(Queued(item, building.columns))

    def _drain(self) -> None:
        """Insert queued batches oldest first until the queue is empty or the store fails."""
        while not self._stop.is_set() or self._draining_on_close:
            with self._lock:
                if not self.backlog.items or self.link.waiting():
                    self._idle.notify_all()
                    return
                queued = self.backlog.in_flight = self.backlog.items[0]
            ok = self._write(queued)
            with self._lock:
                self.backlog.in_flight = None
                condemned, self.backlog.condemned = self.backlog.condemned is queued, None
                if ok is None:  # store down: retry later (unless the spool cap marked this batch)
                    if condemned:
                        self.backlog.drop(queued)
                    self._idle.notify_all()
                    return
                if self.backlog.items and self.backlog.items[0] is queued:
                    self.backlog.items.popleft()
                self.backlog.forget(queued)

    _draining_on_close = False

    def _write(self, queued: Queued) -> bool | None:
        """Insert one batch: True written, False rejected (bad data), None store unavailable."""
        item = queued.file
        lost = 0
        try:
            if queued.columns is not None:
                columns = queued.columns
            else:
                columns, lost = self.spool.load(item)
        except (OSError, StoreError) as exc:
            log.error("writer: cannot read spool file %s (%s); moving it to rejected/", item.path.name,
                      one_line(exc))
            self.spool.reject(item)
            self.stats["rows_rejected"] += item.rows
            return False
        ok = self.link.insert(item.table, columns, item.batch_id)
        if ok is None:
            self.stats["insert_failures"] += 1
            return None
        if not ok:
            self.stats["insert_failures"] += 1
            log.error("writer: store refused batch %s of %s (%d rows): %s; moved to %s", item.batch_id,
                      item.table, item.rows, self.link.last_error, self.spool.reject(item))
            self.stats["rows_rejected"] += item.rows
            return False
        self.spool.remove(item)
        self.stats["rows_rejected"] += lost
        self.stats["rows_written"] += item.rows - lost
        self.stats["batches_written"] += 1
        if queued.replayed:
            self.stats["rows_replayed"] += item.rows - lost
        return True

    # ---- control ------------------------------------------------------------------------------
    def flush(self, timeout_s: float = 30.0) -> bool:
        """Seal every batch and wait until all are in the store; False if the store stayed down."""
        self._seal_due(force=True)
        if self._thread is None:
            self._drain()
            return not self.backlog.items
        deadline = time.monotonic() + timeout_s
        with self._lock:
            self.link.retry_at = 0.0
        self._wake.set()
        with self._idle:
            while self.backlog.items or self.backlog.in_flight is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._idle.wait(min(left, 0.1))
                if self.backlog.items and self.link.waiting():
                    self._wake.set()
        return True

    def close(self, timeout_s: float = 10.0) -> bool:
        """Seal, write what the store takes within ``timeout_s``, stop; the rest stays spooled.

        Returns True when nothing is left in the spool. Safe to call twice.
        """
        if self._thread is not None:
            self._stop.set()
            self._wake.set()
            self._thread.join(timeout=timeout_s + 5)
            self._thread = None
        try:
            self._seal_due(force=True)
        except OSError as exc:  # what could not be sealed stays as .open files, sealed at the next start
            self._spool_failed(exc)
            for building in self._to_seal:
                building.batch.abandon()
            self._to_seal = []
        self._draining_on_close = True
        deadline = time.monotonic() + timeout_s
        try:
            while self.backlog.items and time.monotonic() < deadline:
                self.link.retry_at = 0.0
                self._drain()
                if self.backlog.items:
                    time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))
        finally:
            self._draining_on_close = False
        left = self.backlog.rows()
        if left:
            log.warning("writer: %d rows stay in spool %s for the next start", left, self.spool.dir)
        self.spool.close()
        self.link.close()
        return left == 0

    def snapshot(self) -> dict[str, Any]:
        """Counters and gauges for status output and metrics."""
        with self._lock:
            pending = self.backlog.rows() + sum(
                b.batch.rows for b in (*self._building.values(), *self._to_seal))
            return {**self.stats, "rows_pending": pending, "memory_rows": self.backlog.memory_rows,
                    "spool_bytes": self.backlog.spool_bytes, "store_up": self.link.up,
                    "last_error": self.link.last_error, "spool_error": self.spool_error}
