"""``[blockio]``: the typed config shared by the three block-IO collectors."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Self

from triscope.collectors.blockio.program import MAP_KEYS_MAX
from triscope.component import ComponentConfig, interval, positive
from triscope.errors import ConfigError, InputError


class BlockioConfigError(ConfigError, InputError):
    """A bad ``[blockio]`` value; also an InputError, which blockio raised before typed configs."""


@dataclass(frozen=True)
class BlockioConfig(ComponentConfig):
    """``[blockio]``; ``url`` and ``max_body_bytes`` are for ebpf_exporter, ``format`` and
    ``restart_at_map_keys`` for bpftrace (see docs/blockio.md)."""

    section = "blockio"
    interval_s: float = 1.0
    format: str = "json"
    url: str = "http://127.0.0.1:9435/metrics"
    host: str = ""
    max_body_bytes: int = 16 << 20
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
            positive(where, max_body_bytes=self.max_body_bytes)
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
