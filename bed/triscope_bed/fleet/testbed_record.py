"""``bench/testbed.py --record-metrics CSV``: every backend's KV usage and queue, scraped every 250 ms
during each policy's run, for held-data checks such as ``bench/kv_forecast.py``.

Columns: ``fleet, policy, backend, t_s`` (seconds since the run began), ``kv_usage, running, waiting``.
"""

from __future__ import annotations

import csv
import functools
import threading
import time
from pathlib import Path

from triscope.analyzers.routing.live import live_signals
from triscope.errors import TriscopeError
from triscope.http_fetch import fetch
from triscope.ticker import Ticker

COLUMNS = ("fleet", "policy", "backend", "t_s", "kv_usage", "running", "waiting")


class MetricsRecorder:
    """A thread per backend appending its scrapes to ``path`` while the ``with`` block runs."""

    def __init__(self, path: Path, fleet: str, policy: str, backends: dict[str, str], period_s: float = 0.25) -> None:
        self.path, self.fleet, self.policy, self.backends, self.period_s = path, fleet, policy, backends, period_s
        self.rows: list[tuple[str, str, str, float, float, float, float]] = []
        self._lock = threading.Lock()
        self._tickers = [Ticker(f"record-{n}", period_s, functools.partial(self._scrape, n, u))
                         for n, u in backends.items()]
        self._t0 = 0.0

    def _scrape(self, name: str, base_url: str) -> None:
        t = time.monotonic() - self._t0
        try:
            s = live_signals(fetch(base_url + "/metrics", timeout_s=1.0, max_bytes=4 << 20).decode(), t)
        except TriscopeError:
            return
        with self._lock:
            self.rows.append((self.fleet, self.policy, name, round(t, 3), s.kv_usage, s.running, s.waiting))

    def __enter__(self) -> MetricsRecorder:
        self._t0 = time.monotonic()
        for ticker in self._tickers:
            ticker.start()
        return self

    def __exit__(self, *exc: object) -> None:
        for ticker in self._tickers:
            ticker.stop(5.0)
        new = not self.path.exists()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a", newline="") as fh:
            out = csv.writer(fh)
            if new:
                out.writerow(COLUMNS)
            ordered = sorted(self.rows, key=lambda row: (row[2], row[3]))
            out.writerows(ordered)
