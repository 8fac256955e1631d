"""Does a KV-usage trend forecaster beat "last value" on held recordings of real engines?

    .venv/bin/python bench/testbed.py --fleet vllm --workload azure --record-metrics var/kv-series.csv ...
    .venv/bin/python bench/kv_forecast.py var/kv-series.csv [--horizons 0.25,0.5,1.0] [--json]

Each (fleet, policy, backend) series of ``--record-metrics`` (KV usage scraped every 250 ms) is split in
time: its first half chooses each forecaster's settings (the window and damping of
:class:`~triscope.analyzers.routing.forecast.LinearTrend` with the least error there), its second half,
held out, measures them. A forecast made at a scrape for ``h`` seconds ahead is compared with the
scrape nearest to that time (within half a period). Printed: the mean absolute error per horizon and
its ratio to last value's, in the same run (< 1: the forecaster is better).
"""

from __future__ import annotations

import argparse
import bisect
import csv
import itertools
import json
import math
import sys
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

from triscope.analyzers.routing.forecast import Forecaster, LastValue, LinearTrend

Series = list[tuple[float, float]]
WINDOWS = (0.75, 1.5, 3.0)
DAMPINGS = (0.25, 0.5, 1.0)


def load(path: Path) -> dict[tuple[str, str, str], Series]:
    series: dict[tuple[str, str, str], Series] = defaultdict(list)
    with open(path, newline="") as fh:
        for row in csv.DictReader(fh):
            value = float(row["kv_usage"])
            if math.isfinite(value):
                series[(row["fleet"], row["policy"], row["backend"])].append((float(row["t_s"]), value))
    return {k: sorted(v) for k, v in series.items() if len(v) >= 40}


def errors(series: Series, make: Callable[[], Forecaster], horizon: float, tolerance: float) -> list[float]:
    """|forecast - actual| of every forecast whose target time has a scrape within ``tolerance``."""
    times = [t for t, _ in series]
    forecaster, out = make(), []
    for t, value in series:
        forecaster.observe(t, value)
        i = bisect.bisect_left(times, t + horizon - tolerance)
        if i < len(times) and abs(times[i] - (t + horizon)) <= tolerance:
            predicted = forecaster.predict(t + horizon)
            if math.isfinite(predicted):
                out.append(abs(predicted - series[i][1]))
    return out


def mae(all_series: list[Series], make: Callable[[], Forecaster], horizon: float, tolerance: float) -> float:
    errs = [e for s in all_series for e in errors(s, make, horizon, tolerance)]
    return sum(errs) / len(errs) if errs else math.nan


def split(series: Series) -> tuple[Series, Series]:
    middle = series[0][0] + (series[-1][0] - series[0][0]) / 2
    return [p for p in series if p[0] < middle], [p for p in series if p[0] >= middle]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("csv", type=Path)
    parser.add_argument("--horizons", default="0.25,0.5,1.0")
    parser.add_argument("--period-s", type=float, default=0.25, help="the recording's scrape period")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    series = load(args.csv)
    if not series:
        raise SystemExit(f"{args.csv}: no series of 40+ scrapes")
    train = [split(s)[0] for s in series.values()]
    held = [split(s)[1] for s in series.values()]
    tol = args.period_s / 2
    report = {"series": len(series), "scrapes": sum(len(s) for s in series.values()), "horizons": {}}
    for h in (float(x) for x in args.horizons.split(",")):
        best = min(itertools.product(WINDOWS, DAMPINGS),
                   key=lambda wd: mae(train, lambda wd=wd: LinearTrend(wd[0], wd[1]), h, tol))
        base = mae(held, LastValue, h, tol)
        trend = mae(held, lambda best=best: LinearTrend(best[0], best[1]), h, tol)
        report["horizons"][h] = {"last_value_mae": base, "trend_mae": trend, "trend_window_s": best[0],
                                 "trend_damping": best[1], "ratio": trend / base if base > 0 else math.nan}
    if args.json:
        json.dump(report, sys.stdout, indent=2)
        print()
        return 0
    print(f"{report['series']} series, {report['scrapes']} scrapes; settings chosen on the first half of each, "
          "errors on the second (held)")
    print(f"{'horizon s':>9}  {'last value MAE':>14}  {'trend MAE':>9}  {'trend / last':>12}  window s  damping")
    for h, r in report["horizons"].items():
        print(f"{h:>9.2f}  {r['last_value_mae']:>14.4f}  {r['trend_mae']:>9.4f}  {r['ratio']:>12.3f}  "
              f"{r['trend_window_s']:>8}  {r['trend_damping']:>7}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
