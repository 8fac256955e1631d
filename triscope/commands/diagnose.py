"""``triscope diagnose``: explain where time goes.

``--trace-run ID`` reports the Kineto trace breakdown of one profiling run
(triscope.analyzers.trace_report). Fleet-wide stall diagnosis over a time range is added
by the stall classifier.
"""

from __future__ import annotations

import argparse

from triscope.commands._common import add_common


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("diagnose", help="explain GPU time: trace breakdown or fleet stalls")
    parser.add_argument("--trace-run", metavar="ID", help="report the trace breakdown of this run id")
    parser.add_argument("--rank", type=int, action="append", help="only these ranks (repeatable)")
    parser.add_argument("--include-last-step", action="store_true",
                        help="keep the last ProfilerStep in whole-trace figures (HTA drops it by default)")
    add_common(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.trace_run:
        from triscope.analyzers.trace_report import run_trace_report

        return run_trace_report(args)
    raise SystemExit("triscope diagnose: give --trace-run ID")
