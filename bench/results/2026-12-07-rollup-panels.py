"""The fleet board's gauge panels over the last 24 h of a kept fleet-day store, at a 60 s interval (the
1 min rollup) against 59 s (raw rows: 59 is no multiple of a bucket), interleaved, same store, same run.

    cd bench && ../.venv/bin/python fleet_day.py --scale 0.1 --days 0.25 --panels 0 --cli-runs 0 --path /tmp/fd-keep
    cd .. && .venv/bin/python bench/results/2026-12-07-rollup-panels.py /tmp/fd-keep
"""

import statistics
import sys
import time
from datetime import UTC, datetime, timedelta

from triscope.dashboards.boards import all_boards
from triscope.dashboards.macros import ALL, Context, Var, expand
from triscope.store.embedded import EmbeddedStore

TITLES = ["GPU memory used", "GPU memory used / total", "KV-cache usage per backend", "Queue length per backend"]

store = EmbeddedStore(sys.argv[1] if len(sys.argv) > 1 else "/tmp/fd-keep", database="fleetday")
newest = store.query("SELECT toUnixTimestamp(max(ts)) FROM fleetday.gpu_samples").rows[0][0]
end = datetime.fromtimestamp(float(newest), UTC)
board = all_boards()["fleet"]
variables = {v["name"]: (Var("fleetday", ["fleetday"], multi=False) if v["type"] == "textbox"
                         else Var([ALL], ["__none__"])) for v in board["templating"]["list"]}
for title in TITLES:
    (target,) = [tg for p in board["panels"] if p["title"] == title for tg in p["targets"]]
    spent: dict[int, list[float]] = {60: [], 59: []}
    rows = {}
    for _ in range(5):
        for interval in (60, 59):
            ctx = Context(end - timedelta(hours=24), end, interval_s=interval, variables=variables)
            sql = expand(target["rawSql"], ctx)
            t = time.perf_counter()
            res = store.query(sql)
            spent[interval].append(time.perf_counter() - t)
            rows[interval] = len(res.rows)
    a, b = statistics.median(spent[60]), statistics.median(spent[59])
    print(f"{title:28s} rollup (60 s) {a * 1e3:7.1f} ms  raw (59 s) {b * 1e3:7.1f} ms  "
          f"raw/rollup {b / a:5.1f}x  rows {rows[60]} / {rows[59]}")
store.close()
