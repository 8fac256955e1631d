"""``triscope ingest trace PATH...``: load Kineto traces into the store."""

from __future__ import annotations

import argparse
import sys

from triscope.commands._common import add_common, print_json, store_from


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("ingest", help="load files into the store")
    kinds = parser.add_subparsers(dest="source", metavar="SOURCE", required=True)
    trace = kinds.add_parser("trace", help="PyTorch Profiler (Kineto) traces: files or multi-rank directories")
    trace.add_argument("paths", nargs="+", help=".json / .json.gz files or directories of ranks")
    trace.add_argument("--run-id", help="run id for all files (default: directory or file name)")
    trace.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_common(trace)
    trace.set_defaults(func=run_trace)


def run_trace(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from triscope.collectors.kineto.ingest import IngestResult, expand_paths, ingest_paths
    from triscope.errors import InputError

    files = expand_paths(args.paths)
    err = Console(stderr=True)
    failures: list[str] = []
    results: list[IngestResult] = []
    store = store_from(args)
    show = not (args.no_progress or args.json) and err.is_terminal
    with Progress(TextColumn("[bold]ingest[/]"), BarColumn(), MofNCompleteColumn(),
                  TextColumn("{task.fields[events]:,} events"), TimeElapsedColumn(),
                  console=err, disable=not show) as progress:
        task = progress.add_task("trace", total=len(files), events=0)
        counted = {"events": 0}

        def on_events(n: int) -> None:
            counted["events"] += n
            progress.update(task, events=counted["events"])

        def on_file(outcome: IngestResult | InputError) -> None:
            progress.advance(task)
            if isinstance(outcome, InputError):
                failures.append(str(outcome))
                err.print(f"[red]error:[/] {outcome}", highlight=False, soft_wrap=True)

        results = ingest_paths(store, args.paths, run_id=args.run_id, on_progress=on_events, on_file=on_file)
    store.close()
    if args.json:
        print_json({"ingested": [vars(r) for r in results], "errors": failures})
    else:
        for r in results:
            print(f"{r.path}: run {r.run_id} rank {r.rank}: {r.events:,} events "
                  f"({r.gpu_events:,} GPU) in {r.seconds:.2f}s" + ("" if r.status == "complete" else f" ({r.status})"))
        if failures:
            print(f"{len(failures)} file(s) failed (errors above)", file=sys.stderr)
    return 1 if failures else 0
