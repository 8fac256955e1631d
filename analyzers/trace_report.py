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
    """Print one table per rank: the whole run, then each profiler step."""
    from rich.console import Console
    from rich.table import Table

    console = Console()
    if not console.is_terminal:
        console = Console(width=220)  # piped: keep every column rather than folding to 80
    headers = ["window", "span ms", "compute %", "non-compute %", "idle %", "host-wait ms*", "kernel-wait ms*",
               "other idle ms*", "comm overlap %", "launch p50 us", "launch p95 us", "GPU events"]
    for rank in ranks:
        note = " (last ProfilerStep dropped, as HTA)" if rank.last_step_dropped else ""
        table = Table(title=f"run {run_id} · rank {rank.rank}{note}", title_justify="left")
        for h in headers:
            table.add_column(h, justify="left" if h == "window" else "right")
        table.add_row(*_breakdown_row("whole run", rank.whole), style="bold")
        for step in rank.steps:
            table.add_row(*_breakdown_row(f"step {step.step}", step.breakdown))
        console.print(table)
        console.print("  * idle split per stream, summed over streams (as HTA's idle time breakdown)")
        if rank.whole.gpu_events == 0:
            console.print("  no GPU work in this rank (CPU-only trace): nothing to break down")

