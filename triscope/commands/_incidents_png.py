"""``diagnose --since ... --png PATH``: one timeline per incident (matplotlib, Agg).

Per incident, over its baseline and its span: the fleet's completed requests per second, each backend
hit's worst P99 over its class's SLA, their KV usage, and the cause's own signal (run-queue wait,
scrape up); the breach onset is marked and the incident shaded.
"""

from __future__ import annotations

import math
from pathlib import Path

from triscope.analyzers.incidents import IncidentReport

MAX_INCIDENTS = 6


def _p99_ratio(w: object, sla: dict[str, float], default: float) -> float:
    classes = getattr(w, "classes", {})
    ratios = [c.p99_seconds / sla.get(name, default) for name, c in classes.items() if math.isfinite(c.p99_seconds)]
    if ratios:
        return max(ratios)
    p99 = getattr(w, "engine_p99_seconds", math.nan)
    return p99 / default if math.isfinite(p99) else math.nan


def write_png(report: IncidentReport, path: Path) -> int:
    """Draw the first :data:`MAX_INCIDENTS` incidents into ``path``; returns how many were drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = report.incidents[:MAX_INCIDENTS]
    if not shown:
        return 0
    default = report.sla_s.get("interactive_image_text", 0.8)
    fig, axes = plt.subplots(len(shown), 4, figsize=(18, 3.2 * len(shown)), squeeze=False, constrained_layout=True)
    for row, incident in zip(axes, shown, strict=True):
        lo, hi = incident.start_s - report.config.baseline_s, incident.end_s + 2 * report.window_s
        fleet: dict[float, float] = {}
        for series in report.windows.values():
            for t, w in series.items():
                if lo <= t <= hi:
                    fleet[t] = fleet.get(t, 0.0) + w.requests / report.window_s
        ts = sorted(fleet)
        row[0].plot([t - incident.start_s for t in ts], [fleet[t] for t in ts], color="black")
        row[0].set_title(f"{incident.cause.name}: fleet completed req/s", fontsize=9)
        for backend in incident.backends:
            series = {t: w for t, w in report.windows.get(backend, {}).items() if lo <= t <= hi}
            xs = sorted(series)
            rel = [t - incident.start_s for t in xs]
            row[1].plot(rel, [_p99_ratio(series[t], dict(report.sla_s), default) for t in xs], label=backend)
            row[2].plot(rel, [series[t].kv_usage for t in xs], label=backend)
            if incident.cause.name == "host_cpu":
                row[3].plot(rel, [series[t].cpu_wait_ratio for t in xs], label=backend)
                row[3].set_title("run-queue wait share", fontsize=9)
            else:
                row[3].plot(rel, [series[t].scrape_up for t in xs], label=backend)
                row[3].set_title("scrape up (0 = down)", fontsize=9)
        row[1].axhline(1.0, color="red", linewidth=0.8)
        row[1].set_title("worst P99 / SLA", fontsize=9)
        row[2].set_title("KV usage", fontsize=9)
        for ax in row:
            ax.axvspan(0, incident.end_s - incident.start_s, color="red", alpha=0.08)
            ax.axvline(0, color="red", linestyle="--", linewidth=0.8)
            for name, lead in incident.lead_times_s.items():
                if name == "qps_jump":
                    ax.axvline(-lead, color="grey", linestyle=":", linewidth=0.8)
            ax.set_xlabel("s from the breach", fontsize=8)
            ax.tick_params(labelsize=7)
        row[1].legend(fontsize=7)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return len(shown)
