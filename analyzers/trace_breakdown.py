"""Per-rank and per-step breakdown of GPU time in a Kineto trace run, in exact int64 nanoseconds.

Loads each rank's GPU work from the store and computes its figures (:mod:`.gpu_timeline`): span,
busy, compute, non-compute and idle time, the idle split per GPU (host wait, kernel wait, other)
with the per-stream detail, comm/compute overlap and launch delay. Whole-run figures drop the
last ``ProfilerStep`` as HolisticTraceAnalysis does; step figures are those of non-overlapping
GPU windows, so they add up. Definitions: docs/trace-breakdown.md.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import numpy as np

from triscope.analyzers.gpu_timeline import (  # noqa: F401 - figures re-exported for callers of this module
    DEFAULT_KERNEL_WAIT_NS,
    Breakdown,
    IdleSplit,
    LaunchDelay,
    StreamIdle,
    breakdown_of,
    step_windows,
    window_breakdowns,
)
from triscope.analyzers.intervals import union_length  # noqa: F401 - re-exported
from triscope.errors import InputError
from triscope.schema import TRACE_EVENTS, TRACE_RUNS, qualified
from triscope.store.base import Store

GPU_WORK = "kind IN ('kernel', 'memcpy', 'memset')"
"""SQL condition selecting GPU work in ``trace_events`` (shared with the stall classifier)."""
_STEP_NUMBER = re.compile(r"ProfilerStep\s*#\s*(\d+)")


@dataclass
class StepBreakdown:
    """One ``ProfilerStep#N``: its CPU span and the figures of its GPU window ``[gpu_start_ns, gpu_end_ns)``."""

    step: int
    cpu_start_ns: int
    cpu_dur_ns: int
    breakdown: Breakdown
    gpu_start_ns: int = 0
    gpu_end_ns: int = 0


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
                       "gpu_start_ns": s.gpu_start_ns, "gpu_end_ns": s.gpu_end_ns,
                       **s.breakdown.to_dict()} for s in self.steps],
        }


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
    lo, hi = step_windows(cols, steps)
    windows = window_breakdowns(cols, lo, hi, kernel_wait_ns) if steps else []
    per_step = [StepBreakdown(number, ts, dur, b, int(a), int(z))
                for (number, ts, dur), b, a, z in zip(steps, windows, lo, hi, strict=True)]
    drop_last = len(steps) >= 2 and not include_last_step
    whole_mask = None
    if drop_last:
        # As HTA: keep GPU work launched before the last step began (work without a launch is dropped).
        launch = cols["launch_ts"]
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
