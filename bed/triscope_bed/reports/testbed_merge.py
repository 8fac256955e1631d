"""One side-by-side report from test bed runs made one policy at a time (``bench/testbed_merge.py``).

Policies run in separate commands (interleaved rounds, a setting changed between runs) replay the same
arrivals when the workload, scenario, seed and parameters agree; this joins their JSON documents into
one, with the tables and the PNG the bed prints for a run of several policies. Documents that do not
replay the same arrivals are refused with a one-line error.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from triscope_bed.reports.judge import plot_judgements
from triscope_bed.reports.testbed_report import print_tables

SAME = ("workload", "scenario", "seed", "params", "profile")
"""What must agree for two documents to have replayed the same arrivals."""


class MergeError(ValueError):
    """Documents that cannot be put side by side; one line."""


def merge(docs: list[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    """``(label, document)`` pairs -> one document; a policy is named ``policy``, or ``policy (label)``
    where its document has a label."""
    if not docs:
        raise MergeError("nothing to merge")
    first_label, first = docs[0]
    out: dict[str, Any] = {k: first.get(k) for k in (*SAME, "sla_s")}
    out["merged_from"], out["fleets"] = [], {}
    for label, doc in docs:
        for key in SAME:
            if doc.get(key) != first.get(key):
                raise MergeError(f"{label or 'a document'}: {key} {doc.get(key)!r} differs from "
                                 f"{first_label or 'the first'}'s {first.get(key)!r}: not the same arrivals")
        out["merged_from"].append(doc.get("json_path") or label)
        for kind, fleet in doc.get("fleets", {}).items():
            into = out["fleets"].setdefault(kind, {**{k: v for k, v in fleet.items() if k != "policies"},
                                                   "policies": {}})
            if fleet.get("arrivals") != into.get("arrivals"):
                raise MergeError(f"{label or 'a document'}: {kind} fleet had {fleet.get('arrivals')} arrivals, "
                                 f"the first {into.get('arrivals')}")
            for name, policy in fleet.get("policies", {}).items():
                key = f"{name} ({label})" if label else name
                if key in into["policies"]:
                    raise MergeError(f"policy {key!r} appears twice: label the documents (FILE=LABEL)")
                into["policies"][key] = {**policy, "engine_cores": doc.get("engine_cores"),
                                         "engine_nice": doc.get("engine_nice")}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="join test bed JSON documents of the same arrivals side by side")
    p.add_argument("documents", nargs="+", help="FILE or FILE=LABEL (the label tells runs of one policy apart)")
    p.add_argument("--out", required=True, help="the merged JSON goes here, its PNG beside it (.png)")
    p.add_argument("--title", default="", help="the PNG's title")
    args = p.parse_args(argv)
    docs = []
    try:
        for item in args.documents:
            path, _, label = item.partition("=")
            try:
                docs.append((label, json.loads(Path(path).read_text())))
            except (OSError, ValueError) as exc:
                raise MergeError(f"{path}: not a readable test bed document ({exc})") from None
        merged = merge(docs)
    except MergeError as exc:
        print(f"testbed_merge: {exc}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for kind, fleet in merged["fleets"].items():
        png = out.with_name(f"{out.stem}-{kind}.png") if len(merged["fleets"]) > 1 else out.with_suffix(".png")
        plot_judgements(fleet["policies"], str(png), args.title or
                        f"{kind} fleet, {merged['workload']}, {merged['scenario']}, seed {merged['seed']}")
        fleet["png"] = str(png)
    out.write_text(json.dumps(merged, indent=1, default=str))
    merged["json_path"] = str(out)
    print_tables(merged)
    return 0


if __name__ == "__main__":
    sys.exit(main())
