"""``[serving_metrics]``: the typed config section and its scrape targets."""

from __future__ import annotations

from dataclasses import dataclass, field
from urllib.parse import urlsplit

from triscope.collectors.serving_metrics.engines import ENGINES
from triscope.component import ComponentConfig, config_field, interval, positive
from triscope.errors import ConfigError
from triscope.http_client import HTTP_ALIASES, HttpClientConfig


@dataclass
class Target:
    """One scraped endpoint."""

    url: str
    server: str = ""  # detected from the metric names when empty
    backend: str = ""
    host: str = ""
    model: str = ""
    """The model when the exposition names none (TGI, llama.cpp); for Triton it replaces the repository name."""

    def __post_init__(self) -> None:
        parts = urlsplit(self.url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ConfigError(f"serving_metrics target {self.url!r} is not an http(s) URL")
        if self.server and self.server not in ENGINES:
            raise ConfigError(f"serving_metrics target {self.url}: unknown server {self.server!r}; "
                              f"use one of {', '.join(ENGINES)}")
        self.host = self.host or parts.hostname
        self.backend = self.backend or parts.netloc


@dataclass(frozen=True)
class ServingMetricsHttp(HttpClientConfig):
    """``[serving_metrics.http]``: the client defaults (3 s total per fetch, 16 MiB, same-origin redirects)."""

    section = "serving_metrics.http"


@dataclass(frozen=True)
class ServingMetricsConfig(ComponentConfig):
    """``[serving_metrics]``: the ``/metrics`` URLs to scrape (a URL, or a table of :class:`Target` fields)."""

    section = "serving_metrics"
    aliases = HTTP_ALIASES
    targets: list[str | dict[str, str]] = config_field([])
    interval_s: float = 5.0
    http: ServingMetricsHttp = field(default_factory=ServingMetricsHttp)
    """``[serving_metrics.http]``: timeout_s, max_body_bytes, redirects, max_parallel (scrape threads)."""
    max_models_per_target: int = 64
    """Rows (and histogram baselines) kept per target and scrape; more models are dropped and counted as an error."""

    def validate(self, where: str) -> None:
        interval(where, interval_s=self.interval_s)
        positive(where, max_models_per_target=self.max_models_per_target)
        self.target_list(where)

    def target_list(self, where: str = "[serving_metrics]") -> list[Target]:
        """The targets, checked (ConfigError naming the bad one)."""
        out = []
        for t in self.targets:
            try:
                out.append(Target(url=t) if isinstance(t, str) else Target(**t))
            except TypeError as exc:
                raise ConfigError(f"{where} target {t!r}: {exc}") from None
        return out


__all__ = ["ServingMetricsConfig", "ServingMetricsHttp", "Target"]
