"""Stall classifier: why each window (default 100 ms) or profiler step of each GPU was slow.

Classes, in the default order of precedence (the first whose rule holds is the verdict; the
others that also held are listed with it):

- ``comm``: collective time > 85% of the window/step (trace: union of NCCL kernels, or of
  host-side gloo collectives when the rank has no GPU work).
- ``compute``: SM activity > 95% with L2 and DRAM bandwidth < 60% of peak (gpu_samples), or a
  trace whose compute work (GPU compute kernels; CPU ops for CPU-only ranks) covers > 95%.
- ``io``: block-IO read p99 > 1200 us and queue depth > 64 on one device of the host (io_latency).
- ``host`` (launch/host-bound): a GPU trace whose GPU is busy < 50% while host ops are busy > 50%;
  or GPU samples below 50% activity while the host's serving queue holds requests.
- ``idle``: GPU (and host ops, when traced) busy < 5%.

Every threshold is in the ``[stalls]`` config section. Each verdict carries its evidence: the
metric, its value, the threshold, the comparison and the table it came from.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from triscope.errors import ConfigError, InputError
from triscope.schema import qualified
from triscope.store.base import Store

CLASSES = ("comm", "compute", "io", "host", "idle")
UNCLASSIFIED = "unclassified"
STALL_DEFAULTS: dict[str, Any] = {
    "window_ms": 0,  # 0: use [analysis] window_ms
    "compute_sm_active_min": 0.95,
    "compute_bandwidth_max": 0.60,
    "trace_compute_busy_min": 0.95,
    "io_read_p99_min_seconds": 0.0012,
    "io_queue_depth_min": 64.0,
    "comm_share_min": 0.85,
    "host_gpu_busy_max": 0.50,
    "host_busy_min": 0.50,
    "host_queue_min": 1.0,
    "idle_busy_max": 0.05,
    "precedence": list(CLASSES),
    "alert_classes": ["comm", "compute", "io", "host"],
    "alert_share": 0.25,
    "straggler_min_lateness_seconds": 0.001,
    "straggler_alert_seconds": 0.05,
    "top_windows": 10,
    "max_trace_events": 20_000_000,
}
ACTIONS = {
    "comm": "Communication-bound: overlap collectives with compute (DDP/FSDP bucket sizes, async ops), check "
            "NVLink/IB topology and NCCL_ALGO/NCCL_PROTO, lower the tensor-parallel degree, and fix the "
            "straggler rank first - the others are waiting for it.",
    "compute": "Compute-bound with memory bandwidth to spare: use lower precision (bf16/fp8), fused or "
               "compiled kernels (torch.compile), or add GPUs / replicas for this model.",
    "io": "Storage-bound: cache weights and data on local NVMe or in RAM, prefetch (more DataLoader workers, "
          "pin_memory), spread reads over devices, and move other heavy readers off this host.",
    "host": "Launch/host-bound: the GPU waits for the CPU - capture CUDA graphs, torch.compile "
            "mode='reduce-overhead', batch more per launch, and move pre/post-processing off the serving thread.",
    "idle": "Idle: no work reached this GPU - check load-balancer weights and routing, or scale in.",
    UNCLASSIFIED: "No rule matched (e.g. busy but memory-bandwidth-bound): see the evidence values.",
}
_HOST_COMM = r"^(gloo|mpi|ucc|xccl):"
_NOT_HOST_WORK = r"Synchronize|^c10d::|^record_param_comms$|^nccl:|^ProfilerStep"
_GPU_KINDS = ("kernel", "memcpy", "memset")


def stall_config(config: dict[str, Any]) -> dict[str, Any]:
    """The ``[stalls]`` section over its defaults, checked."""
    cfg = dict(STALL_DEFAULTS)
    cfg.update(config.get("stalls") or {})
    if not cfg["window_ms"]:
        cfg["window_ms"] = (config.get("analysis") or {}).get("window_ms", 100)
    for key, value in cfg.items():
        default = STALL_DEFAULTS.get(key)
        numeric = isinstance(default, (int, float)) and not isinstance(default, bool)
        if numeric and (not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0):
            raise ConfigError(f"[stalls] {key} must be a non-negative number, got {value!r}")
    if cfg["window_ms"] <= 0:
        raise ConfigError("[stalls] window_ms must be > 0")
    unknown = set(cfg["precedence"]) - set(CLASSES)
    if unknown or not cfg["precedence"]:
        raise ConfigError(f"[stalls] precedence must list classes from {CLASSES}, got {cfg['precedence']!r}")
    return cfg


@dataclass
class Evidence:
    """One measured signal compared with its threshold."""

    metric: str
    value: float
    threshold: float
    op: str  # ">" or "<"
    source: str
    met: bool

    def to_json(self) -> dict[str, Any]:
        return {"metric": self.metric, "value": _finite(self.value), "threshold": self.threshold,
                "op": self.op, "source": self.source, "met": self.met}

    def text(self) -> str:
        return f"{self.metric} {_fmt(self.value, self.metric)} {self.op} {_fmt(self.threshold, self.metric)}"


def _finite(x: Any) -> Any:
    if isinstance(x, str):
        return x
    return float(x) if x is not None and math.isfinite(x) else None


def _fmt(x: float, metric: str) -> str:
    if x is None or not math.isfinite(x):
        return "n/a"
    if metric.endswith("_seconds"):
        return f"{x * 1e6:.0f}us" if x < 0.1 else f"{x:.3f}s"
    if metric.endswith(("_ratio", "_share")):
        return f"{x * 100:.1f}%"
    return f"{x:g}"


def _check(metric: str, value: float, op: str, threshold: float, source: str) -> Evidence:
    ok = value is not None and math.isfinite(value) and (
        value > threshold if op == ">" else value >= threshold if op == ">=" else value < threshold)
    return Evidence(metric, value, float(threshold), op, source, bool(ok))


@dataclass
class Window:
    """One classified interval of one unit."""

    unit: str
    host: str
    device: str
    start_ns: int
    end_ns: int
    kind: str  # window or step
    label: str = ""
    metrics: dict[str, float] = field(default_factory=dict)
    verdict: str = UNCLASSIFIED
    matched: list[str] = field(default_factory=list)
    evidence: dict[str, list[Evidence]] = field(default_factory=dict)
    severity: float = 0.0

    @property
    def seconds(self) -> float:
        return (self.end_ns - self.start_ns) / 1e9

    def to_json(self) -> dict[str, Any]:
        return {
            "unit": self.unit, "host": self.host, "device": self.device, "kind": self.kind, "label": self.label,
            "start_ns": self.start_ns, "end_ns": self.end_ns, "verdict": self.verdict, "also": self.matched[1:],
            "severity": round(self.severity, 4),
            "evidence": [e.to_json() for e in self.evidence.get(self.verdict, [])],
            "all_evidence": {c: [e.to_json() for e in ev] for c, ev in self.evidence.items()},
            "metrics": {k: _finite(v) for k, v in self.metrics.items()},
        }


@dataclass
class _Unit:
    host: str
    device: str
    gpu: int
    ranks: set[int] = field(default_factory=set)
    runs: set[str] = field(default_factory=set)
    samples: list[tuple[int, float, float, float, float]] = field(default_factory=list)
    traces: list[dict[str, Any]] = field(default_factory=list)

    @property
    def key(self) -> str:
        return f"{self.host or '?'}/{self.device}"


@dataclass
class StallReport:
    """Classified windows of a time range plus shares, top windows and cross-rank evidence."""

    start_ns: int
    end_ns: int
    window_ms: float
    by: str
    config: dict[str, Any]
    windows: list[Window] = field(default_factory=list)
    stragglers: dict[str, Any] = field(default_factory=dict)
    flight_recorder: list[dict[str, Any]] = field(default_factory=list)

    def shares(self, unit: str | None = None) -> dict[str, float]:
        """Time share of each verdict (windows weighted by their length)."""
        total: Counter[str] = Counter()
        for w in self.windows:
            if unit is None or w.unit == unit:
                total[w.verdict] += w.seconds
        s = sum(total.values())
        return {k: v / s for k, v in total.most_common()} if s else {}

    def units(self) -> list[str]:
        return sorted({w.unit for w in self.windows})

    def top(self, n: int | None = None) -> list[Window]:
        """The worst windows of alert classes, by severity (how far past the threshold)."""
        n = self.config["top_windows"] if n is None else n
        alert = set(self.config["alert_classes"])
        bad = [w for w in self.windows if w.verdict in alert]
        return sorted(bad, key=lambda w: (-w.severity, w.start_ns))[:n]

    def breaches(self) -> list[str]:
        """Why the command should exit non-zero (empty when nothing breached)."""
        out = []
        limit = float(self.config["alert_share"])
        for cls, share in self.shares().items():
            if cls in self.config["alert_classes"] and share > limit:
                out.append(f"{cls} {share * 100:.1f}% of the time > alert_share {limit * 100:g}%")
        for r in self.stragglers.get("by_rank", []):
            if r["max_lateness_seconds"] < float(self.config["straggler_alert_seconds"]):
                continue
            out.append(f"straggler rank {r['rank']} of run {r['run_id']}: last in {r['times_last']} of "
                       f"{r['collectives']} collectives, {r['total_lateness_seconds']:.3f}s total lateness")
        for fr in self.flight_recorder:
            if not fr["ok"]:
                out.append(f"flight recorder {fr['run_id']} pg {fr['comm_id']}: {len(fr['pending'])} pending, "
                           f"{len(fr['ranks_behind'])} rank(s) behind, {len(fr['mismatches'])} mismatch(es)")
        return out

    def share_text(self, unit: str | None = None) -> str:
        """``io 41%, comm 31%, compute 28%``."""
        return ", ".join(f"{k} {v * 100:.0f}%" for k, v in self.shares(unit).items())

    def to_json(self, all_windows: bool = False) -> dict[str, Any]:
        shares = self.shares()
        return {
            "range": {"start_ns": self.start_ns, "end_ns": self.end_ns}, "window_ms": self.window_ms, "by": self.by,
            "thresholds": {k: v for k, v in self.config.items() if k not in ("top_windows", "max_trace_events")},
            "shares": shares, "summary": self.share_text(),
            "units": [{"unit": u, "windows": sum(1 for w in self.windows if w.unit == u),
                       "shares": self.shares(u)} for u in self.units()],
            "top_windows": [w.to_json() for w in self.top()],
            "actions": {c: ACTIONS[c] for c in shares},
            "stragglers": self.stragglers, "flight_recorder": self.flight_recorder,
            "breaches": self.breaches(),
            **({"windows": [w.to_json() for w in self.windows]} if all_windows else {}),
        }


# ---------------------------------------------------------------- interval arithmetic

def _merge(starts: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Union of intervals as sorted disjoint (starts, ends)."""
    if len(starts) == 0:
        return starts, ends
    order = np.argsort(starts, kind="stable")
    s, e = starts[order], ends[order]
    run_end = np.maximum.accumulate(e)
    new = np.ones(len(s), dtype=bool)
    new[1:] = s[1:] > run_end[:-1]
    first = np.flatnonzero(new)
    last = np.append(first[1:] - 1, len(s) - 1)
    return s[first], run_end[last]


def _covered(ms: np.ndarray, me: np.ndarray, t: np.ndarray) -> np.ndarray:
    """Length of the union (disjoint ms/me) lying before each time in ``t``."""
    out = np.zeros(len(t), dtype=np.int64)
    if len(ms) == 0:
        return out
    prefix = np.concatenate([[0], np.cumsum(me - ms)])
    i = np.searchsorted(ms, t, side="right")
    mask = i > 0
    j = i[mask] - 1
    out[mask] = prefix[j] + np.minimum(t[mask], me[j]) - ms[j]
    return out


def busy_ns(starts: np.ndarray, ends: np.ndarray, w_start: np.ndarray, w_end: np.ndarray) -> np.ndarray:
    """Union of [starts, ends) intervals inside each window [w_start, w_end), in ns."""
    ms, me = _merge(np.asarray(starts, dtype=np.int64), np.asarray(ends, dtype=np.int64))
    return _covered(ms, me, np.asarray(w_end, dtype=np.int64)) - _covered(ms, me, np.asarray(w_start, dtype=np.int64))


# ---------------------------------------------------------------- data gathering

def _range_params(start_ns: int, end_ns: int) -> dict[str, Any]:
    return {"start": int(start_ns), "end": int(end_ns)}


def _samples(store: Store, start_ns: int, end_ns: int) -> list[tuple[Any, ...]]:
    return store.query(
        "SELECT host, gpu, gpu_model, toUnixTimestamp64Nano(ts), sm_active_ratio, dram_active_ratio, "
        f"l2_bandwidth_ratio, gpu_util_ratio FROM {qualified(store, 'gpu_samples')} "
        "WHERE ts >= fromUnixTimestamp64Nano({start:Int64}) AND ts < fromUnixTimestamp64Nano({end:Int64}) "
        "ORDER BY host, gpu, ts", _range_params(start_ns, end_ns)).rows


def _io(store: Store, start_ns: int, end_ns: int) -> list[tuple[Any, ...]]:
    """(host, device, op, start_ns, end_ns, p99_seconds, queue_depth): read rows, or 'all' where no read rows.

    window_seconds is Float32: the end is rounded to the microsecond so 0.1 s does not spill into the next window.
    """
    return store.query(
        "SELECT host, device, op, toUnixTimestamp64Nano(ts) AS t, "
        "t + toInt64(round(greatest(window_seconds, 0) * 1e6)) * 1000, p99_seconds, queue_depth "
        f"FROM {qualified(store, 'io_latency')} "
        "WHERE ts < fromUnixTimestamp64Nano({end:Int64}) "
        "AND ts >= fromUnixTimestamp64Nano({start:Int64}) - INTERVAL 1 HOUR "
        "AND (op = 'read' OR (op = 'all' AND (host, device) NOT IN (SELECT host, device FROM "
        f"{qualified(store, 'io_latency')} WHERE op = 'read' AND ts < fromUnixTimestamp64Nano({{end:Int64}}) "
        "AND ts >= fromUnixTimestamp64Nano({start:Int64}) - INTERVAL 1 HOUR))) ORDER BY host, device, t",
        _range_params(start_ns, end_ns)).rows


def _serving_queue(store: Store, start_ns: int, end_ns: int) -> list[tuple[Any, ...]]:
    return store.query(
        f"SELECT host, toUnixTimestamp64Nano(ts), queue_length FROM {qualified(store, 'serving_metrics')} "
        "WHERE ts >= fromUnixTimestamp64Nano({start:Int64}) AND ts < fromUnixTimestamp64Nano({end:Int64}) "
        "AND isFinite(queue_length) ORDER BY host, ts", _range_params(start_ns, end_ns)).rows


def _trace_parts(store: Store, start_ns: int, end_ns: int, run_ids: list[str] | None) -> list[dict[str, Any]]:
    """(run, rank) traces overlapping the range, with host, clock base, span and main GPU."""
    params: dict[str, Any] = _range_params(start_ns, end_ns)
    where = ""
    if run_ids:
        where = "WHERE run_id IN {runs:Array(String)}"
        params["runs"] = list(run_ids)
    runs = qualified(store, "trace_runs")
    events = qualified(store, "trace_events")
    rows = store.query(
        "SELECT e.run_id, e.rank, r.host, r.base, e.lo + r.base, e.hi + r.base, e.dev FROM ("
        f"  SELECT run_id, rank, min(ts_ns) AS lo, max(ts_ns + dur_ns) AS hi, "
        f"  if(countIf(kind IN {_GPU_KINDS}) > 0, topKIf(1)(device, kind IN {_GPU_KINDS})[1], -1) AS dev "
        f"  FROM {events} {where} GROUP BY run_id, rank) AS e "
        "INNER JOIN (SELECT run_id, rank, argMax(host, ingested_at) AS host, "
        f"  argMax(base_time_ns, ingested_at) AS base FROM {runs} GROUP BY run_id, rank) AS r "
        "ON e.run_id = r.run_id AND e.rank = r.rank "
        "WHERE e.lo + r.base < {end:Int64} AND e.hi + r.base > {start:Int64} ORDER BY e.run_id, e.rank",
        params).rows
    return [{"run_id": r[0], "rank": int(r[1]), "host": r[2], "base": int(r[3]), "lo": int(r[4]),
             "hi": int(r[5]), "device": int(r[6])} for r in rows]


def _trace_intervals(store: Store, part: dict[str, Any], start_ns: int, end_ns: int,
                     limit: int) -> dict[str, Any]:
    """Absolute-ns intervals per class for one (run, rank): gpu, gpu_compute, comm, host, steps."""
    base = part["base"]
    params = {"run_id": part["run_id"], "rank": part["rank"], "lo": start_ns - base, "hi": end_ns - base,
              "host_comm": _HOST_COMM, "not_work": _NOT_HOST_WORK, "limit": limit + 1}
    res = store.query_columns(
        "SELECT toUInt8(multiIf(kind IN ('kernel', 'memcpy', 'memset') AND kernel_class = 'comm', 1, "
        "kind IN ('kernel', 'memcpy', 'memset') AND kernel_class IN ('compute', ''), 2, "
        "kind IN ('kernel', 'memcpy', 'memset'), 3, "
        "kind IN ('user_annotation', 'cpu_op') AND match(name, {host_comm:String}), 4, "
        "kind = 'user_annotation' AND startsWith(name, 'ProfilerStep#'), 5, "
        "kind IN ('cpu_op', 'runtime') AND NOT match(name, {not_work:String}), 6, 0)) AS cls, "
        "ts_ns, ts_ns + dur_ns AS te, if(cls = 5, name, '') AS step_name "
        f"FROM {qualified(store, 'trace_events')} "
        "WHERE run_id = {run_id:String} AND rank = {rank:Int32} AND ts_ns < {hi:Int64} "
        "AND ts_ns + dur_ns > {lo:Int64} AND cls != 0 LIMIT {limit:UInt64}", params)
    cls = np.asarray(res.get("cls", []), dtype=np.uint8)
    if len(cls) > limit:
        raise InputError(f"trace {part['run_id']} rank {part['rank']} has more than {limit} events in the range; "
                         "narrow --since/--until or raise [stalls] max_trace_events")
    ts = np.asarray(res.get("ts_ns", []), dtype=np.int64) + base
    te = np.asarray(res.get("te", []), dtype=np.int64) + base
    names = np.asarray(res.get("step_name", []), dtype=object)

    def pick(*codes: int) -> tuple[np.ndarray, np.ndarray]:
        m = np.isin(cls, codes)
        return ts[m], te[m]

    steps = cls == 5
    return {"gpu": pick(1, 2, 3), "gpu_compute": pick(2), "comm": pick(1, 4), "host": pick(6),
            "steps": (ts[steps], te[steps], names[steps]), "has_gpu": part["device"] >= 0}


# ---------------------------------------------------------------- classification

def _window_grid(start_ns: int, end_ns: int, w_ns: int) -> tuple[np.ndarray, np.ndarray]:
    starts = np.arange(start_ns - start_ns % w_ns, end_ns, w_ns, dtype=np.int64)
    return np.maximum(starts, start_ns), np.minimum(starts + w_ns, end_ns)


def _mean_in(ts: np.ndarray, values: np.ndarray, w_start: np.ndarray, w_end: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
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


def classify_window(m: dict[str, float], cfg: dict[str, Any]) -> tuple[str, list[str], dict[str, list[Evidence]], float]:
    """Verdict, every class whose rule held, evidence per class and severity for one window's metrics."""
    nan = float("nan")
    g = m.get
    ev: dict[str, list[Evidence]] = {}
    held: dict[str, float] = {}

    comm = _check("comm_share", g("comm_share", nan), ">", cfg["comm_share_min"], "trace_events")
    ev["comm"] = [comm]
    if comm.met:
        held["comm"] = comm.value / max(cfg["comm_share_min"], 1e-9)

    sm = _check("sm_active_ratio", g("sm_active_ratio", nan), ">", cfg["compute_sm_active_min"], "gpu_samples")
    bw = [_check(k, g(k, nan), "<", cfg["compute_bandwidth_max"], "gpu_samples")
          for k in ("l2_bandwidth_ratio", "dram_active_ratio")]
    measured_bw = [e for e in bw if math.isfinite(e.value)]
    samples_compute = sm.met and all(e.met for e in measured_bw)
    trace_c = _check("trace_compute_share", g("trace_compute_share", nan), ">", cfg["trace_compute_busy_min"],
                     "trace_events")
    ev["compute"] = [sm, *bw, trace_c] if math.isfinite(sm.value) else [trace_c]
    if samples_compute or trace_c.met:
        held["compute"] = max(sm.value / cfg["compute_sm_active_min"] if samples_compute else 0.0,
                              trace_c.value / cfg["trace_compute_busy_min"] if trace_c.met else 0.0)

    p99 = _check("io_read_p99_seconds", g("io_read_p99_seconds", nan), ">", cfg["io_read_p99_min_seconds"],
                 "io_latency")
    qd = _check("io_queue_depth", g("io_queue_depth", nan), ">", cfg["io_queue_depth_min"], "io_latency")
    if m.get("io_device"):
        p99.source = qd.source = f"io_latency[{m['io_device']}]"
    ev["io"] = [p99, qd]
    if g("io_met", 0.0) > 0:
        p99.met = qd.met = True
        held["io"] = math.sqrt(p99.value / max(cfg["io_read_p99_min_seconds"], 1e-12)
                               * qd.value / max(cfg["io_queue_depth_min"], 1e-12))

    gpu_busy = _check("gpu_busy_share", g("gpu_busy_share", nan), "<", cfg["host_gpu_busy_max"], "trace_events")
    host_busy = _check("host_busy_share", g("host_busy_share", nan), ">", cfg["host_busy_min"], "trace_events")
    s_busy = _check("sm_active_ratio", g("gpu_activity_ratio", nan), "<", cfg["host_gpu_busy_max"], "gpu_samples")
    queue = _check("serving_queue_length", g("serving_queue_length", nan), ">=", cfg["host_queue_min"],
                   "serving_metrics")
    trace_host = g("has_gpu", 0.0) > 0 and gpu_busy.met and host_busy.met
    sample_host = s_busy.met and queue.met
    ev["host"] = [gpu_busy, host_busy] if g("has_gpu", 0.0) > 0 else []
    if math.isfinite(s_busy.value) or math.isfinite(queue.value):
        ev["host"] += [s_busy, queue]
    if trace_host or sample_host:
        held["host"] = host_busy.value / max(cfg["host_busy_min"], 1e-9) if trace_host else queue.value

    idle_checks = []
    for key, src in (("device_busy_share", "trace_events"), ("host_busy_share", "trace_events"),
                     ("comm_share", "trace_events"), ("gpu_activity_ratio", "gpu_samples")):
        if math.isfinite(g(key, nan)):
            idle_checks.append(_check(key, g(key, nan), "<", cfg["idle_busy_max"], src))
    ev["idle"] = idle_checks
    if idle_checks and all(e.met for e in idle_checks):
        held["idle"] = 1.0

    matched = [c for c in cfg["precedence"] if c in held]
    verdict = matched[0] if matched else UNCLASSIFIED
    return verdict, matched, {c: e for c, e in ev.items() if e}, held.get(verdict, 0.0)


def _unit_windows(unit: _Unit, start_ns: int, end_ns: int, w_ns: int, by: str) -> list[tuple[int, int, str, str]]:
    """(start, end, kind, label) intervals of the unit that hold data."""
    if by == "step":
        steps = [(int(s), int(e), str(n)) for t in unit.traces for s, e, n in zip(*t["iv"]["steps"], strict=True)]
        if steps:
            return [(max(s, start_ns), min(e, end_ns), "step", n) for s, e, n in sorted(steps)]
    ws, we = _window_grid(start_ns, end_ns, w_ns)
    keep = np.zeros(len(ws), dtype=bool)
    if unit.samples:
        ts = np.array([s[0] for s in unit.samples], dtype=np.int64)
        keep |= np.searchsorted(ts, we, side="left") > np.searchsorted(ts, ws, side="left")
    for t in unit.traces:
        keep |= (ws < t["hi"]) & (we > t["lo"])
    return [(int(a), int(b), "window", "") for a, b, k in zip(ws, we, keep, strict=True) if k]


def _metrics(unit: _Unit, iv: list[tuple[int, int, str, str]], io_rows: list[tuple[Any, ...]],
             queue_rows: list[tuple[int, float]], cfg: dict[str, Any]) -> list[dict[str, float]]:
    n = len(iv)
    ws = np.array([i[0] for i in iv], dtype=np.int64)
    we = np.array([i[1] for i in iv], dtype=np.int64)
    out: list[dict[str, float]] = [{} for _ in range(n)]
    if unit.samples:
        arr = np.array(unit.samples, dtype=np.float64)
        ts = np.array([s[0] for s in unit.samples], dtype=np.int64)
        sm, count = _mean_in(ts, arr[:, 1], ws, we)
        dram, _ = _mean_in(ts, arr[:, 2], ws, we)
        l2, _ = _mean_in(ts, arr[:, 3], ws, we)
        util, _ = _mean_in(ts, arr[:, 4], ws, we)
        for i in range(n):
            if count[i]:
                out[i].update(sm_active_ratio=sm[i], dram_active_ratio=dram[i], l2_bandwidth_ratio=l2[i],
                              gpu_util_ratio=util[i], samples=float(count[i]),
                              gpu_activity_ratio=sm[i] if math.isfinite(sm[i]) else util[i])
    if unit.traces:
        spans = np.zeros(n, dtype=np.int64)
        sums: dict[str, np.ndarray] = defaultdict(lambda: np.zeros(n, dtype=np.int64))
        has_gpu = any(t["iv"]["has_gpu"] for t in unit.traces)
        for t in unit.traces:
            spans += busy_ns(np.array([t["lo"]]), np.array([t["hi"]]), ws, we)
            for key in ("gpu", "gpu_compute", "comm", "host"):
                sums[key] += busy_ns(*t["iv"][key], ws, we)
        for i in range(n):
            if spans[i] <= 0:
                continue
            span = float(spans[i])
            shares = {k: sums[k][i] / span for k in ("gpu", "gpu_compute", "comm", "host")}
            device = shares["gpu"] if has_gpu else shares["host"]
            compute = shares["gpu_compute"] if has_gpu else shares["host"]
            out[i].update(comm_share=shares["comm"], host_busy_share=shares["host"], traced_seconds=span / 1e9,
                          trace_compute_share=compute, device_busy_share=device, has_gpu=float(has_gpu))
            if has_gpu:
                out[i]["gpu_busy_share"] = shares["gpu"]
    if io_rows:
        rows = [(int(a), int(b), str(device), _num(p99), _num(qd)) for _h, device, _op, a, b, p99, qd in io_rows]
        for i in range(n):
            cands = []
            for a, b, device, p99, qd in rows:
                if a < we[i] and b > ws[i]:
                    ok = p99 > cfg["io_read_p99_min_seconds"] and qd > cfg["io_queue_depth_min"]
                    cands.append((ok, p99 if math.isfinite(p99) else -1.0, p99, qd, device))
            if cands:
                ok, _, p99, qd, device = max(cands, key=lambda c: (c[0], c[1]))
                out[i].update(io_read_p99_seconds=p99, io_queue_depth=qd, io_met=float(ok))
                out[i]["io_device"] = device  # type: ignore[assignment]
    if queue_rows:
        qts = np.array([q[0] for q in queue_rows], dtype=np.int64)
        qv = np.array([q[1] for q in queue_rows], dtype=np.float64)
        qmean, qn = _mean_in(qts, qv, ws, we)
        for i in range(n):
            if qn[i]:
                out[i]["serving_queue_length"] = qmean[i]
    return out


def _num(v: Any) -> float:
    return float("nan") if v is None else float(v)


def parse_duration(text: str) -> float:
    """Seconds in ``90s``, ``10m``, ``2h``, ``1d`` or a bare number of seconds."""
    units = {"ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
    t = text.strip().lower()
    for suffix in ("ms", "s", "m", "h", "d"):
        if t.endswith(suffix):
            number, scale = t[: -len(suffix)], units[suffix]
            break
    else:
        number, scale = t, 1.0
    try:
        value = float(number) * scale
    except ValueError:
        raise InputError(f"not a duration: {text!r} (use e.g. 30s, 10m, 2h)") from None
    if value <= 0 or not math.isfinite(value):
        raise InputError(f"duration must be positive: {text!r}")
    return value


def trace_span(store: Store, run_ids: list[str]) -> tuple[int, int]:
    """UTC epoch ns span covered by the given trace runs."""
    parts = _trace_parts(store, -(2**62), 2**62, run_ids)
    if not parts:
        raise InputError(f"no trace events for run(s) {', '.join(run_ids)}")
    return min(p["lo"] for p in parts), max(p["hi"] for p in parts)


def diagnose_stalls(store: Store, start_ns: int, end_ns: int, config: dict[str, Any],
                    hosts: Iterable[str] | None = None, gpus: Iterable[int] | None = None,
                    model: str | None = None, run_ids: list[str] | None = None, by: str = "window") -> StallReport:
    """Classify every window (or profiler step) of every GPU/rank with data in [start_ns, end_ns)."""
    cfg = stall_config(config)
    if end_ns <= start_ns:
        raise InputError("the time range is empty (--until is before --since)")
    w_ns = int(round(float(cfg["window_ms"]) * 1e6))
    host_set = set(hosts or [])
    gpu_set = {int(g) for g in gpus or []}
    units: dict[tuple[str, str], _Unit] = {}

    def unit_for(host: str, gpu: int, rank: int | None = None) -> _Unit:
        device = f"gpu{gpu}" if gpu >= 0 else f"cpu-rank{rank}"
        key = (host, device)
        if key not in units:
            units[key] = _Unit(host, device, gpu)
        return units[key]

    model_gpus = _model_gpus(store, model, start_ns, end_ns) if model else None
    for host, gpu, gpu_model, ts, sm, dram, l2, util in _samples(store, start_ns, end_ns):
        if model_gpus is not None and not ((host, str(gpu)) in model_gpus or (host, "") in model_gpus
                                           or model.lower() in str(gpu_model).lower()):
            continue
        unit_for(host, int(gpu)).samples.append(
            (int(ts), *(float("nan") if v is None else float(v) for v in (sm, dram, l2, util))))
    for part in _trace_parts(store, start_ns, end_ns, run_ids):
        if host_set and part["host"] not in host_set:
            continue
        if gpu_set and part["device"] not in gpu_set:
            continue
        if model_gpus is not None and not ({(part["host"], str(part["device"])), (part["host"], "")} & model_gpus):
            continue
        part["iv"] = _trace_intervals(store, part, start_ns, end_ns, int(cfg["max_trace_events"]))
        u = unit_for(part["host"], part["device"], part["rank"])
        u.traces.append(part)
        u.ranks.add(part["rank"])
        u.runs.add(part["run_id"])
    io_by_host: dict[str, list[tuple[Any, ...]]] = defaultdict(list)
    for row in _io(store, start_ns, end_ns):
        io_by_host[row[0]].append(row)
    queue_by_host: dict[str, list[tuple[int, float]]] = defaultdict(list)
    for host, ts, q in _serving_queue(store, start_ns, end_ns):
        queue_by_host[host].append((int(ts), float(q)))
    if not run_ids:
        for host in io_by_host:  # a host with block-IO data but no GPU data still gets its IO verdicts
            if not any(u.host == host for u in units.values()) and (not gpu_set and model_gpus is None):
                u = _Unit(host, "host", -1)
                u.samples = [(int((r[3] + r[4]) // 2), math.nan, math.nan, math.nan, math.nan)
                             for r in io_by_host[host]]
                u.samples.sort()
                units[(host, "host")] = u
    report = StallReport(start_ns, end_ns, float(cfg["window_ms"]), by, cfg)
    for (host, _device), unit in sorted(units.items()):
        if host_set and host not in host_set:
            continue
        if gpu_set and unit.gpu not in gpu_set:
            continue
        intervals = _unit_windows(unit, start_ns, end_ns, w_ns, by)
        if not intervals:
            continue
        metrics = _metrics(unit, intervals, io_by_host.get(host, []), queue_by_host.get(host, []), cfg)
        for (a, b, kind, label), m in zip(intervals, metrics, strict=True):
            verdict, matched, evidence, severity = classify_window(m, cfg)
            report.windows.append(Window(unit.key, host, unit.device, a, b, kind, label, m, verdict, matched,
                                         evidence, severity))
    from triscope.analyzers.nccl_crossrank import flight_recorder_check, stragglers

    traced_runs = sorted({r for u in units.values() for r in u.runs}) or run_ids
    strag = stragglers(store, run_ids=traced_runs, start_ns=None if run_ids else start_ns,
                       end_ns=None if run_ids else end_ns,
                       min_lateness_seconds=float(cfg["straggler_min_lateness_seconds"]),
                       hosts=sorted(host_set) or None)
    report.stragglers = strag.to_json()
    report.flight_recorder = flight_recorder_check(store, run_ids, None if run_ids else start_ns,
                                                   None if run_ids else end_ns)
    return report


def _model_gpus(store: Store, model: str, start_ns: int, end_ns: int) -> set[tuple[str, str]]:
    """(host, gpu) pairs that served ``model`` in the range (gpu '' = the whole host)."""
    params = {**_range_params(start_ns, end_ns), "model": model}
    rng = "ts >= fromUnixTimestamp64Nano({start:Int64}) AND ts < fromUnixTimestamp64Nano({end:Int64})"
    pairs = {(h, g) for h, g in store.query(
        f"SELECT DISTINCT host, gpu FROM {qualified(store, 'requests')} WHERE model = {{model:String}} AND {rng}",
        params).rows}
    pairs |= {(h, "") for (h,) in store.query(
        f"SELECT DISTINCT host FROM {qualified(store, 'serving_metrics')} WHERE model = {{model:String}} AND {rng}",
        params).rows}
    return pairs
