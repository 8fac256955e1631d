"""The closed-loop bench's numbers: per-policy reports from the raw results, and policy comparisons."""

from __future__ import annotations

import bisect
import math
import re
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


# --- Judging metrics (docs/workloads.md): goodput, P99 over all offered, error split, peak QPS held ---

ERROR_KINDS = ("oom", "lb_reject", "backend_503", "timeout", "connection", "http_other")
_OOM_WORDS = re.compile(r"memory|kv|preempt|\boom\b", re.IGNORECASE)


def error_kind(r: Result) -> str | None:
    """Why a request failed (None: it succeeded), one of :data:`ERROR_KINDS`.

    A 503 naming a backend (X-Backend) is ``oom`` when its reason mentions memory/KV/preemption or is
    unknown (results from before reasons were kept), else ``backend_503``; a 503 without one is
    HAProxy's own (``lb_reject``); status 0 is a client timeout, -1 a connection error.
    """
    if r.status == 200:
        return None
    if r.status in (0, -1):
        return "timeout" if r.status == 0 else "connection"
    if r.status == 503:
        if not r.backend:
            return "lb_reject"
        return "oom" if not r.reason or _OOM_WORDS.search(r.reason) else "backend_503"
    return "http_other"


def _j(x: float) -> float | str | None:
    """A JSON-safe number: infinite -> "inf", NaN -> None."""
    if math.isnan(x):
        return None
    return "inf" if math.isinf(x) else round(x, 6)


MIN_GOODPUT = 0.99
"""X of *held*: a class holds a window when at least this share of its offered requests was goodput."""


def _group(rs: list[Result], seconds: float, quantile: float, min_goodput: float,
           slas: dict[str, float] | None = None) -> dict[str, Any]:
    """Offered, goodput, P99 (all offered / successes), the error split and *held* of one class in one window."""
    sla = (slas or {}).get(rs[0].cls, CLASSES[rs[0].cls].sla_s) if rs and rs[0].cls in CLASSES else None
    good = [r for r in rs if r.status == 200 and sla is not None and r.latency_s <= sla]
    errors = dict.fromkeys(ERROR_KINDS, 0)
    for r in rs:
        kind = error_kind(r)
        if kind is not None:
            errors[kind] += 1
    tail = percentile([r.latency_s if r.status == 200 else math.inf for r in rs], quantile)
    tail_ok = percentile([r.latency_s for r in rs if r.status == 200], quantile)
    tokens = [r.completion_tokens for r in good if r.completion_tokens >= 0]
    held = sla is not None and len(good) >= min_goodput * len(rs) - 1e-9 and tail_ok <= sla
    return {"offered": len(rs), "offered_qps": _j(len(rs) / seconds), "goodput_qps": _j(len(good) / seconds),
            "within_sla": len(good), "goodput_tokens_per_s": _j(sum(tokens) / seconds) if tokens else None,
            "p99_all_s": _j(tail), "p99_ok_s": _j(tail_ok), "errors": errors, "held": held}


def judge(results: list[Result], bucket_s: float, *, duration_s: float | None = None,
          offered_qps: list[float] | None = None, repetitions: int = 1, quantile: float = 99.0,
          min_goodput: float = MIN_GOODPUT, slas: dict[str, float] | None = None) -> dict[str, Any]:
    """Per ``bucket_s`` window (``Result.step``) and per class: goodput, P99 over all offered, errors, held.

    ``duration_s``: the run length (cuts the last window short; default: whole windows up to the
    last step). ``offered_qps``: nominal QPS per step (the step workload's), else arrivals / window
    length. ``repetitions``: runs pooled in ``results`` (rates are divided by it). A class *holds* a
    window when goodput >= ``min_goodput`` x its offered requests and the P99 of its successes is
    within its SLA (at the default 0.99 that is: P99 over all offered within SLA); a window is *held*
    when every class offered in it holds it. *Peak QPS held* is the highest offered QPS q such that
    every window offered at most q was held (0 when none). ``slas``: seconds per class replacing the
    classes' (GPU) SLAs, e.g. a CPU test bed's. Returns a JSON-able dict ("inf", null).
    """
    if bucket_s <= 0 or repetitions < 1 or not 0 < min_goodput <= 1:
        raise ValueError("bucket_s must be > 0, repetitions >= 1 and min_goodput in (0, 1]")
    n_buckets = (math.ceil(duration_s / bucket_s) if duration_s is not None
                 else max((r.step for r in results), default=-1) + 1)
    total_s = duration_s if duration_s is not None else n_buckets * bucket_s
    buckets: list[dict[str, Any]] = []
    for k in range(n_buckets):
        seconds = max(1e-9, min(bucket_s, total_s - k * bucket_s)) * repetitions
        rs = [r for r in results if r.step == k]
        classes = {c: _group([r for r in rs if r.cls == c], seconds, quantile, min_goodput, slas) for c in CLASSES}
        offered = offered_qps[k] if offered_qps is not None and k < len(offered_qps) else len(rs) / seconds
        errors = {e: sum(g["errors"][e] for g in classes.values()) for e in ERROR_KINDS}
        buckets.append({"step": k, "t0_s": k * bucket_s, "offered_qps": _j(offered), "requests": len(rs),
                        "goodput_qps": _j(sum(g["within_sla"] for g in classes.values()) / seconds),
                        "goodput_tokens_per_s": _tokens(classes),
                        "errors": errors, "error_rate": _j(sum(errors.values()) / len(rs) if rs else math.nan),
                        "held": bool(rs) and all(g["held"] for g in classes.values() if g["offered"]),
                        "classes": classes})
    unheld = min((float(b["offered_qps"]) for b in buckets if b["requests"] and not b["held"]), default=math.inf)
    peak = max((float(b["offered_qps"]) for b in buckets if b["held"] and float(b["offered_qps"]) < unheld),
               default=0.0)
    whole = {c: _group([r for r in results if r.cls == c], total_s * repetitions, quantile, min_goodput, slas)
             for c in CLASSES}
    errors = {e: sum(g["errors"][e] for g in whole.values()) for e in ERROR_KINDS}
    return {"bucket_s": bucket_s, "duration_s": total_s, "repetitions": repetitions, "quantile": quantile,
            "min_goodput": min_goodput, "sla_s": {c: (slas or {}).get(c, CLASSES[c].sla_s) for c in CLASSES},
            "requests": len(results), "offered_qps": _j(len(results) / (total_s * repetitions)),
            "goodput_qps": _j(sum(g["within_sla"] for g in whole.values()) / (total_s * repetitions)),
            "goodput_tokens_per_s": _tokens(whole),
            "errors": errors, "error_rate": _j(sum(errors.values()) / len(results) if results else math.nan),
            "peak_qps_held": round(peak, 3), "classes": whole, "buckets": buckets}


def _tokens(classes: dict[str, dict[str, Any]]) -> float | None:
    """Sum of the classes' goodput tokens/s (None when no answer echoed its usage)."""
    rates = [g["goodput_tokens_per_s"] for g in classes.values() if g["goodput_tokens_per_s"] is not None]
    return round(sum(rates), 6) if rates else None


def plot_judgements(judgements: dict[str, dict[str, Any]], path: str, title: str = "") -> None:
    """PNG: goodput and each class's P99 over all offered against offered QPS, one line per policy.

    An infinite P99 (over 1 % failed) is drawn at the top edge (10 x SLA) with an x marker.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # optional heavy import, only when plotting
    from matplotlib.figure import Figure

    fig = Figure(figsize=(4.2 * (1 + len(CLASSES)), 4.0))
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, 1 + len(CLASSES))
    top = 0.0
    slas = {c: CLASSES[c].sla_s for c in CLASSES}
    for doc in judgements.values():
        slas.update(doc.get("sla_s", {}))
    for policy, doc in judgements.items():
        rows = sorted((b for b in doc["buckets"] if b["requests"]), key=lambda b: float(b["offered_qps"]))
        xs = [float(b["offered_qps"]) for b in rows]
        top = max([top, *xs])
        axes[0].plot(xs, [float(b["goodput_qps"]) for b in rows], marker="o", label=policy)
        for ax, c in zip(axes[1:], CLASSES, strict=True):
            ceiling = 10 * slas[c]
            pts = [(x, b["classes"][c]["p99_all_s"]) for x, b in zip(xs, rows, strict=True)
                   if b["classes"][c]["offered"]]
            ys = [ceiling if v == "inf" else min(ceiling, float(v)) for _, v in pts]
            line = ax.plot([x for x, _ in pts], ys, marker="o", label=policy)[0]
            inf_pts = [(x, ceiling) for x, v in pts if v == "inf"]
            if inf_pts:
                ax.scatter(*zip(*inf_pts, strict=True), marker="x", s=60, color=line.get_color(), zorder=3)
    axes[0].plot([0, top], [0, top], ls=":", color="grey", label="goodput = offered")
    axes[0].set(xlabel="offered QPS", ylabel="goodput (200 within SLA) per s", title="goodput")
    axes[0].legend(fontsize=8)
    for ax, c in zip(axes[1:], CLASSES, strict=True):
        ax.axhline(slas[c], ls="--", color="grey", label="SLA")
        ax.set(xlabel="offered QPS", ylabel="P99 over all offered (s)", yscale="log", title=c)
        ax.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
