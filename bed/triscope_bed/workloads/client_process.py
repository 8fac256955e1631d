"""The load generator in a process of its own, as a real client is."""

from __future__ import annotations

import asyncio
import concurrent.futures
import multiprocessing
from typing import Any

from triscope_bed.workloads.arrivals import Arrival
from triscope_bed.workloads.driver import Result, drive


def _ready() -> bool:
    return True


def _drive_here(host: str, port: int, schedule: list[Arrival], kwargs: dict[str, Any]) -> tuple[list[Result], float]:
    return asyncio.run(drive(host, port, schedule, **kwargs))


class ClientProcess:
    """Runs :func:`drive` in a process of its own, as a real client is: a picker serving in the caller's
    process then shares no interpreter lock with the client's event loop. Spawned (the caller may run
    gRPC threads, which do not survive a fork) and started on entry, so a schedule sent later starts
    at once (a scenario's timer in the caller stays in step with it)."""

    def __enter__(self) -> ClientProcess:
        ctx = multiprocessing.get_context("spawn")
        self._pool = concurrent.futures.ProcessPoolExecutor(max_workers=1, mp_context=ctx)
        self._pool.submit(_ready).result()  # imports this module there before any schedule
        return self

    def drive(self, host: str, port: int, schedule: list[Arrival], **kwargs: Any) -> tuple[list[Result], float]:
        """:func:`drive` with these arguments in the client process; blocks until the schedule is done."""
        return self._pool.submit(_drive_here, host, port, schedule, kwargs).result()

    def pids(self) -> set[int]:
        """The client's process ids."""
        return set(getattr(self._pool, "_processes", None) or {})

    def __exit__(self, *exc: object) -> None:
        self._pool.shutdown(cancel_futures=True)
