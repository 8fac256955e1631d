"""The stall rules: one window's metrics against the ``[stalls]`` thresholds, giving a verdict with evidence.

Classes, in the default order of precedence (the first whose rule holds is the verdict; the others that
also held are listed with it): comm, compute, io, host (launch/host-bound), idle. docs/diagnose.md has
the table of rules and their data.
"""

from __future__ import annotations

import math

from triscope.analyzers.stalls.config import UNCLASSIFIED, StallsConfig
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
