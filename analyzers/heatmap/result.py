"""The heatmap result: the count tensor, its axes and bins, the P95 grid and the typical load patterns."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from triscope.analyzers.heatmap.config import HeatmapSpec
from triscope.errors import InputError

AXES = ("qps", "memory", "latency")


@dataclass
class HeatmapResult:
    """The tensor and its summaries."""

    spec: HeatmapSpec
    tensor: np.ndarray  # uint64 [qps, memory, latency]
    start_ns: int
    end_ns: int
    requests: int
    unmatched: int
    p95_grid: np.ndarray | None = None  # float64 [qps, memory], NaN where empty
    patterns: list[dict[str, Any]] = field(default_factory=list)
    seconds: float = 0.0

    def slice(self, keep: tuple[str, str], where: dict[str, tuple[int, int]] | None = None) -> np.ndarray:
        """2-D counts over two axes, summing the third over all bins or an index range ``[lo, hi)``."""
        return slice_axes(self.tensor, keep, where)

    def edges(self, axis: str) -> np.ndarray:
        """Lower bin edges of an axis in its unit (QPS, bytes, seconds)."""
        return self.bin_edges(axis)[:-1]

    def bin_edges(self, axis: str) -> np.ndarray:
        """The ``n + 1`` bin edges of an axis (the last bin also holds every value above its lower edge)."""
        s = self.spec
        if axis not in AXES:
            raise InputError(f"unknown axis {axis!r}; use one of {', '.join(AXES)}")
        width, n = {"qps": (s.qps_bin, s.qps_bins), "memory": (s.memory_bin_bytes, s.memory_bins),
                    "latency": (s.latency_bin_s, s.latency_bins)}[axis]
        return np.arange(n + 1) * width

    def to_json(self) -> dict[str, Any]:
        nz = np.argwhere(self.tensor)
        return {
            "spec": asdict(self.spec), "shape": list(self.tensor.shape),
            "start_ns": self.start_ns, "end_ns": self.end_ns,
            "requests": self.requests, "unmatched_requests": self.unmatched, "seconds": self.seconds,
            "cells": [[int(q), int(m), int(lat), int(self.tensor[q, m, lat])] for q, m, lat in nz],
            "p95_latency_seconds": None if self.p95_grid is None else [
                [int(q), int(m), float(self.p95_grid[q, m])] for q, m in np.argwhere(np.isfinite(self.p95_grid))],
            "patterns": self.patterns,
        }


def slice_axes(tensor: np.ndarray, keep: tuple[str, str], where: dict[str, tuple[int, int]] | None = None
               ) -> np.ndarray:
    """Counts over the two ``keep`` axes (in the given order), the other one summed."""
    if len(keep) != 2 or len(set(keep)) != 2 or not set(keep) <= set(AXES):
        raise InputError(f"slice needs two different axes of {', '.join(AXES)}, got {keep}")
    (other,) = [a for a in AXES if a not in keep]
    axis = AXES.index(other)
    if set(where or {}) - {other}:
        raise InputError(f"slice over {keep[0]} x {keep[1]} can only restrict {other}, got {sorted(where or {})}")
    lo, hi = (where or {}).get(other, (0, tensor.shape[axis]))
    if not 0 <= lo <= hi <= tensor.shape[axis]:
        raise InputError(f"{other} range [{lo}, {hi}) is outside its bins [0, {tensor.shape[axis]})")
    view = np.take(tensor, np.arange(lo, hi), axis=axis).sum(axis=axis)
    rest = [a for a in AXES if a != other]
    return view if list(keep) == rest else view.T


def pattern(spec: HeatmapSpec, cell: dict[str, Any], total: int) -> dict[str, Any]:
    """One (QPS, memory) cell of the summary query as a load pattern with its bounds in QPS and bytes."""
    q, m = int(cell["qbin"]), int(cell["mbin"])
    last_q, last_m = q == spec.qps_bins - 1, m == spec.memory_bins - 1
    return {
        "qps_min": q * spec.qps_bin, "qps_max": None if last_q else (q + 1) * spec.qps_bin,
        "memory_min_bytes": m * spec.memory_bin_bytes,
        "memory_max_bytes": None if last_m else (m + 1) * spec.memory_bin_bytes,
        "requests": int(cell["requests"]), "share": (int(cell["requests"]) / total) if total else 0.0,
        "p95_latency_seconds": float(cell["p95_latency_seconds"]),
        "modality": cell["modality"], "modality_share": cell["modality_share"],
        "request_class": cell["request_class"], "request_class_share": cell["request_class_share"],
    }
