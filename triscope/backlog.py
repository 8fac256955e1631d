"""The writer's backlog: sealed batches waiting for the store, oldest first, within two bounds.

Memory (``max_memory_rows``): past it, the newest queued batches drop their columns and live only
in their spool file (read back when their turn comes). Spool (``spool_max_bytes``): past it, the
oldest batches are deleted and their rows counted as dropped. The caller (:class:`~triscope.writer.Writer`)
holds its lock around every call.
"""

from __future__ import annotations

import collections
import logging
from dataclasses import dataclass
from typing import Any

from triscope.spool import Spool, SpoolFile

log = logging.getLogger("triscope.writer")


@dataclass
class Queued:
    """A sealed batch waiting for the store; ``columns`` is None when only the spool file holds it."""

    file: SpoolFile
    columns: dict[str, list[Any]] | None
    replayed: bool = False


class Backlog:
    """The queue of sealed batches and the writer's memory and spool accounting (lock held by the caller)."""

    def __init__(self, spool: Spool, max_memory_rows: int, spool_max_bytes: int, stats: dict[str, int]) -> None:
        self.spool = spool
        self.max_memory_rows = max_memory_rows
        self.spool_max_bytes = spool_max_bytes
        self.stats = stats
        self.items: collections.deque[Queued] = collections.deque()
        self.memory_rows = 0
        """Rows held in memory: the batches being filled and the queued ones that keep their columns."""
        self.spool_bytes = 0
        self.in_flight: Queued | None = None
        self.condemned: Queued | None = None
        """The in-flight batch the spool cap drops if its insert fails."""

    def rows(self) -> int:
        """Rows queued."""
        return sum(q.file.rows for q in self.items)

    def add(self, queued: Queued) -> None:
        """Queue a sealed batch, then bring memory and spool back within their bounds."""
        self.items.append(queued)
        self._spill_memory()
        self._enforce_spool_cap()

    def _spill_memory(self) -> None:
        """Keep at most max_memory_rows in memory: newest queued batches live only on disk."""
        if self.memory_rows <= self.max_memory_rows:
            return
        for queued in reversed(self.items):
            if self.memory_rows <= self.max_memory_rows:
                break
            if queued.columns is not None and queued is not self.in_flight:
                queued.columns = None
                self.memory_rows -= queued.file.rows

    def _enforce_spool_cap(self) -> None:
        """Delete the oldest batches while the spool is over its byte cap.

        The batch being inserted cannot be deleted under its insert: when it is among the oldest
        it is marked instead, dropped if that attempt fails (kept if it succeeds), and its bytes
        count as freed meanwhile, so no newer batch is deleted in its place.
        """
        for victim in list(self.items):
            marked = self.condemned.file.size if self.condemned is not None else 0
            if self.spool_bytes - marked <= self.spool_max_bytes:
                return
            if victim is self.condemned:
                continue
            if victim is self.in_flight:
                self.condemned = victim
                continue
            self.drop(victim)

    def drop(self, victim: Queued) -> None:
        """Delete a queued batch from the queue and the spool, counting its rows as lost."""
        self.items.remove(victim)
        self.forget(victim)
        self.spool.remove(victim.file)
        self.stats["rows_dropped"] += victim.file.rows
        log.warning("writer: spool over %d bytes; dropped oldest batch %s (%d rows of %s), %d rows lost so far",
                    self.spool_max_bytes, victim.file.batch_id, victim.file.rows, victim.file.table,
                    self.stats["rows_dropped"])

    def forget(self, queued: Queued) -> None:
        """Account a batch leaving the queue."""
        self.spool_bytes -= queued.file.size
        if queued.columns is not None:
            self.memory_rows -= queued.file.rows
            queued.columns = None
