"""The closed-loop bench's numbers: per-policy reports from the raw results, and policy comparisons."""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from triscope_bed.engines.engine import CLASSES
from triscope_bed.stats import percentile
from triscope_bed.workloads.arrivals import LoadShape
from triscope_bed.workloads.driver import Result

FeedSample = dict[str, tuple[int, str, float | None]]
"""The feed's verdict per backend at one instant: (LB weight, state, KV usage it saw)."""


@dataclass
class Policy:
    name: str
    balance: str
    triscope: bool = False
    class_pools: bool = False


@dataclass
class StepStats:
    step: int
    offered_qps: float
    requests: int
    error_rate: float
    oom_rate: float
    p99_s: dict[str, float]
    held: bool
    p99_all_s: dict[str, float] = field(default_factory=dict)


@dataclass
class PolicyReport:
    policy: str
    balance: str
    requests: int
    ok: int
    error_rate: float
    oom_rate: float
    timeout_rate: float
    p99_s: dict[str, float]
    sla_attainment: float
    peak_qps_held: float
    steps: list[StepStats]
    backend_share: dict[str, float]
    backend_oom: dict[str, int]
    backend_peak_kv: dict[str, float]
    weights_mean: dict[str, float]
    weights_min: dict[str, int]
    send_lag_s: float
    wall_s: float
    lb_reject_rate: float = 0.0
    p99_all_s: dict[str, float] = field(default_factory=dict)
    repetitions: int = 1
    drain_check: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class RawRun:
    """Everything one replay of the schedule under one policy produced."""

    results: list[Result]
    lag: float
    samples: list[tuple[float, dict[str, int]]]
    feed_samples: list[tuple[float, FeedSample]]
    states: dict[str, dict[str, Any]]
    wall: float
    feed_kind: str = ""


def is_oom(r: Result) -> bool:
    """A 503 from a backend (its KV pool was full); HAProxy's own 503s carry no X-Backend."""
    return r.status == 503 and bool(r.backend)


def is_lb_reject(r: Result) -> bool:
    """A 503 from HAProxy itself (``timeout queue`` expired, or no server usable)."""
    return r.status == 503 and not r.backend


def p99_all(results: list[Result], cls: str) -> float:
    """P99 over every offered request of ``cls``, a failed request counting as infinitely slow."""
    return percentile([r.latency_s if r.status == 200 else math.inf for r in results if r.cls == cls], 99)


def drain_check(results: list[Result], feed_samples: list[tuple[float, FeedSample]]) -> dict[str, Any]:
    """Did the feed drain a backend before it refused requests? Feed state at each backend 503."""
    if not feed_samples:
        return {}
    times = [t for t, _ in feed_samples]
    counts = {"oom_while_drained": 0, "oom_while_ready": 0, "oom_no_sample": 0}
    drained: dict[str, int] = {}
    max_kv: dict[str, float] = {}
    for _, doc in feed_samples:
        for b, (_w, state, kv) in doc.items():
            drained[b] = drained.get(b, 0) + (state == "drain")
            if kv is not None:
                max_kv[b] = round(max(max_kv.get(b, 0.0), kv), 3)
    kv_at_oom: list[float] = []
    for r in results:
        if not is_oom(r):
            continue
        k = bisect.bisect_right(times, r.t) - 1
        entry = feed_samples[k][1].get(r.backend) if k >= 0 else None
        if entry is None:
            counts["oom_no_sample"] += 1
            continue
        counts["oom_while_drained" if entry[1] == "drain" else "oom_while_ready"] += 1
        if entry[2] is not None:
            kv_at_oom.append(entry[2])
    return {**counts, "drained_samples": drained, "max_kv_seen": max_kv, "feed_kv_at_oom_sum": sum(kv_at_oom),
            "feed_samples": len(feed_samples)}


def summarize(policy: Policy, runs: list[RawRun], shape: LoadShape, max_error: float) -> PolicyReport:
    """Turn the raw results of one or more repetitions (pooled) into the policy's report."""
    results = [r for run in runs for r in run.results]
    samples = [s for run in runs for s in run.samples]
    n = len(results)
    ok = [r for r in results if r.status == 200]
    steps: list[StepStats] = []
    for k in range(shape.steps):
        rs = [r for r in results if r.step == k]
        p99 = {c: percentile([r.latency_s for r in rs if r.cls == c and r.status == 200], 99) for c in CLASSES}
        err = sum(r.status != 200 for r in rs) / len(rs) if rs else math.nan
        oom = sum(is_oom(r) for r in rs) / len(rs) if rs else math.nan
        held = bool(rs) and err <= max_error and all(
            math.isfinite(p99[c]) and p99[c] <= CLASSES[c].sla_s for c in CLASSES
            if any(r.cls == c for r in rs))
        steps.append(StepStats(k, round(shape.step_qps(k), 2), len(rs), err, oom, p99, held,
                               {c: p99_all(rs, c) for c in CLASSES}))
    peak = 0.0
    for s in steps:
        if not s.held:
            break
        peak = s.offered_qps
    served: dict[str, int] = {}
    for r in ok:
        served[r.backend] = served.get(r.backend, 0) + 1
    names = sorted(runs[0].states)
    w_mean = {b: (sum(w.get(b, 0) for _, w in samples) / len(samples)) if samples else math.nan for b in names}
    w_min = {b: min((w.get(b, 0) for _, w in samples), default=-1) for b in names}
    within = sum(1 for r in ok if r.latency_s <= CLASSES[r.cls].sla_s)
    drains = [drain_check(run.results, run.feed_samples) for run in runs]
    drain: dict[str, Any] = {}
    for d in drains:
        for key, value in d.items():
            if isinstance(value, int):
                drain[key] = drain.get(key, 0) + value
    if drains and drains[0]:
        kv_n = drain.get("oom_while_drained", 0) + drain.get("oom_while_ready", 0)
        kv_sum = sum(d.get("feed_kv_at_oom_sum", 0.0) for d in drains)
        drain["feed_kv_at_oom_mean"] = round(kv_sum / kv_n, 3) if kv_n else None
        drain["max_kv_seen"] = {b: max(d["max_kv_seen"].get(b, 0.0) for d in drains) for b in names}
        drain["drained_samples"] = {b: sum(d["drained_samples"].get(b, 0) for d in drains) for b in names}
    return PolicyReport(
        policy=policy.name, balance=policy.balance, requests=n, ok=len(ok),
        error_rate=(n - len(ok)) / n if n else math.nan,
        oom_rate=sum(is_oom(r) for r in results) / n if n else math.nan,
        timeout_rate=sum(r.status == 0 for r in results) / n if n else math.nan,
        p99_s={c: percentile([r.latency_s for r in ok if r.cls == c], 99) for c in CLASSES},
        sla_attainment=within / n if n else math.nan,
        peak_qps_held=peak, steps=steps,
        backend_share={b: served.get(b, 0) / len(ok) if ok else 0.0 for b in names},
        backend_oom={b: sum(sum(run.states[b]["oom"].values()) for run in runs) for b in names},
        backend_peak_kv={b: round(max(run.states[b]["peak_kv_ratio"] for run in runs), 3) for b in names},
        weights_mean={b: round(v, 1) for b, v in w_mean.items()}, weights_min=w_min,
        send_lag_s=max(run.lag for run in runs), wall_s=sum(run.wall for run in runs),
        lb_reject_rate=sum(is_lb_reject(r) for r in results) / n if n else math.nan,
        p99_all_s={c: p99_all(results, c) for c in CLASSES},
        repetitions=len(runs), drain_check=drain,
        extra={"error_rate_by_class": {c: _share(results, c, lambda r: r.status != 200) for c in CLASSES},
               "lb_reject_rate_by_class": {c: _share(results, c, is_lb_reject) for c in CLASSES}})


def _share(results: list[Result], cls: str, pred: Callable[[Result], bool]) -> float:
    """Share of the class's offered requests for which ``pred`` holds (NaN when none were offered)."""
    rs = [r for r in results if r.cls == cls]
    return sum(1 for r in rs if pred(r)) / len(rs) if rs else math.nan


def _ratio(a: float, b: float) -> float:
    """``a / b``; an infinite P99 (over 1 % failed) only compares against a finite one."""
    if math.isnan(a) or math.isnan(b) or (math.isinf(a) and math.isinf(b)):
        return math.nan
    if math.isinf(a):
        return math.inf
    if math.isinf(b):
        return 0.0
    if b == 0:
        return math.inf if a > 0 else 1.0
    return a / b


def common_success_p99(base: list[RawRun], cand: list[RawRun], step: int | None = None) -> dict[str, float]:
    """Per class P99 of each policy over the requests that succeeded under *both* (same arrivals)."""
    out: dict[str, float] = {}
    keyed = []
    for runs in (base, cand):
        keyed.append({(rep, r.idx): r for rep, run in enumerate(runs) for r in run.results
                      if r.status == 200 and (step is None or r.step == step)})
    both = keyed[0].keys() & keyed[1].keys()
    for c in CLASSES:
        for side, rows in zip(("baseline", "candidate"), keyed, strict=True):
            out[f"{side}:{c}"] = percentile([rows[k].latency_s for k in both if rows[k].cls == c], 99)
    return out


def comparison(reports: dict[str, PolicyReport], baseline: str = "leastconn",
               candidate: str = "triscope", raw: dict[str, list[RawRun]] | None = None) -> dict[str, Any]:
    """Baseline/candidate ratios (> 1 means the candidate is better)."""
    if baseline not in reports or candidate not in reports:
        return {}
    b, c = reports[baseline], reports[candidate]
    out = {
        "baseline": baseline, "candidate": candidate,
        "p99_ratio": {k: _ratio(b.p99_s[k], c.p99_s[k]) for k in CLASSES},
        "p99_all_ratio": {k: _ratio(b.p99_all_s[k], c.p99_all_s[k]) for k in CLASSES},
        "error_rate_ratio": _ratio(b.error_rate, c.error_rate),
        "peak_qps_ratio": _ratio(c.peak_qps_held, b.peak_qps_held),
        "sla_attainment_delta": c.sla_attainment - b.sla_attainment,
        "p99_ratio_by_step": [{k: _ratio(sb.p99_s[k], sc.p99_s[k]) for k in CLASSES}
                              for sb, sc in zip(b.steps, c.steps, strict=True)],
        "error_ratio_by_step": [_ratio(sb.error_rate, sc.error_rate) for sb, sc in zip(b.steps, c.steps, strict=True)],
    }
    if raw is not None and raw.get(baseline) and raw.get(candidate):
        cs = common_success_p99(raw[baseline], raw[candidate])
        out["p99_common_ratio"] = {k: _ratio(cs[f"baseline:{k}"], cs[f"candidate:{k}"]) for k in CLASSES}
        out["p99_common_s"] = cs
        by_step = [common_success_p99(raw[baseline], raw[candidate], k) for k in range(len(b.steps))]
        out["p99_common_ratio_by_step"] = [{k: _ratio(cs_k[f"baseline:{k}"], cs_k[f"candidate:{k}"])
                                            for k in CLASSES} for cs_k in by_step]
    return out
