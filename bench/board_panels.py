"""Board panels over a kept fleet-day store: wall and CPU seconds, rows and bytes read, per panel query.

Opens a store that ``bench/fleet_day.py --path DIR`` built and kept, ends the ranges at the store's
last request (so a store built earlier is measured over the same rows), expands every panel of the
chosen boards for the last 1 h and the last 24 h exactly as ``fleet_day.py`` does (variables at All,
Grafana's interval for about 1,000 points), and runs each query ``--runs`` times. ``--before REV``
times, in the same run and on the same store, the boards as generated at git revision REV
(``dashboards/json/<board>.json`` there) beside the current ones, and prints the ratios.

    .venv/bin/python bench/fleet_day.py --scale 0.1 --days 0.05 --panels 0 --cli-runs 0 --path /tmp/fd
    .venv/bin/python bench/board_panels.py --path /tmp/fd --boards heatmap,stalls --before HEAD~1 --json out.json

CPU seconds are the process's user + system time (chDB runs in the process, all its threads counted).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import fleet_day_panels

from triscope.dashboards.boards import all_boards
from triscope.dashboards.macros import Context, expand
from triscope.schema import REQUESTS, migrate, qualified, schema_versions
from triscope.store.embedded import EmbeddedStore

REPO = Path(__file__).resolve().parents[1]


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def boards_at(rev: str, names: list[str]) -> dict[str, dict[str, Any]]:
    """The committed board JSON of ``names`` at git revision ``rev``."""
    out = {}
    for name in names:
        text = subprocess.run(["git", "show", f"{rev}:dashboards/json/{name}.json"], cwd=REPO, check=True,
                              capture_output=True, text=True).stdout
        out[name] = json.loads(text)
    return out


def time_query(store: EmbeddedStore, sql: str, runs: int) -> dict[str, float]:
    """Median wall and CPU seconds over ``runs``, and the rows and bytes the engine read."""
    walls, cpus, rows_read, bytes_read = [], [], 0, 0
    for _ in range(runs):
        c, t = _cpu(), time.perf_counter()
        raw = store.query_raw(sql, "JSON")
        walls.append(time.perf_counter() - t)
        cpus.append(_cpu() - c)
        stats = json.loads(raw).get("statistics", {}) if raw else {}  # the engine's own count of what it read
        rows_read, bytes_read = int(stats.get("rows_read", 0)), int(stats.get("bytes_read", 0))
    return {"wall_s": statistics.median(walls), "cpu_s": statistics.median(cpus), "rows_read": rows_read,
            "bytes_read": bytes_read}


def measure(store: EmbeddedStore, boards: dict[str, dict[str, Any]], end: datetime, runs: int,
            ranges: dict[str, int], only: list[str]) -> dict[str, dict[str, dict[str, float]]]:
    """``{range: {"board/panel/ref": figures}}``."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    for label, range_s in ranges.items():
        ctx = Context(end - timedelta(seconds=range_s), end, interval_s=fleet_day_panels.interval_for(range_s))
        found: dict[str, dict[str, float]] = {}
        for name, board in boards.items():
            ctx.variables = fleet_day_panels.resolve_variables(store, board, ctx)
            for panel in board["panels"]:
                for target in panel.get("targets", []):
                    key = f"{name}/{panel['title']}/{target['refId']}"
                    if "rawSql" in target and (not only or any(o in key for o in only)):
                        found[key] = time_query(store, expand(target["rawSql"], ctx), runs)
                        f = found[key]
                        print(f"  {label:>3s} {f['wall_s']:7.3f} s wall {f['cpu_s']:7.3f} s CPU "
                              f"{f['rows_read']:>11,d} rows {f['bytes_read'] / 1e6:8.1f} MB  {key}", flush=True)
        out[label] = found
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--path", required=True, help="a store directory fleet_day.py built with --path")
    ap.add_argument("--database", default="fleetday")
    ap.add_argument("--boards", default="heatmap,stalls", help="comma-separated board stems, or 'all'")
    ap.add_argument("--before", default="", help="git revision whose generated boards to time as the baseline")
    ap.add_argument("--runs", type=int, default=3, help="runs per query (median)")
    ap.add_argument("--ranges", default="1h,24h", help="comma-separated: 1h, 24h")
    ap.add_argument("--only", default="", help="comma-separated: time only panels whose board/title holds one")
    ap.add_argument("--json", default="", help="write the figures here")
    args = ap.parse_args(argv)
    only = [o for o in args.only.split(",") if o]
    current = all_boards()
    names = list(current) if args.boards == "all" else args.boards.split(",")
    ranges = {r: fleet_day_panels.RANGES[r] for r in args.ranges.split(",")}
    store = EmbeddedStore(args.path, database=args.database)
    try:
        t = time.perf_counter()
        before = schema_versions(store)
        # a store built before a migration gets it here (the rollups' added gauges): {domain: [from, to]}
        ran = {d: [before.get(d, 0), v] for d, v in migrate(store).items() if before.get(d, 0) != v}
        migrated_s = time.perf_counter() - t
        print(f"migrations run: {ran or 'none'} in {migrated_s:.1f} s", flush=True)
        last = store.query(f"SELECT toUnixTimestamp(max(ts)) + 1 FROM {qualified(store, REQUESTS)}").scalar()
        end = datetime.fromtimestamp(int(last), UTC)
        result: dict[str, Any] = {"path": args.path, "end": end.isoformat(), "runs": args.runs, "only": only,
                                  "migrations": ran, "migration_s": migrated_s}
        sets = {"after": {n: current[n] for n in names}}
        if args.before:
            sets = {"before": boards_at(args.before, names), **sets}
            result["before_rev"] = args.before
        for label, boards in sets.items():
            print(f"{label}:", flush=True)
            result[label] = measure(store, boards, end, args.runs, ranges, only)
        if args.before:
            result["ratios"] = ratios(result["before"], result["after"])
    finally:
        store.close()
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0


def ratios(before: dict[str, Any], after: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Per range: the worst and median panel wall and CPU seconds before and after, and before / after."""
    out = {}
    for label in after:
        b, a = before[label], after[label]
        row: dict[str, float] = {}
        for kind in ("wall_s", "cpu_s"):
            bw, aw = max(v[kind] for v in b.values()), max(v[kind] for v in a.values())
            bm, am = statistics.median(v[kind] for v in b.values()), statistics.median(v[kind] for v in a.values())
            row.update({f"worst_{kind}_before": bw, f"worst_{kind}_after": aw, f"worst_{kind}_ratio": bw / aw,
                        f"median_{kind}_before": bm, f"median_{kind}_after": am, f"median_{kind}_ratio": bm / am})
        out[label] = row
        print(f"{label}: worst panel {row['worst_wall_s_before']:.2f} s -> {row['worst_wall_s_after']:.2f} s wall "
              f"({row['worst_wall_s_ratio']:.1f}x), {row['worst_cpu_s_before']:.2f} -> {row['worst_cpu_s_after']:.2f}"
              f" s CPU; median {row['median_wall_s_before']:.3f} -> {row['median_wall_s_after']:.3f} s "
              f"({row['median_wall_s_ratio']:.1f}x)", flush=True)
    return out


if __name__ == "__main__":
    sys.exit(main())
