"""The ``[heatmap]`` config section: bin layout and analysis window of the QPS x memory x latency tensor."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Self

from triscope.component import ComponentConfig
from triscope.errors import ConfigError


@dataclass(frozen=True)
class HeatmapConfig(ComponentConfig):
    """Bin layout and analysis window (docs/heatmap.md)."""

    section = "heatmap"

    window_ms: float = 100.0
    """Defaults to ``[analysis] window_ms`` when that is set."""
    qps_bin: float = 5.0
    qps_bins: int = 32
    memory_bin_bytes: float = 200e6
    memory_bins: int = 64
    latency_bin_s: float = 0.010
    latency_bins: int = 128
    memory_max_age_s: float = 5.0
    """How far back the ASOF lookup of a window's GPU memory may reach."""

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.qps_bins, self.memory_bins, self.latency_bins)

    @property
    def window_ns(self) -> int:
        return int(round(self.window_ms * 1e6))

    def validate(self, where: str = "[heatmap]") -> None:
        if self.window_ns <= 0 or min(self.qps_bin, self.memory_bin_bytes, self.latency_bin_s) <= 0:
            raise ConfigError(f"{where} window and bin widths must be > 0")
        if min(self.qps_bins, self.memory_bins, self.latency_bins) < 1 or \
                self.qps_bins * self.memory_bins * self.latency_bins > 2**31:
            raise ConfigError(f"{where} bin counts must be >= 1 and the tensor below 2^31 cells")
        if self.memory_max_age_s < 0:
            raise ConfigError(f"{where} memory_max_age_s must be >= 0")

    @classmethod
    def from_config(cls, config: Mapping[str, Any] | None) -> Self:
        """The section, ``window_ms`` falling back to ``[analysis] window_ms``."""
        config = config or {}
        section = dict(config.get(cls.section) or {})
        analysis = config.get("analysis") or {}
        if "window_ms" not in section and "window_ms" in analysis:
            section["window_ms"] = analysis["window_ms"]
        return cls.from_mapping(section)


HeatmapSpec = HeatmapConfig
"""The name the analysis code and its callers use for the bin layout."""
