"""The stall rules: one window's metrics against the ``[stalls]`` thresholds, giving a verdict with evidence.

Classes, in the default order of precedence (the first whose rule holds is the verdict; the others that
also held are listed with it): comm, compute, io, host (launch/host-bound), idle. docs/diagnose.md has
the table of rules and their data.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from triscope.analyzers.stalls.config import UNCLASSIFIED, StallsConfig
from triscope.analyzers.stalls.metrics import COLUMN_KEYS, FLAG_KEYS
from triscope.analyzers.stalls.report import Evidence
from triscope.schema import GPU_SAMPLES, IO_LATENCY, SERVING_METRICS, TRACE_EVENTS

# Evidence names the table each signal came from.
_TRACE, _SAMPLES, _IO, _SERVING = TRACE_EVENTS.name, GPU_SAMPLES.name, IO_LATENCY.name, SERVING_METRICS.name
Verdict = tuple[str, list[str], dict[str, list[Evidence]], float]


def _check(metric: str, value: float, op: str, threshold: float, source: str) -> Evidence:
    ok = value is not None and math.isfinite(value) and (
        value > threshold if op == ">" else value >= threshold if op == ">=" else value < threshold)
    return Evidence(metric, value, float(threshold), op, source, bool(ok))


def classify_window(m: dict[str, float], cfg: StallsConfig) -> Verdict:
    """Verdict, every class whose rule held, evidence per class and severity for one window's metrics."""
    nan = float("nan")
    g = m.get
    ev: dict[str, list[Evidence]] = {}
    held: dict[str, float] = {}

    comm = _check("comm_share", g("comm_share", nan), ">", cfg.comm_share_min, _TRACE)
    ev["comm"] = [comm]
    if comm.met:
        held["comm"] = comm.value / max(cfg.comm_share_min, 1e-9)

    sm = _check("sm_active_ratio", g("sm_active_ratio", nan), ">", cfg.compute_sm_active_min, _SAMPLES)
    bw = [_check(k, g(k, nan), "<", cfg.compute_bandwidth_max, _SAMPLES)
          for k in ("l2_bandwidth_ratio", "dram_active_ratio")]
    measured_bw = [e for e in bw if math.isfinite(e.value)]
    samples_compute = sm.met and all(e.met for e in measured_bw)
    trace_c = _check("trace_compute_share", g("trace_compute_share", nan), ">", cfg.trace_compute_busy_min,
                     _TRACE)
    ev["compute"] = [sm, *bw, trace_c] if math.isfinite(sm.value) else [trace_c]
    if samples_compute or trace_c.met:
        held["compute"] = max(sm.value / cfg.compute_sm_active_min if samples_compute else 0.0,
                              trace_c.value / cfg.trace_compute_busy_min if trace_c.met else 0.0)

    p99 = _check("io_read_p99_seconds", g("io_read_p99_seconds", nan), ">", cfg.io_read_p99_min_seconds,
                 _IO)
    qd = _check("io_queue_depth", g("io_queue_depth", nan), ">", cfg.io_queue_depth_min, _IO)
    if m.get("io_device"):
        p99.source = qd.source = f"{_IO}[{m['io_device']}]"
    ev["io"] = [p99, qd]
    if g("io_met", 0.0) > 0:
        p99.met = qd.met = True
        held["io"] = math.sqrt(p99.value / max(cfg.io_read_p99_min_seconds, 1e-12)
                               * qd.value / max(cfg.io_queue_depth_min, 1e-12))

    gpu_busy = _check("gpu_busy_share", g("gpu_busy_share", nan), "<", cfg.host_gpu_busy_max, _TRACE)
    host_busy = _check("host_busy_share", g("host_busy_share", nan), ">", cfg.host_busy_min, _TRACE)
    s_busy = _check("sm_active_ratio", g("gpu_activity_ratio", nan), "<", cfg.host_gpu_busy_max, _SAMPLES)
    queue = _check("serving_queue_length", g("serving_queue_length", nan), ">=", cfg.host_queue_min,
                   _SERVING)
    trace_host = g("has_gpu", 0.0) > 0 and gpu_busy.met and host_busy.met
    sample_host = s_busy.met and queue.met
    ev["host"] = [gpu_busy, host_busy] if g("has_gpu", 0.0) > 0 else []
    if math.isfinite(s_busy.value) or math.isfinite(queue.value):
        ev["host"] += [s_busy, queue]
    if trace_host or sample_host:
        held["host"] = host_busy.value / max(cfg.host_busy_min, 1e-9) if trace_host else queue.value

    idle_checks = []
    for key, src in (("device_busy_share", _TRACE), ("host_busy_share", _TRACE),
                     ("comm_share", _TRACE), ("gpu_activity_ratio", _SAMPLES)):
        if math.isfinite(g(key, nan)):
            idle_checks.append(_check(key, g(key, nan), "<", cfg.idle_busy_max, src))
    ev["idle"] = idle_checks
    if idle_checks and all(e.met for e in idle_checks):
        held["idle"] = 1.0

    matched = [c for c in cfg.precedence if c in held]
    verdict = matched[0] if matched else UNCLASSIFIED
    return verdict, matched, {c: e for c, e in ev.items() if e}, held.get(verdict, 0.0)


def columns_of(metrics: Sequence[Mapping[str, Any]]) -> dict[str, np.ndarray]:
    """The rules' columns of per-window metric dicts (what ``window_metrics`` also returns)."""
    def column(key: str, default: float) -> np.ndarray:
        return np.fromiter((m.get(key, default) for m in metrics), dtype=np.float64, count=len(metrics))

    return {k: column(k, 0.0 if k in FLAG_KEYS else math.nan) for k in COLUMN_KEYS}


def classify_windows(columns: Mapping[str, np.ndarray],
                     cfg: StallsConfig) -> tuple[list[str], list[list[str]], np.ndarray]:
    """``classify_window``'s verdict, matched classes and severity for many windows at once, from the metrics'
    columns (:data:`COLUMN_KEYS`), without the evidence (which :class:`LazyEvidence` builds for the few
    windows that are shown)."""
    n = len(columns["has_gpu"])
    col = {k: np.asarray(v, dtype=np.float64) for k, v in columns.items() if k not in FLAG_KEYS}
    has_gpu = np.asarray(columns["has_gpu"]) > 0
    io_met = np.asarray(columns["io_met"]) > 0
    fin = {k: np.isfinite(v) for k, v in col.items()}
    with np.errstate(invalid="ignore", divide="ignore"):
        def above(key: str, threshold: float) -> np.ndarray:
            return fin[key] & (col[key] > threshold)

        def below(key: str, threshold: float) -> np.ndarray:
            return fin[key] & (col[key] < threshold)

        held: dict[str, np.ndarray] = {}
        severity: dict[str, np.ndarray] = {}
        held["comm"] = above("comm_share", cfg.comm_share_min)
        severity["comm"] = col["comm_share"] / max(cfg.comm_share_min, 1e-9)

        samples_compute = above("sm_active_ratio", cfg.compute_sm_active_min)
        for key in ("l2_bandwidth_ratio", "dram_active_ratio"):  # a bandwidth not measured does not count
            samples_compute &= ~fin[key] | (col[key] < cfg.compute_bandwidth_max)
        trace_c = above("trace_compute_share", cfg.trace_compute_busy_min)
        held["compute"] = samples_compute | trace_c
        severity["compute"] = np.maximum(
            np.where(samples_compute, col["sm_active_ratio"] / cfg.compute_sm_active_min, 0.0),
            np.where(trace_c, col["trace_compute_share"] / cfg.trace_compute_busy_min, 0.0))

        held["io"] = io_met
        severity["io"] = np.sqrt(col["io_read_p99_seconds"] / max(cfg.io_read_p99_min_seconds, 1e-12)
                                 * col["io_queue_depth"] / max(cfg.io_queue_depth_min, 1e-12))

        trace_host = has_gpu & below("gpu_busy_share", cfg.host_gpu_busy_max) \
            & above("host_busy_share", cfg.host_busy_min)
        sample_host = below("gpu_activity_ratio", cfg.host_gpu_busy_max) \
            & fin["serving_queue_length"] & (col["serving_queue_length"] >= cfg.host_queue_min)
        held["host"] = trace_host | sample_host
        severity["host"] = np.where(trace_host, col["host_busy_share"] / max(cfg.host_busy_min, 1e-9),
                                    col["serving_queue_length"])

        idle_keys = ("device_busy_share", "host_busy_share", "comm_share", "gpu_activity_ratio")
        any_measured = np.zeros(n, dtype=bool)
        all_idle = np.ones(n, dtype=bool)
        for key in idle_keys:
            any_measured |= fin[key]
            all_idle &= ~fin[key] | (col[key] < cfg.idle_busy_max)
        held["idle"] = any_measured & all_idle
        severity["idle"] = np.ones(n)

    order = list(cfg.precedence)
    mask = np.zeros(n, dtype=np.int64)
    for bit, cls in enumerate(order):
        mask |= held[cls].astype(np.int64) << bit
    names: dict[int, tuple[str, ...]] = {}
    for value in np.unique(mask).tolist():
        names[value] = tuple(c for bit, c in enumerate(order) if value >> bit & 1)
    matched = [list(names[v]) for v in mask.tolist()]
    verdicts = [m[0] if m else UNCLASSIFIED for m in matched]
    out = np.zeros(n)
    for cls in reversed(order):  # the first class that held sets the severity
        out = np.where(held[cls], severity[cls], out)
    return verdicts, matched, out


class LazyEvidence(Mapping[str, list[Evidence]]):
    """A window's evidence per class, built by ``classify_window`` the first time it is read."""

    __slots__ = ("_metrics", "_cfg", "_built")

    def __init__(self, metrics: dict[str, float], cfg: StallsConfig) -> None:
        self._metrics, self._cfg = metrics, cfg
        self._built: dict[str, list[Evidence]] | None = None

    def _get(self) -> dict[str, list[Evidence]]:
        if self._built is None:
            self._built = classify_window(self._metrics, self._cfg)[2]
        return self._built

    def __getitem__(self, key: str) -> list[Evidence]:
        return self._get()[key]

    def __iter__(self) -> Any:
        return iter(self._get())

    def __len__(self) -> int:
        return len(self._get())
