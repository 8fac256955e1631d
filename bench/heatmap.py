"""Benchmark: the SQL heatmap tensor vs numpy ``histogramdd`` on the same 10M requests.

Generates synthetic requests (8 backends on 2 hosts x 4 GPUs, load following a slow wave plus
noise, latency growing with load, text/image/audio/video mix) and matching GPU memory samples
(one per GPU per 100 ms window, 5 % missing so the ASOF lookup is exercised) into an embedded
store, then times in the same run:

* SQL: :func:`triscope.analyzers.heatmap.tensor_query` (ClickHouse does the windowing, the ASOF
  memory join and the GROUP BY of cell indices; Python only reshapes ~10^4 counts);
* numpy: loading the needed columns out of the same store, then windowing, memory lookup
  (searchsorted) and ``np.histogramdd``: the "faster than numpy including load" baseline;
* for information, the one-pass query the CLI runs (tensor + exact P95 + patterns per cell).

Both tensors must agree. Usage: ``python bench/heatmap.py [--requests 10000000] [--path DIR]``.
Target: SQL <= 1 s on the embedded store for 10M requests.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

import numpy as np

from triscope.analyzers.heatmap import HeatmapSpec, summary_query, tensor_query
from triscope.schema import GPU_SAMPLES, REQUESTS, qualified
from triscope.store import Store, open_store

BACKENDS = 8
MEAN_PER_WINDOW = 8.5
T0_NS = 1_767_225_600_000_000_000  # 2026-01-01T00:00:00Z

_LOAD = "toUInt32(greatest(0, 8.5 + 7.5 * sin(w / 3000.0 + b) + toInt32(cityHash64(w, b, 7) % 5) - 2))"


def generate(store: Store, n_requests: int, spec: HeatmapSpec) -> tuple[int, int]:
    """Insert ``n_requests`` requests and their GPU samples; returns the [start, end) range in ns."""
    wns = spec.window_ns
    windows = int(n_requests / (BACKENDS * MEAN_PER_WINDOW) * 1.15) + 1
    params = {"t0": T0_NS, "wns": wns, "windows": windows, "n": n_requests, "nb": BACKENDS}
    store.command(f"""
INSERT INTO {qualified(store, REQUESTS)}
  (ts, host, backend, gpu, model, modality, request_class, request_id, span_name,
   latency_seconds, ttft_seconds, prompt_tokens, completion_tokens, status)
SELECT
  fromUnixTimestamp64Nano(toInt64({{t0:Int64}} + w * {{wns:Int64}} + cityHash64(w, b, j, 1) % {{wns:Int64}})),
  concat('node-', toString(intDiv(b, 4))),
  concat('node-', toString(intDiv(b, 4)), ':', toString(8000 + b % 4)),
  toString(b % 4),
  if(b < 6, 'llama-3.1-8b', 'qwen2-vl-7b'),
  multiIf(k < 65, 'text', k < 85, 'image', k < 95, 'audio', 'video'),
  multiIf(k < 85, 'interactive_image_text', k < 95, 'realtime_speech', 'offline_video'),
  concat('r', toString(w), '-', toString(b), '-', toString(j)),
  'llm_request',
  (0.012 + 0.0042 * n - log((cityHash64(w, b, j, 3) % 1000000 + 1) / 1000000.0) * 0.03)
    * multiIf(k < 65, 1.0, k < 85, 2.2, k < 95, 0.7, 4.0),
  0.004 + 0.001 * n,
  toUInt32(50 + cityHash64(w, b, j, 5) % 2000),
  toUInt32(cityHash64(w, b, j, 6) % 400),
  'ok'
FROM (
  SELECT intDiv(number, {{nb:UInt32}}) AS w, number % {{nb:UInt32}} AS b, {_LOAD} AS n
  FROM numbers({{windows:UInt64}} * {{nb:UInt32}})
)
ARRAY JOIN range(n) AS j, arrayMap(x -> cityHash64(w, b, x, 4) % 100, range(n)) AS k
LIMIT {{n:UInt64}}
""", params)
    store.command(f"""
INSERT INTO {qualified(store, GPU_SAMPLES)} (ts, host, gpu, gpu_uuid, source, memory_used_bytes,
  memory_total_bytes, state)
SELECT fromUnixTimestamp64Nano(toInt64({{t0:Int64}} + w * {{wns:Int64}} + cityHash64(w, b, 9) % {{wns:Int64}})),
  concat('node-', toString(intDiv(b, 4))), toUInt16(b % 4), concat('GPU-', toString(b)), 'nvml',
  1.5e9 + {_LOAD} * 0.55e9 + toFloat64(cityHash64(w, b, 10) % 150000000), 80e9, 'ok'
FROM (SELECT intDiv(number, {{nb:UInt32}}) AS w, number % {{nb:UInt32}} AS b \
FROM numbers({{windows:UInt64}} * {{nb:UInt32}}))
WHERE cityHash64(w, b, 11) % 100 >= 5
""", params)
    return T0_NS, T0_NS + windows * wns


def numpy_heatmap(store: Store, spec: HeatmapSpec, start_ns: int, end_ns: int) -> tuple[np.ndarray, dict]:
    """The same tensor computed in numpy, loading the raw columns out of the store first."""
    t, cpu = time.perf_counter(), time.process_time()
    p = {"t0": start_ns, "t1": end_ns}
    req = store.query_columns(
        f"SELECT backend, host, gpu, toUnixTimestamp64Nano(ts) AS ts_ns, latency_seconds "
        f"FROM {qualified(store, REQUESTS)} "
        "WHERE ts >= fromUnixTimestamp64Nano({t0:Int64}) AND ts < fromUnixTimestamp64Nano({t1:Int64})", p)
    gpu = store.query_columns(
        f"SELECT host, toString(gpu) AS gidx, gpu_uuid, toUnixTimestamp64Nano(ts) AS ts_ns, memory_used_bytes "
        f"FROM {qualified(store, GPU_SAMPLES)} "
        "WHERE ts < fromUnixTimestamp64Nano({t1:Int64}) AND isFinite(memory_used_bytes)", p)
    load_s = time.perf_counter() - t
    tensor = numpy_tensor(spec, req, gpu)
    return tensor, {"load_s": load_s, "total_s": time.perf_counter() - t, "cpu_s": time.process_time() - cpu}


def _pairs(a: Any, b: Any) -> list[tuple[tuple[str, str], np.ndarray]]:
    """Row indices of every distinct (a, b) pair."""
    import pandas as pd

    ca, ua = pd.factorize(np.asarray(a, dtype=object))
    cb, ub = pd.factorize(np.asarray(b, dtype=object))
    combined = ca.astype(np.int64) * max(1, len(ub)) + cb
    order = np.argsort(combined, kind="stable")
    keys, starts = np.unique(combined[order], return_index=True)
    bounds = list(starts[1:]) + [len(order)]
    return [((str(ua[k // max(1, len(ub))]), str(ub[k % max(1, len(ub))])), order[s:e])
            for k, s, e in zip(keys, starts, bounds, strict=True)]


def numpy_tensor(spec: HeatmapSpec, req: dict[str, Any], gpu: dict[str, Any]) -> np.ndarray:
    """Reference computation of the heatmap tensor from raw columns (same binning rules as the SQL)."""
    import pandas as pd

    wns = spec.window_ns
    w = np.asarray(req["ts_ns"], dtype=np.int64) // wns
    if len(w) == 0:
        return np.zeros(spec.shape, dtype=np.uint64)
    bcode, _ = pd.factorize(req["backend"])
    w0 = w.min()
    span = int(w.max() - w0 + 1)
    key = bcode.astype(np.int64) * span + (w - w0)
    n = np.bincount(key)[key]  # requests of the same backend in the same window
    # GPU memory per (host, gpu key, window): window mean per GPU; '' = sum over the host's GPUs.
    gw = np.asarray(gpu["ts_ns"], dtype=np.int64) // wns
    ghost, gidx, guuid = (np.asarray(gpu[c], dtype=object) for c in ("host", "gidx", "gpu_uuid"))
    used = np.asarray(gpu["memory_used_bytes"], dtype=np.float64)
    series: dict[tuple[str, str], tuple[np.ndarray, np.ndarray]] = {}
    host_parts: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {}
    for (host, idx), sel in _pairs(ghost, gidx):
        uw, inv = np.unique(gw[sel], return_inverse=True)
        mean = np.bincount(inv, weights=used[sel]) / np.bincount(inv)
        series[(host, idx)] = (uw, mean)
        uuid = guuid[sel][0]
        if uuid:
            series[(host, uuid)] = (uw, mean)
        host_parts.setdefault(host, []).append((uw, mean))
    max_age_w = int(spec.memory_max_age_s * 1e9) // wns
    for host, parts in host_parts.items():  # whole host: sum of each GPU's latest value
        uw = np.unique(np.concatenate([p[0] for p in parts]))
        total = np.zeros(len(uw))
        for gw_, mean in parts:
            pos = np.searchsorted(gw_, uw, side="right") - 1
            ok = (pos >= 0) & ((uw - gw_[np.maximum(pos, 0)]) <= max_age_w)
            total[ok] += mean[pos[ok]]
        series[(host, "")] = (uw, total)
    mem = np.full(len(w), np.nan)
    for (host, g), sel in _pairs(req["host"], req["gpu"]):
        if (host, g) not in series:
            continue
        uw, mean = series[(host, g)]
        pos = np.searchsorted(uw, w[sel], side="right") - 1
        ok = pos >= 0
        ok[ok] &= (w[sel][ok] - uw[pos[ok]]) <= max_age_w
        mem[sel[ok]] = mean[pos[ok]]
    lat = np.asarray(req["latency_seconds"], dtype=np.float64)
    keep = np.isfinite(mem) & np.isfinite(lat)
    q = np.minimum(np.floor(n[keep] * 1e9 / wns / spec.qps_bin), spec.qps_bins - 1)
    m = np.minimum(np.floor(np.maximum(mem[keep], 0) / spec.memory_bin_bytes), spec.memory_bins - 1)
    lb = np.minimum(np.floor(np.maximum(lat[keep], 0) / spec.latency_bin_s), spec.latency_bins - 1)
    edges = [np.arange(k + 1) - 0.5 for k in spec.shape]
    hist, _ = np.histogramdd(np.column_stack([q, m, lb]), bins=edges)
    return hist.astype(np.uint64)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=10_000_000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--path", help="embedded store directory (default: a temporary one, removed after)")
    args = ap.parse_args(argv)
    path = args.path or tempfile.mkdtemp(prefix="triscope-bench-heatmap-")
    spec = HeatmapSpec()
    store = open_store({"store": {"backend": "embedded", "path": path, "database": "bench_heatmap"}})
    try:
        store.command(f"TRUNCATE TABLE {qualified(store, REQUESTS)}")
        store.command(f"TRUNCATE TABLE {qualified(store, GPU_SAMPLES)}")
        t = time.perf_counter()
        start, end = generate(store, args.requests, spec)
        store.command(f"OPTIMIZE TABLE {qualified(store, REQUESTS)} FINAL")
        n = store.query(f"SELECT count() FROM {qualified(store, REQUESTS)}").scalar()
        g = store.query(f"SELECT count() FROM {qualified(store, GPU_SAMPLES)}").scalar()
        print(f"generated {int(n):,} requests and {int(g):,} GPU samples over {(end - start) / 1e9:,.0f} s "
              f"in {time.perf_counter() - t:.1f}s")
        sql_times, sql_cpu, np_times, np_loads, np_cpu = [], [], [], [], []
        tensor = ref = None
        for _ in range(args.repeat):
            t, cpu = time.perf_counter(), time.process_time()  # chDB runs in this process: its threads count
            tensor, counted, unmatched = tensor_query(store, spec, start, end)
            sql_times.append(time.perf_counter() - t)
            sql_cpu.append(time.process_time() - cpu)
        for _ in range(max(1, args.repeat - 1)):
            ref, info = numpy_heatmap(store, spec, start, end)
            np_times.append(info["total_s"])
            np_loads.append(info["load_s"])
            np_cpu.append(info["cpu_s"])
        t = time.perf_counter()
        full, _, _, cells = summary_query(store, spec, start, end)
        summary_s = time.perf_counter() - t
        assert tensor is not None and ref is not None
        diff = int(np.abs(tensor.astype(np.int64) - ref.astype(np.int64)).sum())
        sql_best, np_best = min(sql_times), min(np_times)
        print(f"tensor {list(tensor.shape)}: {counted:,} requests counted, {unmatched:,} without a memory sample, "
              f"{int(np.count_nonzero(tensor)):,} non-empty cells; |SQL - numpy| = {diff} requests")
        print(f"SQL heatmap (embedded chDB):      best {sql_best:.3f}s  median {statistics.median(sql_times):.3f}s "
              f"of {len(sql_times)}  (target <= 1 s: {'met' if sql_best <= 1.0 else 'NOT met'}); "
              f"CPU {min(sql_cpu):.3f}s")
        print(f"numpy histogramdd incl. load:      best {np_best:.3f}s  (load {min(np_loads):.3f}s, "
              f"compute {np_best - min(np_loads):.3f}s); CPU {min(np_cpu):.3f}s")
        print(f"ratio numpy/SQL: {np_best / sql_best:.2f}x  (compute-only numpy/SQL: "
              f"{(np_best - min(np_loads)) / sql_best:.2f}x; CPU time numpy/SQL: {min(np_cpu) / min(sql_cpu):.2f}x)")
        same = bool(np.array_equal(full, ref))
        print(f"one-pass tensor + P95 + patterns (what the CLI runs; {len(cells)} cells): {summary_s:.3f}s, "
              f"tensor {'equal' if same else 'DIFFERENT'}")
        print(f"machine: {os.cpu_count()} CPUs, load average {' '.join(f'{x:.1f}' for x in os.getloadavg())} "
              "(other processes share these cores)")
        return 0 if diff == 0 and same else 1
    finally:
        store.close()
        if not args.path:
            shutil.rmtree(path, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
