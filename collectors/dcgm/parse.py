"""dcgm-exporter text: the DCGM series triscope maps, blank values, and a tolerant line parser.

The parser (:func:`triscope.prom_text.scan`) reads Prometheus text as dcgm-exporter writes it and
as a Prometheus ``/federate`` endpoint re-exports it (sorted labels, a millisecond timestamp per
sample). A malformed line is counted and skipped, never fatal. Metric names match
case-insensitively (some relabelling setups lower-case them); labels are kept as they are.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from triscope.prom_text import Parsed, scan

MiB = float(1 << 20)

# DCGM blank values (dcgm_structs.h, DCGM_BLANK_VALUES): base + 0..15 (NOT_FOUND +1, NOT_SUPPORTED +2, ...).
DCGM_INT32_BLANK = 0x7FFFFFF0
DCGM_INT64_BLANK = 0x7FFFFFFFFFFFFFF0
DCGM_FP64_BLANK = 140737488355328.0  # 2**47


def is_blank(value: float, small: bool) -> bool:
    """True for a DCGM blank/sentinel value; ``small``: the field cannot legitimately reach 2**31."""
    if not math.isfinite(value):
        return True
    if value >= float(DCGM_INT64_BLANK):  # as parsed to float every int64 blank rounds to 2**63
        return True
    if DCGM_FP64_BLANK <= value < DCGM_FP64_BLANK + 16:
        return True
    return small and DCGM_INT32_BLANK <= value <= 0x7FFFFFFF


@dataclass(frozen=True)
class Field:
    """How one DCGM series lands in a column: ``column = value * scale / div``; lower ``rank`` wins."""

    column: str
    scale: float = 1.0
    div: float = 1.0
    rank: int = 0
    small: bool = True  # int32 blanks apply (gauges far below 2**31)


FIELDS: dict[str, Field] = {
    "DCGM_FI_DEV_FB_USED": Field("memory_used_bytes", MiB),
    "DCGM_FI_DEV_FB_TOTAL": Field("memory_total_bytes", MiB),
    "DCGM_FI_DEV_FB_RESERVED": Field("memory_reserved_bytes", MiB),
    "DCGM_FI_DEV_FB_FREE": Field("_fb_free_bytes", MiB),  # total = used + free + reserved without FB_TOTAL
    "DCGM_FI_DEV_GPU_UTIL": Field("gpu_util_ratio", div=100.0),  # percent
    # Busy-time ratio like GPU_UTIL; the one utilisation DCGM reports for MIG instances.
    "DCGM_FI_PROF_GR_ENGINE_ACTIVE": Field("gpu_util_ratio", rank=1),
    "DCGM_FI_DEV_MEM_COPY_UTIL": Field("memory_util_ratio", div=100.0),
    "DCGM_FI_PROF_SM_ACTIVE": Field("sm_active_ratio"),
    "DCGM_FI_PROF_SM_OCCUPANCY": Field("sm_occupancy_ratio"),
    "DCGM_FI_PROF_DRAM_ACTIVE": Field("dram_active_ratio"),
    "DCGM_FI_DEV_SM_CLOCK": Field("sm_clock_hz", 1e6),
    "DCGM_FI_DEV_POWER_USAGE": Field("power_watts"),
    "DCGM_FI_DEV_POWER_USAGE_INSTANT": Field("power_watts", rank=1),
    "DCGM_FI_DEV_GPU_TEMP": Field("temperature_celsius"),
    "DCGM_FI_DEV_CLOCKS_EVENT_REASONS": Field("clock_event_reasons"),
    "DCGM_FI_DEV_CLOCK_THROTTLE_REASONS": Field("clock_event_reasons", rank=1),  # pre-3.3 name
    "DCGM_FI_PROF_PCIE_TX_BYTES": Field("pcie_tx_bytes_per_second", small=False),  # bytes/s (DCP)
    "DCGM_FI_PROF_PCIE_RX_BYTES": Field("pcie_rx_bytes_per_second", small=False),
    "DCGM_FI_DEV_PCIE_TX_THROUGHPUT": Field("pcie_tx_bytes_per_second", 1024.0, rank=1, small=False),  # KB/s
    "DCGM_FI_DEV_PCIE_RX_THROUGHPUT": Field("pcie_rx_bytes_per_second", 1024.0, rank=1, small=False),
    "DCGM_FI_PROF_NVLINK_TX_BYTES": Field("nvlink_tx_bytes_per_second", small=False),  # bytes/s, all links
    "DCGM_FI_PROF_NVLINK_RX_BYTES": Field("nvlink_rx_bytes_per_second", small=False),
    "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL": Field("ecc_corrected_total", small=False),
    "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL": Field("ecc_uncorrected_total", small=False),
    "DCGM_FI_DEV_ECC_SBE_AGG_TOTAL": Field("ecc_corrected_total", rank=1, small=False),
    "DCGM_FI_DEV_ECC_DBE_AGG_TOTAL": Field("ecc_uncorrected_total", rank=1, small=False),
}
"""DCGM series -> gpu_samples column. Not mapped on purpose: NVLINK_BANDWIDTH_TOTAL (tx+rx in one
counter), energy, XID, remapped rows, tensor/fp pipes."""

def parse_exposition(text: str, names: Iterable[str] | None = None) -> Parsed:
    """Samples of the series in ``names`` (default: :data:`FIELDS`); malformed lines are counted, not fatal."""
    return scan(text, FIELDS if names is None else set(names), fold_case=True, count_prefix="DCGM_FI_")


__all__ = ["FIELDS", "Field", "MiB", "Parsed", "is_blank", "parse_exposition"]
