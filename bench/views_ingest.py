"""What the weight engine's materialized views (its newest-row and last-hours tables) and any projection
cost the writer: the same batches of the fleet-day generator (bench/fleet_day.py, the 1,000-GPU fleet)
inserted into two databases of one store, one as migrated and one with those views and every projection
dropped (``--views all``: the rollups' views too), alternating which goes first, CPU time per insert
summed (the process's, chDB's threads included).

Two batch shapes: one second of rows per insert (the writer's flush at the fleet's rate) and the
fleet-day build's 200,000-row batches (docs/weights.md, docs/scaling.md).

    PYTHONPATH=bench .venv/bin/python bench/views_ingest.py [--seconds 180] [--views weight|all] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from typing import Any

import fleet_day
import fleet_day_data as data

from triscope.schema import GPU_SAMPLES, REQUESTS, SERVING_METRICS, migrate, qualified
from triscope.schema.gpu import GPU_LATEST
from triscope.schema.requests import REQUESTS_LATEST, REQUESTS_RECENT, SCRAPES_LATEST, SERVING_LATEST, SERVING_RECENT
from triscope.store.embedded import EmbeddedStore

TABLES = (GPU_SAMPLES, SERVING_METRICS, REQUESTS)
WEIGHT_VIEWS = tuple(f"{x.table.name}_mv" for x in (GPU_LATEST, SERVING_LATEST, SCRAPES_LATEST, REQUESTS_LATEST,
                                                    SERVING_RECENT, REQUESTS_RECENT))


def strip(store: EmbeddedStore, views: str) -> list[str]:
    """Drop the weight engine's views (``views="all"``: every materialized view) and every projection of
    the inserted tables; what was dropped."""
    dropped = []
    for (view,) in store.query("SELECT name FROM system.tables WHERE database = {db:String} "
                               "AND engine = 'MaterializedView' ORDER BY name", {"db": store.database}).rows:
        if views != "all" and view not in WEIGHT_VIEWS:
            continue
        store.command(f"DROP VIEW {store.database}.{view}")
        dropped.append(view)
    for table, name in store.query("SELECT DISTINCT table, name FROM system.projection_parts "
                                   "WHERE database = {db:String} AND active", {"db": store.database}).rows:
        store.command(f"ALTER TABLE {store.database}.{table} DROP PROJECTION {name}")
        dropped.append(f"{table} projection {name}")
    for table in TABLES:  # an empty table lists no projection part: the DDL still holds it
        if "PROJECTION" in store.query(f"SHOW CREATE TABLE {qualified(store, table)}").rows[0][0]:
            raise RuntimeError(f"{table.name}: a projection is left that this bench cannot name")
    return dropped


def measure(seconds: int, path: str, views: str = "weight") -> dict[str, Any]:
    """CPU with / without per batch shape and table."""
    shutil.rmtree(path, ignore_errors=True)
    stores = {name: EmbeddedStore(path, database=f"ing_{name}") for name in ("with", "without")}
    try:
        for s in stores.values():
            migrate(s)
        f = fleet_day.fleet_of(1.0, seconds / 86400, float(int(time.time()) - seconds))
        out: dict[str, Any] = {"seconds": seconds, "backends": f.backends, "gpus": f.gpus,
                               "spans_per_s": f.requests_per_s, "views": views}
        out["dropped"] = strip(stores["without"], views)
        half = f.hosts // 2
        for shape, chunk in (("1 s per insert", lambda rows_per_s: 1),
                             ("200,000 rows per insert", lambda rows_per_s: max(1, 200_000 // int(rows_per_s)))):
            for table, chunks in ((GPU_SAMPLES, lambda c: data.gpu_chunks(f, 10, "nvml", range(0, half), c(half * 80))),
                                  (SERVING_METRICS, lambda c: data.serving_chunks(f, c(f.backends))),
                                  (REQUESTS, lambda c: data.request_chunks(f, c(f.requests_per_s)))):
                cpu = {"with": 0.0, "without": 0.0}
                rows = inserts = 0
                for i, batch in enumerate(chunks(chunk)):
                    for name in (("with", "without") if i % 2 else ("without", "with")):
                        t = time.process_time()
                        n = stores[name].insert(qualified(stores[name], table), batch)
                        cpu[name] += time.process_time() - t
                    rows += n
                    inserts += 1
                out.setdefault(shape, {})[table.name] = {
                    "rows": rows, "inserts": inserts, "cpu_s": cpu, "ratio": cpu["with"] / cpu["without"],
                    "rows_per_cpu_s": {k: rows / v for k, v in cpu.items()}}
                print(f"{shape:24s} {table.name:16s} {rows:>9,d} rows in {inserts:4d} inserts: CPU with "
                      f"{cpu['with']:.2f} s, without {cpu['without']:.2f} s ({cpu['with'] / cpu['without']:.2f}x)",
                      flush=True)
        return out
    finally:
        for s in stores.values():
            s.close()
        shutil.rmtree(path, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=int, default=180, help="seconds of the fleet inserted (default 180)")
    ap.add_argument("--views", choices=("weight", "all"), default="weight",
                    help="what the database without drops besides projections (default: the weight engine's views)")
    ap.add_argument("--path", default="/tmp/triscope-views-ingest", help="scratch store directory (removed after)")
    ap.add_argument("--json", default="", help="write the figures here")
    args = ap.parse_args(argv)
    out = measure(args.seconds, args.path, args.views)
    print("dropped in the database without: " + ", ".join(out["dropped"]))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
