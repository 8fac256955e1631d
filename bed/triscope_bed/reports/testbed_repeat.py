"""Repeated test bed rounds summed up: each policy's spread and each triscope policy's paired ratios.

One run of a policy on the 2-CPU bed varies more than policies differ (docs/closed_loop.md: leastconn
alone 9.8-11.2 goodput/s on the same arrivals), so ``bench/testbed.py --repeat N`` replays the arrivals N
times per policy, in a rotated order each round so that drift (warm engines, a busy neighbour) falls on
every policy alike, and this module turns the rounds into figures a claim can stand on: per policy the
mean, standard deviation and range; per pair the ratio of triscope's figure to the peer's in each round,
their geometric mean and a 95 % confidence interval (Student's t on the log ratios, paired by round);
and the ceilings no router can pass at that load (offered / the peer's goodput, where it stops holding
and over the run; the top window / the peer's peak QPS held), against which the routing targets are read.
``bench/testbed_ratios.py`` groups runs of the same arrivals (:func:`group_rounds`) into that verdict.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from triscope_bed.engines.engine import CLASSES

T_975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
         2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086,
         2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)
"""Student's t, two-sided 95 % (the 0.975 quantile), for 1-30 degrees of freedom; 1.96 beyond."""

TRISCOPE_PREFIX = "triscope"


def rotated(policies: Sequence[str], round_index: int) -> list[str]:
    """Round ``round_index``'s order: the list rotated by the round (A B C, B C A, C A B, ...)."""
    if not policies:
        return []
    k = round_index % len(policies)
    return [*policies[k:], *policies[:k]]


def t_quantile(df: int) -> float:
    """Two-sided 95 % Student's t for ``df`` degrees of freedom (>= 1)."""
    if df < 1:
        raise ValueError("t_quantile needs at least 1 degree of freedom")
    return T_975[df - 1] if df <= len(T_975) else 1.96


def spread(values: Sequence[float]) -> dict[str, Any]:
    """n, mean, sd (None below 2 values), min and max of the finite values; ``non_finite`` counts the rest."""
    finite = [float(v) for v in values if _finite(v)]
    out: dict[str, Any] = {"n": len(finite), "non_finite": len(values) - len(finite)}
    if finite:
        out.update(mean=statistics.fmean(finite), sd=statistics.stdev(finite) if len(finite) > 1 else None,
                   min=min(finite), max=max(finite))
    return out


def tail_spread(values: Sequence[Any]) -> dict[str, Any]:
    """Median and range of P99s, where a failed request makes a P99 infinite (``"inf"`` in the documents)."""
    numbers = sorted(math.inf if v == "inf" else float(v) for v in values if v is not None)
    if not numbers:
        return {"n": 0}
    show = lambda v: "inf" if math.isinf(v) else v  # noqa: E731
    return {"n": len(numbers), "median": show(statistics.median(numbers)), "min": show(numbers[0]),
            "max": show(numbers[-1])}


def paired_ratio(ours: Sequence[float], theirs: Sequence[float]) -> dict[str, Any]:
    """Per-round ratios ours / theirs, their geometric mean and its 95 % CI (rounds where either is 0 or
    not finite are left out and counted in ``dropped``; the CI needs two ratios)."""
    ratios = [a / b for a, b in zip(ours, theirs, strict=True) if _finite(a) and _finite(b) and a > 0 and b > 0]
    out: dict[str, Any] = {"per_round": [round(r, 4) for r in ratios], "dropped": len(ours) - len(ratios)}
    if not ratios:
        return out
    logs = [math.log(r) for r in ratios]
    centre = statistics.fmean(logs)
    out["geo_mean"] = math.exp(centre)
    if len(logs) > 1:
        half = t_quantile(len(logs) - 1) * statistics.stdev(logs) / math.sqrt(len(logs))
        out["ci95"] = [math.exp(centre - half), math.exp(centre + half)]
    return out


def peer_break(ours: Mapping[str, Any], peer: Mapping[str, Any]) -> tuple[float, float, float] | None:
    """(our goodput, the peer's, the offered QPS) in the window where the peer stops holding (the routing
    targets' step): of those with requests it did not hold, the one offered least, as ``peak_qps_held`` is judged
    (the earliest on a tie); None when it held every window."""
    unheld = [(float(b["offered_qps"]), k) for k, b in enumerate(peer["buckets"]) if b["requests"] and not b["held"]]
    if not unheld or min(unheld)[1] >= len(ours["buckets"]):
        return None
    k = min(unheld)[1]
    theirs = peer["buckets"][k]
    return float(ours["buckets"][k]["goodput_qps"]), float(theirs["goodput_qps"]), float(theirs["offered_qps"])


def at_peer_break(ours: Sequence[Mapping[str, Any]], peers: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Over rounds: goodput ratios where the peer stops holding, and the ceilings no router can pass at this
    load (offered / the peer's goodput there, overall, and the highest offered window / the peer's held)."""
    breaks = [(k, b) for k, (o, p) in enumerate(zip(ours, peers, strict=True)) if (b := peer_break(o, p))]
    top = [max((float(b["offered_qps"]) for b in p["buckets"] if b["requests"]), default=math.nan) for p in peers]
    return {
        "goodput_at_peer_break": paired_ratio([g for _, (g, _, _) in breaks], [pg for _, (_, pg, _) in breaks]),
        "ceiling_at_peer_break": spread([off / pg if pg > 0 else math.inf for _, (_, pg, off) in breaks]),
        "peer_held_every_window": len(ours) - len(breaks),
        "ceiling_goodput": spread([float(p["offered_qps"]) / float(p["goodput_qps"]) if float(p["goodput_qps"]) > 0
                                   else math.inf for p in peers]),
        "ceiling_held": spread([t / float(p["peak_qps_held"]) if float(p["peak_qps_held"]) > 0 else math.inf
                                for t, p in zip(top, peers, strict=True)]),
    }


def summarize(rounds: Sequence[Mapping[str, Mapping[str, Any]]], orders: Sequence[Sequence[str]]) -> dict[str, Any]:
    """The ``repeat`` block of a fleet: per policy the spread of each figure, per triscope policy and peer
    the paired ratios of goodput and peak QPS held and :func:`at_peer_break`'s figures (a pair only over
    the rounds where both ran)."""
    names = list(dict.fromkeys(p for r in rounds for p in r))
    policies: dict[str, Any] = {}
    for name in names:
        docs = [r[name] for r in rounds if name in r]
        policies[name] = {
            "rounds": len(docs),
            "goodput_qps": spread([float(d["goodput_qps"]) for d in docs]),
            "peak_qps_held": spread([float(d["peak_qps_held"]) for d in docs]),
            "errors": spread([float(sum(d["errors"].values())) for d in docs]),
            "preemptions": spread([float(d.get("preemptions", math.nan)) for d in docs]),
            "p99_all_s": {c: tail_spread([d["classes"][c]["p99_all_s"] for d in docs]) for c in CLASSES},
        }
    ours = [n for n in names if n.startswith(TRISCOPE_PREFIX)]
    pairs: dict[str, Any] = {}
    for a in ours:
        for b in names:
            if b == a or b.startswith(TRISCOPE_PREFIX):
                continue
            both = [r for r in rounds if a in r and b in r]
            pairs[f"{a}/{b}"] = {
                **{key: paired_ratio([float(r[a][key]) for r in both], [float(r[b][key]) for r in both])
                   for key in ("goodput_qps", "peak_qps_held")},
                **at_peer_break([r[a] for r in both], [r[b] for r in both])}
    return {"rounds": len(rounds), "orders": [list(o) for o in orders], "policies": policies, "ratios": pairs}


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v)


def best_peer(repeat: Mapping[str, Any], policy: str) -> str | None:
    """The peer (not a triscope policy) with the highest mean goodput over the rounds, paired with ``policy``."""
    peers = [(p["goodput_qps"].get("mean", -math.inf), name) for name, p in repeat["policies"].items()
             if not name.startswith(TRISCOPE_PREFIX) and f"{policy}/{name}" in repeat["ratios"]]
    return max(peers)[1] if peers else None


PANELS = (("goodput_qps", "ceiling_goodput", "goodput, whole run", 1.2),
          ("goodput_at_peer_break", "ceiling_at_peer_break", "goodput where the peer stops holding", 1.2),
          ("peak_qps_held", "ceiling_held", "peak QPS held", 1.3))
"""(ratio, its ceiling, title, the routing target against the best peer) per panel of :func:`plot_verdicts`."""


def group_rounds(docs: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Rounds of the same arrivals, whichever invocation made them: per fleet, workload, scenario and seed
    (and parameters, and the document's ``label`` where set), a ``--repeat`` document's rounds and a single
    run's policies as one round each, in the order given. Runs on fresh engines (one invocation each) thus
    add up like rounds of one."""
    groups: dict[str, dict[str, Any]] = {}
    for doc in docs:
        tag = doc.get("label") or ""  # set by the reader (``FILE=LABEL``): runs that must not pool
        for kind, fleet in doc.get("fleets", {}).items():
            rounds = fleet.get("rounds") or ([fleet["policies"]] if fleet.get("policies") else [])
            if not rounds:
                continue
            key = json.dumps([kind, doc.get("workload"), doc.get("scenario"), doc.get("seed"), doc.get("params"),
                              tag], sort_keys=True, default=str)
            label = f"{doc.get('workload')}/{doc.get('scenario')}" + (f", {tag}" if tag else "")
            group = groups.setdefault(key, {"fleet": kind, "label": label, "seed": doc.get("seed"), "rounds": [],
                                            "orders": []})
            orders = (fleet.get("repeat") or {}).get("orders") or [list(r) for r in rounds]
            group["rounds"] += rounds
            group["orders"] += orders
    return list(groups.values())


def verdict_rows(docs: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """One row per group of rounds (:func:`group_rounds`, two or more) and triscope policy: its pair blocks
    (ratios and ceilings, :func:`at_peer_break`) against the best peer and round-robin (``haproxy-rr``)
    where it ran, and each side's failed requests per round."""
    rows = []
    for group in group_rounds(docs):
        if len(group["rounds"]) < 2:
            continue
        rep = summarize(group["rounds"], group["orders"])
        for ours in (n for n in rep["policies"] if n.startswith(TRISCOPE_PREFIX)):
            peer = best_peer(rep, ours)
            if peer is None:
                continue
            rows.append({
                "label": group["label"], "fleet": group["fleet"], "seed": group["seed"], "rounds": rep["rounds"],
                "policy": ours, "best_peer": peer, "vs_best_peer": rep["ratios"][f"{ours}/{peer}"],
                "vs_round_robin": rep["ratios"].get(f"{ours}/haproxy-rr") if peer != "haproxy-rr" else None,
                "errors": rep["policies"][ours]["errors"], "peer_errors": rep["policies"][peer]["errors"]})
    return rows


def plot_verdicts(rows: Sequence[Mapping[str, Any]], path: str) -> None:
    """PNG, one panel per :data:`PANELS` entry: per row the geometric mean and 95 % CI of the ratio to the
    best peer (dot) and to round-robin (square), the ceiling against the best peer (grey bar: the most any
    router could make at that load), 1.0 and the target."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # optional heavy import, only when plotting
    from matplotlib.figure import Figure

    fig = Figure(figsize=(15, 2.0 + 0.55 * len(rows)))
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(PANELS), sharey=True)
    names = [f"{r['fleet']} {r['label']} ({r['rounds']}x, vs {r['best_peer']})" for r in rows]
    for ax, (key, ceiling, title, target) in zip(axes, PANELS, strict=True):
        lo_x, hi_x = 0.8, max(1.4, target + 0.1)
        for y, row in enumerate(rows):
            top = row["vs_best_peer"].get(ceiling, {})
            if top.get("n"):
                ax.plot([min(top["mean"], 2.5)], [y], marker="|", markersize=16, mew=2, color="grey")
                hi_x = max(hi_x, min(top["mean"], 2.5) + 0.05)
            for pair, marker, colour, dy in ((row["vs_best_peer"], "o", "tab:blue", 0.0),
                                             (row["vs_round_robin"], "s", "tab:orange", 0.25)):
                ratio = (pair or {}).get(key) or {}
                if "geo_mean" not in ratio:
                    continue
                mid = ratio["geo_mean"]
                lo, hi = ratio.get("ci95", [mid, mid])
                ax.errorbar([mid], [y + dy], xerr=[[mid - lo], [hi - mid]], fmt=marker, color=colour, capsize=3)
                lo_x, hi_x = min(lo_x, lo - 0.05), max(hi_x, hi + 0.05)
        ax.axvline(1.0, color="grey", ls=":")
        ax.axvline(target, color="tab:green", ls="--")
        ax.set(title=f"{title} (target {target:g}x)", xlabel="triscope / other", xlim=(lo_x, hi_x),
               ylim=(len(rows) - 0.5, -0.5))
    axes[0].set_yticks(range(len(rows)), names, fontsize=8)
    fig.suptitle("paired ratios over repeated rounds: dot = vs the best peer, square = vs round-robin, bar = 95 % CI\n"
                 "grey | = ceiling (offered / the best peer's); dashed = target; no dot: the peer held every window",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
