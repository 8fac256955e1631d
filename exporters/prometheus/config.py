"""The ``[prometheus]`` section: where ``/metrics`` listens and how the derived metrics are computed."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from triscope.component import ComponentConfig, non_negative, positive
from triscope.errors import ConfigError
from triscope.loop_server import DEFAULT_HOST, DEFAULT_MAX_CONNECTIONS


@dataclass(frozen=True)
class PrometheusConfig(ComponentConfig):
    """``[prometheus]`` keys and defaults (docs/run.md, Exporters)."""

    section = "prometheus"
    listen: str = DEFAULT_HOST
    port: int = 9472
    window_s: float = 60.0
    """Window of the request rate, P99 latency, KV-cache and GPU memory queries."""
    stall_window_s: float = 60.0
    stalls: bool = True
    """Whether to compute the stall-class shares (the heaviest query)."""
    cache_s: float = 5.0
    """Derived values are recomputed at most this often; 0 = on every scrape."""
    query_timeout_s: float = 5.0
    """A scrape waits this long for a refresh, then serves the previous values."""
    poll_s: float = 0.5
    """How often the writer counters are read between scrapes (to time the last write)."""
    max_connections: int = DEFAULT_MAX_CONNECTIONS

    def validate(self, where: str) -> None:
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"{where} port {self.port} is not in 0..65535")
        positive(where, window_s=self.window_s, stall_window_s=self.stall_window_s,
                 query_timeout_s=self.query_timeout_s, poll_s=self.poll_s, max_connections=self.max_connections)
        non_negative(where, cache_s=self.cache_s)


def prometheus_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """The checked ``[prometheus]`` section of ``config`` with defaults, as a dict (ConfigError, one line)."""
    return PrometheusConfig.from_config(config).as_dict()
