"""Read a test-bed run request by request from HAProxy's log: where each request went and, for the picker
inside HAProxy, why.

    .venv/bin/python bench/pick_log.py var/testbed/work/vllm-triscope-haproxy/haproxy.log [...] [--json]
    .venv/bin/python bench/pick_log.py --run var/testbed            # every HAProxy policy of a run

``bench/testbed.py`` logs every request of its HAProxy policies with
``triscope.exporters.haproxy_pick.PICK_LOG_FORMAT`` (``work/<fleet>-<policy>/haproxy.log``); what is read
from each log: ``triscope_bed.peers.haproxy_log.summarize``, per window of ``--window-s`` too.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from triscope_bed.peers.haproxy_log import read_request_log, summarize


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("logs", nargs="*", type=Path, help="HAProxy logs of the test bed")
    parser.add_argument("--run", type=Path, help="a test-bed --out-dir: every work/*/haproxy.log in it")
    parser.add_argument("--window-s", type=float, default=10.0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    logs = list(args.logs) + (sorted(args.run.glob("work/*/haproxy.log")) if args.run else [])
    if not logs:
        parser.error("no log: name HAProxy logs or --run DIR")
    docs = {}
    for path in logs:
        if not path.is_file():
            print(f"pick_log: no such file: {path}", file=sys.stderr)
            return 2
        docs[str(path)] = summarize(read_request_log(path), args.window_s)
    if args.json:
        print(json.dumps(docs, indent=1))
        return 0
    for path, doc in docs.items():
        if not doc["requests"]:
            print(f"{path}: no request logged")
            continue
        a = doc["active_ms"]
        print(f"{path}: {doc['requests']} requests, split {doc['split']}, HAProxy ms p50 {a['p50']:.0f} "
              f"p99 {a['p99']:.0f} max {a['max']:.0f}, in-flight spread at arrival {doc['spread_mean']:.2f}")
        for w in doc["windows"]:
            a = w["active_ms"]
            print(f"  {w['t0_s']:>6.0f} s  {w['requests']:>4} req  split {w['split']}  p50 {a['p50']:.0f} "
                  f"p99 {a['p99']:.0f}  spread {w['spread_mean']:.2f}")
        if "fit_chosen_other" in doc:
            print(f"  fit (chosen/others): {doc['fit_chosen_other']}; picks seeing external requests: "
                  f"{doc['external_seen']}; sent where HAProxy had more in flight: {len(doc['sent_to_busier'])}")
            for b in doc["sent_to_busier"]:
                print(f"    {b['t_s']:>7.2f} s {b['server']} {b['class']} {b['need']} tokens: {b['standings']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
