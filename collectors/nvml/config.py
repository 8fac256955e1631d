"""``[nvml]``: the NVML sampler's typed config."""

from __future__ import annotations

from dataclasses import dataclass, field

from triscope.component import ComponentConfig, interval, non_negative
from triscope.errors import ConfigError


@dataclass(frozen=True)
class NvmlConfig(ComponentConfig):
    """``[nvml]`` (docs/gpu-collectors.md)."""

    section = "nvml"
    interval_s: float = 0.1
    """100-200 ms recommended."""
    host: str = ""
    """Default: the machine's hostname."""
    devices: list[int] = field(default_factory=list)
    """NVML indices to sample; empty: all."""
    process_interval_s: float = 1.0
    """Per-process memory: every this many seconds; 0 every sample, < 0 never."""
    gpm: bool = True
    """GPM SM activity / occupancy / DRAM bandwidth where supported (Hopper and newer)."""
    retry_s: float = 30.0
    """Re-init when NVML is unavailable, re-probe lost GPUs."""
    ecc: str = "volatile"
    """ECC counters since driver load ("volatile") or lifetime ("aggregate")."""

    def validate(self, where: str) -> None:
        interval(where, interval_s=self.interval_s)
        non_negative(where, retry_s=self.retry_s)
        if self.ecc not in ("volatile", "aggregate"):
            raise ConfigError(f"{where} ecc must be 'volatile' or 'aggregate', not {self.ecc!r}")
        for index in self.devices:
            non_negative(where, devices=index)
