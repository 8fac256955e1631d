"""The weight engine's store readers (``read_inputs``: the newest-row tables and the window's rows;
``read_inputs_scan``: one scan per raw table) read exactly what the reference reader (one query per
input, ``triscope_bed.fleet.weight_inputs_scans``) reads, and the engine computes the same weights from
them: on a real embedded store (chDB) holding every case the readers tell apart, at ``now``s before,
within and after the rows (a backend with rows after ``now`` is read from its raw rows).

Rows are synthetic, shaped like the collectors' (vLLM scrapes at 1 Hz, OTel spans, NVML samples).
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from conftest import fresh_database

from triscope.analyzers.routing import WeightParams, compute_weights, read_inputs, store_latest, with_address
from triscope.analyzers.routing.store_inputs import read_inputs_scan
from triscope.commands.weights import explanation
from triscope.schema import GPU_SAMPLES, REQUESTS, SCRAPE_HEALTH, SERVING_METRICS, encode_ts, qualified
from triscope.schema.requests import REQUESTS_RECENT, SERVING_RECENT
from triscope_bed.fleet import weight_inputs_scans as reference

NOW = float(int(time.time()))
CLASSES = ("realtime_speech", "interactive_image_text", "offline_video", "batch_unknown", "")


def _insert(store: Any, table: Any, rows: list[dict[str, Any]]) -> None:
    for r in rows:
        r["ts"] = encode_ts(int(round(r["ts"] * 1e9)))
    store.insert(qualified(store, table), table.columns_of(rows))


def _fleet(store: Any) -> None:
    """Twelve backends over the last 400 s, each with its own shape of data."""
    rng = np.random.default_rng(7)
    serving, spans, health, gpus = [], [], [], []
    for i in range(12):
        name = f"10.0.0.{i}:8000"
        host = f"node-{i // 4}"
        start = NOW - {3: 400, 4: 200}.get(i, 400)
        stop = {3: NOW - 350, 5: NOW + 30}.get(i, NOW)  # 3: silent past the look-back; 5: rows after now
        total, pre = float(rng.integers(0, 10_000)), 0.0
        for t in np.arange(start, stop, 1.0) + rng.uniform(0, 1):
            total = 3.0 if i == 6 and abs(t - (NOW - 5)) < 0.5 else total + float(rng.poisson(4))  # 6: a reset
            pre += float(rng.random() < 0.02)
            serving.append({"ts": float(t), "backend": name, "host": host, "server": "vllm", "model": "m",
                            "kv_cache_usage_ratio": float(rng.uniform(0, 1)), "requests_total": total,
                            "latency_p99_seconds": math.nan if i == 7 else float(rng.uniform(0.1, 3)),
                            "preemptions_total": math.nan if i == 8 else pre,
                            "sleep_state": float(i == 9)})
        if i != 10:  # 10: scraped, no spans
            for t in np.sort(rng.uniform(start, stop, 600)):
                spans.append({"ts": float(t), "backend": name, "host": host,
                              "gpu": "" if i == 2 else str(i % 4) if i != 11 else f"GPU-{i:04x}",
                              "request_class": CLASSES[int(rng.integers(0, len(CLASSES)))],
                              "latency_seconds": math.nan if rng.random() < 0.05 else float(rng.lognormal(-1, 0.7)),
                              "status": "error" if i == 1 and t > NOW - 3 or rng.random() < 0.05 else "ok"})
        for target in (f"http://{name}/metrics", f"http://{name}/alt") if i in (0, 1) else () if i == 3 else (
                f"http://{name}/m",):
            for t in np.arange(NOW - 320, NOW, 2.0):
                up = int(not (i == 1 and t > NOW - 20) and not (i == 0 and target.endswith("alt") and t > NOW - 6))
                health.append({"ts": float(t), "backend": name, "host": host, "target": target, "up": up,
                               "error": "" if up else f"{target}: connection refused"})
    # 1: failing in every class for its last 3 s, more failures in a row than any ``down_after_errors``
    spans += [{"ts": NOW - 2.9 + j * 0.1, "backend": "10.0.0.1:8000", "host": "node-0", "gpu": "1",
               "request_class": CLASSES[j % len(CLASSES)], "latency_seconds": 0.5, "status": "error"}
              for j in range(25)]
    # 9: an answered and a failed span started at the same nanosecond, after ``NOW``: the failed one is last
    spans += [{"ts": NOW + 0.1, "backend": "10.0.0.9:8000", "host": "node-2", "gpu": "1", "latency_seconds": 0.1,
               "request_class": "offline_video", "status": status} for status in ("error", "ok")]
    # a span naming no backend, a gateway's spans for an address nothing scrapes
    spans += [{"ts": NOW - 2.0, "backend": "", "host": "gw", "gpu": "0"},
              {"ts": NOW - 3.0, "backend": "10.9.9.9:80", "host": "gw", "latency_seconds": 0.2}]
    for h in range(3):
        for g in range(4):
            for t in np.arange(NOW - 350, NOW, 0.5) + rng.uniform(0, 0.5):
                gpus.append({"ts": float(t), "host": f"node-{h}", "gpu": g, "gpu_uuid": f"GPU-{h * 4 + g:04x}",
                             "memory_used_bytes": float(rng.integers(1, 80)) * 2**30,
                             "memory_total_bytes": 80.0 * 2**30 if (h, g) != (1, 1) else math.nan,
                             "state": "lost" if (h, g) == (2, 3) and t > NOW - 4 else "ok"})
    # a GPU that came up 30 s ago: at a ``now`` before that it has no sample, though its host has
    gpus += [{"ts": float(t), "host": "node-1", "gpu": 5, "gpu_uuid": "GPU-new", "memory_used_bytes": 2.0**30,
              "memory_total_bytes": 80.0 * 2**30, "state": "ok"} for t in np.arange(NOW - 30, NOW, 0.5)]
    for table, rows in ((SERVING_METRICS, serving), (REQUESTS, spans), (SCRAPE_HEALTH, health),
                        (GPU_SAMPLES, gpus)):
        _insert(store, table, rows)


PARAMS = {
    "defaults": {},
    "window longer than the look-back": {"window_s": 30.0, "lookback_s": 20.0, "preemption_lookback_s": 90.0},
    "configured, not discovered": {"discover": False, "backends": {
        "10.0.0.0:8000": {"address": "10.0.0.0:8000", "host": "node-0", "gpus": [1, 2]},
        "10.0.0.2:8000": {"address": "10.0.0.2:8000", "host": "node-0"},
        "10.0.0.40:8000": {"address": "10.0.0.40:8000"},
        "10.0.0.41:8000": {"address": "10.0.0.41:8000", "host": "node-1", "gpus": [5]}}},
    "errors in a row": {"down_after_errors": 5, "window_s": 4.0},
}


@pytest.fixture(scope="module")
def fleet(store_path: Path) -> Iterator[Any]:
    """One store of the fleet for every case (building a database takes seconds)."""
    with fresh_database(store_path, f"inputs_eq{os.getpid()}") as s:
        _fleet(s)
        yield s


READERS = {"latest": read_inputs, "scan": read_inputs_scan}


@pytest.mark.parametrize("reader", list(READERS))
@pytest.mark.parametrize("name", list(PARAMS))
def test_inputs_and_weights_equal_the_reference_reader(fleet: Any, name: str, reader: str) -> None:
    store = fleet
    params = WeightParams.from_config({"weights": PARAMS[name]})
    state_new = state_ref = None
    for now in (NOW - 60.0, NOW - 0.5, NOW, NOW + 0.25, NOW + 12.0, NOW + 400.0):
        new = READERS[reader](store, params, now)
        ref = reference.read_inputs(store, params, now)
        assert repr(new) == repr(ref), now
        res_new, state_new = compute_weights([with_address(i, params) for i in new], state_new, params, now)
        res_ref, state_ref = compute_weights([with_address(i, params) for i in ref], state_ref, params, now)
        assert repr(res_new.to_dict()) == repr(res_ref.to_dict()) and repr(state_new) == repr(state_ref), now
        for backend in res_new.backends:  # `weights explain BACKEND`
            assert repr(explanation(res_new, backend)) == repr(explanation(res_ref, backend))
    if name == "defaults":  # the store holds what the cases need: each shape is seen by the reader
        by = {i.backend: i for i in read_inputs(store, params, NOW)}
        assert "10.0.0.3:8000" not in by and "" not in by and "10.9.9.9:80" in by
        assert {i.backend: i for i in read_inputs(store, params, NOW + 0.25)}["10.0.0.9:8000"].trailing_errors == 1
        assert by["10.0.0.1:8000"].trailing_errors == params.down_after_errors and by["10.0.0.1:8000"].scrape_up == 0
        assert len(by["10.0.0.4:8000"].p99_seconds) >= 3 and math.isnan(by["10.0.0.8:8000"].preemptions)
        assert math.isnan(by["10.0.0.10:8000"].span_count) and by["10.0.0.11:8000"].healthy is False


def test_a_range_older_than_the_recent_tables_hold_is_read_from_the_raw_rows(
        fleet: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The window's rows come from the ``*_recent`` tables while they hold the range (the store's clock
    near ``now``), from the raw tables once the range is older than their hours: the same inputs."""
    params = WeightParams.from_config({"weights": {}})
    wstart = int((NOW - params.window_s) * 1e9)
    assert store_latest.by_time(fleet, REQUESTS_RECENT, wstart).endswith(".requests_recent")
    current = read_inputs(fleet, params, NOW)
    monkeypatch.setattr(store_latest, "time", SimpleNamespace(time=lambda: NOW + 3 * 3600.0))
    assert store_latest.by_time(fleet, REQUESTS_RECENT, wstart).endswith(".requests")
    assert store_latest.by_time(fleet, SERVING_RECENT, wstart).endswith(".serving_metrics")
    assert repr(read_inputs(fleet, params, NOW)) == repr(current) == repr(reference.read_inputs(fleet, params, NOW))
