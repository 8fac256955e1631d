"""KV-usage forecasters (analyzers/routing/forecast.py) and the held-data check of bench/kv_forecast.py."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO

from triscope.analyzers.routing.forecast import LastValue, LinearTrend


def test_linear_trend_extends_a_ramp_and_clips_to_a_ratio() -> None:
    trend, last = LinearTrend(window_s=1.0, max_horizon_s=2.0), LastValue()
    assert math.isnan(trend.predict(0)) and math.isnan(last.predict(0))
    for i in range(9):  # +0.1 per second, a scrape every 0.25 s
        t = i * 0.25
        trend.observe(t, 0.5 + 0.1 * t)
        last.observe(t, 0.5 + 0.1 * t)
    assert trend.predict(3.0) == pytest.approx(0.8)  # 2.0 + 1 s ahead
    assert trend.predict(10.0) == pytest.approx(0.9)  # at most max_horizon_s ahead
    assert last.predict(3.0) == pytest.approx(0.7)
    assert len(trend.samples) == 5  # only the last window_s
    steep = LinearTrend(window_s=1.0)
    for i in range(5):
        steep.observe(i * 0.25, 0.8 + 0.2 * i)
    assert steep.predict(2.0) == 1.0  # a usage ratio never forecasts past full
    half = LinearTrend(window_s=1.0, damping=0.5)
    for i in range(5):
        half.observe(i * 0.25, 0.1 * i)
    assert half.predict(2.0) == pytest.approx(0.4 + 0.5 * 0.4 * 1.0)


def test_bench_compares_with_last_value_on_the_held_half(tmp_path: Path) -> None:
    """On a series that keeps rising, the trend wins the held half (ratio < 1); the bench says which
    settings the first half chose."""
    csv = tmp_path / "series.csv"
    rows = ["fleet,policy,backend,t_s,kv_usage,running,waiting"]
    for i in range(400):
        t = i * 0.25
        rows.append(f"vllm,p,b0,{t},{min(1.0, 0.002 * i)},1,0")
    csv.write_text("\n".join(rows) + "\n")
    res = subprocess.run([sys.executable, str(REPO / "bench" / "kv_forecast.py"), str(csv), "--json"],
                         capture_output=True, text=True, cwd=REPO, timeout=120)
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    assert doc["series"] == 1 and doc["scrapes"] == 400
    one = doc["horizons"]["1.0"]
    assert one["ratio"] < 0.2 and one["last_value_mae"] == pytest.approx(0.008, rel=0.05)
