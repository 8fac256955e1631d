"""Render the trace breakdown of a run (``triscope diagnose --trace-run ID``) as tables or JSON."""

from __future__ import annotations

from typing import Any

from triscope.analyzers.trace_breakdown import Breakdown, RankBreakdown


def _ms(ns: int | float) -> str:
    return f"{ns / 1e6:,.3f}"


def _us(ns: int | float) -> str:
    return f"{ns / 1e3:,.1f}"


def report_dict(run_id: str, ranks: list[RankBreakdown]) -> dict[str, Any]:
    """JSON-ready report: every figure in integer nanoseconds plus percentages of the span."""
    return {"run_id": run_id, "ranks": [r.to_dict() for r in ranks]}


def _breakdown_row(label: str, b: Breakdown) -> list[str]:
    return [label, _ms(b.span_ns), f"{b.pct(b.compute_ns):.2f}", f"{b.pct(b.non_compute_ns):.2f}",
            f"{b.pct(b.idle_ns):.2f}", _ms(b.host_wait_ns), _ms(b.kernel_wait_ns), _ms(b.other_idle_ns),
            f"{100 * b.overlap_ratio:.1f}" if b.comm_ns else "-",
            _us(b.launch_delay.p50_ns), _us(b.launch_delay.p95_ns), str(b.gpu_events)]


def print_report(run_id: str, ranks: list[RankBreakdown]) -> None:
    """Print one table per rank: the whole run, then each profiler step, and the per-stream idle detail."""
    from rich.table import Table

    from triscope.console import report_console

    console = report_console(piped_width=200)  # piped: keep every column on one line
    headers = ["window", "span ms", "compute %", "non-compute %", "idle %", "host-wait ms", "kernel-wait ms",
               "other idle ms", "comm overlap %", "launch p50 us", "launch p95 us", "GPU events"]
    for rank in ranks:
        note = " (last ProfilerStep dropped, as HTA)" if rank.last_step_dropped else ""
        table = Table(title=f"run {run_id} · rank {rank.rank}{note}", title_justify="left")
        for h in headers:
            table.add_column(h, justify="left" if h == "window" else "right")
        table.add_row(*_breakdown_row("whole run", rank.whole), style="bold")
        for step in rank.steps:
            table.add_row(*_breakdown_row(f"step {step.step}", step.breakdown))
        console.print(table)
        if rank.whole.gpu_events == 0:
            console.print("  no GPU work in this rank (CPU-only trace): nothing to break down")
            continue
        w, detail = rank.whole, rank.whole.stream_sum
        console.print(f"  idle split per GPU (time no stream is busy): host wait + kernel wait + other idle = "
                      f"idle time ({_ms(w.idle_ns)} ms)", soft_wrap=True)
        console.print(f"  detail, per stream summed over {len(w.idle_by_stream)} stream(s) (HTA's idle time breakdown; "
                      f"can exceed the span): host wait {_ms(detail.host_wait_ns)} ms, kernel wait "
                      f"{_ms(detail.kernel_wait_ns)} ms, other {_ms(detail.other_ns)} ms", soft_wrap=True)
        if rank.steps:
            console.print("  steps: consecutive GPU windows, each nanosecond in one step (docs/trace-breakdown.md); "
                          + ("all but the last add up to the whole run" if rank.last_step_dropped
                             else "they add up to the whole run"), soft_wrap=True)
