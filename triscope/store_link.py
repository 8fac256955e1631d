"""The writer's connection to the store: insert one spooled batch, tell "store down" from "bad data".

A batch is inserted with ``insert_deduplication_token = <batch id>`` so a replay is dropped by
ClickHouse itself. A failed insert is bad data when ``SELECT 1`` still works (the caller moves
the batch to ``rejected/``); otherwise the store is down and the link backs off exponentially.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from triscope.errors import one_line
from triscope.schema import qualified
from triscope.store.base import Store

log = logging.getLogger(__name__)


class StoreLink:
    """One store connection with reconnect, dedup setup and backoff (used by one thread at a time).

    ``store`` is a :class:`Store` or a zero-argument callable opening one; a callable is called
    again after a failure, so a server that is down at start is picked up when it comes back.
    """

    def __init__(self, store: Store | Callable[[], Store], retry_max_s: float, dedup_window: int) -> None:
        if isinstance(store, Store):
            self._store: Store | None = store
            self._connect: Callable[[], Store] | None = None
        else:
            self._store, self._connect = None, store
        self.retry_max_s = retry_max_s
        self.dedup_window = dedup_window
        self.up = True
        self.last_error = ""
        self.retry_at = 0.0
        self._backoff = 0.5
        self._dedup_ready: set[str] = set()

    def waiting(self) -> bool:
        """True while the store is down and its next retry is not due."""
        return not self.up and time.monotonic() < self.retry_at

    def insert(self, table: str, columns: Mapping[str, Sequence[Any]], token: str) -> bool | None:
        """True written, False refused while the store answers (bad data), None store unavailable."""
        try:
            store = self._get()
            if table not in self._dedup_ready and self.dedup_window > 0:
                store.ensure_dedup_window(table, self.dedup_window)
            self._dedup_ready.add(table)
            store.insert(qualified(store, table), columns, settings={"insert_deduplication_token": token})
        except Exception as exc:
            self.last_error = one_line(exc)
            if self._store is not None and self._healthy(self._store):
                return False
            if self.up:
                log.warning("writer: store unavailable (%s); spooling", self.last_error)
            self.up = False
            self._drop_connection()
            self.retry_at = time.monotonic() + self._backoff
            self._backoff = min(self.retry_max_s, self._backoff * 2)
            return None
        if not self.up:
            log.info("writer: store is back; replaying the spool")
        self.up, self._backoff = True, 0.5
        return True

    def _get(self) -> Store:
        if self._store is None:
            assert self._connect is not None
            self._store = self._connect()
            self._dedup_ready.clear()
        return self._store

    def _drop_connection(self) -> None:
        if self._connect is not None and self._store is not None:
            with contextlib.suppress(Exception):  # a dead connection may fail to close
                self._store.close()
            self._store = None

    @staticmethod
    def _healthy(store: Store) -> bool:
        try:
            return bool(store.query("SELECT 1").scalar() == 1)
        except Exception:
            return False

    def close(self) -> None:
        """Close a connection this link opened (a store given ready-made belongs to its owner)."""
        if self._connect is not None and self._store is not None:
            self._store.close()
            self._store = None
