"""Rows of a GPU fleet's day in the shapes triscope's collectors write them, generated in time chunks.

Values follow the collectors' sources, at their precision, not constant columns:

- ``gpu_samples`` (nvml at 10 Hz on half the hosts, dcgm at 1 Hz on the other half): a per-GPU load
  (diurnal cycle, slow waves, noise) drives NVML's integer utilisation percent, power in milliwatts,
  integer degrees, SM clock steps in MHz under throttle, MiB-granular memory that moves with the KV
  cache, GPM/DCGM activity ratios (full-precision floats), PCIe/NVLink rates from counter deltas over
  the measured interval (full-precision floats); every GPU of a host shares its tick's stamp (the
  sampler reads all devices per tick), ``time_ns()`` with wake-up jitter snapped to the tick grid by the
  collectors' :class:`~triscope.tick_clock.TickClock` (the same code, vectorised here).
- ``serving_metrics``: one scrape per backend per second (vLLM gauges, counters, histogram-delta
  percentiles that are NaN when nothing finished), backends offset, stamped like the GPU samples (the
  scraper takes its stamp when its tick wakes, before any fetch).
- ``requests``: spans at the fleet's request rate, random ids, log-normal latencies.
- ``io_latency``: per host, two devices, read/write windows of 1 s. ``weights_history``: one row per
  backend per engine update (1 s).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from triscope.tick_clock import tolerance_ns

MiB = 1 << 20
GPUS_PER_HOST = 8


@dataclass(frozen=True)
class Fleet:
    gpus: int
    backends: int
    requests_per_s: float
    t0: float
    seconds: int
    seed: int = 7

    @property
    def hosts(self) -> int:
        return max(1, self.gpus // GPUS_PER_HOST)


def snap_grid(raw_ns: np.ndarray, period_s: float, last_ns: np.ndarray) -> np.ndarray:
    """``TickClock`` over each column of ``raw_ns`` (ticks x series, int64 ns), continuing from
    ``last_ns`` (one per series, 0 = none yet; updated in place): a stamp within tolerance of the previous
    stamp plus one period goes onto that grid point, another starts a new grid."""
    period = round(period_s * 1e9)
    tol = tolerance_ns(period)
    out = raw_ns.copy()
    for j in range(raw_ns.shape[1]):
        col, i, prev = raw_ns[:, j], 0, int(last_ns[j])
        while i < len(col):
            if prev == 0:
                prev, i = int(col[i]), i + 1
                continue
            grid = prev + period * np.arange(1, len(col) - i + 1, dtype=np.int64)
            bad = np.flatnonzero(np.abs(col[i:] - grid) > tol)
            end = len(col) if bad.size == 0 else i + int(bad[0])
            out[i:end, j] = grid[:end - i]
            if end < len(col):  # off the grid: kept as measured, a new grid from it
                prev, i = int(col[end]), end + 1
            else:
                prev, i = int(grid[end - i - 1]), end
        last_ns[j] = prev
    return out


def stamps(ns: np.ndarray) -> list[str]:
    """Epoch nanoseconds as the DateTime64(9) text the collectors hand the writer (exact to the ns)."""
    return np.datetime_as_string(ns.ravel().astype("datetime64[ns]"), unit="ns").tolist()


def _names(prefix: str, n: int) -> np.ndarray:
    return np.array([f"{prefix}{i:04d}" for i in range(n)], dtype=object)


def _load(rng: np.random.Generator, t: np.ndarray, phase: np.ndarray, wave: np.ndarray) -> np.ndarray:
    """Load 0..1 for times ``t`` (shape ticks x 1) and series (1 x n): diurnal + slow waves + noise."""
    day = 0.5 + 0.3 * np.sin(2 * np.pi * (t / 86400.0 + phase))
    slow = 0.12 * np.sin(2 * np.pi * t / wave) + 0.05 * np.sin(2 * np.pi * t / (wave * 0.13) + phase * 7)
    return np.clip(day + slow + rng.normal(0, 0.06, (t.shape[0], phase.shape[1])), 0, 1)


def gpu_chunks(f: Fleet, hz: float, source: str, hosts: range, chunk_s: int) -> Iterator[dict[str, Any]]:
    """``gpu_samples`` columns for the GPUs of ``hosts`` sampling at ``hz``, ``chunk_s`` seconds a batch."""
    rng = np.random.default_rng(f.seed + int(hz * 10) + hosts.start)
    n = len(hosts) * GPUS_PER_HOST
    if n == 0:
        return
    host_names = _names("gpu-node-", f.hosts)[np.repeat(np.array(hosts), GPUS_PER_HOST)]
    gpu_idx = np.tile(np.arange(GPUS_PER_HOST), len(hosts))
    uuids = np.array([f"GPU-{h:04x}{g:04x}-f2a7-269e-6513-0c5ca6a3a450" for h in hosts for g in range(8)], dtype=object)
    phase = rng.uniform(0, 0.2, (1, n)) + np.repeat(rng.uniform(0, 1, len(hosts)), 8)[None, :]
    wave = rng.uniform(600, 3600, (1, n))
    mem_base = rng.integers(60000, 74000, (1, n))
    ticks_total = int(f.seconds * hz)
    per_chunk = max(1, int(chunk_s * hz))
    pods = np.array([f"vllm-{h:04d}-{g}" for h in hosts for g in range(8)], dtype=object)
    temp = np.full((1, n), 45.0)
    host_offset_ns = np.rint(rng.uniform(0, 1 / hz, len(hosts)) * 1e9).astype(np.int64)
    last = np.zeros(len(hosts), dtype=np.int64)
    for start in range(0, ticks_total, per_chunk):
        k = min(per_chunk, ticks_total - start)
        t_rel = (start + np.arange(k))[:, None] / hz
        jitter = rng.normal(0, 150e-6, (k, len(hosts))).clip(-1e-3, 5e-3)
        tick_ns = (round(f.t0 * 1e9) + (start + np.arange(k, dtype=np.int64))[:, None] * round(1e9 / hz)
                   + host_offset_ns[None, :] + np.rint(jitter * 1e9).astype(np.int64))
        ts = np.repeat(snap_grid(tick_ns, 1 / hz, last), GPUS_PER_HOST, axis=1)
        load = _load(rng, f.t0 + t_rel, phase, wave)
        util = np.rint(load * 100)
        throttle = load > 0.93
        temp = np.rint(40 + 38 * load + rng.normal(0, 0.4, load.shape))
        power_mw = np.rint((85 + 600 * load + rng.normal(0, 6, load.shape)) * 1000)
        mem = (mem_base + np.rint(3000 * load / 256) * 256) * MiB
        dt_s = 1 / hz + rng.normal(0, 2e-4, load.shape)
        pcie_tx = np.rint(load * 2.4e9 * dt_s * rng.uniform(0.9, 1.1, load.shape)) / dt_s
        pcie_rx = np.rint(load * 0.8e9 * dt_s * rng.uniform(0.9, 1.1, load.shape)) / dt_s
        nvl_tx = np.rint(load * 40e9 * dt_s / 1024) * 1024 / dt_s
        nvl_rx = np.rint(load * 38e9 * dt_s / 1024) * 1024 / dt_s
        sm_active = np.clip(load * 0.92 + rng.normal(0, 0.01, load.shape), 0, 1)
        if source == "dcgm":  # dcgm-exporter prints 6 decimals
            sm_active = np.round(sm_active, 6)
        rows = k * n
        flat: dict[str, Any] = {
            "ts": stamps(ts), "host": np.tile(host_names, k), "gpu": np.tile(gpu_idx, k),
            "gpu_uuid": np.tile(uuids, k), "gpu_model": ["NVIDIA H100 80GB HBM3"] * rows, "source": [source] * rows,
            "memory_used_bytes": mem.ravel().astype(float), "memory_total_bytes": [81559.0 * MiB] * rows,
            "memory_reserved_bytes": [553.0 * MiB] * rows,
            "gpu_util_ratio": (util / 100).ravel(), "memory_util_ratio": (np.rint(util * 0.45) / 100).ravel(),
            "sm_active_ratio": sm_active.ravel(), "sm_occupancy_ratio": (sm_active * 0.48).ravel(),
            "dram_active_ratio": (sm_active * 0.37).ravel(), "l2_bandwidth_ratio": [float("nan")] * rows,
            "sm_clock_hz": (np.where(throttle, 1755, 1980) * 1e6).ravel(),
            "power_watts": (power_mw / 1000).ravel(), "temperature_celsius": temp.ravel(),
            "clock_event_reasons": np.where(throttle, 0x20, np.where(load < 0.05, 0x1, 0)).ravel(),
            "pcie_tx_bytes_per_second": pcie_tx.ravel(), "pcie_rx_bytes_per_second": pcie_rx.ravel(),
            "nvlink_tx_bytes_per_second": nvl_tx.ravel(), "nvlink_rx_bytes_per_second": nvl_rx.ravel(),
            "ecc_corrected_total": [3.0] * rows, "ecc_uncorrected_total": [0.0] * rows, "state": ["ok"] * rows,
        }
        if source == "dcgm":
            flat.update(pod=np.tile(pods, k), namespace=["inference"] * rows, container=["vllm"] * rows)
        yield flat


def serving_chunks(f: Fleet, chunk_s: int) -> Iterator[dict[str, Any]]:
    """``serving_metrics``: one scrape per backend per second (offset per backend, jittered)."""
    rng = np.random.default_rng(f.seed + 1)
    n = f.backends
    backends = np.array([f"10.{i // 65536}.{i // 256 % 256}.{i % 256}:8000" for i in range(n)], dtype=object)
    offset = rng.uniform(0, 1, (1, n))
    phase, wave = rng.uniform(0, 1, (1, n)), rng.uniform(600, 3600, (1, n))
    total = np.rint(rng.uniform(0, 1e5, (1, n)))
    preempt = np.zeros((1, n))
    last = np.zeros(n, dtype=np.int64)
    for start in range(0, f.seconds, chunk_s):
        k = min(chunk_s, f.seconds - start)
        t = (start + np.arange(k))[:, None].astype(float)
        tick_ns = (round(f.t0 * 1e9) + (start + np.arange(k, dtype=np.int64))[:, None] * 10**9
                   + np.rint(offset * 1e9).astype(np.int64) + np.rint(rng.normal(0, 150e-6, (k, n)).clip(-1e-3, 5e-3)
                                                                  * 1e9).astype(np.int64))
        ts = snap_grid(tick_ns, 1.0, last)
        load = _load(rng, f.t0 + t, phase, wave)
        finished = rng.poisson(load * 12)
        total = total[-1:] + np.cumsum(finished, axis=0)
        preempt = preempt[-1:] + np.cumsum(rng.random((k, n)) < load * 0.002, axis=0)
        running = np.rint(load * 180)
        queue = np.rint(np.maximum(0, (load - 0.7) * 200 + rng.normal(0, 3, (k, n))))
        none = finished == 0
        p50 = np.where(none, np.nan, rng.lognormal(np.log(2 + 4 * load), 0.3))
        p99 = np.where(none, np.nan, p50 * rng.uniform(1.5, 3, (k, n)))
        rows = k * n
        yield {
            "ts": stamps(ts), "host": np.tile(np.array([f"gpu-node-{i // 8:04d}" for i in range(n)], dtype=object), k),
            "backend": np.tile(backends, k), "server": ["vllm"] * rows, "model": ["meta-llama/Llama-3.1-8B"] * rows,
            "queue_length": queue.ravel(), "running_requests": running.ravel(),
            # vLLM: 1 - free / total KV blocks, so a multiple of 1 / blocks
            "kv_cache_usage_ratio": (np.rint(np.clip(load * 0.9 + rng.normal(0, 0.02, (k, n)), 0, 1) * 21_000)
                                     / 21_000).ravel(),
            "requests_total": total.ravel(), "latency_p50_seconds": p50.ravel(), "latency_p99_seconds": p99.ravel(),
            "ttft_p99_seconds": (p99 * 0.08).ravel(), "preemptions_total": preempt.ravel(),
            "sleep_state": [0.0] * rows, "waiting_capacity": queue.ravel(), "waiting_deferred": [0.0] * rows,
            "swapped_requests": [float("nan")] * rows, "queue_time_p99_seconds": (np.maximum(queue, 0) * 0.05).ravel(),
            "itl_p99_seconds": np.where(none, np.nan, rng.lognormal(np.log(0.03), 0.2, (k, n))).ravel(),
        }


def request_chunks(f: Fleet, chunk_s: int) -> Iterator[dict[str, Any]]:
    """``requests``: spans at ``requests_per_s`` spread over the backends."""
    rng = np.random.default_rng(f.seed + 2)
    backends = np.array([f"10.{i // 65536}.{i // 256 % 256}.{i % 256}:8000" for i in range(f.backends)], dtype=object)
    for start in range(0, f.seconds, chunk_s):
        k = min(chunk_s, f.seconds - start)
        m = int(rng.poisson(f.requests_per_s * k))
        ts = np.sort(f.t0 + start + rng.uniform(0, k, m))
        b = rng.integers(0, f.backends, m)
        prompt = rng.integers(20, 4000, m)
        completion = rng.integers(1, 1000, m)
        ttft = rng.lognormal(np.log(0.15), 0.5, m)
        decode = completion * rng.lognormal(np.log(0.025), 0.2, m)
        queue = rng.exponential(0.05, m)
        hexes = rng.integers(0, 2**63, (m, 3))
        ok = rng.random(m) > 0.01
        yield {
            "ts": ts, "host": [f"gpu-node-{i // 8:04d}" for i in b], "backend": backends[b], "gpu": (b % 8).astype(str),
            "model": ["meta-llama/Llama-3.1-8B"] * m, "model_version": ["v1"] * m, "modality": ["text"] * m,
            "request_class": ["interactive_text"] * m,
            "request_id": [f"chatcmpl-{x:016x}" for x in hexes[:, 0]],
            "trace_id": [f"{x:016x}{y:016x}" for x, y in zip(hexes[:, 1], hexes[:, 0], strict=True)],
            "span_id": [f"{x:016x}" for x in hexes[:, 2]], "span_name": ["chat meta-llama/Llama-3.1-8B"] * m,
            "latency_seconds": queue + ttft + decode, "ttft_seconds": queue + ttft, "queue_seconds": queue,
            "prefill_seconds": ttft, "decode_seconds": decode, "prompt_tokens": prompt, "completion_tokens": completion,
            "status": np.where(ok, "ok", "error"), "service_name": ["vllm"] * m, "operation": ["chat"] * m,
        }


def io_chunks(f: Fleet, chunk_s: int) -> Iterator[dict[str, Any]]:
    """``io_latency``: per host, nvme0n1 and nvme1n1, read and write, 1 s windows."""
    rng = np.random.default_rng(f.seed + 3)
    series = [(h, d, op) for h in range(f.hosts) for d in ("nvme0n1", "nvme1n1") for op in ("read", "write")]
    n = len(series)
    for start in range(0, f.seconds, chunk_s):
        k = min(chunk_s, f.seconds - start)
        ts = (f.t0 + start + np.arange(k))[:, None] + rng.normal(0, 1e-4, (k, n))
        ios = rng.poisson(200, (k, n)).astype(float)
        p50 = rng.lognormal(np.log(8e-5), 0.2, (k, n))
        yield {
            "ts": ts.ravel(), "host": [f"gpu-node-{s[0]:04d}" for s in series] * k,
            "device": [s[1] for s in series] * k,
            "source": ["bpftrace"] * (k * n), "op": [s[2] for s in series] * k, "window_seconds": [1.0] * (k * n),
            "ios": ios.ravel(), "p50_seconds": p50.ravel(), "p99_seconds": (p50 * rng.uniform(3, 8, (k, n))).ravel(),
            "mean_seconds": (p50 * 1.3).ravel(), "queue_depth": (ios * p50 * 1.3).ravel(),
        }


def weights_chunks(f: Fleet, chunk_s: int) -> Iterator[dict[str, Any]]:
    """``weights_history``: one row per backend per engine update (1 s)."""
    rng = np.random.default_rng(f.seed + 4)
    n = f.backends
    backends = np.array([f"10.{i // 65536}.{i // 256 % 256}.{i % 256}:8000" for i in range(n)], dtype=object)
    phase, wave = rng.uniform(0, 1, (1, n)), rng.uniform(600, 3600, (1, n))
    for start in range(0, f.seconds, chunk_s):
        k = min(chunk_s, f.seconds - start)
        t = (start + np.arange(k))[:, None].astype(float)
        load = _load(rng, f.t0 + t, phase, wave)
        target = np.clip(1.1 - load, 0, 1)
        weight = np.round(target, 4)
        rows = k * n
        yield {
            "ts": np.repeat(f.t0 + t.ravel() + 0.0123, n), "backend": np.tile(backends, k),
            "weight": weight.ravel(), "target": target.ravel(), "lb_weight": np.rint(weight * 256).ravel().astype(int),
            "state": ["ready"] * rows, "reasons": [""] * rows, "factor_memory": [1.0] * rows,
            "factor_kv_cache": (1 - load * 0.5).ravel(), "factor_load": (1 - load * 0.7).ravel(),
            "factor_latency": [1.0] * rows, "memory_used_ratio": (0.85 + load * 0.05).ravel(),
            "kv_cache_usage_ratio": (load * 0.9).ravel(), "qps": (load * 12).ravel(),
            "input_age_seconds": rng.uniform(0, 1, rows), "stale": [0] * rows,
            "version": np.repeat(start + np.arange(k), n),
        }
