"""Shared pieces of the real-disk tests (block IO, IO stalls, the daemon): a /proc/diskstats sampler, synced writes."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path


class DiskstatsSampler(threading.Thread):
    """(wall ns, reads completed, weighted ms doing IO) of one device every ~10 ms, until ``stop`` is set."""

    def __init__(self, device: str) -> None:
        super().__init__(daemon=True)
        self.device = device
        self.samples: list[tuple[int, float, float]] = []
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            for line in Path("/proc/diskstats").read_text().splitlines():
                f = line.split()
                if f[2] == self.device:
                    self.samples.append((time.time_ns(), float(f[3]), float(f[13])))
            time.sleep(0.01)

    def bracket(self, t0: int, t1: int) -> tuple[tuple[float, float], tuple[float, float]]:
        """Bounds of the change of (reads completed, weighted ms) over [t0, t1]: both counters only
        grow, so the change lies between the samples just inside and just outside the window."""
        s = self.samples
        assert s[0][0] <= t0 < t1 <= s[-1][0], "window outside the sampled span"
        before0 = max(x for x in s if x[0] <= t0)
        after0 = min((x for x in s if x[0] >= t0), key=lambda x: x[0])
        before1 = max(x for x in s if x[0] <= t1)
        after1 = min((x for x in s if x[0] >= t1), key=lambda x: x[0])
        return tuple((before1[i] - after0[i], after1[i] - before0[i]) for i in (1, 2))  # type: ignore[return-value]


def synced_write(path: Path, size: int) -> None:
    """Write ``size`` random bytes to ``path`` and fsync: real disk IO for block-IO collectors to see."""
    with path.open("wb") as fh:
        fh.write(os.urandom(size))
        fh.flush()
        os.fsync(fh.fileno())
