"""SQL heatmap (triscope.analyzers.heatmap) against an independent numpy computation.

Seeded requests and GPU memory samples go through the real embedded store (chDB); the
reference below recomputes windows, the memory lookup, clamping and ``np.histogramdd`` from the
same rows in plain Python/numpy, written separately from the analyzer and from bench/heatmap.py.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict

import numpy as np
import pytest

from triscope.analyzers.heatmap import AXES, HeatmapSpec, compute_heatmap, slice_axes
from triscope.errors import ConfigError, InputError
from triscope.schema import encode_ts, qualified

T0 = 1_767_225_600_000_000_000  # 2026-01-01T00:00:00Z, on the 100 ms grid
WNS = 100_000_000
MODALITIES = ["text", "image", "audio", "video"]
CLASSES = ["realtime_speech", "interactive_image_text", "offline_video"]

# backend -> (host, gpu column of its requests)
BACKENDS = {
    "h1:8000": ("h1", "0"),        # GPU by index
    "h1:8001": ("h1", "GPU-b1"),   # GPU by uuid (index 1)
    "h2:8000": ("h2", ""),         # whole host: sum of its GPUs
    "h3:8000": ("h3", "0"),        # no memory samples at all -> unmatched
}
GPUS = [("h1", 0, "GPU-a0"), ("h1", 1, "GPU-b1"), ("h2", 0, "GPU-c0"), ("h2", 1, "GPU-c1")]


def _seed(store, seed: int = 7, windows: int = 120) -> tuple[list[dict], list[dict]]:
    """Insert requests and GPU samples; returns both as row dicts for the reference."""
    rng = np.random.default_rng(seed)
    reqs: list[dict] = []
    for b, (host, gpu) in BACKENDS.items():
        for w in range(windows):
            # up to 25 requests per 100 ms window = 250 QPS, beyond the last QPS bin (160) -> clamped
            for _ in range(int(rng.integers(0, 26))):
                lat = float(rng.exponential(0.25)) if rng.random() > 0.03 else float("nan")
                if rng.random() < 0.02:
                    lat = 3.0  # beyond 1.28 s -> last latency bin
                reqs.append({"ts": T0 + w * WNS + int(rng.integers(0, WNS)), "host": host, "backend": b,
                             "gpu": gpu, "model": "m-a" if rng.random() < 0.6 else "m-b",
                             "modality": MODALITIES[int(rng.choice(4, p=[0.6, 0.25, 0.1, 0.05]))],
                             "latency_seconds": lat})
                reqs[-1]["request_class"] = CLASSES[reqs[-1]["ts"] % 7 % 3]  # 3/7, 2/7, 2/7
    gpus: list[dict] = []
    for host, idx, uuid in GPUS:
        for w in range(-3, windows):
            if rng.random() < 0.15:
                continue  # missing window -> ASOF lookup of an earlier one
            for _ in range(int(rng.integers(1, 3))):  # 1-2 samples per window -> window mean
                used = float(rng.uniform(0, 15e9))  # up to 15 GB, beyond 12.8 GB -> clamped
                gpus.append({"ts": T0 + w * WNS + int(rng.integers(0, WNS)), "host": host, "gpu": idx,
                             "gpu_uuid": uuid, "memory_used_bytes": used})
    store.insert(qualified(store, "requests"), {
        "ts": [encode_ts(r["ts"]) for r in reqs], **{k: [r[k] for r in reqs] for k in (
            "host", "backend", "gpu", "model", "modality", "request_class", "latency_seconds")},
        "span_name": ["llm_request"] * len(reqs)})
    store.insert(qualified(store, "gpu_samples"), {
        "ts": [encode_ts(g["ts"]) for g in gpus], **{k: [g[k] for g in gpus] for k in (
            "host", "gpu", "gpu_uuid", "memory_used_bytes")}, "source": ["nvml"] * len(gpus)})
    return reqs, gpus


def _reference(reqs: list[dict], gpus: list[dict], spec: HeatmapSpec, start: int, end: int,
               backends: list[str] | None = None, models: list[str] | None = None
               ) -> tuple[np.ndarray, int, dict[tuple[int, int], list[tuple[float, str, str]]]]:
    """Tensor, unmatched count and per-(qps, memory) cell (latency, modality, class) lists, in numpy."""
    wns = spec.window_ns
    max_age = int(spec.memory_max_age_s * 1e9) // wns
    rows = [r for r in reqs if start <= r["ts"] < end and (not backends or r["backend"] in backends)]
    load = Counter((r["backend"], r["ts"] // wns) for r in rows)  # every model counts as load
    sums: dict[tuple[str, int, int], list[float]] = defaultdict(list)
    uuid_idx: dict[tuple[str, str], int] = {}
    for g in gpus:
        if g["ts"] < end:
            sums[(g["host"], g["gpu"], g["ts"] // wns)].append(g["memory_used_bytes"])
        uuid_idx[(g["host"], g["gpu_uuid"])] = g["gpu"]
    mem: dict[tuple[str, str], dict[int, float]] = defaultdict(dict)
    for (host, idx, w), vals in sums.items():
        mem[(host, str(idx))][w] = sum(vals) / len(vals)

    def latest(series: dict[int, float], w: int) -> float:
        for back in range(max_age + 1):
            if w - back in series:
                return series[w - back]
        return math.nan

    # a whole host: in each window where any of its GPUs reported, the sum of every GPU's latest value
    for host in {h for h, _ in list(mem)}:
        own = [series for (h, g), series in list(mem.items()) if h == host and g != ""]
        for w in set().union(*own):
            mem[(host, "")][w] = sum(v for v in (latest(series, w) for series in own) if not math.isnan(v))

    def lookup(host: str, gpu: str, w: int) -> float:
        if gpu and not gpu.isdigit():
            gpu = str(uuid_idx.get((host, gpu), -1))
        return latest(mem.get((host, gpu), {}), w)

    points, cells, unmatched = [], defaultdict(list), 0
    for r in rows:
        if (models and r["model"] not in models) or not math.isfinite(r["latency_seconds"]):
            continue
        w = r["ts"] // wns
        used = lookup(r["host"], r["gpu"], w)
        if math.isnan(used):
            unmatched += 1
            continue
        q = min(int(load[(r["backend"], w)] * 1e9 / wns // spec.qps_bin), spec.qps_bins - 1)
        m = min(int(max(used, 0) // spec.memory_bin_bytes), spec.memory_bins - 1)
        lat = min(int(max(r["latency_seconds"], 0) // spec.latency_bin_s), spec.latency_bins - 1)
        points.append((q, m, lat))
        cells[(q, m)].append((r["latency_seconds"], r["modality"], r["request_class"]))
    edges = [np.arange(n + 1) - 0.5 for n in spec.shape]
    hist, _ = np.histogramdd(np.array(points, dtype=float).reshape(-1, 3), bins=edges)
    return hist.astype(np.uint64), unmatched, cells


def test_tensor_matches_numpy_histogramdd(store) -> None:
    reqs, gpus = _seed(store)
    spec = HeatmapSpec()
    res = compute_heatmap(store, spec, T0, T0 + 120 * WNS)
    ref, unmatched, _ = _reference(reqs, gpus, spec, T0, T0 + 120 * WNS)
    assert res.tensor.shape == (32, 64, 128)
    np.testing.assert_array_equal(res.tensor, ref)  # from the one-pass summary query
    lean = compute_heatmap(store, spec, T0, T0 + 120 * WNS, summaries=False)  # tensor_query
    np.testing.assert_array_equal(lean.tensor, ref)
    assert (lean.requests, lean.unmatched) == (res.requests, res.unmatched) and lean.patterns == []
    # every seeded row is accounted for: in the tensor, unmatched (h3 has no GPU samples; only rows
    # with a finite latency count there), or left out for a NaN latency
    finite = [r for r in reqs if math.isfinite(r["latency_seconds"])]
    h3 = sum(1 for r in finite if r["backend"] == "h3:8000")
    assert res.unmatched == unmatched == h3 > 1000
    assert res.requests == int(ref.sum()) == len(finite) - h3 > 3000
    assert len(reqs) - len(finite) > 50  # NaN latencies were exercised
    # clamping happened on all three axes: the last bins hold at least the out-of-range values
    load = Counter((r["backend"], r["ts"] // WNS) for r in reqs)
    over_qps = sum(1 for r in finite if r["backend"] != "h3:8000" and load[(r["backend"], r["ts"] // WNS)] >= 16)
    over_lat = sum(1 for r in finite if r["backend"] != "h3:8000" and r["latency_seconds"] >= 1.28)
    assert res.tensor[-1].sum() == over_qps > 0  # >= 160 QPS (16 per 100 ms) all in the last QPS bin
    assert res.tensor[:, :, -1].sum() >= over_lat > 50
    assert res.tensor[:, -1].sum() > 0  # > 12.8 GB (and the h2 host sums) in the last memory bin


def test_filters_range_and_custom_spec(store) -> None:
    reqs, gpus = _seed(store, seed=11)
    spec = HeatmapSpec(window_ms=200, qps_bin=10, qps_bins=8, memory_bin_bytes=1e9, memory_bins=10,
                       latency_bin_s=0.05, latency_bins=16, memory_max_age_s=0.2)
    start, end = T0 + 10 * WNS, T0 + 90 * WNS
    for backends, models in ((None, None), (["h1:8000", "h2:8000"], None), (None, ["m-b"]),
                             (["h1:8001"], ["m-a"])):
        ref, unmatched, _ = _reference(reqs, gpus, spec, start, end, backends, models)
        for summaries in (False, True):
            res = compute_heatmap(store, spec, start, end, backends=backends, models=models, summaries=summaries)
            assert res.tensor.shape == (8, 10, 16)
            np.testing.assert_array_equal(res.tensor, ref, err_msg=f"{backends} {models} {summaries}")
            assert res.unmatched == unmatched
    # an unknown backend selects nothing
    assert compute_heatmap(store, spec, start, end, backends=["nope"]).tensor.sum() == 0


def test_slices_by_any_two_axes(store) -> None:
    _seed(store, seed=3, windows=60)
    res = compute_heatmap(store, HeatmapSpec(), T0, T0 + 60 * WNS, summaries=False)
    t = res.tensor
    assert res.slice(("qps", "memory")).tolist() == t.sum(axis=2).tolist()
    assert res.slice(("memory", "qps")).tolist() == t.sum(axis=2).T.tolist()
    assert res.slice(("qps", "latency")).tolist() == t.sum(axis=1).tolist()
    assert res.slice(("latency", "memory")).tolist() == t.sum(axis=0).T.tolist()
    assert res.slice(("memory", "latency")).tolist() == t.sum(axis=0).tolist()
    assert res.slice(("latency", "qps")).tolist() == t.sum(axis=1).T.tolist()
    for keep in (("qps", "memory"), ("qps", "latency"), ("memory", "latency")):
        assert int(res.slice(keep).sum()) == int(t.sum()) == res.requests
    part = res.slice(("qps", "latency"), where={"memory": (10, 30)})
    assert part.tolist() == t[:, 10:30, :].sum(axis=1).tolist()
    for bad in (("qps", "qps"), ("qps",), ("qps", "gpu")):
        with pytest.raises(InputError, match="two different axes"):
            slice_axes(t, bad)  # type: ignore[arg-type]
    with pytest.raises(InputError, match="outside its bins"):
        res.slice(("qps", "latency"), where={"memory": (10, 65)})
    with pytest.raises(InputError, match="can only restrict memory"):
        res.slice(("qps", "latency"), where={"qps": (0, 3)})
    assert res.slice(("qps", "latency"), where={"memory": (5, 5)}).sum() == 0
    assert len(res.edges("memory")) == 64 and res.edges("latency")[3] == pytest.approx(0.03)
    assert set(AXES) == {"qps", "memory", "latency"}


def test_p95_per_cell_and_patterns(store) -> None:
    reqs, gpus = _seed(store, seed=5)
    spec = HeatmapSpec()
    res = compute_heatmap(store, spec, T0, T0 + 120 * WNS, top=5)
    _, _, cells = _reference(reqs, gpus, spec, T0, T0 + 120 * WNS)
    assert res.p95_grid is not None
    filled = {(int(q), int(m)) for q, m in np.argwhere(np.isfinite(res.p95_grid))}
    assert filled == set(cells)
    for (q, m), items in cells.items():
        expected = np.percentile([item[0] for item in items], 95)  # numpy default: linear
        assert res.p95_grid[q, m] == pytest.approx(expected, rel=1e-12), (q, m)
    ranked = sorted(cells.items(), key=lambda kv: (-len(kv[1]), kv[0]))[:5]
    assert len(res.patterns) == 5
    for pat, ((q, m), items) in zip(res.patterns, ranked, strict=True):
        assert pat["requests"] == len(items)
        assert pat["qps_min"] == q * 5.0 and pat["memory_min_bytes"] == m * 200e6
        assert pat["qps_max"] == (None if q == 31 else (q + 1) * 5.0)
        assert pat["p95_latency_seconds"] == pytest.approx(np.percentile([x[0] for x in items], 95))
        for key, pos in (("modality", 1), ("request_class", 2)):
            counts = Counter(item[pos] for item in items)
            top = max(counts.values())
            assert pat[key] == min(name for name, c in counts.items() if c == top), key  # ties: first name
            assert pat[f"{key}_share"] == pytest.approx(top / len(items))
        assert pat["share"] == pytest.approx(len(items) / res.requests)
    assert {p["request_class"] for p in res.patterns} >= {"realtime_speech"}
    doc = res.to_json()
    assert sum(c[3] for c in doc["cells"]) == res.requests
    assert doc["shape"] == [32, 64, 128] and len(doc["patterns"]) == 5


def test_empty_range_and_bad_spec(store) -> None:
    with pytest.raises(InputError, match="empty time range"):
        compute_heatmap(store)  # no requests at all
    _seed(store, seed=1, windows=10)
    with pytest.raises(InputError, match="empty time range"):
        compute_heatmap(store, start_ns=T0 + 5 * WNS, end_ns=T0 + 5 * WNS)
    empty = compute_heatmap(store, start_ns=T0 - 100 * WNS, end_ns=T0 - 50 * WNS)
    assert empty.tensor.sum() == 0 and empty.patterns == [] and empty.requests == 0
    for bad in ({"qps_bin": 0}, {"latency_bins": 0}, {"window_ms": -1}, {"memory_max_age_s": -1},
                {"qps_bins": 4096, "memory_bins": 4096, "latency_bins": 4096}):
        with pytest.raises(ConfigError):
            HeatmapSpec(**bad).validate()
    with pytest.raises(ConfigError, match="unknown keys: bogus"):
        HeatmapSpec.from_config({"heatmap": {"bogus": 1}})
    for bad in ({"qps_bins": "many"}, {"qps_bins": 16.5}, {"latency_bins": True}, {"qps_bin": [5]}):
        with pytest.raises(ConfigError, match=f"bad value for {next(iter(bad))}"):
            HeatmapSpec.from_config({"heatmap": bad})
    assert HeatmapSpec.from_config({"heatmap": {"qps_bins": 16.0, "qps_bin": 2}}).qps_bins == 16
    spec = HeatmapSpec.from_config({"heatmap": {"qps_bins": 16}, "analysis": {"window_ms": 50}})
    assert spec.shape == (16, 64, 128) and spec.window_ns == 50_000_000


def test_bench_numpy_baseline_agrees(store) -> None:
    """bench/heatmap.py's numpy baseline (load out of the store + histogramdd) gives the same tensor
    on the seeded rows (GPU by index, by uuid, whole host, missing samples)."""
    import importlib.util

    from conftest import REPO

    spec_ = importlib.util.spec_from_file_location("bench_heatmap", REPO / "bench" / "heatmap.py")
    assert spec_ is not None and spec_.loader is not None
    bench = importlib.util.module_from_spec(spec_)
    spec_.loader.exec_module(bench)
    _seed(store, seed=9, windows=60)
    spec = HeatmapSpec()
    res = compute_heatmap(store, spec, T0, T0 + 60 * WNS, summaries=False)
    ref, info = bench.numpy_heatmap(store, spec, T0, T0 + 60 * WNS)
    assert res.requests > 1000 and info["total_s"] >= info["load_s"] > 0
    np.testing.assert_array_equal(ref, res.tensor)
