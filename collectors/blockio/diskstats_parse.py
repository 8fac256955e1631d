"""/proc/diskstats: the kernel's per-device IO counters, and latency and queue depth between two snapshots.

The fallback source of ``io_latency`` when bpftrace cannot run (:mod:`.diskstats`): means, not
histograms, since the kernel keeps only sums of ticks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from triscope.errors import InputError


@dataclass(frozen=True)
class DiskStat:
    """The /proc/diskstats counters the IO tables use (ticks in milliseconds)."""

    major: int
    minor: int
    name: str
    reads: int
    read_ticks_ms: int
    writes: int
    write_ticks_ms: int
    in_flight: int
    io_ticks_ms: int
    weighted_ticks_ms: int


def parse_diskstats(text: str) -> dict[str, DiskStat]:
    """/proc/diskstats lines (14, 18 or 20 fields) by device name; bad lines raise InputError."""
    out = {}
    for line in text.splitlines():
        f = line.split()
        if not f or line.lstrip().startswith("#"):
            continue
        if len(f) < 14:
            raise InputError(f"diskstats: expected >= 14 fields, got {len(f)}: {line.strip()[:80]!r}")
        try:
            v = [int(x) for x in f[3:14]]
            out[f[2]] = DiskStat(int(f[0]), int(f[1]), f[2], v[0], v[3], v[4], v[7], v[8], v[9], v[10])
        except ValueError:
            raise InputError(f"diskstats: non-integer field: {line.strip()[:80]!r}") from None
    return out


@dataclass(frozen=True)
class DiskDelta:
    """Per-device figures between two diskstats snapshots, per op."""

    device: str
    op: str
    ios: float
    mean_seconds: float
    queue_depth: float


def diskstats_delta(before: dict[str, DiskStat], after: dict[str, DiskStat], interval_s: float) -> list[DiskDelta]:
    """Average latency per op (ticks delta / ios delta) and queue depth (weighted ticks delta /
    interval, shared by both ops since the kernel keeps one counter) for devices in both snapshots."""
    out = []
    for name, a in after.items():
        b = before.get(name)
        if b is None:
            continue
        qd = max(a.weighted_ticks_ms - b.weighted_ticks_ms, 0) / 1000.0 / interval_s if interval_s > 0 else math.nan
        for op, n1, n0, t1, t0 in (("read", a.reads, b.reads, a.read_ticks_ms, b.read_ticks_ms),
                                   ("write", a.writes, b.writes, a.write_ticks_ms, b.write_ticks_ms)):
            ios = max(n1 - n0, 0)
            mean = (max(t1 - t0, 0) / 1000.0 / ios) if ios else math.nan
            out.append(DiskDelta(name, op, float(ios), mean, qd))
    return out
