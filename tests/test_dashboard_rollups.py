"""The fleet board's gauge panels read the rollup that fits the panel's interval and answer what the raw
rows answer: checked against averages computed here from the inserted rows, then with the raw tables
emptied (only a rollup can answer then). SYNTHETIC rows in the collectors' shapes."""

from __future__ import annotations

import functools
import math
from collections import defaultdict
from datetime import UTC, datetime
from typing import Any

import numpy as np
import pytest
from conftest import fresh_database

from triscope.dashboards.boards import all_boards
from triscope.dashboards.macros import ALL, Context, Var, expand
from triscope.schema import GPU_SAMPLES, SERVING_METRICS, encode_ts, qualified

T0_S = 1_767_225_600  # 2026-01-01 00:00:00 UTC, minute-aligned
SECONDS = 20 * 60
PANELS = {"GPU memory used": "gpu", "GPU memory used / total": "gpu_ratio", "KV-cache usage per backend": "kv",
          "Queue length per backend": "queue"}


def _rows(rng: np.random.Generator) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    gpu, serving = [], []
    for k in range(SECONDS * 5):  # 5 Hz
        ns = T0_S * 10**9 + k * 200_000_000
        for host, index in (("h1", 0), ("h1", 1), ("h2", 0)):
            used = float(rng.integers(1000, 70000)) * (1 << 20)
            gpu.append({"ts": encode_ts(ns), "host": host, "gpu": index, "source": "nvml",
                        "memory_used_bytes": math.nan if k % 17 == 0 else used,
                        "memory_total_bytes": 80.0 * (1 << 30)})
    for k in range(SECONDS):
        ns = T0_S * 10**9 + k * 10**9 + 250_000_000
        for backend in ("h1:8000", "h2:8000"):
            serving.append({"ts": encode_ts(ns), "host": backend[:2], "backend": backend, "server": "vllm",
                            "kv_cache_usage_ratio": math.nan if k % 13 == 0 else float(np.float32(rng.random())),
                            "queue_length": float(rng.integers(0, 40)), "running_requests": float(rng.integers(0, 9))})
    return gpu, serving


@functools.cache
def _seconds(text: str) -> int:
    return int(datetime.strptime(text, "%Y-%m-%d %H:%M:%S").replace(tzinfo=UTC).timestamp())


def _expected(rows: list[dict[str, Any]], keys: tuple[str, ...], value: str, interval: int) -> dict[tuple, float]:
    """avgIf(value, isFinite(value)) per interval window and keys, computed from the rows themselves."""
    acc: dict[tuple, list[float]] = defaultdict(list)
    for r in rows:
        sec = _seconds(r["ts"][:19])
        key = (sec // interval * interval, *(str(r[k]) for k in keys))
        acc[key].append(r[value])
    return {k: (float(np.mean([v for v in vs if math.isfinite(v)])) if any(math.isfinite(v) for v in vs)
                else math.nan) for k, vs in acc.items()}


def _panel(store, title: str, interval: int) -> dict[tuple, tuple[float, ...]]:
    board = all_boards()["fleet"]
    (target,) = [tg for p in board["panels"] if p["title"] == title for tg in p["targets"]]
    variables = {v["name"]: (Var(store.database, [store.database], multi=False) if v["type"] == "textbox"
                             else Var([ALL], ["__none__"])) for v in board["templating"]["list"]}
    variables.update(host=Var([ALL], ["h1", "h2"]), gpu=Var([ALL], ["0", "1"]),
                     backend=Var([ALL], ["h1:8000", "h2:8000"]))
    ctx = Context(datetime.fromtimestamp(T0_S, UTC), datetime.fromtimestamp(T0_S + SECONDS + 600, UTC),
                  interval_s=interval, variables=variables)
    res = store.query(expand(target["rawSql"], ctx))
    out = {}
    for row in res.rows:
        when = (row[0].replace(tzinfo=row[0].tzinfo or UTC) if isinstance(row[0], datetime)
                else datetime.strptime(str(row[0]), "%Y-%m-%d %H:%M:%S").replace(tzinfo=UTC)).timestamp()
        k = 3 if title.startswith("GPU") else 2
        out[(int(when), *map(str, row[1:k]))] = tuple(row[k:])
    return out


def _approx(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    for key, value in want.items():
        g = math.nan if got[key][0] is None else got[key][0]  # the store's JSON writes NaN as null
        assert (math.isnan(g) and math.isnan(value)) or g == pytest.approx(value, rel=1e-9), key


def test_gauge_panels_equal_the_raw_averages_at_every_interval(store_path) -> None:
    """1 s and 15 s read raw rows, 10 s and 30 s the 10 s rollup, 60 s and 120 s the 1 min one."""
    gpu, serving = _rows(np.random.default_rng(5))
    with fresh_database(store_path, "rollpanel") as store:
        store.insert(qualified(store, GPU_SAMPLES), GPU_SAMPLES.columns_of(gpu))
        store.insert(qualified(store, SERVING_METRICS), SERVING_METRICS.columns_of(serving))
        for interval in (1, 15, 10, 30, 60, 120):
            _approx(_panel(store, "GPU memory used", interval),
                    _expected(gpu, ("host", "gpu"), "memory_used_bytes", interval))
            _approx(_panel(store, "KV-cache usage per backend", interval),
                    _expected(serving, ("backend",), "kv_cache_usage_ratio", interval))
            queue = _panel(store, "Queue length per backend", interval)
            _approx(queue, _expected(serving, ("backend",), "queue_length", interval))
            running = _expected(serving, ("backend",), "running_requests", interval)
            assert {k: v[1] for k, v in queue.items()} == pytest.approx(running, rel=1e-9)


def test_long_intervals_are_answered_by_the_rollups_alone(store_path) -> None:
    """With the raw rows gone, a 1 min or 30 s interval still answers (the 1 min or 10 s rollup), the
    same numbers as before; a 1 s or 15 s interval reads raw rows and has none left."""
    gpu, serving = _rows(np.random.default_rng(7))
    with fresh_database(store_path, "rollonly") as store:
        store.insert(qualified(store, GPU_SAMPLES), GPU_SAMPLES.columns_of(gpu))
        store.insert(qualified(store, SERVING_METRICS), SERVING_METRICS.columns_of(serving))
        before = {(title, i): _panel(store, title, i) for title in PANELS for i in (1, 15, 30, 60)}
        assert all(before.values())
        for table in (GPU_SAMPLES, SERVING_METRICS):
            store.command(f"TRUNCATE TABLE {qualified(store, table)}")
        for title in PANELS:
            assert _panel(store, title, 60) == before[(title, 60)]
            assert _panel(store, title, 30) == before[(title, 30)]
            assert _panel(store, title, 1) == {} and _panel(store, title, 15) == {}
