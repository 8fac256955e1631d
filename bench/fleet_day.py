"""One day of a GPU fleet in the store: bytes per stored value, ingest rate, board panel latency.

Builds an embedded store holding ``--days`` of a fleet of ``1000 * --scale`` GPUs (half the hosts
sampled by nvml at 10 Hz, half by dcgm at 1 Hz), as many vLLM backends scraped at 1 Hz, request
spans at ``5000 * --scale`` per second, IO latency windows and the weight engine's history
(bench/fleet_day_data.py says how the values move). It prints, for every table and column, the
compressed bytes per row and per stored value after the parts are merged (system.parts_columns, plus
the table's projections from system.projection_parts: a projection is stored in each part beside its
columns, so it is part of what the table costs),
and the rows/s each table was written at through ``Store.insert`` (the writer's last step), with the
headroom over what a 1,000-GPU fleet writes. ``--try-codecs`` copies every table into scratch
columns under candidate codecs and prints the smallest per column; ``--baseline`` first resets
every column to the server's default codec (LZ4) to measure a store as it was before codecs.

    .venv/bin/python bench/fleet_day.py                      # CI-sized: 16 GPUs, 6 hours (about a minute)
    .venv/bin/python bench/fleet_day.py --scale 1 --days 1   # the 1,000-GPU day
    .venv/bin/python bench/fleet_day.py --baseline --try-codecs --json out.json

Latency figures on a shared 2-core machine are noisy; byte counts are exact.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import fleet_day_codecs
import fleet_day_data as data
import fleet_day_panels

from triscope.schema import (
    GPU_SAMPLES,
    IO_LATENCY,
    REQUESTS,
    SERVING_METRICS,
    WEIGHTS_HISTORY,
    Table,
    migrate,
    qualified,
)
from triscope.schema.gpu import GPU_SAMPLES_1M, GPU_SAMPLES_10S
from triscope.schema.model import modify_codec_sql
from triscope.schema.requests import REQUESTS_RECENT, SERVING_METRICS_1M, SERVING_METRICS_10S, SERVING_RECENT
from triscope.store.embedded import EmbeddedStore

TABLES = (GPU_SAMPLES, SERVING_METRICS, REQUESTS, IO_LATENCY, WEIGHTS_HISTORY)
ROLLUPS = tuple(r.table for r in (GPU_SAMPLES_10S, GPU_SAMPLES_1M, SERVING_METRICS_10S, SERVING_METRICS_1M))
RECENT = (SERVING_RECENT.table, REQUESTS_RECENT.table)
"""The weight engine's last hours by time: their rows are those of the store's last 2 to 3 hours."""
MEASURED = TABLES + ROLLUPS + RECENT
"""Every table whose bytes are reported."""
FULL_FLEET = {"gpus": 1000, "backends": 1000, "requests_per_s": 5000.0}
"""The fleet the targets speak of: 1,000 GPUs at 10 Hz, 1,000 engines at 1 Hz, 5,000 requests/s."""
INSERT_ROWS = 200_000


def fleet_of(scale: float, days: float, t0: float) -> data.Fleet:
    gpus = max(16, int(round(FULL_FLEET["gpus"] * scale / 16)) * 16)
    return data.Fleet(gpus=gpus, backends=max(8, int(FULL_FLEET["backends"] * scale)),
                      requests_per_s=FULL_FLEET["requests_per_s"] * scale, t0=t0, seconds=int(days * 86400))


def sources(f: data.Fleet) -> list[tuple[Table, str, Callable[[], Iterator[dict[str, Any]]]]]:
    """(table, label, chunks) per writer: nvml on the first half of the hosts, dcgm on the rest."""
    half = f.hosts // 2
    per_s = lambda rows_per_s: max(1, INSERT_ROWS // max(1, int(rows_per_s)))  # noqa: E731
    return [
        (GPU_SAMPLES, "nvml 10 Hz", lambda: data.gpu_chunks(f, 10, "nvml", range(0, half), per_s(half * 80))),
        (GPU_SAMPLES, "dcgm 1 Hz", lambda: data.gpu_chunks(f, 1, "dcgm", range(half, f.hosts),
                                                           per_s((f.hosts - half) * 8))),
        (SERVING_METRICS, "vllm 1 Hz", lambda: data.serving_chunks(f, per_s(f.backends))),
        (REQUESTS, "spans", lambda: data.request_chunks(f, per_s(f.requests_per_s))),
        (IO_LATENCY, "io 1 s", lambda: data.io_chunks(f, per_s(f.hosts * 4))),
        (WEIGHTS_HISTORY, "engine 1 s", lambda: data.weights_chunks(f, per_s(f.backends))),
    ]


def build(store: EmbeddedStore, f: data.Fleet) -> dict[str, dict[str, float]]:
    """Insert every source; rows and seconds of insert per table (generation excluded)."""
    out: dict[str, dict[str, float]] = {}
    for table, label, chunks in sources(f):
        rows, spent = 0, 0.0
        for batch in chunks():
            t = time.perf_counter()
            rows += store.insert(qualified(store, table), batch)
            spent += time.perf_counter() - t
        acc = out.setdefault(table.name, {"rows": 0, "insert_s": 0.0})
        acc["rows"] += rows
        acc["insert_s"] += spent
        print(f"  {table.name:16s} {label:11s} {rows:>12,d} rows  {rows / max(spent, 1e-9):>10,.0f} rows/s",
              flush=True)
    return out


def required_rates() -> dict[str, float]:
    """Rows/s a 1,000-GPU fleet writes per table (the ingest target)."""
    return {"gpu_samples": FULL_FLEET["gpus"] * 10.0, "serving_metrics": FULL_FLEET["backends"] * 1.0,
            "requests": FULL_FLEET["requests_per_s"], "io_latency": FULL_FLEET["gpus"] / 8 * 4.0,
            "weights_history": FULL_FLEET["backends"] * 1.0}


def headroom(built: dict[str, dict[str, float]]) -> float:
    """How many such fleets one writer thread could insert: 1 / sum(required rate / measured rate)."""
    load = sum(rate * built[name]["insert_s"] / max(built[name]["rows"], 1)
               for name, rate in required_rates().items() if name in built)
    return 1.0 / load if load else float("inf")


def sizes(store: EmbeddedStore, tables: tuple[Table, ...]) -> dict[str, dict[str, Any]]:
    """Per table: rows, compressed bytes (columns and projections), per projection its compressed bytes,
    and per column compressed bytes, bytes per value, codec. A table's bytes per value is all its
    bytes over its rows times its columns: a projection's copy of a column adds bytes, not values."""
    res = store.query(
        "SELECT c.table, c.column, sum(c.column_data_compressed_bytes), sum(c.column_data_uncompressed_bytes), "
        "any(s.compression_codec) FROM system.parts_columns AS c LEFT JOIN system.columns AS s "
        "ON s.database = c.database AND s.table = c.table AND s.name = c.column "
        "WHERE c.database = {db:String} AND c.active GROUP BY c.table, c.column", {"db": store.database})
    rows = dict(store.query("SELECT table, sum(rows) FROM system.parts WHERE database = {db:String} AND active "
                            "GROUP BY table", {"db": store.database}).rows)
    out: dict[str, dict[str, Any]] = {}
    names = {t.name: t for t in tables}
    for table, column, comp, uncomp, codec in res.rows:
        if table not in names:
            continue
        n = int(rows.get(table, 0)) or 1
        t = out.setdefault(table, {"rows": int(rows.get(table, 0)), "bytes": 0, "columns": {}, "projections": {}})
        t["bytes"] += int(comp)
        t["columns"][column] = {"bytes": int(comp), "bytes_per_value": int(comp) / n,
                                "uncompressed_per_value": int(uncomp) / n, "codec": codec or "LZ4 (default)"}
    for table, name, comp in store.query(
            "SELECT table, name, sum(data_compressed_bytes) FROM system.projection_parts "
            "WHERE database = {db:String} AND active GROUP BY table, name", {"db": store.database}).rows:
        if table in out:
            out[table]["projections"][name] = int(comp)
    for t in out.values():
        # what the table costs: its columns and its projections (system.parts_columns has the columns only)
        t["columns_bytes"] = t["bytes"]
        t["bytes"] += sum(t["projections"].values())
        t["bytes_per_row"] = t["bytes"] / max(t["rows"], 1)
        t["bytes_per_value"] = t["bytes"] / max(t["rows"] * len(t["columns"]), 1)
    return out


def print_sizes(found: dict[str, dict[str, Any]], verbose: bool) -> None:
    for name, t in found.items():
        print(f"\n{name}: {t['rows']:,} rows, {t['bytes']:,} B, {t['bytes_per_row']:.2f} B/row, "
              f"{t['bytes_per_value']:.3f} B/value over {len(t['columns'])} columns")
        for proj, b in t["projections"].items():
            print(f"    projection {proj}: {b:,} B ({b / max(t['columns_bytes'], 1):.0%} of the columns' "
                  f"{t['columns_bytes']:,} B; {t['columns_bytes'] / max(t['rows'] * len(t['columns']), 1):.3f} "
                  f"B/value without it)")
        if verbose:
            for col, c in sorted(t["columns"].items(), key=lambda kv: -kv[1]["bytes"]):
                print(f"    {col:28s} {c['bytes_per_value']:8.3f} B/value  (raw {c['uncompressed_per_value']:5.1f})"
                      f"  {c['codec']}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scale", type=float, default=0.016, help="fraction of the 1,000-GPU fleet (default 16 GPUs)")
    ap.add_argument("--days", type=float, default=0.25, help="days of data (default 6 hours)")
    ap.add_argument("--path", default="", help="store directory (default: a fresh one under /tmp, removed after)")
    ap.add_argument("--baseline", action="store_true", help="every column at the default codec (LZ4) first")
    ap.add_argument("--try-codecs", action="store_true", help="measure candidate codecs per column on a copy")
    ap.add_argument("--panels", type=int, default=5, help="runs per board panel query (0: skip the panels)")
    ap.add_argument("--cli-runs", type=int, default=1, help="runs of heatmap / diagnose --since 1h (0: skip)")
    ap.add_argument("--columns", action="store_true", help="print every column's bytes per value")
    ap.add_argument("--json", default="", help="write the figures here")
    args = ap.parse_args(argv)
    path = args.path or f"/tmp/triscope-fleetday-{os.getpid()}"
    t0 = float(int(time.time()) - int(args.days * 86400))
    f = fleet_of(args.scale, args.days, t0)
    print(f"fleet: {f.gpus} GPUs on {f.hosts} hosts, {f.backends} backends, {f.requests_per_s:g} requests/s, "
          f"{f.seconds / 3600:g} h; store {path}", flush=True)
    store = EmbeddedStore(path, database="fleetday")
    result: dict[str, Any] = {"fleet": {"gpus": f.gpus, "hosts": f.hosts, "backends": f.backends,
                                        "requests_per_s": f.requests_per_s, "hours": f.seconds / 3600},
                              "baseline": args.baseline}
    try:
        migrate(store)
        for table in MEASURED:
            # wide parts at every size, so each column's bytes are its own (compact parts share one file)
            store.command(f"ALTER TABLE {qualified(store, table)} MODIFY SETTING min_bytes_for_wide_part = 0")
            if args.baseline:
                for c in table.columns:
                    if c.codec:
                        for sql in modify_codec_sql(table.name, type(c)(c.name, c.type), store.database):
                            store.command(sql)
        started = time.perf_counter()
        built = build(store, f)
        result["build_s"] = time.perf_counter() - started
        t = time.perf_counter()
        for table in MEASURED:
            store.command(f"OPTIMIZE TABLE {qualified(store, table)} FINAL")
        result["optimize_s"] = time.perf_counter() - t
        result["ingest"] = {name: {**b, "rows_per_s": b["rows"] / max(b["insert_s"], 1e-9)}
                            for name, b in built.items()}
        result["ingest_required_rows_per_s"] = required_rates()
        result["ingest_headroom"] = headroom(built)
        print(f"built in {result['build_s']:.1f} s, merged in {result['optimize_s']:.1f} s; ingest headroom over a "
              f"1,000-GPU fleet (one insert thread): {result['ingest_headroom']:.1f}x", flush=True)
        result["sizes"] = sizes(store, MEASURED)
        print_sizes(result["sizes"], args.columns or args.try_codecs)
        if args.try_codecs:
            result["codec_trials"] = fleet_day_codecs.trial(store, TABLES)
        # right after the build: the engine reads the last seconds of inputs, which age while panels run
        result["weight_update"] = fleet_day_panels.weight_update(store, max(args.panels, 3))
        if args.panels:
            result["panels"] = fleet_day_panels.panels(store, args.panels)
        if args.cli_runs:
            for key, cmd in (("heatmap", ["heatmap", "--since", "1h"]), ("diagnose", ["diagnose", "--since", "1h"])):
                result[key] = fleet_day_panels.cli(path, store.database, cmd, args.cli_runs)
    finally:  # what was measured is written even when a later step fails or is interrupted
        store.close()
        if not args.path:
            shutil.rmtree(path, ignore_errors=True)
        if args.json:
            with open(args.json, "w") as fh:
                json.dump(result, fh, indent=1, default=float)
    return 0


if __name__ == "__main__":
    sys.exit(main())
