"""``triscope diagnose``: explain where time goes.

``diagnose TRACE_OR_DIR...`` ingests Kineto traces (files, or a directory of one job's ranks) into the
configured store and reports them in the same process: the trace breakdown of each run, then the
stall verdict of each profiler step. ``--trace-run ID`` reports the Kineto trace breakdown of one profiling run
(triscope.analyzers.trace_breakdown, rendered by triscope.analyzers.trace_report). Without it, the stall classifier
(triscope.analyzers.stalls) labels every window (``--since 10m``, default 100 ms) or profiler
step of every GPU as compute-, IO-, comm-, launch/host-bound or idle, with the evidence, the
shares, the worst windows, the straggler rank of each collective and an action per class.
Exit status 3 when a configured alert threshold is breached.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import sys
import threading
import time
from typing import TYPE_CHECKING, Any

from triscope.commands._common import add_common, config_from, print_json, store_from, time_range, utc_text

if TYPE_CHECKING:
    from triscope.analyzers.stalls import StallReport

EXIT_BREACH = 3
EXIT_INPUT = 2


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("diagnose", help="explain GPU time: trace breakdown or fleet stalls")
    parser.add_argument("paths", nargs="*", metavar="TRACE_OR_DIR",
                        help="Kineto traces (.json/.json.gz, or a directory of one job's ranks): ingest, then report")
    parser.add_argument("--trace-run", metavar="ID",
                        help="report the trace breakdown of this run id (with TRACE_OR_DIR: the run id to ingest as)")
    parser.add_argument("--rank", type=int, action="append", help="only these ranks (repeatable)")
    parser.add_argument("--include-last-step", action="store_true",
                        help="keep the last ProfilerStep in whole-trace figures (HTA drops it by default)")
    stalls = parser.add_argument_group("stall diagnosis (without --trace-run)")
    stalls.add_argument("--since", metavar="DURATION", help="analyse the last DURATION (e.g. 10m, 2h; default 10m)")
    stalls.add_argument("--from", dest="start", metavar="WHEN",
                        help="start of the range instead of --since: a DURATION ago or an ISO-8601 UTC time")
    stalls.add_argument("--until", metavar="WHEN",
                        help="end of the range: a DURATION ago or an ISO-8601 UTC time (default now)")
    stalls.add_argument("--png", metavar="PATH", help="a timeline per incident (load, P99 / SLA, KV usage, the "
                                                       "cause's signal; the breach marked)")
    stalls.add_argument("--summary", action="store_true",
                        help="over the range's incidents: the share after a QPS jump, time to breach, KV usage at the "
                             "breach, P99 growth (in --json always, under incidents.summary)")
    stalls.add_argument("--run-id", action="append", metavar="ID",
                        help="analyse these trace runs over their own time span (repeatable)")
    stalls.add_argument("--host", action="append", help="only these hosts (repeatable)")
    stalls.add_argument("--gpu", type=int, action="append", help="only these GPU indices (repeatable)")
    stalls.add_argument("--model", help="only GPUs that served this model (requests / serving_metrics / gpu_model)")
    stalls.add_argument("--by", choices=("window", "step"), default="window",
                        help="classify fixed windows or profiler steps (default window)")
    stalls.add_argument("--window-ms", type=float, help="window length (default [stalls] / [analysis] window_ms)")
    stalls.add_argument("--top", type=int, help="worst windows to list (default [stalls] top_windows)")
    stalls.add_argument("--all-windows", action="store_true", help="with --json: include every window")
    add_common(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.paths:
        return run_traces(args)
    return run_trace_report(args) if args.trace_run else run_stalls(args)


def run_traces(args: argparse.Namespace) -> int:
    """``diagnose TRACE_OR_DIR...``: ingest, breakdown and per-step stall verdicts in one process (one store open).

    Exit 2 when no file could be ingested (with ``--json`` the errors are still a JSON document on stdout),
    1 when some could not or a run could not be classified (the rest is reported), else as the stall
    diagnosis (3 on a breached threshold). A rank whose breakdown supports no verdict (too short to judge,
    device activity recorded as profiler ranges only) is left out of the verdicts, and says why."""
    from triscope.collectors.kineto.config import TraceIngestConfig
    from triscope.collectors.kineto.errors import SkippedTraceError
    from triscope.collectors.kineto.ingest import IngestResult, ingest_paths
    from triscope.commands.ingest import device_text
    from triscope.errors import InputError
    from triscope.store import open_store

    config = config_from(args)
    settings = TraceIngestConfig.from_config(config)
    failures: list[str] = []
    skipped: list[str] = []

    def on_file(outcome: IngestResult | InputError) -> None:
        if isinstance(outcome, SkippedTraceError):  # a stray file in a directory: said, not a failure
            skipped.append(str(outcome))
            print(f"triscope: warning: {outcome}", file=sys.stderr)
        elif isinstance(outcome, InputError):
            failures.append(str(outcome))
            print(f"triscope: error: {outcome}", file=sys.stderr)
        elif not args.json:
            print(f"ingested {outcome.path}: run {outcome.run_id} rank {outcome.rank}, {outcome.events:,} events "
                  f"({device_text(outcome)}) in {outcome.seconds:.2f}s", file=sys.stderr)

    store = open_store(config)
    # Started once the store is open: before, the command's own imports and chDB's start-up need the GIL.
    warm = _warm_imports()
    results: list[IngestResult] = []
    reports: list[tuple[str, Any, StallReport | None]] = []
    breaches: list[str] = []
    try:
        try:
            results = ingest_paths(store, args.paths, run_id=args.trace_run, on_file=on_file, settings=settings)
        except InputError as exc:  # a path that is not there, a directory without traces
            if not args.json:
                raise
            failures.append(str(exc))
            print(f"triscope: error: {exc}", file=sys.stderr)
        for run_id in dict.fromkeys(r.run_id for r in results if r.events):
            ranks, stalls = _analyze(store, run_id, args, config, failures)
            breaches += stalls.breaches() if stalls else []
            reports.append((run_id, ranks, stalls))
    finally:
        store.close()
        warm.join()
    if not results and not failures:
        failures.append(f"no Kineto trace among {', '.join(args.paths)} ({len(skipped)} file(s) skipped)")
        print(f"triscope: error: {failures[-1]}", file=sys.stderr)
    _print_traces(args, results, failures, skipped, reports)
    if not results:
        return EXIT_INPUT
    if failures:
        return 1
    return EXIT_BREACH if breaches else 0


def _analyze(store: Any, run_id: str, args: argparse.Namespace, config: dict[str, Any],
             failures: list[str]) -> tuple[Any, StallReport | None]:
    """The breakdown of a run's ranks, and the stall verdicts of the ranks whose breakdown supports one."""
    from triscope.analyzers.stalls import diagnose_runs
    from triscope.analyzers.trace_breakdown import analyze_run
    from triscope.errors import InputError

    ranks = analyze_run(store, run_id, ranks=args.rank, include_last_step=args.include_last_step)
    judged = [r.rank for r in ranks if not r.no_verdict()]
    if not judged:
        return ranks, None
    try:  # the breakdown stands on its own: a run the classifier refuses (too large) still gets it
        return ranks, diagnose_runs(store, [run_id], config, by="step", ranks=judged)
    except InputError as exc:
        failures.append(f"{run_id}: stall verdicts: {exc}")
        print(f"triscope: error: {failures[-1]}", file=sys.stderr)
        return ranks, None


def _print_traces(args: argparse.Namespace, results: list[Any], failures: list[str], skipped: list[str],
                  reports: list[tuple[str, Any, StallReport | None]]) -> None:
    """The report of ``diagnose TRACE_OR_DIR...``: JSON, or per run its breakdown, its verdicts (or why there
    are none) and the command that reports it again."""
    if args.json:
        from triscope.analyzers.trace_report import report_dict

        print_json({"ingested": [vars(r) for r in results], "errors": failures, "skipped": skipped,
                    "runs": [{**report_dict(run_id, ranks), "stalls": stalls.to_json() if stalls else None,
                              "report_again": f"triscope diagnose --trace-run {run_id}"}
                             for run_id, ranks, stalls in reports]})
        return
    from triscope.analyzers.trace_report import print_report

    for run_id, ranks, stalls in reports:
        print_report(run_id, ranks)
        if stalls is not None:
            render(stalls, title=f"stall verdicts of run {run_id}, per profiler step")
        for rank in ranks:
            if rank.no_verdict():
                print(f"rank {rank.rank}: no stall verdict: {rank.no_verdict()}")
        print(f"run id {run_id}: report it again with `triscope diagnose --trace-run {run_id}`")


def _warm_imports() -> threading.Thread:
    """Import what the report needs on a thread while chDB starts and ingests, which release the GIL
    (about 60 ms of a small trace's 0.8 s, measured with bench/cli_e2e.py); joined before the report."""
    def load() -> None:
        for name in ("numpy", "pyarrow", "triscope.analyzers.trace_report", "triscope.analyzers.stalls",
                     "triscope.console", "rich.table"):
            with contextlib.suppress(ImportError):
                importlib.import_module(name)

    thread = threading.Thread(target=load, name="triscope-warm-imports")
    thread.start()
    return thread


def run_trace_report(args: argparse.Namespace) -> int:
    """``--trace-run ID``: the trace breakdown of one run, as tables or ``--json``."""
    from triscope.analyzers.trace_breakdown import analyze_run
    from triscope.analyzers.trace_report import print_report, report_dict

    store = store_from(args)
    try:
        ranks = analyze_run(store, args.trace_run, ranks=args.rank, include_last_step=args.include_last_step)
    finally:
        store.close()
    if args.json:
        print_json(report_dict(args.trace_run, ranks))
    else:
        print_report(args.trace_run, ranks)
    return 0


def run_stalls(args: argparse.Namespace) -> int:
    from triscope.analyzers.stalls import diagnose_stalls, trace_span
    from triscope.store import open_store

    config = config_from(args)
    if args.window_ms is not None:
        config.setdefault("stalls", {})["window_ms"] = args.window_ms
    if args.top is not None:
        config.setdefault("stalls", {})["top_windows"] = args.top
    now_ns = time.time_ns()
    # a fleet's range unless trace runs are named without one (then their own span); refused before the store opens
    fleet = None if args.run_id and not (args.since or args.start) else \
        time_range(args.since, args.start, args.until, now_ns, epoch_seconds=False, end_flag="--until")
    store = open_store(config)
    try:
        start_ns, end_ns = fleet if fleet is not None else trace_span(store, args.run_id)
        report = diagnose_stalls(store, start_ns, end_ns, config, hosts=args.host, gpus=args.gpu,
                                 model=args.model, run_ids=args.run_id, by=args.by)
        incidents = None
        if fleet is not None:  # a fleet's range, not one trace's
            from triscope.analyzers.incidents import find_incidents

            incidents = find_incidents(store, start_ns, end_ns, config)
    finally:
        store.close()
    if args.json:
        doc = report.to_json(all_windows=args.all_windows)
        if incidents is not None:
            doc["incidents"] = incidents.to_dict()
        print_json(doc)
    else:
        if incidents is not None:
            from triscope.commands._incidents_view import render_incidents, render_summary

            render_incidents(incidents)
            if args.summary:
                render_summary(incidents)
        render(report)
    if args.png and incidents is not None:
        from pathlib import Path

        from triscope.commands._incidents_png import write_png

        drawn = write_png(incidents, Path(args.png))
        if not args.json:
            print(f"incident timelines: {args.png}" if drawn else "no incident to draw: no PNG written")
    alerts = incidents.alerts() if incidents is not None else []
    return EXIT_BREACH if report.breaches() or alerts else 0


def render(report: StallReport, title: str = "") -> None:
    """Rich tables: shares per unit, worst windows with evidence, stragglers, actions."""
    from rich.table import Table

    from triscope.analyzers.stalls import ACTIONS
    from triscope.console import report_console

    console = report_console()
    if title:
        console.print(f"[bold]{title}[/]")
    else:
        console.print(f"[bold]stalls[/] {utc_text(report.start_ns)} .. {utc_text(report.end_ns)} UTC, "
                      f"{'profiler steps' if report.by == 'step' else f'{report.window_ms:g} ms windows'}")
    if not report.windows:
        console.print("no GPU samples, traces or IO data in this range")
    elif report.host_io_unclassified:
        console.print(f"no GPU samples or device work in this range: {len(report.windows)} windows of host-side "
                      "data (block IO), none IO- or host-bound")
    else:
        console.print(f"[bold]overall:[/] {report.share_text()}")
        devices = {w.device for w in report.windows if w.device_data}
        kinds = sorted({d.rstrip("0123456789").split("-")[0].upper() for d in devices})
        units = Table(title=f"per {'/'.join(kinds) or 'device'} / rank", show_lines=False)
        for col in ("unit", "windows", "shares"):
            units.add_column(col)
        for u in report.units():
            units.add_row(u, str(len(report.unit_windows(u))), report.share_text(u))
        console.print(units)
        top = report.top()
        if top:
            worst = Table(title="worst windows")
            for col in ("unit", "start (UTC)", "length", "verdict", "evidence", "also"):
                worst.add_column(col)
            for w in top:
                evidence = "; ".join(e.text() for e in w.evidence.get(w.verdict, []) if e.met)
                worst.add_row(w.unit, utc_text(w.start_ns) + (f" {w.label}" if w.label else ""),
                              f"{w.seconds * 1e3:.0f} ms", w.verdict, evidence, ",".join(w.matched[1:]))
            console.print(worst)
    strag = report.stragglers.get("by_rank") or []
    if strag:
        t = Table(title=f"stragglers ({report.stragglers['collectives']} collectives seen by >= 2 ranks)")
        for col in ("run", "rank", "last in", "total lateness", "max lateness"):
            t.add_column(col)
        for r in strag:
            t.add_row(r["run_id"], str(r["rank"]), f"{r['times_last']}/{r['collectives']}",
                      f"{r['total_lateness_seconds'] * 1e3:.1f} ms", f"{r['max_lateness_seconds'] * 1e3:.1f} ms")
        console.print(t)
    for fr in report.flight_recorder:
        status = "ok" if fr["ok"] else "[red]problem[/]"
        console.print(f"flight recorder {fr['run_id']} pg {fr['comm_id']} ({fr['pg_desc']}): {status}; "
                      f"last seq per rank {fr['last_seq']}; pending {len(fr['pending'])}; "
                      f"behind {[b['rank'] for b in fr['ranks_behind']]}; mismatches {len(fr['mismatches'])}")
    shares = report.shares()
    for cls in shares:
        if cls in ACTIONS and cls in [*report.config.alert_classes, "idle"]:
            console.print(f"[bold]{cls}[/] -> {report.action(cls)}")  # CPU-side without device data
    for b in report.breaches():
        console.print(f"[red]breach:[/] {b}")
