"""Stall-classifier bench: classify a large multi-rank trace range, against a pure-Python baseline.

    .venv/bin/python bench/stalls.py                      # 8 ranks x 200k kernels, 60 s, ~1 min on 2 cores
    .venv/bin/python bench/stalls.py --ranks 4 --events 50000 --json

Seeds a temporary embedded store with N ranks of GPU kernels (compute kernels with an NCCL
all_reduce every few ms, some steps comm-heavy), host ops, 10 Hz gpu_samples and 1 s io_latency rows,
then times ``diagnose_stalls`` over the range. The baseline computes the same per-window comm and
compute shares with a straightforward Python loop over the same rows (fetched once, fetch time
excluded), and the bench checks both agree before printing the speed ratio.
"""

from __future__ import annotations

import argparse
import bisect
import json
import tempfile
import time

import numpy as np

from triscope.analyzers.stalls import diagnose_stalls
from triscope.schema import GPU_SAMPLES, IO_LATENCY, TRACE_EVENTS, TRACE_RUNS, encode_ts, qualified
from triscope.store import open_store

MS = 1_000_000


def seed(store, ranks: int, events: int, seconds: float, t0: int, rng: np.random.Generator) -> None:
    span = int(seconds * 1e9)
    for rank in range(ranks):
        gaps = rng.exponential(span / events * 0.05, events).astype(np.int64)
        durs = rng.exponential(span / events * 0.95, events).astype(np.int64) + 1000
        starts = np.cumsum(gaps + durs) - durs
        scale = span / max(1, starts[-1] + durs[-1])
        starts = (starts * scale).astype(np.int64)
        durs = np.maximum((durs * scale).astype(np.int64), 1)
        comm = rng.random(events) < 0.15
        # one second in five is communication-bound on this rank
        comm |= ((starts // 1_000_000_000) % 5 == rank % 5) & (rng.random(events) < 0.95)
        n = events
        store.insert(qualified(store, TRACE_RUNS), {
            "run_id": ["bench"], "rank": [rank], "host": [f"node{rank // 8}"], "base_time_ns": [t0],
            "time_base": ["relative"], "status": ["complete"], "ingested_at": [time.time()]})
        store.insert(qualified(store, TRACE_EVENTS), {
            "run_id": ["bench"] * n, "rank": [rank] * n, "kind": ["kernel"] * n,
            "kernel_class": np.where(comm, "comm", "compute").tolist(),
            "name": np.where(comm, "ncclDevKernel_AllReduce_Sum_f32_RING_LL", "sm90_gemm").tolist(),
            "device": [rank % 8] * n, "stream": [7] * n, "ts_ns": starts.tolist(), "dur_ns": durs.tolist(),
            "category": ["kernel"] * n, "pid": ["0"] * n, "tid": ["7"] * n})
        ts = np.arange(0, span, 100 * MS)
        m = len(ts)
        store.insert(qualified(store, GPU_SAMPLES), {
            "ts": [encode_ts(t0 + t) for t in ts], "host": [f"node{rank // 8}"] * m, "gpu": [rank % 8] * m,
            "sm_active_ratio": rng.uniform(0.5, 1.0, m).tolist(), "dram_active_ratio": rng.uniform(0, 0.8, m).tolist(),
            "l2_bandwidth_ratio": rng.uniform(0, 0.8, m).tolist(), "gpu_util_ratio": [1.0] * m})
    secs = np.arange(0, int(seconds))
    k = len(secs)
    store.insert(qualified(store, IO_LATENCY), {
        "ts": [encode_ts(t0 + int(s) * 10**9) for s in secs], "host": ["node0"] * k, "device": ["nvme0n1"] * k,
        "source": ["bpftrace"] * k, "op": ["read"] * k, "window_seconds": [1.0] * k,
        "p99_seconds": rng.uniform(0.0005, 0.003, k).tolist(), "queue_depth": rng.uniform(1, 128, k).tolist()})


def baseline(store, ranks: int, t0: int, seconds: float) -> tuple[float, dict[tuple[int, int], float]]:
    """Per (rank, window) comm share with plain Python; returns (seconds, shares)."""
    rows = store.query(f"SELECT rank, kernel_class, ts_ns, ts_ns + dur_ns FROM {qualified(store, TRACE_EVENTS)} "
                       "WHERE run_id = 'bench' ORDER BY rank, ts_ns").rows
    started = time.perf_counter()
    per_rank: dict[int, list[tuple[int, int, str]]] = {}
    for rank, cls, a, b in rows:
        per_rank.setdefault(rank, []).append((a + t0, b + t0, cls))
    out = {}
    w = 100 * MS
    for rank, evs in per_rank.items():
        lo = min(e[0] for e in evs)
        hi = max(e[1] for e in evs)
        comm = sorted((a, b) for a, b, c in evs if c == "comm")
        merged: list[list[int]] = []
        for a, b in comm:
            if merged and a <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], b)
            else:
                merged.append([a, b])
        starts = [m[0] for m in merged]
        ws = lo - lo % w
        while ws < hi:
            a0, b0 = max(ws, lo), min(ws + w, hi)
            i = max(0, bisect.bisect_right(starts, a0) - 1)
            busy = 0
            while i < len(merged) and merged[i][0] < b0:
                busy += max(0, min(b0, merged[i][1]) - max(a0, merged[i][0]))
                i += 1
            out[(rank, ws)] = busy / (b0 - a0)
            ws += w
    return time.perf_counter() - started, out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--events", type=int, default=200_000, help="kernels per rank")
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--json", action="store_true")
    a = p.parse_args()
    rng = np.random.default_rng(7)
    t0 = (time.time_ns() // 10**9 - 3600) * 10**9
    with tempfile.TemporaryDirectory() as tmp:
        store = open_store({"store": {"backend": "embedded", "path": tmp, "database": "bench"}})
        began = time.perf_counter()
        seed(store, a.ranks, a.events, a.seconds, t0, rng)
        seed_s = time.perf_counter() - began
        began = time.perf_counter()
        report = diagnose_stalls(store, t0, t0 + int(a.seconds * 1e9), {}, run_ids=["bench"])
        triscope_s = time.perf_counter() - began
        base_s, shares = baseline(store, a.ranks, t0, a.seconds)
        store.close()
    ours = {}
    for w in report.windows:
        rank = int(w.device[3:]) if w.device.startswith("gpu") else -1
        ours[(rank, w.start_ns - w.start_ns % (100 * MS))] = w.metrics.get("comm_share", float("nan"))
    common = [k for k in shares if k in ours]
    worst = max(abs(ours[k] - shares[k]) for k in common)
    result = {
        "ranks": a.ranks, "events": a.ranks * a.events, "windows": len(report.windows), "seed_s": round(seed_s, 2),
        "triscope_s_incl_sql": round(triscope_s, 3), "baseline_python_s_excl_fetch": round(base_s, 3),
        "speedup_vs_baseline": round(base_s / triscope_s, 2), "max_comm_share_diff": worst,
        "shares": report.share_text(), "windows_per_s": round(len(report.windows) / triscope_s),
    }
    if worst > 1e-9:
        raise SystemExit(f"triscope and the baseline disagree on comm share by {worst}")
    if a.json:
        print(json.dumps(result, indent=2))
    else:
        for k, v in result.items():
            print(f"{k:32s} {v}")


if __name__ == "__main__":
    main()
