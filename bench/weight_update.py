"""One weight-engine update over a fleet's store: the store reader (newest-row tables and the window's rows)
against the raw-scan reader (one scan per raw table) and the reference reader (one query per input), read +
compute, on the same store in the same run.

Builds (or reuses, ``--path``) the fleet-day store of bench/fleet_day.py (``--scale 1 --days 0.01``:
1,000 backends, 992 GPUs, 5,000 spans/s, 14 minutes, parts merged) and runs ``--runs`` updates of each
reader, interleaved, at a fixed ``now`` (the newest scrape + 0.5 s, so a kept store measures the same):
``read_inputs`` then ``compute_weights`` carrying the engine state, as the feed does. Every update checks
that the readers give the same inputs and the same weights. Prints the median wall and CPU time
(the process's, chDB's threads included) of each, their ratios to the store reader, and each raw table's
floor: the time to read only the columns the raw scan needs over the look-back's rows, with no aggregation.
The newest-row tables are measured merged (``OPTIMIZE ... FINAL``, one row per key); ``--live N`` first
appends N more seconds of the fleet one second per insert and table (as the writer flushes) and measures
the tables as the background merges left them (each insert adds a row per key until parts merge).

    .venv/bin/python bench/weight_update.py [--scale 1 --days 0.01] [--path DIR] [--runs 7] [--json out.json]

Target: <= 100 ms read + compute over 1,000 backends. Wall times on a shared 2-core machine are
noisy: compare the ratios and the CPU times.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from typing import Any

import fleet_day
import fleet_day_data as data
import fleet_day_panels

from triscope.analyzers.routing import WeightParams, compute_weights, read_inputs
from triscope.analyzers.routing.store_inputs import read_inputs_scan
from triscope.schema import GPU_SAMPLES, REQUESTS, SERVING_METRICS, migrate, qualified
from triscope.schema.gpu import GPU_LATEST
from triscope.schema.requests import REQUESTS_LATEST, SCRAPES_LATEST, SERVING_LATEST
from triscope.store.embedded import EmbeddedStore
from triscope_bed.fleet import weight_inputs_scans as reference

READERS = {"reader": read_inputs, "scan": read_inputs_scan, "reference": reference.read_inputs}
LATEST = tuple(x.table for x in (GPU_LATEST, SERVING_LATEST, SCRAPES_LATEST, REQUESTS_LATEST))

FLOORS = {
    "gpu_samples": (GPU_SAMPLES, "count(), sum(memory_used_bytes), sum(memory_total_bytes), "
                                 "sum(length(gpu_uuid)), sum(length(state)), sum(gpu)", "ts <= {until}"),
    "requests": (REQUESTS, "count(), sum(latency_seconds), sum(length(backend)), sum(length(request_class)), "
                           "sum(length(host)), sum(length(gpu)), sum(status = 'error')", "1"),
    "serving_metrics": (SERVING_METRICS, "count(), sum(length(backend)), sum(kv_cache_usage_ratio), "
                        "sum(latency_p99_seconds), sum(requests_total), sum(sleep_state), sum(preemptions_total)",
                        "1"),
}
"""Per table: the columns the raw scan reads, summed over the rows since the look-back's start."""


def ensure_store(path: str, scale: float, days: float) -> tuple[EmbeddedStore, bool]:
    """The fleet-day store at ``path`` and whether it was built now (else it already held the fleet)."""
    store = EmbeddedStore(path, database="fleetday")
    migrate(store)
    built = int(store.query(f"SELECT count() FROM {qualified(store, SERVING_METRICS)}").scalar() or 0) == 0
    if built:
        f = fleet_day.fleet_of(scale, days, float(int(time.time()) - int(days * 86400)))
        print(f"building {f.backends} backends, {f.gpus} GPUs, {f.requests_per_s:g} spans/s, "
              f"{f.seconds / 60:g} min in {path}", flush=True)
        fleet_day.build(store, f)
        for table in fleet_day.TABLES + fleet_day.ROLLUPS:
            store.command(f"OPTIMIZE TABLE {qualified(store, table)} FINAL")
    return store, built


def update(read: Any, store: EmbeddedStore, params: WeightParams, state: Any, now: float
           ) -> tuple[float, float, Any, Any, list[Any]]:
    """(wall s, CPU s, result, state, inputs) of one read + compute."""
    t, c = time.perf_counter(), time.process_time()
    inputs = read(store, params, now)
    result, state = compute_weights(inputs, state, params, now)
    return time.perf_counter() - t, time.process_time() - c, result, state, inputs


def floors(store: EmbeddedStore, params: WeightParams, now: float, runs: int) -> dict[str, dict[str, float]]:
    """Median wall and CPU seconds to read the columns each table's query needs, per table."""
    p = {"since": int((now - params.lookback_s) * 1e9), "until": int(now * 1e9) + 1}
    out = {}
    for name, (table, cols, extra) in FLOORS.items():
        cond = extra.replace("{until}", "fromUnixTimestamp64Nano({until:Int64})")
        sql = (f"SELECT {cols} FROM {qualified(store, table)} "
               f"WHERE ts >= fromUnixTimestamp64Nano({{since:Int64}}) AND {cond}")
        wall, cpu = [], []
        for _ in range(runs):
            t, c = time.perf_counter(), time.process_time()
            store.query(sql, p)
            wall.append(time.perf_counter() - t)
            cpu.append(time.process_time() - c)
        out[name] = {"wall_s": statistics.median(wall), "cpu_s": statistics.median(cpu)}
    return out


def compare(store: EmbeddedStore, params: WeightParams, now: float, runs: int) -> dict[str, Any] | None:
    """Median wall and CPU seconds of each reader's update (interleaved), their ratios to the store
    reader's; None when any reader's inputs or weights differ from the reference's."""
    times: dict[str, dict[str, list[float]]] = {k: {"wall_s": [], "cpu_s": []} for k in READERS}
    states: dict[str, Any] = dict.fromkeys(READERS)
    for read in READERS.values():  # warm each: first queries load marks and columns
        update(read, store, params, None, now)
    backends = 0
    for _ in range(max(runs, 1)):
        got = {}
        for name, read in READERS.items():
            wall, cpu, result, states[name], inputs = update(read, store, params, states[name], now)
            times[name]["wall_s"].append(wall)
            times[name]["cpu_s"].append(cpu)
            got[name] = (repr(inputs), repr(result.to_dict()))
            backends = len(inputs)
        if len(set(got.values())) != 1:
            return None
    med = {name: {k: statistics.median(v) for k, v in t.items()} for name, t in times.items()}
    ratios = {f"{name} / reader": {k: med[name][k] / med["reader"][k] for k in ("wall_s", "cpu_s")}
              for name in READERS if name != "reader"}
    print(f"weight-engine update over {backends} backends (read + compute), median of {runs}:")
    for name in READERS:
        print(f"  {name:9s}  wall {med[name]['wall_s'] * 1e3:6.0f} ms  CPU {med[name]['cpu_s'] * 1e3:6.0f} ms")
    print("  " + "; ".join(f"{k}: wall {v['wall_s']:.2f}x, CPU {v['cpu_s']:.2f}x" for k, v in ratios.items())
          + "; inputs and weights identical in every run")
    return {"backends": backends, "median": med, "runs_s": times, "ratios": ratios}


def extra_bytes(store: EmbeddedStore) -> dict[str, int]:
    """Bytes on disk of the newest-row tables and of each projection, beside the raw tables'."""
    db = {"db": store.database}
    out = {str(t): int(b) for t, b in store.query(
        "SELECT table, sum(bytes_on_disk) FROM system.parts WHERE database = {db:String} AND active "
        "GROUP BY table", db).rows}
    for t, name, b in store.query(
            "SELECT table, name, sum(bytes_on_disk) FROM system.projection_parts "
            "WHERE database = {db:String} AND active GROUP BY table, name", db).rows:
        out[f"{t} projection {name}"] = int(b)
    return out


def newest_scrape(store: EmbeddedStore) -> float:
    """The time of the newest engine scrape in the store (epoch seconds)."""
    return int(store.query(f"SELECT toUnixTimestamp64Nano(max(ts)) FROM {qualified(store, SERVING_METRICS)}")
               .scalar()) / 1e9


def append(store: EmbeddedStore, scale: float, seconds: int) -> None:
    """``seconds`` more of the same fleet after the newest row, one insert per table and second."""
    f = fleet_day.fleet_of(scale, seconds / 86400, float(int(newest_scrape(store)) + 1))
    half = f.hosts // 2
    feeds = [(GPU_SAMPLES, data.gpu_chunks(f, 10, "nvml", range(0, half), 1)),
             (GPU_SAMPLES, data.gpu_chunks(f, 1, "dcgm", range(half, f.hosts), 1)),
             (SERVING_METRICS, data.serving_chunks(f, 1)), (REQUESTS, data.request_chunks(f, 1))]
    for _ in range(seconds):
        for table, chunks in feeds:
            batch = next(chunks, None)
            if batch is not None:
                store.insert(qualified(store, table), batch)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scale", type=float, default=1.0, help="fraction of the 1,000-GPU fleet (default 1)")
    ap.add_argument("--days", type=float, default=0.01, help="days of data (default 0.01: 14 minutes)")
    ap.add_argument("--path", default="", help="store directory, kept (default: a fresh one, removed after)")
    ap.add_argument("--runs", type=int, default=7, help="updates per reader (default 7)")
    ap.add_argument("--live", type=int, default=0, metavar="N",
                    help="append N seconds one second per insert and measure before merging the newest-row tables")
    ap.add_argument("--json", default="", help="write the figures here")
    args = ap.parse_args(argv)
    path = args.path or f"/tmp/triscope-weightupdate-{os.getpid()}"
    store, built = ensure_store(path, args.scale, args.days)
    try:
        params = WeightParams.from_config({})
        out: dict[str, Any] = {"runs": args.runs}
        if args.live:
            append(store, args.scale, args.live)
            out["latest_unmerged"] = {t.name: store.query(
                "SELECT count(), sum(rows) FROM system.parts WHERE database = {db:String} AND table = {t:String} "
                "AND active", {"db": store.database, "t": t.name}).rows[0] for t in LATEST}
            print(f"newest-row tables after {args.live} s of 1 s inserts, (parts, rows): {out['latest_unmerged']}")
            out["unmerged"] = compare(store, params, newest_scrape(store) + 0.5, args.runs)
            if out["unmerged"] is None:
                print("the readers disagree: inputs or weights differ", file=sys.stderr)
                return 1
        now = out["now"] = newest_scrape(store) + 0.5
        for t in LATEST:
            store.command(f"OPTIMIZE TABLE {qualified(store, t)} FINAL")
        got = compare(store, params, now, args.runs)
        if got is None:
            print("the readers disagree: inputs or weights differ", file=sys.stderr)
            return 1
        out.update(got, equal=True, floor_s=floors(store, params, now, max(args.runs, 1)), bytes=extra_bytes(store))
        print("  the raw scan's floor (reading only the columns it needs, no aggregation), CPU: "
              + ", ".join(f"{k} {v['cpu_s'] * 1e3:.0f} ms" for k, v in out["floor_s"].items()))
        if built:  # the rows are as fresh as the build: `weights show` (now = the clock) sees the fleet
            out["weights_show"] = fleet_day_panels.cli(path, store.database, ["weights", "show"], args.runs)
        if args.json:
            with open(args.json, "w") as fh:
                json.dump(out, fh, indent=1)
    finally:
        store.close()
        if not args.path:
            shutil.rmtree(path, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
