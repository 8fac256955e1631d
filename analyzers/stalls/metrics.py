"""Per-window metrics of one GPU / rank: the windows (or profiler steps) it has data in, and what each measured."""

from __future__ import annotations

import bisect
import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from triscope.analyzers.intervals import coverage
from triscope.analyzers.stalls.config import StallsConfig

Interval = tuple[int, int, str, str]
"""(start_ns, end_ns, kind, label) of one window or profiler step."""


@dataclass
class Unit:
    """One GPU (or CPU-only rank, or IO-only host) and the data it has in the range."""

    host: str
    device: str
    gpu: int
    ranks: set[int] = field(default_factory=set)
    device_data: bool = True
    """False for a traced rank with no device work (a CPU-only trace) and an IO-only host."""
    runs: set[str] = field(default_factory=set)
    sample_ts: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    """Sample times (ns), sorted."""
    sample_values: np.ndarray = field(default_factory=lambda: np.zeros((0, 4)))
    """(sm_active, dram_active, l2_bandwidth, gpu_util) ratios per sample; NaN where not reported."""
    traces: list[dict[str, Any]] = field(default_factory=list)

    @property
    def samples(self) -> bool:
        """Whether the unit has samples (GPU samples, or the IO rows' times of an IO-only host)."""
        return len(self.sample_ts) > 0

    @property
    def key(self) -> str:
        return f"{self.host or '?'}/{self.device}"


def window_grid(start_ns: int, end_ns: int, w_ns: int) -> tuple[np.ndarray, np.ndarray]:
    """Windows aligned to multiples of ``w_ns``, clipped to the range."""
    starts = np.arange(start_ns - start_ns % w_ns, end_ns, w_ns, dtype=np.int64)
    return np.maximum(starts, start_ns), np.minimum(starts + w_ns, end_ns)


def mean_in(ts: np.ndarray, values: np.ndarray, w_start: np.ndarray,
            w_end: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(mean of finite values, sample count) per window for samples at ``ts`` (sorted)."""
    lo = np.searchsorted(ts, w_start, side="left")
    hi = np.searchsorted(ts, w_end, side="left")
    finite = np.isfinite(values)
    csum = np.concatenate([[0.0], np.cumsum(np.where(finite, values, 0.0))])
    ccount = np.concatenate([[0], np.cumsum(finite)])
    n = ccount[hi] - ccount[lo]
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = np.where(n > 0, (csum[hi] - csum[lo]) / np.maximum(n, 1), np.nan)
    return mean, hi - lo


def unit_windows(unit: Unit, start_ns: int, end_ns: int, w_ns: int, by: str) -> list[Interval]:
    """(start, end, kind, label) intervals of the unit that hold data.

    Steps are clipped to the range and to their trace's recorded span. A window at the edge of the
    unit's data that holds less than half a window of it is merged into its neighbour: a few
    milliseconds of trace are not a verdict of their own.
    """
    if by == "step":
        steps = [(max(int(s), t["lo"], start_ns), min(int(e), t["hi"], end_ns), str(n)) for t in unit.traces
                 for s, e, n in zip(*t["iv"]["steps"], strict=True)]
        steps = [(s, e, n) for s, e, n in steps if e > s]
        if steps:
            return [(s, e, "step", n) for s, e, n in sorted(steps)]
    ws, we = window_grid(start_ns, end_ns, w_ns)
    keep = np.zeros(len(ws), dtype=bool)
    if unit.samples:
        ts = unit.sample_ts
        keep |= np.searchsorted(ts, we, side="left") > np.searchsorted(ts, ws, side="left")
    for t in unit.traces:
        keep |= (ws < t["hi"]) & (we > t["lo"])
    windows = [(int(a), int(b)) for a, b, k in zip(ws, we, keep, strict=True) if k]
    return [(a, b, "window", "") for a, b in _merge_edges(windows, unit, w_ns)]


def _held(a: int, b: int, unit: Unit) -> int:
    """How much of [a, b) the unit has data for: its traces' spans (samples count as the whole window)."""
    if unit.samples or not unit.traces:
        return b - a
    return int(coverage([t["lo"] for t in unit.traces], [t["hi"] for t in unit.traces],
                        np.array([a], dtype=np.int64), np.array([b], dtype=np.int64))[0])


def _merge_edges(windows: list[tuple[int, int]], unit: Unit, w_ns: int) -> list[tuple[int, int]]:
    """Merge the first and last window of each contiguous stretch into their neighbour when they hold
    less than half a window of data."""
    out: list[tuple[int, int]] = []
    for a, b in windows:
        if out and out[-1][1] == a and (len(out) == 1 or out[-2][1] != out[-1][0]) \
                and _held(*out[-1], unit) * 2 < w_ns:
            out[-1] = (out[-1][0], b)  # a short first window of a stretch joins the next one
        else:
            out.append((a, b))
    merged: list[tuple[int, int]] = []
    for i, (a, b) in enumerate(out):
        last = i + 1 == len(out) or out[i + 1][0] != b
        if merged and merged[-1][1] == a and last and _held(a, b, unit) * 2 < w_ns:
            merged[-1] = (merged[-1][0], b)  # a short last window of a stretch joins the previous one
        else:
            merged.append((a, b))
    return merged


def _num(v: Any) -> float:
    return float("nan") if v is None else float(v)


Columns = dict[str, np.ndarray]
"""Each metric over a unit's windows, NaN where a window has none (``has_gpu`` and ``io_met`` 0 there)."""
COLUMN_KEYS = ("comm_share", "sm_active_ratio", "l2_bandwidth_ratio", "dram_active_ratio", "trace_compute_share",
               "io_read_p99_seconds", "io_queue_depth", "gpu_busy_share", "host_busy_share", "gpu_activity_ratio",
               "serving_queue_length", "device_busy_share", "has_gpu", "io_met")
FLAG_KEYS = ("has_gpu", "io_met")
"""The columns that are flags: 0 (not NaN) where a window has none."""


def window_metrics(unit: Unit, iv: list[Interval], io_rows: list[tuple[Any, ...]],
                   queue_rows: list[tuple[int, float]],
                   cfg: StallsConfig) -> tuple[list[dict[str, float]], Columns]:
    """What each interval measured (sample means, traced busy shares, the worst IO device, the serving queue),
    as one dict per interval and as the columns the rules read."""
    n = len(iv)
    ws = np.array([i[0] for i in iv], dtype=np.int64)
    we = np.array([i[1] for i in iv], dtype=np.int64)
    out: list[dict[str, float]] = [{} for _ in range(n)]
    cols: Columns = {k: np.full(n, 0.0 if k in FLAG_KEYS else np.nan) for k in COLUMN_KEYS}
    if unit.samples:
        arr, ts = unit.sample_values, unit.sample_ts
        sm, count = mean_in(ts, arr[:, 0], ws, we)
        dram, _ = mean_in(ts, arr[:, 1], ws, we)
        l2, _ = mean_in(ts, arr[:, 2], ws, we)
        util, _ = mean_in(ts, arr[:, 3], ws, we)
        activity = np.where(np.isfinite(sm), sm, util)
        has = count > 0
        for key, values in (("sm_active_ratio", sm), ("dram_active_ratio", dram), ("l2_bandwidth_ratio", l2),
                            ("gpu_activity_ratio", activity)):
            cols[key] = np.where(has, values, np.nan)
        lists = [v.tolist() for v in (sm, dram, l2, util, count.astype(np.float64), activity)]
        for i in np.flatnonzero(has).tolist():
            out[i].update(sm_active_ratio=lists[0][i], dram_active_ratio=lists[1][i], l2_bandwidth_ratio=lists[2][i],
                          gpu_util_ratio=lists[3][i], samples=lists[4][i], gpu_activity_ratio=lists[5][i])
    if unit.traces:
        _trace_shares(unit, ws, we, out, cols)
    if io_rows:
        rows = [(int(a), int(b), str(device), _num(p99), _num(qd)) for _h, device, _op, a, b, p99, qd in io_rows]
        # Only rows starting in (window start - longest row, window end) can overlap a window: found by
        # bisection over the starts, then checked in the rows' own order (ties go to the earlier row).
        by_start = sorted(range(len(rows)), key=lambda j: rows[j][0])
        starts = [rows[j][0] for j in by_start]
        longest = max(b - a for a, b, *_ in rows)
        for i in range(n):
            cands = []
            lo = bisect.bisect_right(starts, int(ws[i]) - longest - 1)
            hi = bisect.bisect_left(starts, int(we[i]))
            for j in sorted(by_start[lo:hi]):
                a, b, device, p99, qd = rows[j]
                if a < we[i] and b > ws[i]:
                    ok = p99 > cfg.io_read_p99_min_seconds and qd > cfg.io_queue_depth_min
                    cands.append((ok, p99 if math.isfinite(p99) else -1.0, p99, qd, device))
            if cands:
                ok, _, p99, qd, device = max(cands, key=lambda c: (c[0], c[1]))
                out[i].update(io_read_p99_seconds=p99, io_queue_depth=qd, io_met=float(ok))
                out[i]["io_device"] = device  # type: ignore[assignment]
                cols["io_read_p99_seconds"][i], cols["io_queue_depth"][i], cols["io_met"][i] = p99, qd, float(ok)
    if queue_rows:
        qts = np.array([q[0] for q in queue_rows], dtype=np.int64)
        qv = np.array([q[1] for q in queue_rows], dtype=np.float64)
        qmean, qn = mean_in(qts, qv, ws, we)
        cols["serving_queue_length"] = np.where(qn > 0, qmean, np.nan)
        qlist = qmean.tolist()
        for i in np.flatnonzero(qn).tolist():
            out[i]["serving_queue_length"] = qlist[i]
    return out, cols


def _trace_shares(unit: Unit, ws: np.ndarray, we: np.ndarray, out: list[dict[str, float]], cols: Columns) -> None:
    """Busy shares of the traced part of each window (the denominator), per class of trace work."""
    n = len(ws)
    classes = ("gpu", "gpu_compute", "comm", "host")
    spans = np.zeros(n, dtype=np.int64)
    sums: dict[str, np.ndarray] = defaultdict(lambda: np.zeros(n, dtype=np.int64))
    has_gpu = any(t["iv"]["has_gpu"] for t in unit.traces)
    for t in unit.traces:
        spans += coverage([t["lo"]], [t["hi"]], ws, we)
        for key in classes:
            starts, ends = t["iv"][key]
            sums[key] += coverage(starts, ends, ws, we)
    for i in range(n):
        if spans[i] <= 0:
            continue
        span = float(spans[i])
        shares = {k: sums[k][i] / span for k in classes}
        device = shares["gpu"] if has_gpu else shares["host"]
        compute = shares["gpu_compute"] if has_gpu else shares["host"]
        out[i].update(comm_share=shares["comm"], host_busy_share=shares["host"], traced_seconds=span / 1e9,
                      trace_compute_share=compute, device_busy_share=device, has_gpu=float(has_gpu))
        if has_gpu:
            out[i]["gpu_busy_share"] = shares["gpu"]
        for key in ("comm_share", "host_busy_share", "trace_compute_share", "device_busy_share", "has_gpu",
                    "gpu_busy_share"):
            if key in out[i]:
                cols[key][i] = out[i][key]
