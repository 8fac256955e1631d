"""Shared pieces of the real-disk tests (block IO, IO stalls, the daemon): a /proc/diskstats sampler, synced writes."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple


class Bracket(NamedTuple):
    """(lo, hi) bounds of each diskstats counter's change over a window."""

    reads: tuple[float, float]
    read_ms: tuple[float, float]
    """Milliseconds spent by reads (field 4): the summed residence of the reads completed."""
    weighted_ms: tuple[float, float]
    """Weighted milliseconds (field 11): the residence of every request, flushes included."""


class DiskstatsSampler(threading.Thread):
    """(ns, reads completed, ms reading, weighted ms doing IO) of one device every ~10 ms, until
    ``stop`` is set.

    ``spans`` holds each reading with ``clock`` (wall ns by default) read just before and just
    after reading /proc/diskstats: the counters were current at some instant inside that span (a
    thread can be preempted between the read and a single timestamp, by milliseconds under load).
    ``samples`` stamps each reading with the later clock. Compare against kernel-clock windows
    with ``clock=time.monotonic_ns``: no wall/monotonic offset then enters the comparison.
    """

    def __init__(self, device: str, clock: Callable[[], int] = time.time_ns) -> None:
        super().__init__(daemon=True)
        self.device = device
        self.clock = clock
        self.spans: list[tuple[int, int, float, float, float]] = []
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            before = self.clock()
            text = Path("/proc/diskstats").read_text()
            after = self.clock()
            for line in text.splitlines():
                f = line.split()
                if f[2] == self.device:
                    self.spans.append((before, after, float(f[3]), float(f[6]), float(f[13])))
            time.sleep(0.01)

    @property
    def samples(self) -> list[tuple[int, float, float]]:
        """(ns, reads completed, weighted ms) of each reading, stamped with the later clock."""
        return [(after, reads, weighted) for _, after, reads, _, weighted in self.spans]

    def bracket(self, t0: int, t1: int) -> Bracket:
        """Bounds of the change of each counter over [t0, t1]: the counters only grow, so the change
        lies between the samples surely inside and surely outside the window (a sample is surely
        after t0 when its read began at or after t0, surely before t0 when it ended at or before t0)."""
        s = self.spans
        assert s[0][1] <= t0 < t1 <= s[-1][0], "window outside the sampled span"
        before0 = max((x for x in s if x[1] <= t0), key=lambda x: x[1])
        after0 = min((x for x in s if x[0] >= t0), key=lambda x: x[0])
        before1 = max((x for x in s if x[1] <= t1), key=lambda x: x[1])
        after1 = min((x for x in s if x[0] >= t1), key=lambda x: x[0])
        return Bracket(*((before1[i] - after0[i], after1[i] - before0[i]) for i in (2, 3, 4)))


def synced_write(path: Path, size: int) -> None:
    """Write ``size`` random bytes to ``path`` and fsync: real disk IO for block-IO collectors to see."""
    with path.open("wb") as fh:
        fh.write(os.urandom(size))
        fh.flush()
        os.fsync(fh.fileno())


def _device_irq_counts() -> dict[str, list[int]]:
    """``{irq number: per-CPU counts}`` of the numbered (device) lines of /proc/interrupts."""
    lines = Path("/proc/interrupts").read_text().splitlines()
    cpus = len(lines[0].split())
    counts = {}
    for line in lines[1:]:
        name, _, rest = line.partition(":")
        fields = rest.split()
        if name.strip().isdigit() and len(fields) >= cpus and all(f.isdigit() for f in fields[:cpus]):
            counts[name.strip()] = [int(f) for f in fields[:cpus]]
    return counts


def cpus_apart_from_disk_irq(probe: Path) -> set[int] | None:
    """The CPUs this process may run on that did not take the completion interrupts of synced
    writes to ``probe``'s disk (the busiest device interrupt during them); None when every CPU did
    or the interrupts cannot be read.

    Why: BPF programs on classic tracepoints share one per-CPU guard, so a completion interrupt
    arriving while an issue probe runs on that CPU is skipped (``recursion_misses``; ~17 % of
    fio's completions on the 2-CPU CI machine, 0.02 % with fio on the other CPU). Tests that
    check the collector's arithmetic against diskstats run their IO apart from that CPU; one test
    provokes the skips on purpose."""
    try:
        before = _device_irq_counts()
        for _ in range(40):
            synced_write(probe, 64 << 10)
        after = _device_irq_counts()
    except (OSError, IndexError):
        return None
    deltas = {irq: [a - b for a, b in zip(after[irq], before.get(irq, after[irq]), strict=True)] for irq in after}
    busiest = max(deltas.values(), key=sum, default=None)
    if busiest is None or sum(busiest) < 20:
        return None
    apart = os.sched_getaffinity(0) - {cpu for cpu, n in enumerate(busiest) if n}
    return apart or None
