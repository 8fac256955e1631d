"""GPU samples (NVML, dcgm-exporter), per-process GPU memory and torch allocator samples.

Conventions for every time-series table in triscope: ``ts`` is ``DateTime64(9, 'UTC')``;
a float that a source could not measure is NaN (aggregate with ``...If(x, isFinite(x))``);
units are in the column names (``_bytes``, ``_seconds``, ``_ratio`` in 0..1, ``_hz``, ``_watts``).
"""

from triscope.schema.latest import Latest, create_latest
from triscope.schema.model import (
    Column,
    Migration,
    Table,
    add_columns,
    create_tables,
    set_codecs,
    set_types,
)
from triscope.schema.rollup import Rollup, add_rollup_gauges, create_rollups

DOMAIN = "gpu"

TS = Column("ts", "DateTime64(9, 'UTC')", codec="Delta, ZSTD(1)")
HOST = Column("host", "LowCardinality(String)")
RATE_NOTE = ("counter delta over the measured interval; Float32 keeps 7 significant digits, finer than a rate "
             "over a jittered interval, at half the bytes of a Float64 (docs/scaling.md)")

GPU_SAMPLES = Table(
    name="gpu_samples",
    columns=[
        TS, HOST,
        Column("gpu", "UInt16", "device index on the host"),
        Column("gpu_uuid", "LowCardinality(String)"),
        Column("gpu_model", "LowCardinality(String)"),
        Column("source", "LowCardinality(String)", "nvml or dcgm"),
        Column("memory_used_bytes", "Float64"),
        Column("memory_total_bytes", "Float64"),
        Column("memory_reserved_bytes", "Float64"),
        Column("gpu_util_ratio", "Float32"),
        Column("memory_util_ratio", "Float32"),
        Column("sm_active_ratio", "Float32", "DCGM PROF_SM_ACTIVE or NVML GPM SM activity"),
        Column("sm_occupancy_ratio", "Float32", "DCGM PROF_SM_OCCUPANCY or NVML GPM occupancy"),
        Column("dram_active_ratio", "Float32", "DCGM PROF_DRAM_ACTIVE: fraction of peak DRAM bandwidth"),
        Column("l2_bandwidth_ratio", "Float32", "fraction of peak L2 bandwidth when known"),
        Column("sm_clock_hz", "Float64"),
        Column("power_watts", "Float32"),
        Column("temperature_celsius", "Float32"),
        Column("clock_event_reasons", "UInt64", "NVML clock event (throttle) reason bitmask", codec="T64, ZSTD(1)"),
        Column("pcie_tx_bytes_per_second", "Float32", RATE_NOTE),
        Column("pcie_rx_bytes_per_second", "Float32", RATE_NOTE),
        Column("nvlink_tx_bytes_per_second", "Float32", RATE_NOTE),
        Column("nvlink_rx_bytes_per_second", "Float32", RATE_NOTE),
        Column("ecc_corrected_total", "Float64", codec="Gorilla, ZSTD(1)"),
        Column("ecc_uncorrected_total", "Float64", codec="Gorilla, ZSTD(1)"),
        Column("state", "LowCardinality(String)", "ok, lost, unavailable"),
        Column("pod", "LowCardinality(String)", "Kubernetes pod using the GPU (dcgm-exporter -k), comma-joined",
               since=2),
        Column("namespace", "LowCardinality(String)", "Kubernetes namespace of that pod", since=2),
        Column("container", "LowCardinality(String)", "Kubernetes container of that pod", since=2),
        Column("error", "String", "one-line reason when state is not ok", since=2),
        Column("mig_instance", "LowCardinality(String)", "MIG GPU instance id (dcgm GPU_I_ID); '' = whole GPU",
               since=4),
        Column("mig_profile", "LowCardinality(String)", "MIG profile of that instance (GPU_I_PROFILE)", since=4),
    ],
    order_by="host, gpu, ts",
    partition_by="toYYYYMMDD(ts)",
    retention="raw",
    codec="ZSTD(1)",
)


GPU_PROCESS_MEMORY = Table(
    name="gpu_process_memory",
    columns=[TS, HOST, Column("gpu", "UInt16"), Column("pid", "UInt32", codec="T64, ZSTD(1)"),
             Column("process_name", "LowCardinality(String)"), Column("used_bytes", "Float64")],
    order_by="host, gpu, ts, pid",
    partition_by="toYYYYMMDD(ts)",
    retention="raw",
    codec="ZSTD(1)",
)

ALLOCATOR_SAMPLES = Table(
    name="allocator_samples",
    columns=[
        TS, HOST, Column("gpu", "UInt16"), Column("pid", "UInt32"),
        Column("allocated_bytes", "Float64"),
        Column("reserved_bytes", "Float64"),
        Column("inactive_split_bytes", "Float64"),
        Column("alloc_retries_total", "UInt64", codec="T64, ZSTD(1)"),
        Column("ooms_total", "UInt64", codec="T64, ZSTD(1)"),
        Column("fragmentation_ratio", "Float32", "1 - allocated/reserved"),
        Column("active_bytes", "Float64",
               "torch allocator active blocks: allocated, or freed but awaiting stream events", since=3),
    ],
    order_by="host, gpu, pid, ts",
    partition_by="toYYYYMMDD(ts)",
    retention="raw",
    codec="ZSTD(1)",
)


GPU_GAUGES = ("memory_used_bytes", "memory_total_bytes", "gpu_util_ratio", "memory_util_ratio", "sm_active_ratio",
              "sm_occupancy_ratio", "dram_active_ratio", "power_watts", "temperature_celsius", "l2_bandwidth_ratio")
"""The gauges the boards average over hours; the rollups keep their sum, count, min and max."""
GPU_GAUGES_SINCE = (("l2_bandwidth_ratio", 9),)
"""Gauges added to the rollups after they were created (the stall rule's L2 bandwidth)."""
GPU_KEYS = ("host", "gpu", "mig_instance", "source")
GPU_SAMPLES_10S = Rollup(GPU_SAMPLES, 10, GPU_KEYS, GPU_GAUGES, GPU_GAUGES_SINCE)
GPU_SAMPLES_1M = Rollup(GPU_SAMPLES, 60, GPU_KEYS, GPU_GAUGES, GPU_GAUGES_SINCE)
GPU_LATEST = Latest(GPU_SAMPLES, ("host", "gpu"), ("gpu_uuid", "memory_used_bytes", "memory_total_bytes", "state"))
"""Each GPU's newest sample of what the weight engine reads (its memory and state)."""


MIGRATIONS = [
    Migration(1, "gpu samples, process memory, allocator",
              create_tables(GPU_SAMPLES, GPU_PROCESS_MEMORY, ALLOCATOR_SAMPLES, version=1)),
    Migration(2, "gpu samples: kubernetes pod labels and error text", add_columns(GPU_SAMPLES, 2)),
    Migration(3, "allocator samples: active bytes", add_columns(ALLOCATOR_SAMPLES, 3)),
    Migration(4, "gpu samples: MIG instance and profile (dcgm)", add_columns(GPU_SAMPLES, 4)),
    Migration(5, "gpu samples, process memory, allocator: per-column codecs (Delta timestamps, ZSTD, Gorilla rates)",
              set_codecs(GPU_SAMPLES, GPU_PROCESS_MEMORY, ALLOCATOR_SAMPLES)),
    Migration(6, "gpu samples: 10 s and 1 min rollups (materialized views, backfilled)",
              create_rollups(GPU_SAMPLES_10S, GPU_SAMPLES_1M, version=6)),
    Migration(7, "gpu samples: PCIe and NVLink rates as Float32",
              set_types(GPU_SAMPLES, *(f"{link}_{way}_bytes_per_second" for link in ("pcie", "nvlink")
                                        for way in ("tx", "rx")))),
    Migration(8, "gpu samples: newest sample per GPU (materialized view, backfilled)", create_latest(GPU_LATEST)),
    Migration(9, "gpu samples rollups: L2 bandwidth (the compute-bound rule's), backfilled",
              add_rollup_gauges(GPU_SAMPLES_10S, GPU_SAMPLES_1M, version=9)),
]
