"""Host signals of the serving engines (``[host]``): per-engine CPU and run-queue wait, RSS, PSI, OOM kills."""

from triscope.collectors.host.collector import HostCollector, HostConfig, create

__all__ = ["HostCollector", "HostConfig", "create"]
