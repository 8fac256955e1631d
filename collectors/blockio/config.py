"""``[blockio]``: the typed config shared by the three block-IO collectors."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Self

from triscope.collectors.blockio.program import MAP_KEYS_MAX
from triscope.component import ComponentConfig, interval
from triscope.errors import ConfigError, InputError
from triscope.http_client import HttpClientConfig


class BlockioConfigError(ConfigError, InputError):
    """A bad ``[blockio]`` value; also an InputError, which blockio raised before typed configs."""


@dataclass(frozen=True)
class BlockioHttp(HttpClientConfig):
    """``[blockio.http]``: how ebpf_exporter's page is fetched (one target, on the collector's own thread)."""

    section = "blockio.http"
    timeout_s: float = 5.0
    redirects: str = "none"
    max_parallel: int = 1


@dataclass(frozen=True)
class BlockioConfig(ComponentConfig):
    """``[blockio]``; ``url`` and ``[blockio.http]`` are for ebpf_exporter, ``format`` and
    ``restart_at_map_keys`` for bpftrace (see docs/blockio.md)."""

    section = "blockio"
    aliases = {"max_body_bytes": "http.max_body_bytes"}
    interval_s: float = 1.0
    format: str = "json"
    url: str = "http://127.0.0.1:9435/metrics"
    host: str = ""
    http: BlockioHttp = field(default_factory=BlockioHttp)
    restart_at_map_keys: int = 3072
    """Entries one request-start map may hold before the bpftrace process is replaced (of MAP_KEYS_MAX)."""

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any] | None, where: str | None = None) -> Self:
        try:
            return super().from_mapping(data, where)
        except BlockioConfigError:
            raise
        except ConfigError as exc:
            raise BlockioConfigError(str(exc)) from None

    def validate(self, where: str) -> None:
        try:
            interval(where, interval_s=self.interval_s)
        except ConfigError as exc:
            raise BlockioConfigError(str(exc)) from None
        if self.format not in ("text", "json"):
            raise BlockioConfigError(f"{where} format must be text or json, not {self.format!r}")
        if not 1 <= self.restart_at_map_keys <= MAP_KEYS_MAX:
            raise BlockioConfigError(f"{where} restart_at_map_keys must be within 1..{MAP_KEYS_MAX}, "
                                     f"got {self.restart_at_map_keys}")


def blockio_config(config: Mapping[str, Any] | BlockioConfig | None) -> BlockioConfig:
    """``config`` as a :class:`BlockioConfig`: the typed config itself, or the whole configuration."""
    return config if isinstance(config, BlockioConfig) else BlockioConfig.from_config(config)
