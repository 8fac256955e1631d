"""The routing verdict from repeated test-bed runs: triscope against the best peer, with 95 % intervals.

    .venv/bin/python bench/testbed.py --repeat 4 ... --out-dir var/r1      # one or more repeated runs
    .venv/bin/python bench/testbed_ratios.py var/r1/testbed-*.json [...] [--png ratios.png] [--json]
    .venv/bin/python bench/testbed_ratios.py before.json=old-picker after.json=new-picker

Runs of the same fleet, workload, scenario, seed and parameters add up as rounds, whether one
``--repeat`` invocation made them or several (e.g. each on fresh engines). Per group and triscope
policy: the peer with the best mean goodput; the paired ratios (geometric mean, 95 % t interval over
rounds) of goodput over the run, goodput in the window where that peer stops holding (the 1.2x
target) and peak QPS held (1.3x), against it and against round-robin; the ceiling of each (offered /
the peer's figure: what no router could beat at that load); the failed requests per round of each
(``triscope_bed.reports.testbed_repeat``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from triscope_bed.reports.testbed_repeat import plot_verdicts, verdict_rows


def _ratio(r: dict[str, Any] | None) -> str:
    if not r or "geo_mean" not in r:
        return "-"
    ci = f" [{r['ci95'][0]:.2f}-{r['ci95'][1]:.2f}]" if "ci95" in r else ""
    return f"{r['geo_mean']:.2f}{ci}"


def _ceiling(s: dict[str, Any]) -> str:
    return f"{s['mean']:.2f}" if s.get("n") else "-"


def _line(r: dict[str, Any]) -> str:
    best, rr = r["vs_best_peer"], r["vs_round_robin"]
    at_break = (f"{_ratio(best['goodput_at_peer_break'])} (ceiling {_ceiling(best['ceiling_at_peer_break'])}; "
                f"the peer held every window in {best['peer_held_every_window']} of {r['rounds']})")
    line = (f"{r['fleet']} {r['label']} seed {r['seed']} x{r['rounds']}: {r['policy']} / {r['best_peer']}: "
            f"goodput {_ratio(best['goodput_qps'])} (ceiling {_ceiling(best['ceiling_goodput'])}), "
            f"where it stops holding {at_break}, held {_ratio(best['peak_qps_held'])} "
            f"(ceiling {_ceiling(best['ceiling_held'])}); failed/round {r['errors'].get('mean', 0):.1f} "
            f"vs {r['peer_errors'].get('mean', 0):.1f}")
    if rr:
        line += f"; / haproxy-rr: goodput {_ratio(rr['goodput_qps'])}, held {_ratio(rr['peak_qps_held'])}"
    return line


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", help="test-bed JSON documents (--repeat runs, or runs of the same seed) "
                                                "as FILE or FILE=LABEL (runs with different labels never pool)")
    parser.add_argument("--png", type=Path, help="write the ratios with their intervals here")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = parser.parse_args(argv)
    docs: list[dict[str, Any]] = []
    bad = 0
    for item in args.runs:
        name, _, label = item.partition("=")
        path = Path(name)
        try:
            doc = json.loads(path.read_text())
            if not isinstance(doc, dict) or not isinstance(doc.get("fleets"), dict):
                raise ValueError("no fleets")
            if label:
                doc["label"] = label
        except (OSError, ValueError) as exc:
            print(f"testbed_ratios: {path}: not a test-bed document ({type(exc).__name__}: {exc})", file=sys.stderr)
            bad += 1
            continue
        docs.append(doc)
    try:
        rows = verdict_rows(docs)
    except (KeyError, TypeError, ValueError) as exc:
        print(f"testbed_ratios: a document lacks what a judged run has ({type(exc).__name__}: {exc})",
              file=sys.stderr)
        return 2
    if not rows:
        print("testbed_ratios: no two rounds of the same arrivals with a triscope policy and a peer (run "
              "bench/testbed.py with --repeat 2 or more, or name runs of the same --seed)", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        for r in rows:
            print(_line(r))
    if args.png and rows:
        plot_verdicts(rows, str(args.png))
        if not args.json:
            print(f"PNG: {args.png}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
