"""Figures of a GPU timeline, in exact int64 nanoseconds: busy, compute, communication, idle and its causes.

:func:`window_breakdowns` gives the figures of the timeline inside windows (the whole run, or the
``ProfilerStep`` windows of :func:`step_windows`); :mod:`triscope.analyzers.trace_breakdown` loads
the timeline of each rank from the store. Definitions: docs/trace-breakdown.md.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from triscope.analyzers.intervals import coverage

DEFAULT_KERNEL_WAIT_NS = 30_000  # HTA's consecutive_kernel_delay default (30 us)


@dataclass
class LaunchDelay:
    """Distribution of launch delays (ns)."""

    count: int = 0
    mean_ns: float = 0.0
    p50_ns: int = 0
    p95_ns: int = 0
    p99_ns: int = 0
    max_ns: int = 0


@dataclass
class IdleSplit:
    """Idle time split by cause (ns)."""

    host_wait_ns: int = 0
    kernel_wait_ns: int = 0
    other_ns: int = 0

    @property
    def total_ns(self) -> int:
        return self.host_wait_ns + self.kernel_wait_ns + self.other_ns


@dataclass
class StreamIdle:
    """Idle time of one stream split by cause (ns)."""

    stream: int
    host_wait_ns: int = 0
    kernel_wait_ns: int = 0
    other_ns: int = 0

    @property
    def total_ns(self) -> int:
        return self.host_wait_ns + self.kernel_wait_ns + self.other_ns


@dataclass
class Breakdown:
    """GPU time of one rank over one window (whole run or one step).

    ``idle_split`` splits the GPU's idle time (gaps of the union over all streams), so its parts
    add up to ``idle_ns``; ``idle_by_stream`` is the per-stream detail, whose sum over streams can
    exceed the span (streams are idle at the same time)."""

    span_ns: int = 0
    busy_ns: int = 0
    compute_ns: int = 0
    non_compute_ns: int = 0
    idle_ns: int = 0
    comm_ns: int = 0
    memory_ns: int = 0
    comm_compute_overlap_ns: int = 0
    gpu_events: int = 0
    idle_split: IdleSplit = field(default_factory=IdleSplit)
    idle_by_stream: list[StreamIdle] = field(default_factory=list)
    launch_delay: LaunchDelay = field(default_factory=LaunchDelay)

    @property
    def host_wait_ns(self) -> int:
        return self.idle_split.host_wait_ns

    @property
    def kernel_wait_ns(self) -> int:
        return self.idle_split.kernel_wait_ns

    @property
    def other_idle_ns(self) -> int:
        return self.idle_split.other_ns

    @property
    def stream_sum(self) -> IdleSplit:
        """The per-stream idle split summed over streams (HTA's idle time breakdown adds these)."""
        return IdleSplit(sum(s.host_wait_ns for s in self.idle_by_stream),
                         sum(s.kernel_wait_ns for s in self.idle_by_stream),
                         sum(s.other_ns for s in self.idle_by_stream))

    def pct(self, part_ns: int) -> float:
        """``part_ns`` as a percentage of the span."""
        return 100.0 * part_ns / self.span_ns if self.span_ns else 0.0

    @property
    def overlap_ratio(self) -> float:
        """Share of communication time overlapped by compute (0 when there is no communication)."""
        return self.comm_compute_overlap_ns / self.comm_ns if self.comm_ns else 0.0

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out.update(
            host_wait_ns=self.host_wait_ns, kernel_wait_ns=self.kernel_wait_ns, other_idle_ns=self.other_idle_ns,
            idle_split_stream_sum=asdict(self.stream_sum),
            compute_pct=round(self.pct(self.compute_ns), 4), non_compute_pct=round(self.pct(self.non_compute_ns), 4),
            idle_pct=round(self.pct(self.idle_ns), 4), comm_compute_overlap_ratio=round(self.overlap_ratio, 6),
        )
        return out


def _percentile(sorted_values: np.ndarray, q: float) -> int:
    """Nearest-rank percentile of an ascending array."""
    if sorted_values.size == 0:
        return 0
    rank = max(1, int(np.ceil(q / 100.0 * sorted_values.size)))
    return int(sorted_values[rank - 1])


def _launch_delay(delays: np.ndarray) -> LaunchDelay:
    if delays.size == 0:
        return LaunchDelay()
    d = np.sort(delays)
    return LaunchDelay(count=int(d.size), mean_ns=float(d.mean()), p50_ns=_percentile(d, 50),
                       p95_ns=_percentile(d, 95), p99_ns=_percentile(d, 99), max_ns=int(d[-1]))


_HOST, _KERNEL, _OTHER = 0, 1, 2
_NO_LAUNCH = np.iinfo(np.int64).max


def _gaps(start: np.ndarray, end: np.ndarray, launch_ts: np.ndarray, has_launch: np.ndarray,
          kernel_wait_ns: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The gaps of the union of ``[start, end)`` as (gap start, gap end, cause).

    Cause: host wait when the item that ends the gap was launched after the gap began (the GPU
    waited for the CPU), else kernel wait when shorter than ``kernel_wait_ns``, else other. Of
    items starting together, the earliest launched one decides."""
    if start.size < 2:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, empty
    order = np.lexsort((np.where(has_launch, launch_ts, _NO_LAUNCH), start))
    s, reach = start[order], np.maximum.accumulate(end[order])
    after = np.flatnonzero(s[1:] > reach[:-1]) + 1
    gs, ge, nxt = reach[after - 1], s[after], order[after]
    host = has_launch[nxt] & (launch_ts[nxt] > gs)
    return gs, ge, np.where(host, _HOST, np.where(ge - gs < kernel_wait_ns, _KERNEL, _OTHER))


def _split_in(gaps: tuple[np.ndarray, np.ndarray, np.ndarray], lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """Gap time of each cause inside each window: shape (3, windows)."""
    gs, ge, cause = gaps
    return np.stack([coverage(gs[cause == c], ge[cause == c], lo, hi) for c in (_HOST, _KERNEL, _OTHER)])


def window_breakdowns(cols: dict[str, np.ndarray], lo: np.ndarray, hi: np.ndarray,
                      kernel_wait_ns: int = DEFAULT_KERNEL_WAIT_NS) -> list[Breakdown]:
    """Breakdown of the GPU timeline in each window ``[lo[i], hi[i])``: work is clipped to the window.

    Gaps are found on the whole timeline of ``cols`` and then clipped, so a gap that crosses a
    window edge keeps its cause; every nanosecond of GPU time counts in the windows it lies in."""
    lo, hi = np.asarray(lo, dtype=np.int64), np.asarray(hi, dtype=np.int64)
    start = cols["ts_ns"]
    end = start + cols["dur_ns"]
    klass, stream, launch_ts = cols["kernel_class"], cols["stream"], cols["launch_ts"]
    has_launch = launch_ts >= 0
    compute, comm, memory = klass == "compute", klass == "comm", klass == "memory"

    def cov(mask: np.ndarray | None = None) -> np.ndarray:
        return coverage(start, end, lo, hi) if mask is None else coverage(start[mask], end[mask], lo, hi)

    busy, compute_ns, comm_ns = cov(), cov(compute), cov(comm)
    overlap = compute_ns + comm_ns - cov(compute | comm)  # |A and B| = |A| + |B| - |A or B|
    memory_ns = cov(memory)
    gpu_split = _split_in(_gaps(start, end, launch_ts, has_launch, kernel_wait_ns), lo, hi)
    per_stream = []
    for sid in np.unique(stream):
        m = stream == sid
        split = _split_in(_gaps(start[m], end[m], launch_ts[m], has_launch[m], kernel_wait_ns), lo, hi)
        per_stream.append((int(sid), split, cov(m)))
    by_start = np.argsort(start, kind="stable")
    first = np.searchsorted(start[by_start], lo, side="left")
    last = np.searchsorted(start[by_start], hi, side="left")
    delays = np.maximum(start - cols["launch_end"], 0)
    out = []
    for i in range(lo.size):
        items = by_start[first[i]:last[i]]
        out.append(Breakdown(
            span_ns=int(hi[i] - lo[i]), busy_ns=int(busy[i]), compute_ns=int(compute_ns[i]),
            non_compute_ns=int(busy[i] - compute_ns[i]), idle_ns=int(hi[i] - lo[i] - busy[i]),
            comm_ns=int(comm_ns[i]), memory_ns=int(memory_ns[i]), comm_compute_overlap_ns=int(overlap[i]),
            gpu_events=int(items.size), idle_split=IdleSplit(*(int(v) for v in gpu_split[:, i])),
            idle_by_stream=[StreamIdle(sid, *(int(v) for v in split[:, i])) for sid, split, on in per_stream
                            if on[i] or split[:, i].any()],
            launch_delay=_launch_delay(delays[items[has_launch[items]]]),
        ))
    return out


def breakdown_of(cols: dict[str, np.ndarray], mask: np.ndarray | None = None,
                 kernel_wait_ns: int = DEFAULT_KERNEL_WAIT_NS) -> Breakdown:
    """Breakdown of the GPU work rows in ``cols`` (optionally only where ``mask``), from the first start to the
    last end."""
    if mask is not None:
        cols = {k: v[mask] for k, v in cols.items()}
    start = cols["ts_ns"]
    if start.size == 0:
        return Breakdown()
    lo, hi = start.min(), (start + cols["dur_ns"]).max()
    return window_breakdowns(cols, np.array([lo]), np.array([hi]), kernel_wait_ns)[0]


def step_windows(cols: dict[str, np.ndarray], steps: list[tuple[int, int, int]]) -> tuple[np.ndarray, np.ndarray]:
    """The GPU window ``[lo, hi)`` of each ``(number, cpu start, cpu duration)`` step, in order, without overlap.

    Step N's window ends where the last GPU work launched before step N+1 began ends (the last
    step: the last launched work), and starts where step N-1's window ends (the first: at the
    first launched work). The windows tile the GPU timeline: each nanosecond of GPU time belongs
    to one step, and the windows of all but the last step cover exactly the whole-run span with
    the last step dropped. Work of step N still running after its window ends counts in step
    N+1's figures from then on; a step whose work ended no later than the previous window gets an
    empty window."""
    k = len(steps)
    launch = cols["launch_ts"]
    launched = launch >= 0
    if k == 0 or not launched.any():
        return np.zeros(k, dtype=np.int64), np.zeros(k, dtype=np.int64)
    order = np.argsort(launch[launched], kind="stable")
    by_launch = launch[launched][order]
    start = cols["ts_ns"][launched][order]
    reach = np.maximum.accumulate(start + cols["dur_ns"][launched][order])
    bounds = np.array([ts for _, ts, _ in steps[1:]] + [np.iinfo(np.int64).max], dtype=np.int64)
    launched_before = np.searchsorted(by_launch, bounds, side="left")
    first = int(start.min())
    ends = np.where(launched_before > 0, reach[np.maximum(launched_before - 1, 0)], first)
    hi = np.maximum.accumulate(np.maximum(ends, first))
    lo = np.concatenate([[first], hi[:-1]])
    return lo, hi
