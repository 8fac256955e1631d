"""Readers over the fleet-day store: every board panel's own SQL, diagnose, heatmap, a weight-engine update.

Panels: each board's variables are resolved by their own queries (All selected, as a board opens),
each panel's SQL is expanded by the Grafana/plugin macros for the last 1 h and the last 24 h (the
interval Grafana would pick for ~1,000 points), and run ``runs`` times; the median and the worst
median are reported. The weight-engine update is the feed's step: ``read_inputs`` over the store
plus ``compute_weights`` for every backend. ``diagnose --since 1h`` and ``heatmap --since 1h`` run
as the CLI's entry point in this process.
"""

from __future__ import annotations

import contextlib
import io
import os
import statistics
import time
from datetime import UTC, datetime, timedelta
from typing import Any

from triscope.analyzers.routing import WeightParams, read_inputs
from triscope.analyzers.routing.scoring import compute_weights
from triscope.dashboards.boards import all_boards
from triscope.dashboards.macros import ALL, Context, Var, expand
from triscope.store.base import Store

RANGES = {"1h": 3600, "24h": 86400}


def interval_for(range_s: int) -> float:
    """Grafana's interval for about 1,000 points, rounded to its steps."""
    for step in (1, 2, 5, 10, 15, 20, 30, 60, 120, 300, 600):
        if range_s / step <= 1500:
            return float(step)
    return 3600.0


def resolve_variables(store: Store, board: dict[str, Any], ctx: Context) -> dict[str, Var]:
    state: dict[str, Var] = {}
    for v in board["templating"]["list"]:
        if v["type"] == "textbox":
            state[v["name"]] = Var(store.database, [store.database], multi=False)
            continue
        ctx.variables = state
        options = [str(r[0]) for r in store.query(expand(v["query"]["rawSql"], ctx)).rows] or ["__none__"]
        state[v["name"]] = Var([ALL], options, multi=v.get("multi", True))
    return state


def panels(store: Store, runs: int) -> dict[str, Any]:
    """``{range: {"board/panel/ref": median seconds}}`` plus the summary per range."""
    end = datetime.now(UTC)
    out: dict[str, Any] = {}
    for label, range_s in RANGES.items():
        ctx = Context(end - timedelta(seconds=range_s), end, interval_s=interval_for(range_s))
        times: dict[str, float] = {}
        for name, board in all_boards().items():
            ctx.variables = resolve_variables(store, board, ctx)
            for panel in board["panels"]:
                for target in panel.get("targets", []):
                    if "rawSql" not in target:
                        continue
                    sql = expand(target["rawSql"], ctx)
                    spent = []
                    for _ in range(runs):
                        t = time.perf_counter()
                        store.query(sql)
                        spent.append(time.perf_counter() - t)
                    times[f"{name}/{panel['title']}/{target['refId']}"] = statistics.median(spent)
        worst = sorted(times.items(), key=lambda kv: -kv[1])
        out[label] = {"panels": times, "count": len(times), "median_s": statistics.median(times.values()),
                      "worst": worst[:5]}
        print(f"\npanels, last {label}: {len(times)} queries, median of medians {out[label]['median_s'] * 1e3:.0f} ms,"
              f" worst {worst[0][1] * 1e3:.0f} ms ({worst[0][0]})", flush=True)
        for key, s in worst[:5]:
            print(f"    {s * 1e3:8.0f} ms  {key}")
    return out


def weight_update(store: Store, runs: int) -> dict[str, Any]:
    """One engine update (read the inputs, compute every backend's weight), ``runs`` times."""
    params = WeightParams.from_config({})
    spent, n, state = [], 0, None
    for _ in range(max(runs, 1)):
        t = time.perf_counter()
        inputs = read_inputs(store, params, time.time())
        result, state = compute_weights(inputs, state, params, time.time())
        spent.append(time.perf_counter() - t)
        n = len(inputs)
    print(f"\nweight-engine update over {n} backends: median {statistics.median(spent) * 1e3:.0f} ms", flush=True)
    return {"backends": n, "median_s": statistics.median(spent), "runs_s": spent}


def cli(path: str, database: str, args: list[str], runs: int) -> dict[str, Any]:
    """``triscope ARGS --json`` against the store, run in this process (chDB holds a data path per
    process) with its output discarded; wall seconds per run, the store's opening and migration check
    included."""
    from triscope.cli import main

    os.environ.update(TRISCOPE_STORE__PATH=path, TRISCOPE_STORE__DATABASE=database)
    spent, codes = [], []
    for _ in range(max(runs, 1)):
        t = time.perf_counter()
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()) as err:
            codes.append(main([*args, "--json"]))
        spent.append(time.perf_counter() - t)
    if any(c not in (0, 1) for c in codes):
        print(f"triscope {' '.join(args)}: exit {codes}: {err.getvalue().strip()[-300:]}", flush=True)
    print(f"triscope {' '.join(args)}: median {statistics.median(spent):.2f} s", flush=True)
    return {"median_s": statistics.median(spent), "runs_s": spent, "exit": codes}
