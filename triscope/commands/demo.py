"""``triscope demo``: the main job end to end on the embedded store.

1. captures a fresh PyTorch Profiler trace of a small model on this machine's CPU (torch),
2. ingests it together with the sample GPU traces shipped in ``examples/traces``
   (plus any ``--traces`` paths) into the configured store (default: embedded chDB in
   ``var/triscope-data``),
3. prints the per-rank / per-step trace breakdown of every run and the stall verdicts
   (compute / IO / comm / launch-bound / idle) over the runs' own time span,
4. unless ``--no-fleet``: runs three *simulated* vLLM-style backends in-process, drives bursty load
   at them, stores every request as an OpenTelemetry span, scrapes their ``/metrics`` with the real
   collector, writes their simulated GPU memory, and prints the heatmap's typical load patterns
   (PNG in ``var/demo/heatmap.png``) and the weight engine's verdict per backend
   (the test bed's :mod:`triscope_bed.demo.fleet`; docs/demo.md says what is real and what is simulated).

The simulated fleet lives in the test bed, a package of its own (``pip install -e ./bed``, which
``make setup`` runs): the product imports it only here, lazily; without it the demo says so in one
line and exits 2 before doing anything (``--no-fleet`` runs without it).

Re-running replaces the demo runs (same run ids), it never duplicates rows; fleet rows are time
series and accumulate (each run analyses only its own window and backends).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

from triscope.commands._common import add_common, config_from, print_json

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "traces"
FLEET_PNG = Path("var") / "demo" / "heatmap.png"
BED_MISSING = ("triscope demo: the simulated fleet needs the test bed package triscope-bed, which is not installed: "
               "run `pip install -e ./bed` in the repository (or `make setup`), or pass --no-fleet")


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "demo", help="the whole pipeline on the embedded store: sample traces, then a simulated serving fleet")
    parser.add_argument("--traces", nargs="*", default=None, metavar="PATH",
                        help=f"trace files or directories to ingest (default: {EXAMPLES})")
    parser.add_argument("--no-capture", action="store_true", help="do not profile a torch model on this machine")
    parser.add_argument("--no-fleet", action="store_true",
                        help="skip the simulated serving fleet (load, spans, metrics, heatmap, weights)")
    parser.add_argument("--fleet-png", default=str(FLEET_PNG), metavar="PATH",
                        help=f"where the fleet heatmap PNG goes (default: {FLEET_PNG})")
    parser.add_argument("--fleet-seconds", type=float, default=12.0, help=argparse.SUPPRESS)
    add_common(parser)
    parser.set_defaults(func=run)


def capture_cpu_trace(out: Path, steps: int = 4) -> Path:
    """Profile a few training steps of a small MLP on the CPU and write the Kineto trace to ``out``."""
    import torch

    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    data, target = torch.randn(32, 64), torch.randint(0, 10, (32,))
    schedule = torch.profiler.schedule(wait=0, warmup=1, active=steps)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], schedule=schedule,
                                on_trace_ready=lambda p: p.export_chrome_trace(str(out))) as prof:
        for _ in range(steps + 1):
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(data), target).backward()
            optimizer.step()
            prof.step()
    return out


def _trace_files(paths: list[str] | None) -> list[tuple[str, Path]]:
    """(run id, file) pairs; the files of one directory are the ranks of one run."""
    from triscope.collectors.kineto.ingest import expand_paths
    from triscope.errors import InputError

    if paths:
        return [(f"demo-{run_id or _stem(p)}", p) for p, run_id in expand_paths(paths)]
    if not EXAMPLES.is_dir():
        raise InputError(f"sample traces not found at {EXAMPLES}; pass --traces PATH")
    return [(f"demo-{_stem(p)}", p) for p in sorted(EXAMPLES.glob("*.json*"))]


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from triscope.analyzers.stalls import diagnose_runs
    from triscope.analyzers.trace_breakdown import analyze_run
    from triscope.analyzers.trace_report import print_report, report_dict
    from triscope.collectors.kineto.ingest import ingest_trace
    from triscope.errors import InputError, TriscopeError
    from triscope.store import open_store

    console = Console(stderr=True)
    if not 0 < args.fleet_seconds <= 600:
        raise InputError(f"--fleet-seconds must be in (0, 600], got {args.fleet_seconds:g}")
    if not args.no_fleet and not _bed_installed():
        print(BED_MISSING, file=sys.stderr)
        return 2
    config = config_from(args)
    files = _trace_files(args.traces)
    with tempfile.TemporaryDirectory(prefix="triscope-demo-") as tmp:
        if not args.no_capture:
            try:
                files.insert(0, ("demo-torch-cpu", capture_cpu_trace(Path(tmp) / "torch_cpu_mlp.json")))
            except ImportError:
                console.print("torch is not installed: skipping the live profiler capture")
        store = open_store(config)
        report: dict[str, Any] = {"store": config["store"]["backend"], "runs": [], "errors": []}
        try:
            taken: set[tuple[str, int]] = set()
            with console.status("ingesting traces") as status:
                for run_id, path in files:
                    status.update(f"ingesting {path.name}")
                    try:
                        result = ingest_trace(store, path, run_id=run_id, taken=taken)
                    except TriscopeError as exc:
                        report["errors"].append(str(exc))
                        console.print(f"[red]error:[/] {exc}", highlight=False)
                        continue
                    console.print(f"ingested {path.name}: {result.events:,} events "
                                  f"({result.gpu_events:,} GPU) in {result.seconds:.2f}s as run {run_id}")
                    report["runs"].append({"run_id": run_id, "file": str(path), "events": result.events,
                                           "gpu_events": result.gpu_events, "seconds": result.seconds})
            for entry in _unique_runs(report["runs"]):
                ranks = analyze_run(store, entry["run_id"])
                entry["breakdown"] = report_dict(entry["run_id"], ranks)
                unjudged = [r.no_verdict() for r in ranks if r.no_verdict()]
                if unjudged and len(unjudged) == len(ranks):  # the verdict follows from the breakdown, or is none
                    entry["stalls"], entry["stall_shares"] = None, f"no verdict: {unjudged[0].split(':')[0]}"
                else:
                    stalls = diagnose_runs(store, [entry["run_id"]], config, by="step")
                    entry["stalls"] = stalls.to_json()
                    entry["stall_shares"] = stalls.share_text()
                if not args.json:
                    print_report(entry["run_id"], ranks)
            if not args.json:
                _print_summary(report["runs"])
            report["fleet"] = None if args.no_fleet else _fleet(store, config, args, report, console)
        finally:
            store.close()
    if args.json:
        print_json(report)
    else:
        print("\nnext: triscope diagnose --trace-run RUN_ID [--json] · triscope ingest trace YOUR_TRACE.json.gz"
              + ("" if args.no_fleet else " · triscope heatmap --since 5m"), file=sys.stderr)
    return 1 if report["errors"] else 0


def _fleet(store: Any, config: dict[str, Any], args: argparse.Namespace, report: dict[str, Any],
           console: Any) -> dict[str, Any] | None:
    """The simulated-fleet part; a failure is one line in ``report["errors"]``."""
    from triscope.errors import TriscopeError
    from triscope_bed.demo.fleet import FleetOptions, run_fleet  # the test bed, checked by run()

    options = FleetOptions(seconds=args.fleet_seconds, png=Path(args.fleet_png) if args.fleet_png else None)
    try:
        if options.png is not None:  # fail before the load, not after it
            options.png.parent.mkdir(parents=True, exist_ok=True)
        with console.status("fleet: starting simulated backends") as status:
            doc, heatmap = run_fleet(store, config, options, status)
    except (TriscopeError, OSError, ValueError) as exc:
        line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        report["errors"].append(f"fleet: {line}")
        console.print(f"[red]error:[/] fleet: {line}", highlight=False)
        return None
    for line in doc["client_errors"]:
        report["errors"].append(f"fleet: load generator: {line}")
    if doc["spans_stored"] != doc["requests_sent"]:
        report["errors"].append(f"fleet: {doc['requests_sent']} requests sent but {doc['spans_stored']} spans stored")
    from triscope.analyzers.incidents import find_incidents

    window = doc["window"]
    incidents = find_incidents(store, window["start_ns"], window["end_ns"], config)
    doc["incidents"] = incidents.to_dict()
    if not args.json:
        from triscope.commands._incidents_view import render_incidents
        from triscope_bed.demo.report import print_fleet

        print_fleet(doc, heatmap)
        render_incidents(incidents)  # why the fleet fell over, as `diagnose --since` says it
    return doc


def _bed_installed() -> bool:
    """Whether the test bed's demo fleet imports (the bed is a package of its own: ``pip install -e ./bed``)."""
    try:
        import triscope_bed.demo.fleet
        import triscope_bed.demo.report  # noqa: F401
    except ModuleNotFoundError as exc:
        if exc.name is None or exc.name.split(".")[0] != "triscope_bed":
            raise  # the bed is there but broken: a bug to show, not a missing install
        return False
    return True


def _unique_runs(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Fold the files of a multi-rank run into one entry (events summed)."""
    merged: dict[str, dict[str, Any]] = {}
    for entry in runs:
        if entry["run_id"] in merged:
            merged[entry["run_id"]]["events"] += entry["events"]
            merged[entry["run_id"]]["gpu_events"] += entry["gpu_events"]
        else:
            merged[entry["run_id"]] = entry
    runs[:] = list(merged.values())
    return runs


def _print_summary(runs: list[dict[str, Any]]) -> None:
    from rich.table import Table

    table = Table(title="demo runs: where the time goes", title_justify="left")
    for col in ("run", "events", "GPU events", "compute %", "idle %", "stall verdicts per profiler step"):
        table.add_column(col, justify="left" if col in ("run", "stall verdicts per profiler step") else "right")
    for entry in runs:
        whole = [r["whole"] for r in entry["breakdown"]["ranks"]]
        span = sum(w["span_ns"] for w in whole) or 1
        compute = 100 * sum(w["compute_ns"] for w in whole) / span
        idle = 100 * sum(w["idle_ns"] for w in whole) / span
        table.add_row(entry["run_id"], f"{entry['events']:,}", f"{entry['gpu_events']:,}",
                      f"{compute:.1f}" if entry["gpu_events"] else "-", f"{idle:.1f}" if entry["gpu_events"] else "-",
                      entry["stall_shares"] or "-")
    from triscope.console import report_console

    console = report_console()
    console.print(table)


def _stem(path: Path) -> str:
    name = path.name
    for suffix in (".gz", ".json"):
        name = name.removesuffix(suffix)
    return name
