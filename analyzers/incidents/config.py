"""``[incidents]``: how serving incidents are found and judged (docs/diagnose.md, "Incidents")."""

from __future__ import annotations

from dataclasses import dataclass

from triscope.component import ComponentConfig, non_negative, positive
from triscope.errors import ConfigError


@dataclass(frozen=True)
class IncidentsConfig(ComponentConfig):
    """Windows, thresholds and what makes ``diagnose`` exit 3."""

    section = "incidents"
    window_s: float = 5.0
    """Signals are read in windows of this length."""
    merge_gap_s: float = 10.0
    """Breached windows closer than this are one incident."""
    min_requests: int = 3
    """A class's P99 from spans counts in a window with at least this many requests."""
    error_ratio: float = 0.05
    """Failed requests over all requests of a backend in a window that breach it (with min_requests)."""
    qps_jump: float = 0.3
    """A rise of the fleet's completed requests over its baseline that counts as a load jump (the seed's 30 %)."""
    baseline_s: float = 60.0
    """The stretch before an incident whose signals are its baseline and where lead times are looked for."""
    kv_high: float = 0.9
    """KV-cache usage at which a backend is under KV pressure."""
    fleet_share: float = 0.75
    """Share of the fleet's backends breaching together that reads as load beyond capacity."""
    imbalance: float = 1.5
    """A breached backend's share of requests over its fair share that reads as routing imbalance."""
    cpu_wait: float = 0.3
    """Share of a window an engine's threads waited runnable on a run queue that reads as CPU starvation."""
    rss_growth: float = 0.25
    """Growth of an engine's RSS over its baseline that, with memory pressure, reads as host memory trouble."""
    psi_memory: float = 0.1
    """Host PSI ``memory some`` share that counts as memory pressure."""
    io_p99_s: float = 0.05
    """Block-IO read P99 (or mean where only diskstats exists) that reads as IO trouble for serving."""
    io_queue_depth: float = 16.0
    """A disk's average queue depth that reads as IO trouble for serving (a saturated fast disk keeps its
    latency and queues instead; an engine host's own writes stay in single digits)."""
    alert_open: bool = True
    """Exit 3 when an incident is still open at the end of the range."""
    alert_min_p99_ratio: float = 0.0
    """Exit 3 also for any incident whose P99 / SLA reached this (0 = off)."""

    def validate(self, where: str) -> None:
        positive(where, window_s=self.window_s, qps_jump=self.qps_jump, baseline_s=self.baseline_s,
                 fleet_share=self.fleet_share, imbalance=self.imbalance, io_p99_s=self.io_p99_s,
                 io_queue_depth=self.io_queue_depth)
        non_negative(where, merge_gap_s=self.merge_gap_s, min_requests=self.min_requests,
                     alert_min_p99_ratio=self.alert_min_p99_ratio)
        if not 0 < self.error_ratio <= 1 or not 0 < self.kv_high <= 1:
            raise ConfigError(f"{where} error_ratio and kv_high must be in (0, 1]")
