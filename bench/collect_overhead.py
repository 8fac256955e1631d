"""Benchmark: NVML sampler CPU cost and gpu_samples write throughput into the embedded store.

1. **Sampler**: :class:`triscope.collectors.nvml.NvmlSampler` over 8 simulated H100s (the
   module-boundary stand-in ``triscope_bed.engines.nvml_standin``: the real ``pynvml`` structs, errors and
   ctypes field-value arrays, simulated library entry points), ``--samples`` samples with traffic
   between them, default config (processes every 1 s). CPU time per sample and per GPU, and the
   share of one core at 10 Hz. Baseline in the same run: the same NVML calls issued directly,
   without the sampler (the floor any Python sampler pays on this stand-in).
   Not included: time inside the real driver (ioctl); ``tools/nvml_check.py`` prints the CPU per
   sample on a real GPU.
2. **Store**: ``--rows`` gpu_samples rows (every column, values as the sampler makes them) into a
   fresh chDB store through ``Store.insert`` in batches of ``--batch`` rows, then through
   :class:`triscope.writer.Writer` (spool with fsync, dedup token). Baseline in the same run:
   ClickHouse generating the same rows itself (``INSERT ... SELECT FROM numbers()``).

Targets: 8 GPUs at 10 Hz < 1 % of one core; >= 1M rows/s through Store.insert.
Usage: ``python bench/collect_overhead.py [--samples 600] [--rows 1000000] [--batch 100000]``.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from triscope.collectors.nvml import NvmlSampler
from triscope.schema import GPU_SAMPLES, encode_ts, qualified
from triscope.store import open_store
from triscope.writer import Writer
from triscope_bed.engines.nvml_standin import FakeGpu, advance, standin

GPUS = 8
HZ = 10.0
T0_NS = 1_767_225_600_000_000_000  # 2026-01-01T00:00:00Z


def fleet() -> list[FakeGpu]:
    return [FakeGpu(uuid=f"GPU-{i:08x}-0000-0000-0000-000000000000", used=(20000 + 5000 * i) << 20,
                    processes=[(4000 + i, (19000 + 5000 * i) << 20)]) for i in range(GPUS)]


def bench_sampler(samples: int) -> dict[str, float]:
    """CPU seconds per sample: the sampler, and the bare NVML calls it makes (baseline)."""
    gpus = fleet()
    nv = standin(gpus)
    sampler = NvmlSampler({"nvml": {"host": "bench", "interval_s": 1 / HZ}}, nvml=nv)
    sampler.start()
    assert sampler.state == "ok" and len(sampler.devices) == GPUS, sampler.reason
    cpu = 0.0
    rows = 0
    for i in range(samples):
        advance(gpus, nv.clock, 1 / HZ, pcie_tx_bps=2e9, pcie_rx_bps=5e8, nvlink_tx_bps=1e11, nvlink_rx_bps=1e11)
        t0 = time.process_time()
        out = sampler.sample_once(now_ns=T0_NS + i * 100_000_000)
        cpu += time.process_time() - t0
        rows += len(out[GPU_SAMPLES]["ts"])
    assert rows == samples * GPUS
    sampler.close()

    # baseline: the same entry points, called directly (no row building, no error handling)
    gpus = fleet()
    nv = standin(gpus)
    nv.nvmlInit()
    handles = [nv.nvmlDeviceGetHandleByIndex(i) for i in range(GPUS)]
    fields = [(nv.NVML_FI_DEV_POWER_INSTANT, 0), (nv.NVML_FI_DEV_PCIE_COUNT_TX_BYTES, 0),
              (nv.NVML_FI_DEV_PCIE_COUNT_RX_BYTES, 0), (nv.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, 0xFFFFFFFF),
              (nv.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX, 0xFFFFFFFF), (nv.NVML_FI_DEV_ECC_SBE_VOL_TOTAL, 0),
              (nv.NVML_FI_DEV_ECC_DBE_VOL_TOTAL, 0)]
    gpm = [(nv.nvmlGpmSampleAlloc(), nv.nvmlGpmSampleAlloc()) for _ in handles]
    base = 0.0
    for i in range(samples):
        advance(gpus, nv.clock, 1 / HZ)
        t0 = time.process_time()
        for h, (s1, s2) in zip(handles, gpm, strict=True):
            nv.nvmlDeviceGetMemoryInfo(h, nv.nvmlMemory_v2)
            nv.nvmlDeviceGetUtilizationRates(h)
            nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM)
            nv.nvmlDeviceGetTemperatureV(h, nv.NVML_TEMPERATURE_GPU)
            nv.nvmlDeviceGetCurrentClocksEventReasons(h)
            nv.nvmlDeviceGetFieldValues(h, fields)
            nv.nvmlGpmSampleGet(h, s2 if i % 2 else s1)
            if i:
                mg = nv.c_nvmlGpmMetricsGet_t()
                mg.version = nv.NVML_GPM_METRICS_GET_VERSION
                mg.numMetrics = 3
                for k, metric in enumerate((2, 3, 10)):
                    mg.metrics[k].metricId = metric
                mg.sample1, mg.sample2 = (s1, s2) if i % 2 else (s2, s1)
                nv.nvmlGpmMetricsGet(mg)
            if i % 10 == 0:
                nv.nvmlDeviceGetComputeRunningProcesses(h)
        base += time.process_time() - t0
    return {"sampler_s": cpu / samples, "baseline_s": base / samples}


def columns_like_sampler(n: int, start_ns: int) -> dict[str, list[Any]]:
    """``n`` gpu_samples rows (8 GPUs at 10 Hz) with the sampler's value types in every column."""
    gpus = fleet()
    nv = standin(gpus)
    sampler = NvmlSampler({"nvml": {"host": "bench"}}, nvml=nv)
    sampler.start()
    sampler.sample_once(now_ns=start_ns)
    advance(gpus, nv.clock, 0.1, pcie_tx_bps=2e9, pcie_rx_bps=5e8, nvlink_tx_bps=1e11, nvlink_rx_bps=1e11)
    one = sampler.sample_once(now_ns=start_ns)[GPU_SAMPLES]
    sampler.close()
    reps = -(-n // GPUS)
    cols = {c: (v * reps)[:n] for c, v in one.items()}
    cols["ts"] = [encode_ts(start_ns + (i // GPUS) * 100_000_000) for i in range(n)]
    return cols


def bench_store(rows: int, batch: int, path: Path, repeat: int = 3) -> dict[str, float]:
    """Rows per second (best of ``repeat``): native generation (baseline), Store.insert, Writer (spool + insert)."""
    store = open_store({"store": {"backend": "embedded", "path": str(path / "db"), "database": "bench"}})
    table = qualified(store, GPU_SAMPLES)
    nb = -(-rows // batch)
    batches = [columns_like_sampler(min(batch, rows - b * batch), T0_NS + b * (batch // GPUS) * 100_000_000)
               for b in range(nb)]
    select = ", ".join({
        "ts": "fromUnixTimestamp64Nano(toInt64({t0:Int64} + intDiv(number, 8) * 100000000))",
        "host": "'bench'", "gpu": "toUInt16(number % 8)", "gpu_uuid": "concat('GPU-', toString(number % 8))",
        "gpu_model": "'NVIDIA H100 80GB HBM3'", "source": "'nvml'", "state": "'ok'", "pod": "''",
        "namespace": "''", "container": "''", "error": "''", "clock_event_reasons": "toUInt64(32)",
        "mig_instance": "''", "mig_profile": "''",
    }.get(c, "toFloat64(number % 1000) * 1.5") for c in GPU_SAMPLES.column_names())

    def timed(fn: Any) -> float:
        """Best wall time of ``repeat`` runs into an emptied table, checking the row count each time."""
        best = float("inf")
        for _ in range(repeat):
            store.command(f"TRUNCATE TABLE {table}")
            t0 = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t0)
            got = int(store.query(f"SELECT count() FROM {table}").rows[0][0])
            assert got == rows, got
        return best

    def direct() -> None:
        for cols in batches:
            store.insert(table, cols)

    def via_writer() -> None:
        spool = path / "spool"
        shutil.rmtree(spool, ignore_errors=True)
        writer = Writer(store, str(spool), batch_rows=batch, fsync=True)
        writer.start()
        for cols in batches:
            writer.submit(GPU_SAMPLES, cols)
        assert writer.flush(timeout_s=600)
        writer.close()

    store.insert(table, {c: v[:1000] for c, v in batches[0].items()})  # warm-up: first Python() scan
    native = timed(lambda: store.command(f"INSERT INTO {table} SELECT {select} FROM numbers({rows})",
                                         {"t0": T0_NS}))
    t_direct = timed(direct)
    t_writer = timed(via_writer)
    store.close()
    return {"native": rows / native, "insert": rows / t_direct, "writer": rows / t_writer}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=600)
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--batch", type=int, default=100_000)
    ap.add_argument("--repeat", type=int, default=3, help="store timings: best of this many runs")
    ap.add_argument("--path", help="store + spool directory (default: a temporary one)")
    args = ap.parse_args(argv)
    if args.batch < 100_000:
        ap.error("--batch must be >= 100000 (the writer's batch size)")

    s = bench_sampler(args.samples)
    core_pct = s["sampler_s"] * HZ * 100
    print(f"NVML sampler, {GPUS} simulated GPUs, {args.samples} samples:")
    print(f"  CPU per sample     {s['sampler_s'] * 1e3:8.3f} ms   ({s['sampler_s'] * 1e6 / GPUS:.1f} us per GPU)")
    print(f"  bare NVML calls    {s['baseline_s'] * 1e3:8.3f} ms   (baseline; sampler / baseline = "
          f"{s['sampler_s'] / s['baseline_s']:.2f}x)")
    print(f"  at {HZ:g} Hz           {core_pct:8.3f} % of one core   target < 1 %: ratio {core_pct / 1.0:.2f} "
          f"-> {'PASS' if core_pct < 1.0 else 'FAIL'}")

    tmp = Path(args.path) if args.path else Path(tempfile.mkdtemp(prefix="triscope-bench-"))
    try:
        r = bench_store(args.rows, args.batch, tmp, args.repeat)
    finally:
        if not args.path:
            shutil.rmtree(tmp, ignore_errors=True)
    print(f"gpu_samples into the embedded store, {args.rows:,} rows ({len(GPU_SAMPLES.columns)} columns), "
          f"batches of {args.batch:,}, best of {args.repeat}:")
    print(f"  native INSERT SELECT  {r['native']:12,.0f} rows/s   (baseline)")
    print(f"  Store.insert          {r['insert']:12,.0f} rows/s   {r['insert'] / r['native']:.2f}x baseline; "
          f"target >= 1M rows/s: ratio {r['insert'] / 1e6:.2f} -> {'PASS' if r['insert'] >= 1e6 else 'FAIL'}")
    print(f"  Writer (spool+fsync)  {r['writer']:12,.0f} rows/s   {r['writer'] / r['native']:.2f}x baseline; "
          f"ratio vs 1M rows/s {r['writer'] / 1e6:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
