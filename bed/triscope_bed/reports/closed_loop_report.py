"""The closed-loop bench's terminal report (rich tables)."""

from __future__ import annotations

import math
from typing import Any

from triscope_bed.engines.backend import BackendSpec
from triscope_bed.engines.engine import CLASSES
from triscope_bed.reports.closed_loop_stats import PolicyReport
from triscope_bed.workloads.arrivals import LoadShape


def _fmt_s(x: float) -> str:
    if not math.isfinite(x):
        return "-"
    return f"{x * 1000:.0f}ms" if x < 10 else f"{x:.1f}s"


def _fmt_inf(x: float) -> str:
    return "inf" if x == math.inf else _fmt_s(x)


def print_report(reports: dict[str, PolicyReport], comps: list[dict[str, Any]], shape: LoadShape,
                 specs: list[BackendSpec]) -> None:
    from rich.console import Console
    from rich.table import Table

    con = Console(width=max(150, Console().width))
    backends = ", ".join(f"{s.name}({s.kv_gib:g}GiB KV, {s.slots} slots, x{s.speed:g})" for s in specs)
    con.print(f"backends: {backends}")
    con.print(f"load: {shape.steps} steps x {shape.step_s:g}s from {shape.base_qps:g} QPS, "
              f"x{shape.step_factor:g}/step, "
              f"bursts x{shape.burst_factor:g} for {shape.burst_s:g}s every {shape.burst_period_s:g}s")
    t = Table(title="closed loop: per policy (P99 of successful requests [P99 of all offered, failures = inf]; "
                    "SLA speech 200ms / image 800ms / video 5s)")
    for col in ("policy", "peak QPS held", "P99 speech", "P99 image-text", "P99 video", "errors", "OOM 503",
                "LB 503", "timeouts", "within SLA"):
        t.add_column(col)
    for r in reports.values():
        t.add_row(f"{r.policy} ({r.balance})", f"{r.peak_qps_held:g}",
                  *[f"{_fmt_s(r.p99_s[c])} [{_fmt_inf(r.p99_all_s.get(c, math.nan))}]" for c in CLASSES],
                  f"{r.error_rate:.2%}", f"{r.oom_rate:.2%}", f"{r.lb_reject_rate:.2%}", f"{r.timeout_rate:.2%}",
                  f"{r.sla_attainment:.1%}")
    con.print(t)
    for r in reports.values():
        if r.drain_check:
            d = r.drain_check
            con.print(f"{r.policy} drain check: backend 503s while the feed had that backend drained "
                      f"{d.get('oom_while_drained', 0)}, ready {d.get('oom_while_ready', 0)} "
                      f"(feed KV at those 503s: mean {d.get('feed_kv_at_oom_mean')}); max KV seen by the feed "
                      f"{d.get('max_kv_seen')}; drained samples {d.get('drained_samples')}")
    for r in reports.values():
        e, lb = r.extra.get("error_rate_by_class", {}), r.extra.get("lb_reject_rate_by_class", {})
        con.print(f"{r.policy} errors by class (LB 503 part): " + ", ".join(
            f"{c} {e.get(c, math.nan):.2%} ({lb.get(c, math.nan):.2%})" for c in CLASSES))
    b = Table(title="per backend: share of served requests | OOM 503s | peak memory ratio | HAProxy weight mean (min)")
    b.add_column("policy")
    for spec in specs:
        b.add_column(f"{spec.name} ({spec.kv_gib:g}GiB)")
    for r in reports.values():
        b.add_row(r.policy, *[f"{r.backend_share.get(x.name, 0):.0%} | {r.backend_oom.get(x.name, 0)} | "
                              f"{r.backend_peak_kv.get(x.name, 0):.2f} | {r.weights_mean.get(x.name, 0):g} "
                              f"({r.weights_min.get(x.name, -1)})" for x in specs])
    con.print(b)
    s = Table(title="per step: errors | P99 speech/image/video (* = step held)")
    s.add_column("step QPS")
    for r in reports.values():
        s.add_column(r.policy)
    for k in range(shape.steps):
        row = [f"{shape.step_qps(k):.1f}"]
        for r in reports.values():
            st = r.steps[k]
            row.append(f"{'*' if st.held else ' '} {st.error_rate:.1%} | "
                       + "/".join(_fmt_s(st.p99_s[c]) for c in CLASSES))
        s.add_row(*row)
    con.print(s)
    for comp in comps:
        if not comp:
            continue
        p = comp["p99_ratio"]
        con.print(f"{comp['baseline']} / {comp['candidate']}: P99 speech x{p['realtime_speech']:.2f}, "
                  f"image-text x{p['interactive_image_text']:.2f}, video x{p['offline_video']:.2f}; "
                  f"errors x{comp['error_rate_ratio']:.2f}; peak QPS held x{comp['peak_qps_ratio']:.2f} "
                  f"(candidate/baseline); within-SLA {comp['sla_attainment_delta']:+.1%}")
        if "p99_common_ratio" in comp:
            q = comp["p99_common_ratio"]
            con.print(f"  over requests that succeeded under both: P99 x{q['realtime_speech']:.2f} / "
                      f"x{q['interactive_image_text']:.2f} / x{q['offline_video']:.2f}")
        common = comp.get("p99_common_ratio_by_step") or [None] * len(comp["p99_ratio_by_step"])
        for k, (pr, er, cr) in enumerate(zip(comp["p99_ratio_by_step"], comp["error_ratio_by_step"], common,
                                             strict=True)):
            line = (f"  step {shape.step_qps(k):6.1f} QPS: P99 x{pr['realtime_speech']:.2f} / "
                    f"x{pr['interactive_image_text']:.2f} / x{pr['offline_video']:.2f}, errors x{er:.2f}")
            if cr:
                line += (f"; common successes x{cr['realtime_speech']:.2f} / x{cr['interactive_image_text']:.2f}"
                         f" / x{cr['offline_video']:.2f}")
            con.print(line)
    lag = max(r.send_lag_s for r in reports.values())
    if lag > 0.05:
        con.print(f"[yellow]load generator fell up to {lag * 1000:.0f} ms behind schedule (CPU-bound machine)")


