"""Judging metrics (docs/workloads.md): goodput, P99 over all offered, the error split, peak QPS held,
per class and per time window, and their plot; what a user would judge a policy by."""

from __future__ import annotations

import math
import re
from typing import Any

from triscope_bed.engines.engine import CLASSES
from triscope_bed.stats import percentile
from triscope_bed.workloads.driver import Result

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
