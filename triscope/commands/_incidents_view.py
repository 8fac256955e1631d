"""``diagnose --since``'s incidents as text: each with its cause, evidence, runners-up and lead times."""

from __future__ import annotations

import math

from triscope.analyzers.incidents import UNKNOWN, IncidentReport
from triscope.commands._common import utc_text


def render_incidents(report: IncidentReport) -> None:
    from rich.markup import escape

    from triscope.console import report_console

    console = report_console()
    if not report.incidents:
        if report.backends:
            console.print(f"[bold]incidents:[/] none ({len(report.backends)} serving backends, every class "
                          "within its SLA, no failed requests, every scrape answered)")
        return
    console.print(f"[bold]incidents:[/] {len(report.incidents)}")
    for i in report.incidents:
        span = f"{utc_text(int(i.start_s * 1e9))} .. {utc_text(int(i.end_s * 1e9))}"
        if i.open:
            span += " (still open at the end of the range)"
        how = []
        if math.isfinite(i.worst_p99_ratio):
            how.append(f"P99 {i.worst_p99_ratio:.1f}x SLA")
        if i.failed_requests:
            how.append(f"{i.failed_requests} of {i.requests} requests failed")
        if math.isfinite(i.completed_drop_ratio) and i.completed_drop_ratio > 0:
            how.append(f"completed rate -{i.completed_drop_ratio:.0%}")
        console.print(f"[red]incident[/] {span} UTC ({i.end_s - i.start_s:.0f} s) on {', '.join(i.backends)}"
                      + escape(f" [{', '.join(i.classes) or '-'}]: {'; '.join(how) or 'SLO broken'}"))
        if i.cause.name == UNKNOWN:
            console.print("  cause: [bold]unknown[/]: no rule's data says it; missing: " + "; ".join(i.missing))
        else:
            console.print(f"  cause: [bold]{i.cause.name}[/] ({i.cause.score:.2f})")
            for line in i.cause.evidence:
                console.print(f"    {escape(line)}")
        if i.runners_up:
            console.print("  also: " + ", ".join(f"{c.name} ({c.score:.2f})" for c in i.runners_up))
        if i.lead_times_s:
            console.print("  moved first: " + ", ".join(
                f"{k} {v:.0f} s before" if v >= 0 else f"{k} {-v:.0f} s after" for k, v in
                sorted(i.lead_times_s.items(), key=lambda kv: -kv[1])))


def render_summary(report: IncidentReport) -> None:
    """``--summary``: the design's headline figures over the range."""
    from triscope.console import report_console

    s = report.summary()
    console = report_console()
    if not s["incidents"]:
        console.print("summary: no incident in this range")
        return
    line = (f"summary: {s['incidents']} incident(s); {s['after_qps_jump']} "
            f"({s['share_after_qps_jump']:.0%}) came after a QPS jump of {s['qps_jump']:.0%} or more")
    parts = []
    for key, label, fmt in (("seconds_from_jump_to_breach", "time from the jump to the breach", "{:.0f} s"),
                            ("kv_usage_at_breach", "KV usage at the breach", "{:.0%}"),
                            ("p99_growth", "P99 growth", "{:.0%}")):
        v = s[key]
        if v:
            parts.append(f"{label} {fmt.format(v['median'])} (range {fmt.format(v['min'])}-{fmt.format(v['max'])})")
    console.print(line + (": " + "; ".join(parts) if parts else ""))
    console.print("causes: " + ", ".join(f"{c} {n}" for c, n in s["causes"].items()))
