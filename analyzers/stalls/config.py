"""The ``[stalls]`` config section: every threshold of the stall classifier, with its default."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, Self

from triscope.component import ComponentConfig, config_field, non_negative, positive
from triscope.errors import ConfigError

CLASSES = ("comm", "compute", "io", "host", "idle")
UNCLASSIFIED = "unclassified"
HOST_IO_DEVICE = "host"
"""The unit device of a host with block-IO data and no GPU samples or trace."""


@dataclass(frozen=True)
class StallsConfig(ComponentConfig):
    """Thresholds, precedence and alerting of ``triscope diagnose`` (see docs/diagnose.md)."""

    section = "stalls"

    window_ms: float = 0.0
    """0: the ``[analysis] window_ms`` (100 when unset)."""
    compute_sm_active_min: float = 0.95
    compute_bandwidth_max: float = 0.60
    trace_compute_busy_min: float = 0.95
    io_read_p99_min_seconds: float = 0.0012
    io_queue_depth_min: float = 64.0
    comm_share_min: float = 0.85
    host_gpu_busy_max: float = 0.50
    host_busy_min: float = 0.50
    host_queue_min: float = 1.0
    idle_busy_max: float = 0.05
    precedence: list[str] = config_field(list(CLASSES))
    alert_classes: list[str] = config_field(["comm", "compute", "io", "host"])
    alert_share: float = 0.25
    straggler_min_lateness_seconds: float = 0.001
    straggler_alert_seconds: float = 0.05
    top_windows: int = 10
    max_trace_events: int = 20_000_000

    def validate(self, where: str) -> None:
        non_negative(where, **{f.name: getattr(self, f.name) for f in fields(self)
                               if isinstance(getattr(self, f.name), int | float)})
        if not self.precedence or set(self.precedence) - set(CLASSES):
            raise ConfigError(f"{where} precedence must list classes from {CLASSES}, got {self.precedence!r}")

    @classmethod
    def from_config(cls, config: Mapping[str, Any] | None) -> Self:
        """The section, with ``window_ms`` 0 (or unset) resolved from ``[analysis] window_ms``."""
        config = config or {}
        section = dict(config.get(cls.section) or {})
        if not section.get("window_ms"):
            section["window_ms"] = (config.get("analysis") or {}).get("window_ms", 100)
        out = cls.from_mapping(section)
        positive(f"[{cls.section}]", window_ms=out.window_ms)
        return out

    def __getitem__(self, key: str) -> Any:
        """Read access by key, for callers of the former dict config (``cfg["alert_classes"]``)."""
        if key not in {f.name for f in fields(self)}:
            raise KeyError(key)
        return getattr(self, key)


def stall_config(config: Mapping[str, Any] | None) -> StallsConfig:
    """The ``[stalls]`` section of the whole configuration, checked, ``window_ms`` resolved."""
    return StallsConfig.from_config(config)
