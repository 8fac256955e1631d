"""``[dcgm]``: the typed config section and its scrape targets (docs/gpu-collectors.md)."""

from __future__ import annotations

from dataclasses import dataclass, field
from urllib.parse import urlsplit

from triscope.component import ComponentConfig, config_field, interval
from triscope.errors import ConfigError
from triscope.http_client import HTTP_ALIASES, HttpClientConfig


@dataclass(frozen=True)
class TargetSpec:
    """One ``[dcgm] urls`` entry: a dcgm-exporter ``/metrics`` or a Prometheus ``/federate`` URL."""

    url: str
    host: str = ""
    """Host of every row from this target (an exporter whose Hostname label is its pod name)."""
    host_label: str = ""
    """Label naming the host on each series (e.g. ``node``), tried before Hostname."""

    @property
    def url_host(self) -> str:
        return urlsplit(self.url).hostname or ""


@dataclass(frozen=True)
class DcgmHttp(HttpClientConfig):
    """``[dcgm.http]``: ~30 series x 8 GPUs is ~100 KiB, so anything far larger is not an exporter
    (raise ``max_body_bytes`` for /federate); a 3xx is the target's error unless allowed."""

    section = "dcgm.http"
    timeout_s: float = 2.0
    max_body_bytes: int = 8 << 20
    redirects: str = "none"


@dataclass(frozen=True)
class DcgmConfig(ComponentConfig):
    """``[dcgm]`` (docs/gpu-collectors.md)."""

    section = "dcgm"
    aliases = HTTP_ALIASES
    urls: list[str | dict[str, str]] = config_field([])
    """Targets: a URL (``"http://gpu-node-17:9400/metrics"``) or a table ``{url, host, host_label}``."""
    interval_s: float = 5.0
    """No faster than dcgm-exporter refreshes (its -c, 30 s by default)."""
    http: DcgmHttp = field(default_factory=DcgmHttp)
    """``[dcgm.http]``: timeout_s (2.0, total per fetch), max_body_bytes (8 MiB), redirects, max_parallel."""
    exporter_pods: list[str] = config_field(["*dcgm-exporter*"])
    """Globs of the exporter's own pod names: a ``pod`` label matching one is not a workload."""

    def validate(self, where: str) -> None:
        if not self.urls:
            raise ConfigError(f"{where} urls is empty; name the dcgm-exporter endpoints, e.g. "
                              '["http://gpu-node-17:9400/metrics"]')
        interval(where, interval_s=self.interval_s)
        self.targets(where)

    def targets(self, where: str = "[dcgm]") -> list[TargetSpec]:
        """The targets, checked (ConfigError naming the bad one)."""
        out = []
        for entry in self.urls:
            try:
                spec = TargetSpec(url=entry) if isinstance(entry, str) else TargetSpec(**entry)
            except TypeError as exc:
                raise ConfigError(f"{where} urls entry {entry!r}: {exc} (keys: url, host, host_label)") from None
            parts = urlsplit(spec.url)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise ConfigError(f"{where} url {spec.url!r} is not an http(s) URL")
            out.append(spec)
        return out


__all__ = ["DcgmConfig", "DcgmHttp", "TargetSpec"]
