"""The stalls board at every interval: windows of 100 ms up to a 1 s interval, of the interval rounded up to
a multiple of 10 s beyond, their GPU means from the 10 s or 1 min rollup. Checked against shares computed here from the
inserted rows at the same window width, then with the raw GPU rows emptied (only a rollup can answer).
SYNTHETIC rows in the collectors' shapes."""

from __future__ import annotations

import math
from collections import defaultdict
from datetime import UTC, datetime
from typing import Any

import numpy as np
import pytest
from conftest import fresh_database

from triscope.analyzers.stalls import StallsConfig
from triscope.dashboards.boards import all_boards
from triscope.dashboards.macros import ALL, Context, Var, expand
from triscope.schema import GPU_SAMPLES, IO_LATENCY, encode_ts, qualified

T0_S = 1_767_225_600  # 2026-01-01 00:00:00 UTC, minute-aligned
SECONDS = 6 * 60
GPUS = (("h1", 0), ("h1", 1), ("h2", 0))
C = StallsConfig()
BUSY = {("h1", 0): lambda s: (s // 15) % 2 == 0, ("h1", 1): lambda s: not 100 <= s < 170,
        ("h2", 0): lambda s: (s // 45) % 2 == 0}
"""When each GPU's SM activity sits mostly above 95% (by second): phases that whole minutes hold or cut."""


def _rows(rng: np.random.Generator) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """10 Hz GPU samples whose SM activity sits near the compute threshold (so window means cross it) and
    whose L2 bandwidth is sometimes unmeasured; per host one 1 s IO window per second, bound in runs."""
    gpu, io = [], []
    for k in range(SECONDS * 10):
        ns = T0_S * 10**9 + k * 100_000_000 + 3_000_000
        for host, index in GPUS:
            busy = BUSY[(host, index)](k // 10)
            sm = rng.uniform(0.94, 1.0) if busy else rng.uniform(0.5, 0.97)
            gpu.append({"ns": ns, "ts": encode_ts(ns), "host": host, "gpu": index, "source": "nvml",
                        "sm_active_ratio": float(np.float32(sm)),
                        "dram_active_ratio": float(np.float32(rng.uniform(0.1, 0.65))),
                        "l2_bandwidth_ratio": math.nan if k % 7 == 0 else float(np.float32(rng.uniform(0.1, 0.7)))})
    for s in range(SECONDS):
        for host in ("h1", "h2"):
            bound = (s // 20) % 3 == (0 if host == "h1" else 1)
            ns = (T0_S + s) * 10**9
            io.append({"ns": ns, "ts": encode_ts(ns), "host": host, "device": "nvme0n1", "source": "bpftrace",
                       "op": "read", "window_seconds": 1.0, "ios": 100.0,
                       "p99_seconds": 0.002 if bound else 0.0005, "queue_depth": 80.0 if bound else 4.0})
    return gpu, io


def _stored(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in r.items() if k != "ns"} for r in rows]


def _window_ns(interval: int) -> int:
    """100 ms up to a 1 s interval, else the interval rounded up to a multiple of 10 s."""
    return -(-interval // 10) * 10 * 10**9 if interval > 1 else 100_000_000


def _expected(gpu: list[dict[str, Any]], io: list[dict[str, Any]], interval: int) -> dict[tuple[str, str], tuple]:
    """(compute-bound share, IO-bound share) per (host, gpu): the rules on each window's means."""
    wns = _window_ns(interval)
    sums: dict[tuple, list[list[float]]] = defaultdict(lambda: [[], [], []])
    for r in gpu:
        acc = sums[(r["host"], str(r["gpu"]), r["ns"] // wns)]
        for i, g in enumerate(("sm_active_ratio", "dram_active_ratio", "l2_bandwidth_ratio")):
            if math.isfinite(r[g]):
                acc[i].append(r[g])
    io_bound: dict[tuple[str, int], bool] = {}
    for r in io:
        t0 = r["ns"]
        bound = r["p99_seconds"] > C.io_read_p99_min_seconds and r["queue_depth"] > C.io_queue_depth_min
        for w in range(t0 // wns, (t0 + 10**9 - 1) // wns + 1):
            io_bound[(r["host"], w)] = io_bound.get((r["host"], w), False) or bound
    per_gpu: dict[tuple[str, str], list[tuple[bool, bool]]] = defaultdict(list)
    for (host, index, w), (sm, dram, l2) in sums.items():
        mean = [float(np.mean(v)) if v else math.nan for v in (sm, dram, l2)]
        compute = (math.isfinite(mean[0]) and mean[0] > C.compute_sm_active_min
                   and all(not math.isfinite(m) or m < C.compute_bandwidth_max for m in mean[1:]))
        per_gpu[(host, index)].append((compute, io_bound[(host, w)]))
    return {k: (float(np.mean([c for c, _ in v])), float(np.mean([i for _, i in v]))) for k, v in per_gpu.items()}


def _panel(store, title: str, interval: int) -> list[dict[str, Any]]:
    board = all_boards()["stalls"]
    (target,) = [tg for p in board["panels"] if p["title"] == title for tg in p["targets"]]
    variables = {"database": Var(store.database, [store.database], multi=False),
                 "host": Var([ALL], ["h1", "h2"]), "gpu": Var([ALL], ["0", "1"])}
    ctx = Context(datetime.fromtimestamp(T0_S, UTC), datetime.fromtimestamp(T0_S + SECONDS, UTC),
                  interval_s=interval, variables=variables)
    return store.query(expand(target["rawSql"], ctx)).dicts()


def _shares(store, interval: int) -> dict[tuple[str, str], tuple]:
    return {(r["host"], r["gpu"]): (r["compute_bound_share"], r["io_bound_share"])
            for r in _panel(store, "GPUs by stall share", interval)}


def test_stall_shares_equal_the_rules_on_each_window_at_every_interval(store_path) -> None:
    """1 s: 100 ms windows of raw rows; 5 s, 15 s, 30 s: 10, 20 and 30 s windows of the 10 s rollup; 60 s
    and 120 s: the 1 min one. Per GPU and over the range (the bar gauge)."""
    gpu, io = _rows(np.random.default_rng(11))
    with fresh_database(store_path, "stallwin") as store:
        store.insert(qualified(store, GPU_SAMPLES), GPU_SAMPLES.columns_of(_stored(gpu)))
        store.insert(qualified(store, IO_LATENCY), IO_LATENCY.columns_of(_stored(io)))
        for interval in (1, 5, 15, 30, 60, 120):
            want = _expected(gpu, io, interval)
            got = _shares(store, interval)
            assert got.keys() == want.keys()
            for key, (compute, io_share) in want.items():
                assert got[key] == pytest.approx((compute, io_share), abs=1e-12), (interval, key)
            assert len({c for c, _ in want.values()}) > 1 and max(i for _, i in want.values()) > 0
            gauge = {r["signal"]: r["share"] for r in _panel(store, "Stall shares over the range", interval)}
            assert gauge["compute"] == pytest.approx(sum(c for c, _ in want.values()) / len(want), abs=1e-12)
            assert gauge["io"] == pytest.approx(sum(i for _, i in want.values()) / len(want), abs=1e-12)
        # with the raw GPU rows gone, the coarse windows still answer the same; the fine ones have nothing
        before = {i: _shares(store, i) for i in (5, 15, 60, 120)}
        store.command(f"TRUNCATE TABLE {qualified(store, GPU_SAMPLES)}")
        for interval, shares in before.items():
            assert _shares(store, interval) == shares
        assert _shares(store, 1) == {}
