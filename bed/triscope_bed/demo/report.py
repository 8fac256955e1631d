"""Terminal output of the fleet part of ``triscope demo`` (rich tables on stdout)."""

from __future__ import annotations

import argparse
from typing import Any

from triscope.analyzers.routing import DEFAULT_CLASSES
from triscope.schema import GPU_SAMPLES, SERVING_METRICS
from triscope_bed.demo.fleet import SIM_SOURCE


def _console() -> Any:
    from triscope.console import report_console

    return report_console()


def _gb(x: float | None) -> str:
    return "-" if x is None else f"{x / 1e9:.1f}"


def _worst_p99(p99: dict[str, float | None]) -> str:
    """The class furthest over its SLA: ``1.39 s realtime_speech (7.0x SLA)``."""
    best, ratio = None, -1.0
    for name, value in p99.items():
        sla = DEFAULT_CLASSES.get(name, {}).get("sla_ms")
        if value is None or not sla:
            continue
        r = value / (sla / 1000.0)
        if r > ratio:
            best, ratio = (name, value), r
    if best is None:
        return "-"
    return f"{best[1]:.2f} s {best[0]} ({ratio:.1f}x SLA)"


def print_fleet(doc: dict[str, Any], heatmap: Any) -> None:
    """Requests and rows per backend, the heatmap's typical load patterns, the weight verdicts."""
    from rich.table import Table

    from triscope.commands.heatmap import render

    console = _console()
    console.print("\n[bold]fleet[/] (simulated): 3 vLLM-style backends from the test bed on 127.0.0.1; "
                  f"there is no GPU, so their GPU memory rows are [bold]simulated[/] ({GPU_SAMPLES.name}.source = "
                  f"'{SIM_SOURCE}'). Spans, scrapes, the writer, the store, the heatmap and the weight engine are "
                  "the real ones.", highlight=False)
    table = Table(title=f"fleet: {doc['options']['seconds']:g} s of bursty load, what the collectors stored",
                  title_justify="left")
    for col in ("backend", "address", "sim GPU GB", "sent", "ok", "failed", "spans stored",
                f"{SERVING_METRICS.name} rows", f"{GPU_SAMPLES.name} rows (sim)", "P99 latency"):
        table.add_column(col, justify="left" if col in ("backend", "address") else "right")
    for b in doc["backends"]:
        p99 = b["p99_latency_seconds"]
        table.add_row(b["name"], b["address"], _gb(b["gpu_memory_total_bytes"]), f"{b['requests_sent']:,}",
                      f"{b['requests_ok']:,}", f"{b['requests_failed']:,}", f"{b['spans_stored']:,}",
                      f"{b['serving_metrics_rows']:,}", f"{b['gpu_samples_rows']:,}",
                      "-" if p99 is None else f"{p99 * 1e3:.0f} ms")
    console.print(table)
    if heatmap is not None and heatmap.requests:
        render(heatmap, argparse.Namespace(backend=None, model=None))
        if doc["heatmap"]["png"]:
            console.print(f"heatmap PNG: {doc['heatmap']['png']}", highlight=False)
    weights = doc["weights"]
    table = Table(title=f"routing weights at the end of the load ({weights['updates']} engine updates "
                        f"replayed at {weights['interval_s']:g} s over the stored rows)", title_justify="left")
    for col in ("backend", "GPU memory used (sim)", "KV usage", "P99 (worst class)", "weight", "LB weight",
                "drained", "min weight"):
        table.add_column(col, justify="left" if col in ("backend", "P99 (worst class)") else "right")
    for addr in [b["address"] for b in doc["backends"]]:
        w = weights["backends"].get(addr)
        if w is None:
            continue
        i = w["inputs"]
        kv = i["kv_cache_usage_ratio"]
        drained = w["drained_updates"]
        table.add_row(f"{w['name']} ({addr})",
                      f"{_gb(i['memory_used_bytes'])} / {_gb(i['memory_total_bytes'])} GB",
                      "-" if kv is None else f"{kv * 100:.0f}%", _worst_p99(i["p99_seconds"]),
                      f"{w['weight']:.2f}", str(w["lb_weight"]),
                      ("yes" if w["drained"] else "no")
                      + (f" (in {drained} of {weights['updates']} updates)" if drained else ""),
                      "-" if w["min_weight"] is None else f"{w['min_weight']:.2f}")
    console.print(table)
    scale = weights["scale"]
    console.print(f"KV-cache scaling: {scale['action']} ({scale['reason']})", highlight=False)
