"""Render the trace breakdown of a run (``triscope diagnose --trace-run ID``) as tables or JSON.

Columns and notes name the device kind the trace has (GPU, MTIA, ...); a rank without kernel events says
why (CPU only, or device activity recorded as range-profiler measurements and what to change), a rank
too short to judge says so, and the steps' footer says whether they add up to the whole run only when
they do. Definitions: docs/trace-breakdown.md.
"""

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


def ranges_advice(rank: RankBreakdown) -> str:
    """What a trace of range-profiler measurements without kernel events is, and how to record kernels."""
    f = rank.facts
    runtime = f", {f.runtime_calls:,} runtime calls" if f.runtime_calls else ""
    device = f" {f.device}" if f.device >= 0 else ""
    return (f"{rank.device_type}{device} activity is recorded as {f.profiler_ranges:,} profiler ranges "
            f"({f.profiler_range_category}: counters measured by the CUPTI range profiler{runtime}) and no "
            f"kernel events: kernels were not captured, so there is no {rank.device_type} timeline to break down "
            "and no CPU-side verdict either (the host launched device work). The profiler ran with "
            "experimental_config=torch.profiler._ExperimentalConfig(profiler_metrics=[...]); to record kernels, "
            "profile with activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA] and without profiler_metrics / "
            "profiler_measure_per_kernel (measure the counters in a separate run).")


def _steps_footer(rank: RankBreakdown) -> str:
    kind = rank.device_type
    if rank.steps_add_up():
        which = "all but the last add up" if rank.last_step_dropped else "they add up"
        return (f"  steps: consecutive {kind} windows, each nanosecond in one step (docs/trace-breakdown.md); "
                f"{which} to the whole run")
    counted = [s.breakdown for s in rank.counted_steps()]
    span, events = sum(b.span_ns for b in counted), sum(b.gpu_events for b in counted)
    which = "all steps but the last" if rank.last_step_dropped else "the steps"
    return (f"  steps: consecutive {kind} windows (docs/trace-breakdown.md); {which} do not add up to the whole "
            f"run here: {_ms(span)} ms and {events:,} {kind} events against {_ms(rank.whole.span_ns)} ms and "
            f"{rank.whole.gpu_events:,} ({kind} work without a launching runtime call is placed by time, and the "
            "whole run keeps only work launched before the last step)")


def print_report(run_id: str, ranks: list[RankBreakdown]) -> None:
    """Print one table per rank: the whole run, then each profiler step, and the per-stream idle detail."""
    from rich.table import Table

    from triscope.console import report_console

    console = report_console(piped_width=200)  # piped: keep every column on one line
    for rank in ranks:
        kind = rank.device_type
        headers = ["window", "span ms", "compute %", "non-compute %", "idle %", "host-wait ms", "kernel-wait ms",
                   "other idle ms", "comm overlap %", "launch p50 us", "launch p95 us", f"{kind} events"]
        note = " (last ProfilerStep dropped, as HTA)" if rank.last_step_dropped else ""
        device = f" · {kind} {rank.facts.device}" if rank.device_events and rank.facts.device >= 0 else ""
        table = Table(title=f"run {run_id} · rank {rank.rank}{device}{note}", title_justify="left")
        for h in headers:
            table.add_column(h, justify="left" if h == "window" else "right")
        table.add_row(*_breakdown_row("whole run", rank.whole), style="bold")
        for step in rank.steps:
            table.add_row(*_breakdown_row(f"step {step.step}", step.breakdown))
        console.print(table)
        if rank.ranges_only:
            console.print(f"  {ranges_advice(rank)}", soft_wrap=True)
            continue
        if rank.device_events == 0:
            console.print("  no device work in this rank (CPU-only trace): nothing to break down")
            continue
        if rank.too_short:
            console.print(f"  {rank.no_verdict()}: its figures are those of so few events that they judge nothing "
                          "(profile more steps: torch.profiler.schedule with a larger active)", soft_wrap=True)
        w, detail = rank.whole, rank.whole.stream_sum
        console.print(f"  idle split per {kind} (time no stream is busy): host wait + kernel wait + other idle = "
                      f"idle time ({_ms(w.idle_ns)} ms)", soft_wrap=True)
        console.print(f"  detail, per stream summed over {len(w.idle_by_stream)} stream(s) (HTA's idle time breakdown; "
                      f"can exceed the span): host wait {_ms(detail.host_wait_ns)} ms, kernel wait "
                      f"{_ms(detail.kernel_wait_ns)} ms, other {_ms(detail.other_ns)} ms", soft_wrap=True)
        if rank.facts.off_stream:
            console.print(f"  left out: {rank.facts.off_stream:,} {kind} events on no stream that no runtime call "
                          "launched (the device's own transfers, not the program's work; docs/trace-breakdown.md)",
                          soft_wrap=True)
        if rank.steps:
            console.print(_steps_footer(rank), soft_wrap=True)
