"""dcgm-exporter text: the DCGM series triscope maps, blank values, and a tolerant line parser.

The parser reads Prometheus text as dcgm-exporter writes it and as a Prometheus ``/federate``
endpoint re-exports it (sorted labels, a millisecond timestamp per sample). A malformed line is
counted and skipped, never fatal. Metric names match case-insensitively (some relabelling setups
lower-case them); labels are kept as they are.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import dataclass, field

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

_SAMPLE = re.compile(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?[ \t]+(\S+)(?:[ \t]+(-?\d+))?[ \t]*\r?")
_LABEL = re.compile(r'[ \t]*([a-zA-Z_][a-zA-Z0-9_]*)[ \t]*=[ \t]*"((?:[^"\\]|\\.)*)"[ \t]*(,|$)')
_UNESCAPE = re.compile(r"\\(.)")


def _labels(body: str) -> dict[str, str] | None:
    out: dict[str, str] = {}
    pos, n = 0, len(body.rstrip())
    while pos < n:
        m = _LABEL.match(body, pos)
        if m is None:
            return None
        value = m.group(2)
        if "\\" in value:
            value = _UNESCAPE.sub(lambda e: "\n" if e.group(1) == "n" else e.group(1), value)
        out[m.group(1)] = value
        pos = m.end()
        if not m.group(3):
            break
    return out if pos >= n else None


@dataclass
class Parsed:
    """DCGM samples of one exposition and the lines that were not Prometheus text."""

    samples: list[tuple[str, dict[str, str], float]] = field(default_factory=list)
    stamps_ms: list[int | None] = field(default_factory=list)
    """The sample timestamp of each of ``samples`` (a federation endpoint writes one), else None."""
    bad_lines: int = 0
    first_bad: str = ""
    unmapped: dict[str, int] = field(default_factory=dict)
    """``DCGM_FI_*`` families present but not asked for -> sample count (for the 'no mapped fields' error)."""


def parse_exposition(text: str, names: Iterable[str] | None = None) -> Parsed:
    """Samples of the series in ``names`` (default: :data:`FIELDS`); malformed lines are counted, not fatal."""
    wanted = set(FIELDS if names is None else names)
    out = Parsed()
    for lineno, line in enumerate(text.split("\n"), 1):
        if not line or line[0] == "#" or line.isspace():
            continue
        m = _SAMPLE.fullmatch(line)
        value: float | None = None
        labels: dict[str, str] | None = {}
        name = ""
        if m is not None:
            name = m.group(1)
            if name not in wanted:
                upper = name.upper()
                if upper in wanted:
                    name = upper
                else:  # another family, or a DCGM one we do not map: not parsed further
                    if upper.startswith("DCGM_FI_"):
                        out.unmapped[upper] = out.unmapped.get(upper, 0) + 1
                    continue
            if m.group(2):
                labels = _labels(m.group(2))
            try:
                value = float(m.group(3))
            except ValueError:
                value = None
        if m is None or labels is None or value is None:
            out.bad_lines += 1
            if not out.first_bad:
                out.first_bad = f"line {lineno}: {line.strip()[:80]!r}"
            continue
        out.samples.append((name, labels, value))
        out.stamps_ms.append(int(m.group(4)) if m.group(4) else None)
    return out


__all__ = ["FIELDS", "Field", "MiB", "Parsed", "is_blank", "parse_exposition"]
