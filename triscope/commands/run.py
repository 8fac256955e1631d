"""``triscope run``: the collection daemon (collectors -> writer -> store, exporters)."""

from __future__ import annotations

import argparse
import logging
import sys

from triscope.commands._common import add_common, config_from, print_json


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "run", help="run the configured collectors and exporters until SIGTERM",
        description="Start the collectors named in [run] collectors, batch their rows through the "
                    "spooling writer into the store, and run [run] exporters. SIGTERM/SIGINT flush and exit 0.")
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                        help="log level on stderr (default INFO)")
    add_common(parser)
    parser.set_defaults(func=run_daemon)


def run_daemon(args: argparse.Namespace) -> int:
    from triscope.daemon import run

    logging.basicConfig(level=getattr(logging, args.log_level), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    summary = run(config_from(args))
    if args.json:
        print_json(summary)
    else:
        w = summary["writer"]
        print(f"stopped: {w['rows_written']:,} rows written, {w['rows_pending']:,} left in the spool, "
              f"{w['rows_dropped']:,} dropped, {w['rows_rejected']:,} rejected")
        for name, c in summary["collectors"].items():
            lost = summary["lost"].get(name, 0)
            print(f"  {name}: {c['rows']:,} rows, {c['errors']} errors"
                  + (f", {lost:,} rows lost (the spool could not take them)" if lost else "")
                  + (f"; last error: {c['last_error']}" if c["errors"] else ""))
    return 0
