"""What the newest-row tables and the last hours by time (materialized views, no projection left) cost the
writer: the same batches of the fleet-day generator inserted into two databases of one store, one with
the six views and one without them (dropped after migrating), alternating, CPU time per insert summed.
Two batch shapes: one second of rows per insert (the writer's flush at the fleet's rate) and the fleet-day
build's 200,000-row batches.

    PYTHONPATH=bench .venv/bin/python bench/results/2026-12-07-weight-update-recent-ingest.py [SECONDS] [JSON]
"""

import json
import shutil
import sys
import time

import fleet_day
import fleet_day_data as data

from triscope.schema import GPU_SAMPLES, REQUESTS, SERVING_METRICS, migrate, qualified
from triscope.store.embedded import EmbeddedStore

SECONDS = int(sys.argv[1]) if len(sys.argv) > 1 else 120
PATH = "/tmp/triscope-recent-ingest"
shutil.rmtree(PATH, ignore_errors=True)
stores = {name: EmbeddedStore(PATH, database=f"ing_{name}") for name in ("with", "without")}
for s in stores.values():
    migrate(s)
bare = stores["without"]
for view in ("gpu_samples_latest_mv", "serving_metrics_latest_mv", "scrape_health_latest_mv", "requests_latest_mv",
             "serving_metrics_recent_mv", "requests_recent_mv"):
    bare.command(f"DROP VIEW {bare.database}.{view}")
for s in stores.values():  # neither holds a projection any more
    assert "PROJECTION" not in s.query(f"SHOW CREATE TABLE {qualified(s, SERVING_METRICS)}").rows[0][0]

f = fleet_day.fleet_of(1.0, SECONDS / 86400, float(int(time.time()) - SECONDS))
half = f.hosts // 2
out: dict = {"seconds": SECONDS, "backends": f.backends, "gpus": f.gpus, "spans_per_s": f.requests_per_s}
for shape, chunk in (("1 s per insert", lambda rows_per_s: 1),
                     ("200,000 rows per insert", lambda rows_per_s: max(1, 200_000 // int(rows_per_s)))):
    for table, chunks in ((GPU_SAMPLES, lambda c: data.gpu_chunks(f, 10, "nvml", range(0, half), c(half * 80))),
                          (SERVING_METRICS, lambda c: data.serving_chunks(f, c(f.backends))),
                          (REQUESTS, lambda c: data.request_chunks(f, c(f.requests_per_s)))):
        cpu = {"with": 0.0, "without": 0.0}
        rows = inserts = 0
        for i, batch in enumerate(chunks(chunk)):
            order = ("with", "without") if i % 2 else ("without", "with")
            for name in order:
                t = time.process_time()
                n = stores[name].insert(qualified(stores[name], table), batch)
                cpu[name] += time.process_time() - t
            rows += n
            inserts += 1
        out.setdefault(shape, {})[table.name] = {
            "rows": rows, "inserts": inserts, "cpu_s": cpu, "ratio": cpu["with"] / cpu["without"],
            "rows_per_cpu_s": {k: rows / v for k, v in cpu.items()}}
        print(f"{shape:24s} {table.name:16s} {rows:>9,d} rows in {inserts:4d} inserts: CPU with "
              f"{cpu['with']:.2f} s, without {cpu['without']:.2f} s ({cpu['with'] / cpu['without']:.2f}x)", flush=True)
for s in stores.values():
    s.close()
shutil.rmtree(PATH, ignore_errors=True)
if len(sys.argv) > 2:
    with open(sys.argv[2], "w") as fh:
        json.dump(out, fh, indent=1)
