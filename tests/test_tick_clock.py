"""Sample timestamps snapped to the sampler's tick grid (Prometheus' scrape timestamp alignment)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from scrape_helpers import Route, raw_server
from test_serving_metrics_faults import VLLM

from triscope import tick_clock
from triscope.collectors.serving_metrics import ServingMetricsScraper
from triscope.schema import SCRAPE_HEALTH, SERVING_METRICS, encode_ts
from triscope.tick_clock import snap_series, tolerance_ns

MS = 1_000_000
REPO = Path(__file__).resolve().parents[1]


def test_tolerance_is_one_percent_of_the_period_at_most_2_ms() -> None:
    assert tolerance_ns(100 * MS) == 1 * MS
    assert tolerance_ns(1000 * MS) == 2 * MS
    assert tolerance_ns(15_000 * MS) == 2 * MS


def test_jittered_stamps_land_on_the_grid_and_a_late_one_starts_a_new_grid() -> None:
    t0 = 1_765_000_000 * 10**9 + 123_456_789
    raw = [t0, t0 + 100 * MS + 300_000, t0 + 200 * MS - 400_000, t0 + 300 * MS + 5 * MS, t0 + 400 * MS + 5 * MS + 1000]
    out = snap_series(raw, 0.1)
    assert out[:3] == [t0, t0 + 100 * MS, t0 + 200 * MS]
    assert out[3] == raw[3]  # 5 ms late at 10 Hz: beyond 1 ms, kept as measured
    assert out[4] == raw[3] + 100 * MS  # the next tick continues from the new grid
    assert all(abs(a - b) <= tolerance_ns(100 * MS) for a, b in zip(out, raw, strict=True))
    assert out == sorted(out)


def test_a_missed_tick_keeps_the_grid() -> None:
    t0 = 10**18
    out = snap_series([t0, t0 + 2000 * MS + 500_000, t0 + 3000 * MS - 700_000], 1.0)
    assert out == [t0, t0 + 2000 * MS, t0 + 3000 * MS]


def test_a_clock_stepping_back_is_kept_as_measured() -> None:
    t0 = 10**18
    assert snap_series([t0, t0 - 5 * MS, t0 + 995 * MS + 100], 1.0) == [t0, t0 - 5 * MS, t0 + 995 * MS]


def test_a_real_scrape_writes_its_tick_clocks_stamps(monkeypatch: pytest.MonkeyPatch) -> None:
    """serving_metrics against a real HTTP target (the vLLM V1 page of the faults test): its rows carry
    the tick clock's stamps. The wall clock is replaced by wake-ups with known jitter so the check does
    not depend on this machine's scheduler; the snapping itself is tested above."""
    t0 = 1_765_000_000 * 10**9
    jitter_us = [0, 310, -120, 880, 40, 3500, 20]
    wakeups = iter(t0 + i * 200 * MS + j * 1000 for i, j in enumerate(jitter_us))
    monkeypatch.setattr(tick_clock, "time", SimpleNamespace(time_ns=lambda: next(wakeups)))
    with raw_server({"/metrics": Route(body=VLLM.encode())}) as server:
        scraper = ServingMetricsScraper({"serving_metrics": {"targets": [server.url("/metrics")],
                                                             "interval_s": 0.2}})
        try:
            stamps = [scraper.collect() for _ in jitter_us]
        finally:
            scraper.close()
    got = [(out[SCRAPE_HEALTH]["ts"][0], out[SERVING_METRICS]["ts"][0]) for out in stamps]
    expected = snap_series([t0 + i * 200 * MS + j * 1000 for i, j in enumerate(jitter_us)], 0.2)
    assert [g[0] for g in got] == [g[1] for g in got] == [encode_ts(ns) for ns in expected]
    assert expected[4] == t0 + 4 * 200 * MS and expected[5] == t0 + 5 * 200 * MS + 3_500_000


def test_the_fleet_day_bench_stamps_as_the_collectors_do(monkeypatch: pytest.MonkeyPatch) -> None:
    """bench/fleet_day.py's vectorised snapping equals TickClock's, across chunk boundaries, so its
    byte counts are those of what the collectors write."""
    spec = importlib.util.spec_from_file_location("fleet_day_data", REPO / "bench" / "fleet_day_data.py")
    assert spec and spec.loader
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, bench)  # its dataclasses look their module up
    spec.loader.exec_module(bench)
    rng = np.random.default_rng(3)
    raw = 10**18 + np.arange(60)[:, None] * 100 * MS + np.rint(rng.normal(0, 600e3, (60, 4))).astype(np.int64)
    last = np.zeros(4, dtype=np.int64)
    got = np.vstack([bench.snap_grid(raw[:25], 0.1, last), bench.snap_grid(raw[25:], 0.1, last)])
    for j in range(4):
        assert got[:, j].tolist() == snap_series(raw[:, j].tolist(), 0.1)
    assert 0 < (got == raw).mean() < 1  # some stamps moved, some (beyond 1 ms) kept
