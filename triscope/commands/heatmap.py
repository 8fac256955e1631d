"""``triscope heatmap``: the QPS x GPU memory x latency tensor and its typical load patterns.

Runs :func:`triscope.analyzers.heatmap.compute_heatmap` (all binning in ClickHouse) over
``--since 10m`` (default), ``--from/--to`` or ``--all`` of the data, optionally for some
backends / models, and prints the busiest (QPS, memory) cells as a rich table, or writes
``--json`` (stdout), ``--npz PATH`` (tensor, bin edges, P95 grid) and ``--png PATH`` (matplotlib, Agg).
Bin sizes come from ``[heatmap]`` in the config (``TRISCOPE_HEATMAP__QPS_BIN=10``) or the flags here.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from triscope.commands._common import add_common, time_range, utc_text
from triscope.errors import InputError

AXIS_UNITS = {"qps": "QPS", "memory": "GPU memory (GB)", "latency": "latency (ms)"}


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("heatmap", help="QPS x GPU memory x latency heatmap and typical load patterns")
    rng = parser.add_argument_group("time range (default: the last 10m)")
    rng.add_argument("--since", metavar="DURATION", help="the last DURATION (e.g. 90s, 10m, 2h), ending at --to or now")
    rng.add_argument("--from", dest="start", metavar="WHEN",
                     help="start: ISO-8601 (UTC unless it has an offset), epoch seconds, or a DURATION ago")
    rng.add_argument("--to", dest="end", metavar="WHEN", help="end (exclusive), same forms as --from (default now)")
    rng.add_argument("--all", action="store_true", help="the whole span of the stored requests")
    sel = parser.add_argument_group("filters")
    sel.add_argument("--backend", action="append", metavar="NAME", help="only these backends (repeatable)")
    sel.add_argument("--model", action="append", metavar="NAME",
                     help="only requests for these models (repeatable; the backend's load still counts all)")
    bins = parser.add_argument_group("bins (default [heatmap] config: 100 ms, 5 QPS, 200 MB, 10 ms; [32, 64, 128])")
    bins.add_argument("--window-ms", type=float, help="analysis window length")
    bins.add_argument("--qps-bin", type=float, help="QPS per bin")
    bins.add_argument("--memory-bin-mb", type=float, help="GPU memory per bin, MB (10^6 bytes)")
    bins.add_argument("--latency-bin-ms", type=float, help="latency per bin, ms")
    bins.add_argument("--shape", metavar="Q,M,L", help="bin counts of the three axes, e.g. 32,64,128")
    out = parser.add_argument_group("output")
    out.add_argument("--top", type=int, default=10, help="typical load patterns to list (default 10)")
    out.add_argument("--slice", metavar="A,B", help="a 2-D slice for --json/--npz/--png, two of qps, memory, latency")
    out.add_argument("--npz", metavar="PATH", help="write tensor, bin edges and P95 grid as a numpy .npz")
    out.add_argument("--png", metavar="PATH", help="write a PNG: three 2-D slices and the P95 latency per cell")
    add_common(parser)
    parser.set_defaults(func=run)


def time_bounds(args: argparse.Namespace, now_ns: int) -> tuple[int | None, int | None]:
    """``[start, end)`` from the range flags; ``(None, None)`` for ``--all``."""
    if args.all:
        if args.since or args.start or args.end:
            raise InputError("--all cannot be combined with --since/--from/--to")
        return None, None
    return time_range(args.since, args.start, args.end, now_ns)


def spec_from(args: argparse.Namespace, config: dict[str, Any]) -> Any:
    """HeatmapSpec from ``[heatmap]`` config, then the command-line flags."""
    from triscope.analyzers.heatmap import HeatmapSpec

    section = config.setdefault("heatmap", {})
    for flag, key, scale in (("window_ms", "window_ms", 1.0), ("qps_bin", "qps_bin", 1.0),
                             ("memory_bin_mb", "memory_bin_bytes", 1e6), ("latency_bin_ms", "latency_bin_s", 1e-3)):
        value = getattr(args, flag)
        if value is not None:
            section[key] = value * scale
    if args.shape:
        parts = args.shape.split(",")
        if len(parts) != 3 or not all(p.strip().isdigit() for p in parts):
            raise InputError(f"--shape needs three positive integers Q,M,L, got {args.shape!r}")
        section.update(zip(("qps_bins", "memory_bins", "latency_bins"), (int(p) for p in parts), strict=True))
    return HeatmapSpec.from_config(config)


def _slice_axes(text: str | None) -> tuple[str, str] | None:
    from triscope.analyzers.heatmap import AXES

    if not text:
        return None
    keep = [p.strip() for p in text.split(",")]
    if len(keep) != 2 or len(set(keep)) != 2 or not set(keep) <= set(AXES):
        raise InputError(f"--slice needs two different axes of {', '.join(AXES)}, e.g. qps,latency; got {text!r}")
    return keep[0], keep[1]


def run(args: argparse.Namespace) -> int:
    from triscope.analyzers.heatmap import compute_heatmap
    from triscope.commands._common import config_from, print_json
    from triscope.store import open_store

    if args.top < 0:
        raise InputError("--top must be >= 0")
    keep = _slice_axes(args.slice)
    for path in (args.npz, args.png):
        if path and not Path(path).parent.is_dir():
            raise InputError(f"output directory does not exist: {Path(path).parent}")
    config = config_from(args)
    spec = spec_from(args, config)
    start, end = time_bounds(args, time.time_ns())
    store = open_store(config)
    try:
        result = compute_heatmap(store, spec, start, end, backends=args.backend, models=args.model, top=args.top)
    finally:
        store.close()
    if result.requests == 0:
        what = f"{utc_text(result.start_ns)} .. {utc_text(result.end_ns)} UTC" if result.end_ns else "the store"
        why = (f"; {result.unmatched} had no GPU memory sample within {spec.memory_max_age_s:g} s"
               if result.unmatched else "")
        raise InputError(f"no requests with a latency in {what}{_filter_text(args)}{why}")
    if args.npz:
        write_npz(result, args.npz, keep)
    if args.png:
        write_png(result, args.png, keep)
    if args.json:
        doc = result.to_json()
        doc["bin_edges"] = {a: result.bin_edges(a).tolist() for a in ("qps", "memory", "latency")}
        if keep:
            doc["slice"] = {"axes": list(keep), "counts": result.slice(keep).tolist()}
        print_json(doc)
    else:
        render(result, args)
    return 0


def _filter_text(args: argparse.Namespace) -> str:
    parts = [f"backend {', '.join(args.backend)}" if args.backend else "",
             f"model {', '.join(args.model)}" if args.model else ""]
    return "".join(f" for {p}" for p in parts if p)


def write_npz(result: Any, path: str, keep: tuple[str, str] | None) -> None:
    """``tensor``, ``{axis}_edges`` (n + 1 edges; the last bin also holds everything above), ``p95_latency_seconds``."""
    import numpy as np

    extra = {"slice": result.slice(keep), "slice_axes": np.array(keep)} if keep else {}
    np.savez_compressed(
        path, tensor=result.tensor, qps_edges=result.bin_edges("qps"),
        memory_edges_bytes=result.bin_edges("memory"), latency_edges_seconds=result.bin_edges("latency"),
        p95_latency_seconds=result.p95_grid, axes=np.array(["qps", "memory", "latency"]),
        start_ns=np.int64(result.start_ns), end_ns=np.int64(result.end_ns), window_ms=np.float64(result.spec.window_ms),
        **extra)


def _scaled_edges(result: Any, axis: str) -> Any:
    edges = result.bin_edges(axis)
    return edges / 1e9 if axis == "memory" else edges * 1e3 if axis == "latency" else edges


def write_png(result: Any, path: str, keep: tuple[str, str] | None) -> None:
    """Three 2-D count slices (log colour) and the P95 latency per (QPS, memory) cell."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.colors import LogNorm

    pairs = [("qps", "memory"), ("qps", "latency"), ("memory", "latency")]
    if keep:
        pairs = [keep] + [p for p in pairs if set(p) != set(keep)]
    fig, axes = plt.subplots(2, 2, figsize=(12, 9), constrained_layout=True)
    for ax, (a, b) in zip(axes.flat, pairs, strict=False):
        counts = result.slice((a, b)).astype(float)
        mesh = ax.pcolormesh(_scaled_edges(result, a), _scaled_edges(result, b), np.ma.masked_equal(counts.T, 0),
                             norm=LogNorm(vmin=1, vmax=max(1.0, counts.max())), cmap="viridis", shading="flat")
        fig.colorbar(mesh, ax=ax, label="requests")
        ax.set_xlabel(AXIS_UNITS[a])
        ax.set_ylabel(AXIS_UNITS[b])
        ax.set_title(f"requests by {a} x {b}")
    ax = axes.flat[3]
    grid = result.p95_grid if result.p95_grid is not None else np.full(result.tensor.shape[:2], np.nan)
    mesh = ax.pcolormesh(_scaled_edges(result, "qps"), _scaled_edges(result, "memory"),
                         np.ma.masked_invalid(grid.T * 1e3), cmap="magma", shading="flat")
    fig.colorbar(mesh, ax=ax, label="P95 latency (ms)")
    ax.set_xlabel(AXIS_UNITS["qps"])
    ax.set_ylabel(AXIS_UNITS["memory"])
    ax.set_title("P95 latency per (QPS, memory) cell")
    fig.suptitle(f"triscope heatmap {utc_text(result.start_ns)} .. {utc_text(result.end_ns)} UTC, "
                 f"{result.requests:,} requests, {result.spec.window_ms:g} ms windows")
    fig.savefig(path, format="png", dpi=90)
    plt.close(fig)


def _range(lo: float, hi: float | None, fmt: str) -> str:
    return f">= {fmt.format(lo)}" if hi is None else f"{fmt.format(lo)} - {fmt.format(hi)}"


def _kind(name: str, share: float) -> str:
    return f"{name} ({share * 100:.0f}%)" if name else "-"


def render(result: Any, args: argparse.Namespace) -> None:
    """Typical load patterns (the busiest QPS x memory cells) as a rich table."""
    from rich.table import Table

    from triscope.console import report_console

    console = report_console()
    s = result.spec
    console.print(f"[bold]heatmap[/] {utc_text(result.start_ns)} .. {utc_text(result.end_ns)} UTC{_filter_text(args)}: "
                  f"{result.requests:,} requests in {int((result.tensor > 0).sum()):,} of "
                  f"{result.tensor.size:,} cells {list(result.tensor.shape)} "
                  f"({s.window_ms:g} ms windows; {s.qps_bin:g} QPS, {s.memory_bin_bytes / 1e6:g} MB, "
                  f"{s.latency_bin_s * 1e3:g} ms per bin) in {result.seconds:.2f}s")
    if result.unmatched:
        console.print(f"{result.unmatched:,} requests left out: no GPU memory sample within "
                      f"{s.memory_max_age_s:g} s")
    table = Table(title="typical load patterns")
    for col, justify in (("QPS", "right"), ("GPU memory (GB)", "right"), ("requests", "right"),
                         ("share", "right"), ("P95 latency", "right"), ("dominant modality", "left"),
                         ("dominant class", "left")):
        table.add_column(col, justify=justify)  # type: ignore[arg-type]
    for p in result.patterns:
        mem_hi = None if p["memory_max_bytes"] is None else p["memory_max_bytes"] / 1e9
        table.add_row(_range(p["qps_min"], p["qps_max"], "{:g}"),
                      _range(p["memory_min_bytes"] / 1e9, mem_hi, "{:.1f}"),
                      f"{p['requests']:,}", f"{p['share'] * 100:.1f}%",
                      f"{p['p95_latency_seconds'] * 1e3:.1f} ms", _kind(p["modality"], p["modality_share"]),
                      _kind(p["request_class"], p["request_class_share"]))
    console.print(table)
