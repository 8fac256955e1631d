"""``triscope dashboards``: build the Grafana boards from code, or push them to a Grafana.

``dashboards build [--out DIR] [--check]``   write the board JSON (default dashboards/json), or check it
``dashboards push --url URL [--folder F]``    upload every board (token / basic auth from the environment)
"""

from __future__ import annotations

import argparse
from pathlib import Path

from triscope.commands._common import add_json_flag, print_json


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("dashboards", help="Grafana boards: build the JSON, push to a Grafana")
    verbs = parser.add_subparsers(dest="verb", metavar="VERB", required=True)
    build = verbs.add_parser("build", help="write the generated board JSON files")
    build.add_argument("--out", type=Path, help="output folder (default: dashboards/json of the source tree)")
    build.add_argument("--check", action="store_true", help="write nothing; exit 1 when a file is stale")
    add_json_flag(build)
    build.set_defaults(func=run_build)
    push = verbs.add_parser("push", help="upload every board to Grafana (POST /api/dashboards/db)")
    push.add_argument("--url", required=True, help="Grafana base URL, e.g. http://127.0.0.1:3000")
    push.add_argument("--folder", default="triscope", help="folder title (default triscope)")
    push.add_argument("--folder-uid", default="triscope", help="folder uid (default triscope)")
    push.add_argument("--token-env", default="GRAFANA_TOKEN", metavar="VAR",
                      help="environment variable holding a service-account token (default GRAFANA_TOKEN)")
    push.add_argument("--basic-env", default="GRAFANA_BASIC_AUTH", metavar="VAR",
                      help="environment variable holding user:password for basic auth (default GRAFANA_BASIC_AUTH)")
    push.add_argument("--timeout", type=float, default=10.0, help="seconds per HTTP request (default 10)")
    add_json_flag(push)
    push.set_defaults(func=run_push)


def run_build(args: argparse.Namespace) -> int:
    from triscope.dashboards.generate import DEFAULT_OUT, stale_files, write

    out = args.out or DEFAULT_OUT
    if args.check:
        stale = stale_files(out)
        if args.json:
            print_json({"out": str(out), "stale": stale})
        else:
            for name in stale:
                print(f"stale: {out / name}")
            if not stale:
                print(f"{out}: up to date")
        return 1 if stale else 0
    paths = write(out)
    if args.json:
        print_json({"out": str(out), "files": [str(p) for p in paths]})
    else:
        for p in paths:
            print(p)
    return 0


def run_push(args: argparse.Namespace) -> int:
    from triscope.dashboards.push import credential_from_env, push

    credential = credential_from_env(args.token_env, args.basic_env)
    pushed = push(args.url, credential, folder_title=args.folder, folder_uid=args.folder_uid, timeout=args.timeout)
    if args.json:
        print_json({"folder_uid": args.folder_uid, "dashboards": [vars(p) for p in pushed]})
    else:
        for p in pushed:
            print(f"{p.uid}: {p.title} -> {p.url or '?'} (version {p.version}, {p.status or 'saved'})")
    return 0
