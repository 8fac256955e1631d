"""Per-rank and per-step breakdown of GPU time in a Kineto trace run, in exact int64 nanoseconds.

Loads each rank's GPU work from the store and computes its figures (:mod:`.gpu_timeline`): span,
busy, compute, non-compute and idle time, the idle split per GPU (host wait, kernel wait, other)
with the per-stream detail, comm/compute overlap and launch delay. Whole-run figures drop the
last ``ProfilerStep`` as HolisticTraceAnalysis does; step figures are those of non-overlapping
GPU windows, so they add up. Definitions: docs/trace-breakdown.md.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
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
MIN_JUDGED_DEVICE_EVENTS = 2
"""A whole run with fewer device events is too short to judge: the breakdown of one kernel is 100 % busy
by construction and says nothing of what the device waited for."""
_STEP_NUMBER = re.compile(r"ProfilerStep\s*#\s*(\d+)")
_GPU_WORDS = frozenset({"kernel", "gpu", "memcpy", "memset", "cuda", "hip", "rocm"})


def device_kind(category: str) -> str:
    """The device a device-activity category ran on, as ingest names it: ``GPU`` (CUDA and ROCm write the
    same categories), ``MTIA`` (``mtia_ccp_events``), else the category's first word in capitals."""
    word = category.lower().split("_", 1)[0]
    return "GPU" if word in _GPU_WORDS else word.upper() or "GPU"


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
class RankFacts:
    """What a rank's trace holds besides its device work: the device's kind and index, range-profiler
    measurements, runtime calls, and device work on no stream (left out: docs/trace-breakdown.md)."""

    device_type: str = "GPU"
    device: int = -1
    profiler_ranges: int = 0
    profiler_range_category: str = ""
    runtime_calls: int = 0
    off_stream: int = 0


@dataclass
class RankBreakdown:
    rank: int
    whole: Breakdown
    steps: list[StepBreakdown]
    last_step_dropped: bool
    device_events: int = 0
    """Device work events of the rank, the last step's included."""
    facts: RankFacts = field(default_factory=RankFacts)

    @property
    def device_type(self) -> str:
        return self.facts.device_type

    @property
    def ranges_only(self) -> bool:
        """Device activity recorded as range-profiler measurements only: no kernel events."""
        return not self.device_events and self.facts.profiler_ranges > 0

    @property
    def too_short(self) -> bool:
        """The whole run holds device work, but too little to judge (:data:`MIN_JUDGED_DEVICE_EVENTS`)."""
        return self.device_events > 0 and self.whole.gpu_events < MIN_JUDGED_DEVICE_EVENTS

    def no_verdict(self) -> str:
        """Why no stall verdict follows from this rank's breakdown (empty when one does)."""
        kind, w = self.device_type, self.whole
        if self.ranges_only:
            return (f"{kind} activity recorded as {self.facts.profiler_ranges:,} profiler ranges "
                    f"({self.facts.profiler_range_category}), kernels not captured")
        if not self.too_short:
            return ""
        events = f"{w.gpu_events} {kind} event" + ("" if w.gpu_events == 1 else "s")
        text = f"too short to judge: the whole run holds {events} over {w.span_ns / 1e6:,.3f} ms"
        if self.last_step_dropped and self.device_events > w.gpu_events:
            text += (f" once the last ProfilerStep is dropped (--include-last-step keeps all "
                     f"{self.device_events:,})")
        return text

    def counted_steps(self) -> list[StepBreakdown]:
        """The steps whose windows make up the whole run: all but the last when it was dropped."""
        return self.steps[:-1] if self.last_step_dropped else self.steps

    def steps_add_up(self) -> bool:
        """Whether span, busy, compute, idle and device events of the counted steps add up to the whole run's."""
        steps = [s.breakdown for s in self.counted_steps()]
        keys = ("span_ns", "busy_ns", "compute_ns", "idle_ns", "gpu_events")
        return bool(steps) and all(sum(getattr(b, k) for b in steps) == getattr(self.whole, k) for k in keys)

    def to_dict(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "last_step_dropped": self.last_step_dropped,
            "device_type": self.device_type, "device": self.facts.device, "device_events": self.device_events,
            "profiler_ranges": self.facts.profiler_ranges, "runtime_calls": self.facts.runtime_calls,
            "off_stream_events": self.facts.off_stream, "no_verdict": self.no_verdict(),
            "steps_add_up": self.steps_add_up() if self.steps else None,
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


def _load_facts(store: Store, run_id: str, ranks: list[int]) -> dict[int, RankFacts]:
    """:class:`RankFacts` of each rank."""
    res = store.query(
        f"SELECT rank, topKIf(1)(category, {GPU_WORK}), topKIf(1)(device, {GPU_WORK}), "
        "countIf(kind = 'profiler_range'), topKIf(1)(category, kind = 'profiler_range'), "
        "topKIf(1)(device, kind = 'profiler_range'), countIf(kind = 'runtime'), countIf(kind = 'device_other') "
        f"FROM {qualified(store, TRACE_EVENTS)} WHERE run_id = {{run_id:String}} AND rank IN {{ranks:Array(Int32)}} "
        "GROUP BY rank", {"run_id": run_id, "ranks": ranks})
    facts = {r: RankFacts() for r in ranks}
    for rank, cat, dev, ranges, range_cat, range_dev, runtime, off in res.rows:
        # the kind and index of the device its work ran on, else of its profiler ranges
        category, device = (cat[0], dev[0]) if len(cat) else (range_cat[0], range_dev[0]) if len(range_cat) \
            else ("", -1)
        facts[int(rank)] = RankFacts(device_kind(category) if category else "GPU", int(device), int(ranges),
                                     range_cat[0] if len(range_cat) else "", int(runtime), int(off))
    return facts


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
                    include_last_step: bool, kernel_wait_ns: int, facts: RankFacts | None = None) -> RankBreakdown:
    lo, hi = step_windows(cols, steps)
    drop_last = len(steps) >= 2 and not include_last_step
    if steps and not drop_last and (cols["launch_ts"] >= 0).any():
        # All steps make up the whole run: work no runtime call launched, before the first launched work or
        # after the last, belongs to the first or the last step.
        lo[0] = min(int(lo[0]), int(cols["ts_ns"].min()))
        hi[-1] = max(int(hi[-1]), int((cols["ts_ns"] + cols["dur_ns"]).max()))
    windows = window_breakdowns(cols, lo, hi, kernel_wait_ns) if steps else []
    per_step = [StepBreakdown(number, ts, dur, b, int(a), int(z))
                for (number, ts, dur), b, a, z in zip(steps, windows, lo, hi, strict=True)]
    whole_mask = None
    if drop_last:
        # As HTA: keep GPU work launched before the last step began (work without a launch is dropped).
        launch = cols["launch_ts"]
        whole_mask = (launch >= 0) & (launch < steps[-1][1])
    return RankBreakdown(rank, breakdown_of(cols, whole_mask, kernel_wait_ns), per_step, drop_last,
                         int(cols["ts_ns"].size), facts or RankFacts())


def analyze_rank(store: Store, run_id: str, rank: int, include_last_step: bool = False,
                 kernel_wait_ns: int = DEFAULT_KERNEL_WAIT_NS) -> RankBreakdown:
    """Whole-run and per-step breakdown of one rank."""
    return _breakdown_rank(rank, _load_gpu_work(store, run_id, [rank])[rank], _load_steps(store, run_id, [rank])[rank],
                           include_last_step, kernel_wait_ns, _load_facts(store, run_id, [rank])[rank])


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
            facts = _load_facts(store, run_id, group)
            out += [_breakdown_rank(r, work[r], steps[r], include_last_step, kernel_wait_ns, facts[r]) for r in group]
    return out
