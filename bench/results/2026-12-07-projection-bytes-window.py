"""Ad-hoc (2026-12-07-projection-bytes.md): every query the store reader issues for one update, with
EXPLAIN indexes=1's granules (did the primary key or a projection skip any?) and each query's median CPU.

    cd bench && ../.venv/bin/python results/2026-12-07-projection-bytes-window.py STORE_DIR [RUNS] [--pair] [--json OUT]

STORE_DIR: a kept fleet-day store (weight_update.py --path, fleet_day.py --path). ``now`` is the newest
scrape + 0.5 s, as weight_update.py takes it. ``--pair``: copies ``serving_metrics`` into a table without
the projection (merged like the source: one part per partition) and times the reader's serving window
query on both, interleaved, in this process. Opens the store for writing: use a copy.
"""

from __future__ import annotations

import json
import re
import statistics
import sys
import time
from typing import Any

from triscope.analyzers.routing import WeightParams, read_inputs
from triscope.schema import SERVING_METRICS, qualified
from triscope.store.embedded import EmbeddedStore


class Recorder:
    """Forwards to a store and keeps each query's SQL and parameters."""

    def __init__(self, store: EmbeddedStore) -> None:
        self.store, self.seen = store, []  # type: ignore[var-annotated]

    def query(self, sql: str, params: Any = None) -> Any:
        self.seen.append((sql, dict(params or {})))
        return self.store.query(sql, params)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)


def pair(store: EmbeddedStore, sql: str, params: dict[str, Any], runs: int) -> dict[str, Any]:
    """Median CPU ms of the serving window query on ``serving_metrics`` (its projection) and on a
    merged copy without it, interleaved; each one's granules."""
    src = qualified(store, SERVING_METRICS)
    copy = f"{src}_noproj"
    if not store.query("EXISTS TABLE " + copy).scalar():
        store.command(f"CREATE TABLE {copy} AS {src}")
        store.command(f"ALTER TABLE {copy} DROP PROJECTION IF EXISTS by_time")
        store.command(f"INSERT INTO {copy} SELECT * FROM {src}")
        store.command(f"OPTIMIZE TABLE {copy} FINAL")
    queries = {"projection": sql, "raw": sql.replace(f"FROM {src}\n", f"FROM {copy}\n")}
    same = sorted(store.query(queries["raw"], params).rows) == sorted(store.query(sql, params).rows)
    assert queries["raw"] != sql and same, "the copy answers differently"
    cpu: dict[str, list[float]] = {k: [] for k in queries}
    for _ in range(runs):
        for k, q in queries.items():
            c = time.process_time()
            store.query(q, params)
            cpu[k].append(time.process_time() - c)
    out = {}
    for k, q in queries.items():
        plan = "\n".join(str(r[0]) for r in store.query("EXPLAIN indexes = 1 " + q, params).rows)
        out[k] = {"cpu_ms": statistics.median(cpu[k]) * 1e3, "granules": re.findall(r"Granules: (\d+/\d+)", plan),
                  "read": re.findall(r"ReadFromMergeTree \(([^)]*)\)", plan)}
        print(f"  serving window, {k:10s}: {out[k]['cpu_ms']:6.1f} ms CPU (median of {runs}, interleaved), "
              f"read {out[k]['read']} granules {out[k]['granules']}")
    return out


def main(argv: list[str]) -> int:
    path, runs = argv[0], int(argv[1]) if len(argv) > 1 and argv[1].isdigit() else 9
    out_json = argv[argv.index("--json") + 1] if "--json" in argv else ""
    store = EmbeddedStore(path, database="fleetday")
    try:
        now = int(store.query(f"SELECT toUnixTimestamp64Nano(max(ts)) FROM {qualified(store, SERVING_METRICS)}")
                  .scalar()) / 1e9 + 0.5
        rec = Recorder(store)
        read_inputs(rec, WeightParams.from_config({}), now)  # type: ignore[arg-type]
        projections = store.query("SELECT table, name, count(), sum(rows) FROM system.projection_parts "
                                  "WHERE database = {db:String} AND active GROUP BY table, name",
                                  {"db": store.database}).rows
        print(f"store {path}: projections {projections}")
        found = []
        for sql, params in rec.seen:
            plan = "\n".join(str(r[0]) for r in store.query("EXPLAIN indexes = 1 " + sql, params).rows)
            granules = re.findall(r"Granules: (\d+/\d+)", plan)
            reads = re.findall(r"ReadFromMergeTree \(([^)]*)\)", plan)
            cpu = []
            for _ in range(runs):
                c = time.process_time()
                store.query(sql, params)
                cpu.append(time.process_time() - c)
            table = re.search(r"FROM ([\w.]+)", sql)
            row = {"from": table.group(1) if table else "?", "read": reads, "granules": granules,
                   "cpu_ms": statistics.median(cpu) * 1e3, "sql": " ".join(sql.split())[:160]}
            found.append(row)
            print(f"  {row['from']:32s} {row['cpu_ms']:6.1f} ms CPU  read {reads} granules {granules}")
        doc: dict[str, Any] = {"path": path, "now": now, "projections": projections, "queries": found}
        if "--pair" in argv:
            sql, params = next((q, p) for q, p in rec.seen if "maxIf(requests_total" in q)
            doc["pair"] = pair(store, sql, params, max(runs, 15))
        if out_json:
            with open(out_json, "w") as fh:
                json.dump(doc, fh, indent=1)
    finally:
        store.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
