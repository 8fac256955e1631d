"""``triscope ingest trace PATH...``: load Kineto traces into the store.

Exit status: 0 when every file went in (files of a directory that are not traces are skipped with a
warning), 1 when a file was damaged (its events before the damage are kept, the run is ``partial``),
2 when a file was refused and nothing of it kept (not a Kineto trace, too large, rank taken, another job).
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from triscope.commands._common import add_common, config_from, print_json, store_from

if TYPE_CHECKING:
    from triscope.collectors.kineto.runs import IngestResult


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("ingest", help="load files into the store")
    kinds = parser.add_subparsers(dest="source", metavar="SOURCE", required=True)
    trace = kinds.add_parser("trace", help="PyTorch Profiler (Kineto) traces: files or multi-rank directories")
    trace.add_argument("paths", nargs="+", help=".json / .json.gz files or directories of ranks")
    trace.add_argument("--run-id", help="run id for all files (default: directory or file name)")
    trace.add_argument("--no-progress", action="store_true", help="no progress bar")
    trace.add_argument("--max-decompressed-bytes", type=int, metavar="N",
                       help="refuse a .json.gz that decompresses to more than N bytes "
                            "(default [ingest] max_decompressed_bytes, 8 GiB)")
    add_common(trace)
    trace.set_defaults(func=run_trace)


def device_text(result: IngestResult) -> str:
    """``1,313 MTIA`` / ``3,774 GPU`` / ``no GPU kernels: 77 GPU profiler ranges`` / ``CPU only: no device events``."""
    if not result.gpu_events and result.profiler_ranges:
        kind = result.device_type or "GPU"
        return f"no {kind} kernels: {result.profiler_ranges:,} {kind} profiler ranges"
    if not result.gpu_events:
        return "CPU only: no device events"
    return f"{result.gpu_events:,} {result.device_type or 'GPU'}"


def run_trace(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.markup import escape
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from triscope.collectors.kineto.config import TraceIngestConfig
    from triscope.collectors.kineto.errors import OtherJobError, RefusedTraceError, SkippedTraceError
    from triscope.collectors.kineto.ingest import expand_paths, ingest_paths
    from triscope.errors import InputError

    settings = TraceIngestConfig.from_config(config_from(args))
    if args.max_decompressed_bytes is not None:
        if args.max_decompressed_bytes <= 0:
            raise InputError(f"--max-decompressed-bytes must be > 0, got {args.max_decompressed_bytes}")
        settings = settings.replace(max_decompressed_bytes=args.max_decompressed_bytes)
    files = expand_paths(args.paths)
    err = Console(stderr=True)
    failures: list[str] = []
    skipped: list[str] = []
    refused = False
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
            nonlocal refused
            if not isinstance(outcome, OtherJobError):  # reported after its file was counted
                progress.advance(task)
            if isinstance(outcome, SkippedTraceError):
                skipped.append(str(outcome))
                err.print(f"[yellow]warning:[/] {escape(str(outcome))}", highlight=False, soft_wrap=True)
            elif isinstance(outcome, InputError):
                refused = refused or isinstance(outcome, RefusedTraceError)
                failures.append(str(outcome))
                err.print(f"[red]error:[/] {escape(str(outcome))}", highlight=False, soft_wrap=True)

        try:
            results = ingest_paths(store, args.paths, run_id=args.run_id, on_progress=on_events, on_file=on_file,
                                   settings=settings)
        finally:
            store.close()
    if not results and not failures:
        failures.append(f"no Kineto trace among {', '.join(args.paths)} ({len(skipped)} file(s) skipped)")
        refused = True
        err.print(f"[red]error:[/] {escape(failures[-1])}", highlight=False, soft_wrap=True)
    if args.json:
        print_json({"ingested": [vars(r) for r in results], "errors": failures, "skipped": skipped})
    else:
        for r in results:
            print(f"{r.path}: run {r.run_id} rank {r.rank}: {r.events:,} events ({device_text(r)}) "
                  f"in {r.seconds:.2f}s" + ("" if r.status == "complete" else f" ({r.status})"))
        if failures:
            print(f"{len(failures)} file(s) failed (errors above)", file=sys.stderr)
    return 2 if refused else 1 if failures else 0
