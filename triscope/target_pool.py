"""The one target pool of every scraper: each target's fetch on at most ``max_parallel`` threads,
one fetch in flight per target, and a collect bounded by ``ceil(targets / max_parallel) x timeout_s``
plus a grace second whatever the targets do (a trickling or hung one is reported, never waited for
past the bound, and not fetched again while its previous fetch runs).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Generic, TypeVar

T = TypeVar("T")

GRACE_S = 1.0
"""Waited beyond the fetch deadlines for threads to hand their results back."""


class TargetPool(Generic[T]):
    """``run({key: fetch})``: the fetches of one collect, each target's future (or None if still busy)."""

    def __init__(self, name: str, max_parallel: int, timeout_s: float) -> None:
        self.name = name
        self.max_parallel = max(1, max_parallel)
        self.timeout_s = timeout_s
        self._pool: ThreadPoolExecutor | None = None
        self._running: dict[str, Future[T]] = {}

    def busy(self, key: str) -> bool:
        """Whether ``key``'s previous fetch is still running."""
        future = self._running.get(key)
        return future is not None and not future.done()

    def run(self, fetches: Mapping[str, Callable[[], T]]) -> dict[str, Future[T] | None]:
        """Start every fetch whose target is not busy and wait for them within the bound.

        Returns each key's future (done, or still running past the bound) or None when the previous
        fetch of that target had not finished, so this one was not started.
        """
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=max(1, min(self.max_parallel, len(fetches))),
                                            thread_name_prefix=self.name)
        out: dict[str, Future[T] | None] = {}
        for key, fn in fetches.items():
            if self.busy(key):
                out[key] = None
                continue
            out[key] = self._running[key] = self._pool.submit(fn)
        started = [f for f in out.values() if f is not None]
        if started:
            waves = math.ceil(len(started) / max(1, min(self.max_parallel, len(fetches))))
            wait(started, timeout=waves * self.timeout_s + GRACE_S)
        return out

    def close(self) -> None:
        """Stop the threads without waiting for a fetch in flight (each ends by its deadline); safe twice."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
        self._running.clear()


__all__ = ["GRACE_S", "TargetPool"]
