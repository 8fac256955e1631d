"""Timestamps of a periodic sampler, snapped to its tick grid when the wake-up was only a little late.

A sampler woken every ``period`` stamps each sample with ``time_ns()``, which carries the scheduler's
wake-up jitter (tens to hundreds of microseconds). That jitter is noise, not information, and it is
what a delta-of-delta timestamp codec cannot compress: a grid of exact periods costs about 0.01 bytes
per stamp, a jittered one 1.5 to 2. Prometheus aligns scrape timestamps the same way: a stamp within
``min(period / 100, 2 ms)`` of the previous stamp plus a whole number of periods is moved onto that
grid point; a later or earlier stamp starts a new grid, so no stamp is ever off by more than the
tolerance, and stamps keep increasing.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

MAX_TOLERANCE_NS = 2_000_000
"""Prometheus' scrape timestamp tolerance (2 ms), clamped further to 1 % of the period."""


def tolerance_ns(period_ns: int) -> int:
    """How far a stamp may be moved: 1 % of the period, at most 2 ms."""
    return max(0, min(period_ns // 100, MAX_TOLERANCE_NS))


class TickClock:
    """``now_ns()`` for a sampler that runs every ``period_s``: wall-clock nanoseconds on its tick grid."""

    def __init__(self, period_s: float, last_ns: int | None = None) -> None:
        self.period_ns = max(1, round(float(period_s) * 1e9))
        self.tolerance_ns = tolerance_ns(self.period_ns)
        self._last = last_ns

    def now_ns(self, now_ns: int | None = None) -> int:
        """The stamp for a sample taken now (or at ``now_ns``): on the grid if within tolerance."""
        stamp = snap(time.time_ns() if now_ns is None else int(now_ns), self._last, self.period_ns,
                     self.tolerance_ns)
        self._last = stamp
        return stamp


def snap(now_ns: int, last_ns: int | None, period_ns: int, tol_ns: int) -> int:
    """``now_ns`` moved to ``last_ns + k * period_ns`` (k >= 1: missed ticks allowed) when within ``tol_ns``."""
    if last_ns is None or tol_ns <= 0 or now_ns <= last_ns:
        return now_ns
    k = max(1, round((now_ns - last_ns) / period_ns))
    grid = last_ns + k * period_ns
    return grid if abs(now_ns - grid) <= tol_ns else now_ns


def snap_series(stamps_ns: Sequence[int], period_s: float, last_ns: int | None = None) -> list[int]:
    """:class:`TickClock`'s stamps for a series of raw stamps (oldest first), continuing from ``last_ns``."""
    clock = TickClock(period_s, last_ns)
    return [clock.now_ns(raw) for raw in stamps_ns]


__all__: Sequence[str] = ["MAX_TOLERANCE_NS", "TickClock", "snap", "snap_series", "tolerance_ns"]
