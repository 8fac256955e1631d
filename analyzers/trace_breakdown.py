"""Per-rank and per-step breakdown of GPU time in a Kineto trace run, in exact int64 nanoseconds.

Span, busy, compute, non-compute and idle time, idle split per stream (host wait, kernel wait, other),
comm/compute overlap and launch delay; whole-run figures drop the last ``ProfilerStep`` as
HolisticTraceAnalysis does. Definitions: docs/trace-breakdown.md.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from triscope.analyzers.intervals import intersection_length, union_length
from triscope.errors import InputError
from triscope.schema import TRACE_EVENTS, TRACE_RUNS, qualified
from triscope.store.base import Store

DEFAULT_KERNEL_WAIT_NS = 30_000  # HTA's consecutive_kernel_delay default (30 us)
GPU_WORK = "kind IN ('kernel', 'memcpy', 'memset')"
"""SQL condition selecting GPU work in ``trace_events`` (shared with the stall classifier)."""
_STEP_NUMBER = re.compile(r"ProfilerStep\s*#\s*(\d+)")


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
    """GPU time of one rank over one window (whole run or one step)."""

    span_ns: int = 0
    busy_ns: int = 0
    compute_ns: int = 0
    non_compute_ns: int = 0
    idle_ns: int = 0
    comm_ns: int = 0
    memory_ns: int = 0
    comm_compute_overlap_ns: int = 0
    gpu_events: int = 0
    idle_by_stream: list[StreamIdle] = field(default_factory=list)
    launch_delay: LaunchDelay = field(default_factory=LaunchDelay)

    @property
    def host_wait_ns(self) -> int:
        return sum(s.host_wait_ns for s in self.idle_by_stream)

    @property
    def kernel_wait_ns(self) -> int:
        return sum(s.kernel_wait_ns for s in self.idle_by_stream)

    @property
    def other_idle_ns(self) -> int:
        return sum(s.other_ns for s in self.idle_by_stream)

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
            compute_pct=round(self.pct(self.compute_ns), 4), non_compute_pct=round(self.pct(self.non_compute_ns), 4),
            idle_pct=round(self.pct(self.idle_ns), 4), comm_compute_overlap_ratio=round(self.overlap_ratio, 6),
        )
        return out


@dataclass
class StepBreakdown:
    step: int
    cpu_start_ns: int
    cpu_dur_ns: int
    breakdown: Breakdown


@dataclass
class RankBreakdown:
    rank: int
    whole: Breakdown
    steps: list[StepBreakdown]
    last_step_dropped: bool

    def to_dict(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "last_step_dropped": self.last_step_dropped,
            "whole": self.whole.to_dict(),
            "steps": [{"step": s.step, "cpu_start_ns": s.cpu_start_ns, "cpu_dur_ns": s.cpu_dur_ns,
                       **s.breakdown.to_dict()} for s in self.steps],
        }


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


def _stream_idle(stream: np.ndarray, start: np.ndarray, end: np.ndarray, launch_ts: np.ndarray,
                 has_launch: np.ndarray, kernel_wait_ns: int) -> list[StreamIdle]:
    out: list[StreamIdle] = []
    for sid in np.unique(stream):
        idx = np.flatnonzero(stream == sid)
        idx = idx[np.argsort(start[idx], kind="stable")]
        if idx.size < 2:
            out.append(StreamIdle(int(sid)))
            continue
        prev_end = end[idx[:-1]]
        cur = idx[1:]
        gap = np.maximum(start[cur] - prev_end, 0)
        host = has_launch[cur] & (launch_ts[cur] > prev_end)
        kernel = ~host & (gap < kernel_wait_ns)
        other = ~host & ~kernel
        out.append(StreamIdle(int(sid), int(gap[host].sum()), int(gap[kernel].sum()), int(gap[other].sum())))
    return out


def breakdown_of(cols: dict[str, np.ndarray], mask: np.ndarray | None = None,
                 kernel_wait_ns: int = DEFAULT_KERNEL_WAIT_NS) -> Breakdown:
    """Breakdown of the GPU work rows in ``cols`` (optionally only where ``mask``)."""
    if mask is not None:
        cols = {k: v[mask] for k, v in cols.items()}
    start = cols["ts_ns"]
    if start.size == 0:
        return Breakdown()
    end = start + cols["dur_ns"]
    klass = cols["kernel_class"]
    compute, comm, memory = klass == "compute", klass == "comm", klass == "memory"
    busy = union_length(start, end)
    compute_ns = union_length(start[compute], end[compute])
    comm_ns = union_length(start[comm], end[comm])
    overlap = intersection_length(start[compute], end[compute], start[comm], end[comm])
    span = int(end.max() - start.min())
    has_launch = cols["launch_ts"] >= 0
    delays = np.maximum(start[has_launch] - cols["launch_end"][has_launch], 0)
    return Breakdown(
        span_ns=span, busy_ns=busy, compute_ns=compute_ns, non_compute_ns=busy - compute_ns,
        idle_ns=span - busy, comm_ns=comm_ns, memory_ns=union_length(start[memory], end[memory]),
        comm_compute_overlap_ns=overlap, gpu_events=int(start.size),
        idle_by_stream=_stream_idle(cols["stream"], start, end, cols["launch_ts"], has_launch, kernel_wait_ns),
        launch_delay=_launch_delay(delays),
    )


ANALYZE_GROUP_GPU_EVENTS = 2_000_000
"""Ranks are loaded together, one query per group, while their GPU events add up to at most
this (a larger rank is loaded alone): a many-rank run of small ranks costs two queries per
group instead of two per rank, and memory stays bounded by the group."""


def _by_rank(ranks: list[int], rank_col: np.ndarray) -> dict[int, slice]:
    """Row range of each rank in a result sorted by rank."""
    lo = np.searchsorted(rank_col, ranks, side="left")
    hi = np.searchsorted(rank_col, ranks, side="right")
    return {r: slice(int(a), int(b)) for r, a, b in zip(ranks, lo, hi, strict=True)}


def _load_gpu_work(store: Store, run_id: str, ranks: list[int]) -> dict[int, dict[str, np.ndarray]]:
    """GPU work of each rank with the start/end of its launching runtime call (-1 when none)."""
    events = qualified(store, TRACE_EVENTS)
    cols = store.query_columns(
        f"""
        SELECT g.rank AS rank, g.ts_ns AS ts_ns, g.dur_ns AS dur_ns, g.kernel_class AS kernel_class,
               g.stream AS stream,
               if(r.found, r.ts_ns, -1) AS launch_ts, if(r.found, r.ts_ns + r.dur_ns, -1) AS launch_end
        FROM (SELECT rank, ts_ns, dur_ns, kernel_class, stream, correlation FROM {events}
              WHERE run_id = {{run_id:String}} AND rank IN {{ranks:Array(Int32)}}
                AND {GPU_WORK}) AS g
        LEFT JOIN (SELECT rank, correlation, min(ts_ns) AS ts_ns, any(dur_ns) AS dur_ns, 1 AS found FROM {events}
                   WHERE run_id = {{run_id:String}} AND rank IN {{ranks:Array(Int32)}} AND kind = 'runtime'
                     AND correlation != 0
                   GROUP BY rank, correlation) AS r
          ON g.rank = r.rank AND g.correlation = r.correlation
        ORDER BY rank, ts_ns
        SETTINGS join_use_nulls = 0
        """,
        {"run_id": run_id, "ranks": ranks},
    )
    rank_col = cols.pop("rank").astype(np.int64)
    cols = {k: (v if k == "kernel_class" else v.astype(np.int64)) for k, v in cols.items()}
    return {r: {k: v[rows] for k, v in cols.items()} for r, rows in _by_rank(ranks, rank_col).items()}


def _load_steps(store: Store, run_id: str, ranks: list[int]) -> dict[int, list[tuple[int, int, int]]]:
    """``ProfilerStep#N`` annotations of each rank: (N, start, duration), in time order."""
    res = store.query(
        f"SELECT rank, name, ts_ns, dur_ns FROM {qualified(store, TRACE_EVENTS)} "
        "WHERE run_id = {run_id:String} AND rank IN {ranks:Array(Int32)} "
        "AND kind IN ('cpu_op', 'user_annotation') AND startsWith(name, 'ProfilerStep') ORDER BY rank, ts_ns",
        {"run_id": run_id, "ranks": ranks},
    )
    steps: dict[int, list[tuple[int, int, int]]] = {r: [] for r in ranks}
    for rank, name, ts, dur in res.rows:
        match = _STEP_NUMBER.search(name)
        if match:
            steps[int(rank)].append((int(match.group(1)), int(ts), int(dur)))
    return steps


def _ranks_with_gpu_events(store: Store, run_id: str) -> dict[int, int]:
    """Ranks ingested for ``run_id`` and their GPU event counts (raises InputError when the run is unknown)."""
    res = store.query(f"SELECT rank, max(gpu_event_count) FROM {qualified(store, TRACE_RUNS)} FINAL "
                      "WHERE run_id = {run_id:String} GROUP BY rank ORDER BY rank", {"run_id": run_id})
    if not res.rows:
        known = store.query(f"SELECT DISTINCT run_id FROM {qualified(store, TRACE_RUNS)} ORDER BY run_id LIMIT 20")
        names = ", ".join(r[0] for r in known.rows) or "none"
        raise InputError(f"no trace run {run_id!r} in the store (known: {names})")
    return {int(rank): int(count) for rank, count in res.rows}


def _breakdown_rank(rank: int, cols: dict[str, np.ndarray], steps: list[tuple[int, int, int]],
                    include_last_step: bool, kernel_wait_ns: int) -> RankBreakdown:
    launch = cols["launch_ts"]
    per_step = []
    for number, ts, dur in steps:
        in_step = (launch >= ts) & (launch < ts + dur)
        per_step.append(StepBreakdown(number, ts, dur, breakdown_of(cols, in_step, kernel_wait_ns)))
    drop_last = len(steps) >= 2 and not include_last_step
    whole_mask = None
    if drop_last:
        # As HTA: keep GPU work launched before the last step began (work without a launch is dropped).
        whole_mask = (launch >= 0) & (launch < steps[-1][1])
    return RankBreakdown(rank, breakdown_of(cols, whole_mask, kernel_wait_ns), per_step, drop_last)


def analyze_rank(store: Store, run_id: str, rank: int, include_last_step: bool = False,
                 kernel_wait_ns: int = DEFAULT_KERNEL_WAIT_NS) -> RankBreakdown:
    """Whole-run and per-step breakdown of one rank."""
    return _breakdown_rank(rank, _load_gpu_work(store, run_id, [rank])[rank], _load_steps(store, run_id, [rank])[rank],
                           include_last_step, kernel_wait_ns)


def rank_groups(gpu_events: dict[int, int], limit: int = ANALYZE_GROUP_GPU_EVENTS) -> list[list[int]]:
    """Consecutive ranks in groups of at most ``limit`` GPU events (a larger rank alone)."""
    groups: list[list[int]] = []
    total = 0
    for rank, count in gpu_events.items():
        if groups and total + count <= limit:
            groups[-1].append(rank)
            total += count
        else:
            groups.append([rank])
            total = count
    return groups


def analyze_run(store: Store, run_id: str, ranks: list[int] | None = None, include_last_step: bool = False,
                kernel_wait_ns: int = DEFAULT_KERNEL_WAIT_NS) -> list[RankBreakdown]:
    """Breakdown of every (or the given) rank of a run."""
    available = _ranks_with_gpu_events(store, run_id)
    chosen = {r: n for r, n in available.items() if ranks is None or r in ranks}
    if ranks and not chosen:
        raise InputError(f"run {run_id!r} has no rank {ranks} (ranks: {list(available)})")
    out = []
    with store.releasing_memory():
        for group in rank_groups(chosen):
            work, steps = _load_gpu_work(store, run_id, group), _load_steps(store, run_id, group)
            out += [_breakdown_rank(r, work[r], steps[r], include_last_step, kernel_wait_ns) for r in group]
    return out
