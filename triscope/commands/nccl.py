"""``triscope nccl``: load collective-communication data and list stragglers.

``nccl ingest PATH...``  NCCL Inspector (JSONL or .prom), Flight Recorder dumps (pickle/JSON,
                         a file or a directory of ranks), nccl-tests stdout.
``nccl kineto RUN...``   extract the collectives of Kineto traces already in the store.
``nccl stragglers``      latest-arriving rank per collective, plus Flight Recorder checks.
"""

from __future__ import annotations

import argparse
import sys

from triscope.commands._common import add_common, print_json, store_from


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("nccl", help="NCCL/gloo collectives: ingest, extract from traces, stragglers")
    verbs = parser.add_subparsers(dest="verb", metavar="VERB", required=True)
    ing = verbs.add_parser("ingest", help="load Inspector, Flight Recorder or nccl-tests files")
    ing.add_argument("paths", nargs="+")
    ing.add_argument("--format", default="auto", choices=("auto", "inspector", "flight-recorder", "nccl-tests"))
    ing.add_argument("--run-id", help="run id for the rows (default: file or directory name)")
    ing.add_argument("--rank", type=int, help="rank of a single Flight Recorder file without one in its name")
    ing.add_argument("--collective", default="", help="nccl-tests: the collective when the output does not say")
    add_common(ing)
    ing.set_defaults(func=run_ingest)
    kin = verbs.add_parser("kineto", help="extract collectives from ingested Kineto trace runs")
    kin.add_argument("run_ids", nargs="+")
    add_common(kin)
    kin.set_defaults(func=run_kineto)
    st = verbs.add_parser("stragglers", help="straggler rank per collective and Flight Recorder checks")
    st.add_argument("--run-id", action="append", help="only these runs (repeatable)")
    st.add_argument("--min-lateness-ms", type=float, default=1.0)
    add_common(st)
    st.set_defaults(func=run_stragglers)


def run_ingest(args: argparse.Namespace) -> int:
    from triscope.collectors.nccl.ingest import ingest_path
    from triscope.errors import InputError

    store = store_from(args)
    results, failures = [], []
    try:
        for path in args.paths:
            try:
                results.append(ingest_path(store, path, args.format, args.run_id, args.rank, args.collective))
            except InputError as exc:
                failures.append(str(exc))
    finally:
        store.close()
    if args.json:
        print_json({"ingested": [vars(r) for r in results], "errors": failures})
    else:
        for r in results:
            print(f"{r.path}: {r.format} run {r.run_id}: {r.rows} rows")
            for e in r.errors:
                print(f"warning: {e}", file=sys.stderr)
        for f in failures:
            print(f"error: {f}", file=sys.stderr)
    return 1 if failures or any(r.errors for r in results) else 0


def run_kineto(args: argparse.Namespace) -> int:
    from triscope.collectors.nccl.kineto import ingest_kineto_summary

    store = store_from(args)
    try:
        summaries = [ingest_kineto_summary(store, run) for run in args.run_ids]
    finally:
        store.close()
    if args.json:
        print_json({"rows": {s.run_id: s.rows for s in summaries}, "runs": [s.to_json() for s in summaries]})
        return 0
    for s in summaries:
        ranks = f" on {len(s.ranks)} rank{'s' if len(s.ranks) != 1 else ''}" if s.ranks else ""
        busbw = (f"; median bus bandwidth {s.median_busbw_bytes_per_second / 1e9:.2f} GB/s over {s.busbw_known}"
                 if s.median_busbw_bytes_per_second is not None else "")
        print(f"{s.run_id}: {s.rows} collective ops{ranks}{busbw}")
        for note in s.notes:
            print(f"  {note}")
    return 0


def run_stragglers(args: argparse.Namespace) -> int:
    from triscope.analyzers.nccl_crossrank import flight_recorder_check, nothing_to_compare, stragglers

    store = store_from(args)
    try:
        report = stragglers(store, run_ids=args.run_id, min_lateness_seconds=args.min_lateness_ms / 1e3)
        fr = flight_recorder_check(store, args.run_id)
        notes = nothing_to_compare(store, report, args.run_id)
    finally:
        store.close()
    if args.json:
        print_json({"stragglers": report.to_json(), "flight_recorder": fr, "notes": notes})
        return 0
    for r in report.by_rank():
        print(f"run {r['run_id']}: rank {r['rank']} last in {r['times_last']}/{r['collectives']} collectives, "
              f"{r['total_lateness_seconds'] * 1e3:.1f} ms total, {r['max_lateness_seconds'] * 1e3:.1f} ms max")
    for note in notes:
        print(note)
    for f in fr:
        print(f"flight recorder {f['run_id']} pg {f['comm_id']}: {'ok' if f['ok'] else 'PROBLEM'} "
              f"pending={len(f['pending'])} behind={[b['rank'] for b in f['ranks_behind']]} "
              f"mismatches={len(f['mismatches'])}")
    return 0
