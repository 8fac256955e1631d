"""The heatmap board over a wide range: windows of the panel's interval rounded up to a multiple of 10 s,
GPU memory from the 10 s / 1 min rollup. Each slice equals ``triscope heatmap``'s tensor computed with
that window (``window_ms``) from the raw rows; with the raw rows' GPU memory gone the board answers the
same (only a rollup can). SYNTHETIC rows in the collectors' and the OTLP receiver's shapes."""

from __future__ import annotations

import dataclasses
import math
from datetime import UTC, datetime
from typing import Any

import numpy as np
from conftest import fresh_database

from triscope.analyzers.heatmap import HeatmapSpec, compute_heatmap
from triscope.dashboards.boards import all_boards
from triscope.dashboards.heatmap import slice_sql
from triscope.dashboards.macros import ALL, Context, Var, expand
from triscope.schema import GPU_SAMPLES, REQUESTS, encode_ts, qualified

T0_S = 1_767_225_600  # 2026-01-01 00:00:00 UTC, minute-aligned
SECONDS = 300
BACKENDS = {"h1:8000": ("h1", "0"), "h1:8001": ("h1", "GPU-h1-1"), "h2:8000": ("h2", "")}
GPUS = (("h1", 0, "GPU-h1-0"), ("h1", 1, "GPU-h1-1"), ("h2", 0, "GPU-h2-0"), ("h2", 1, "GPU-h2-1"))


def _rows(rng: np.random.Generator) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Request rates that move between 0 and 40/s per backend (several QPS bins at 10-60 s windows), GPU
    memory that drifts over minutes (several memory bins), h2's GPU 1 silent in some 20 s stretches."""
    requests = []
    for backend, (host, gpu) in BACKENDS.items():
        for s in range(1, SECONDS - 1):
            rate = 20 + 20 * math.sin(s / 23 + len(backend))
            for _ in range(int(rng.poisson(rate))):
                ns = (T0_S + s) * 10**9 + int(rng.integers(0, 10**9))
                requests.append({"ts": encode_ts(ns), "host": host, "backend": backend, "gpu": gpu, "model": "m",
                                 "modality": "text", "request_class": "interactive_text",
                                 "latency_seconds": float(rng.exponential(0.3)) if rng.random() > 0.02 else math.nan})
    gpus = []
    for k in range(-50, SECONDS * 5):
        for host, index, uuid in GPUS:
            if host == "h2" and index == 1 and (k // 100) % 3 == 1:
                continue
            base = 4e9 + 3e9 * math.sin(k / 400 + index) + (2e9 if host == "h2" else 0)
            gpus.append({"ts": encode_ts(T0_S * 10**9 + k * 200_000_000 + 7_000_000), "host": host, "gpu": index,
                         "gpu_uuid": uuid, "source": "nvml", "memory_used_bytes": base + float(rng.uniform(0, 4e8)),
                         "memory_total_bytes": 16e9})
    return requests, gpus


def _board_slice(store, x: str, y: str, interval: int, shape: tuple[int, int], spec: HeatmapSpec) -> np.ndarray:
    board = all_boards()["heatmap"]
    variables = {v["name"]: Var([ALL], ["__none__"]) for v in board["templating"]["list"]}
    variables.update(database=Var(store.database, [store.database], multi=False),
                     host=Var([ALL], ["h1", "h2"]), backend=Var([ALL], list(BACKENDS)))
    ctx = Context(datetime.fromtimestamp(T0_S, UTC), datetime.fromtimestamp(T0_S + SECONDS, UTC),
                  interval_s=interval, variables=variables)
    widths = {"qps": spec.qps_bin, "memory": spec.memory_bin_bytes, "latency": spec.latency_bin_s}
    got = np.zeros(shape, dtype=np.uint64)
    for xv, yv, n in store.query(expand(slice_sql(x, y), ctx)).rows:
        got[int(round(xv / widths[x])), int(round(yv / widths[y]))] += n or 0
    return got


def test_heatmap_slices_equal_the_analyzer_with_the_board_window(store_path) -> None:
    requests, gpus = _rows(np.random.default_rng(4))
    with fresh_database(store_path, "heatwin") as store:
        store.insert(qualified(store, REQUESTS), REQUESTS.columns_of(requests))
        store.insert(qualified(store, GPU_SAMPLES), GPU_SAMPLES.columns_of(gpus))
        slices = (("qps", "latency"), ("memory", "latency"), ("qps", "memory"))
        answers = {}
        for interval, window_s in ((5, 10), (15, 20), (60, 60)):
            spec = dataclasses.replace(HeatmapSpec(), window_ms=window_s * 1000.0)
            want = compute_heatmap(store, spec, T0_S * 10**9, (T0_S + SECONDS) * 10**9 + 1)
            assert want.requests > 10_000
            for x, y in slices:
                ref = want.slice((x, y))
                assert np.count_nonzero(ref.sum(axis=1)) >= 3, (interval, x, y)  # several bins on each axis
                got = _board_slice(store, x, y, interval, ref.shape, spec)
                np.testing.assert_array_equal(got, ref, err_msg=f"{interval} s: {x} x {y}")
                answers[(interval, x, y)] = got
        # the raw rows' memory gone (their uuids stay: requests name a GPU by uuid), the rollups answer alone
        store.command(f"ALTER TABLE {qualified(store, GPU_SAMPLES)} UPDATE memory_used_bytes = nan WHERE 1 "
                      "SETTINGS mutations_sync = 2")
        assert _board_slice(store, "qps", "memory", 1, (32, 64), HeatmapSpec()).sum() == 0  # 100 ms: raw rows
        for (interval, x, y), got in answers.items():
            np.testing.assert_array_equal(_board_slice(store, x, y, interval, got.shape, HeatmapSpec()), got)
