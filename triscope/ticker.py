"""A thread calling a function every ``period_s``: a ticker that skips the ticks it missed.

Used where something is watched on a fixed period (the picker's scrapes and feed polls, the test bed's
recorder and peers' scrapers): a step that overruns its period starts the next one at once instead of
running a backlog.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class Ticker:
    """Calls ``step()`` every ``period_s`` on its own daemon thread until :meth:`stop`."""

    def __init__(self, name: str, period_s: float, step: Callable[[], None]) -> None:
        self.period_s, self.step = period_s, step
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float) -> None:
        """Stop ticking and wait up to ``timeout_s`` for a step in progress."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=timeout_s)

    def _run(self) -> None:
        next_at = time.monotonic()
        while not self._stop.is_set():
            self.step()
            next_at = max(next_at + self.period_s, time.monotonic())
            self._stop.wait(max(0.0, next_at - time.monotonic()))
