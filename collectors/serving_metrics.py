"""Scrape vLLM, SGLang and TGI ``/metrics`` into ``serving_metrics``.

One row per scraped instance and model: queue length, running requests, KV-cache usage,
finished-requests counter, and p50/p99 end-to-end latency and p99 TTFT computed from the
*change* of the latency histograms since the previous scrape (NaN on the first scrape, and when
no request finished in between). Series of several engines in one instance (vLLM's ``engine``
label, data-parallel ranks) are aggregated: counts and histogram buckets are summed, KV-cache
usage is the mean over engines. Parsing and histogram arithmetic: :mod:`triscope.collectors.prom_text`.

Family names per server (the first present wins; vLLM renamed ``gpu_cache_usage_perc`` to
``kv_cache_usage_perc``):
"""

from __future__ import annotations

import logging
import math
import time
import urllib.error
import urllib.request
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from triscope.collectors.prom_text import Series, bucket_delta, histogram_quantile, le_bound, parse_exposition
from triscope.component import ComponentConfig, Context, config_field, interval, positive
from triscope.errors import ConfigError, InputError
from triscope.schema import SERVING_METRICS, encode_ts

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServerNames:
    """Sample names of one serving engine (gauges, counter, histograms by base name)."""

    queue: tuple[str, ...]
    running: tuple[str, ...]
    kv_cache: tuple[str, ...]
    requests_total: tuple[str, ...]
    latency: tuple[str, ...]
    ttft: tuple[str, ...]
    model_labels: tuple[str, ...] = ("model_name",)
    kv_scale: float = 1.0


SERVERS: dict[str, ServerNames] = {
    "vllm": ServerNames(
        queue=("vllm:num_requests_waiting",),
        running=("vllm:num_requests_running",),
        kv_cache=("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
        requests_total=("vllm:request_success_total",),
        latency=("vllm:e2e_request_latency_seconds",),
        ttft=("vllm:time_to_first_token_seconds",),
    ),
    "sglang": ServerNames(
        queue=("sglang:num_queue_reqs",),
        running=("sglang:num_running_reqs",),
        kv_cache=("sglang:token_usage",),
        requests_total=("sglang:num_requests_total",),
        latency=("sglang:e2e_request_latency_seconds",),
        ttft=("sglang:time_to_first_token_seconds",),
        model_labels=("model_name", "name"),
    ),
    "tgi": ServerNames(
        queue=("tgi_queue_size",),
        running=("tgi_batch_current_size",),
        kv_cache=(),
        requests_total=("tgi_request_success", "tgi_request_success_total"),
        latency=("tgi_request_duration",),
        ttft=(),
        model_labels=(),
    ),
}
__doc__ += "".join(
    f"\n* {server}: queue {n.queue}, running {n.running}, KV {n.kv_cache or '(none)'}, "
    f"finished {n.requests_total}, latency {n.latency}, TTFT {n.ttft or '(none)'}"
    for server, n in SERVERS.items()
)

def detect_server(series: Series, source: str = "metrics") -> str:
    """``vllm``, ``sglang`` or ``tgi`` from the sample names; InputError when none matches."""
    names = set(series)
    for server, prefix in (("vllm", "vllm:"), ("sglang", "sglang:"), ("tgi", "tgi_")):
        if any(n.startswith(prefix) for n in names):
            return server
    raise InputError(f"{source}: no vLLM, SGLang or TGI metrics found (expected vllm:*, sglang:* or tgi_* names)")


def _model(labels: dict[str, str], names: ServerNames, default: str) -> str:
    for key in names.model_labels:
        if labels.get(key):
            return labels[key]
    return default


def _first_present(series: Series, candidates: Iterable[str]) -> list[tuple[dict[str, str], float]]:
    for name in candidates:
        if name in series:
            return series[name]
    return []


@dataclass
class InstanceSnapshot:
    """Aggregated figures of one (instance, model) at one scrape."""

    model: str
    queue_length: float = math.nan
    running_requests: float = math.nan
    kv_cache_usage_ratio: float = math.nan
    requests_total: float = math.nan
    latency_buckets: dict[float, float] = field(default_factory=dict)
    ttft_buckets: dict[float, float] = field(default_factory=dict)


def _sum_into(target: dict[str, float], rows: list[tuple[dict[str, str], float]], names: ServerNames,
              default_model: str) -> set[str]:
    seen = set()
    for labels, value in rows:
        model = _model(labels, names, default_model)
        target[model] = target.get(model, 0.0) + value
        seen.add(model)
    return seen


def aggregate(series: Series, server: str, default_model: str = "") -> dict[str, InstanceSnapshot]:
    """Per-model snapshot of one instance, summing over engines and other labels."""
    names = SERVERS[server]
    queue: dict[str, float] = {}
    running: dict[str, float] = {}
    finished: dict[str, float] = {}
    models = _sum_into(queue, _first_present(series, names.queue), names, default_model)
    models |= _sum_into(running, _first_present(series, names.running), names, default_model)
    models |= _sum_into(finished, _first_present(series, names.requests_total), names, default_model)
    kv: dict[str, list[float]] = defaultdict(list)
    for labels, value in _first_present(series, names.kv_cache):
        kv[_model(labels, names, default_model)].append(value * names.kv_scale)
    models |= set(kv)
    hists: dict[str, dict[str, dict[float, float]]] = {"latency": {}, "ttft": {}}
    for kind, bases in (("latency", names.latency), ("ttft", names.ttft)):
        for labels, value in _first_present(series, [b + "_bucket" for b in bases]):
            model = _model(labels, names, default_model)
            buckets = hists[kind].setdefault(model, {})
            le = le_bound(labels.get("le", "+Inf"))
            buckets[le] = buckets.get(le, 0.0) + value
            models.add(model)
    out = {}
    for model in sorted(models):
        out[model] = InstanceSnapshot(
            model=model,
            queue_length=queue.get(model, math.nan),
            running_requests=running.get(model, math.nan),
            kv_cache_usage_ratio=(sum(kv[model]) / len(kv[model])) if kv.get(model) else math.nan,
            requests_total=finished.get(model, math.nan),
            latency_buckets=hists["latency"].get(model, {}),
            ttft_buckets=hists["ttft"].get(model, {}),
        )
    return out


@dataclass
class Target:
    """One scraped endpoint."""

    url: str
    server: str = ""  # detected from the metric names when empty
    backend: str = ""
    host: str = ""
    model: str = ""

    def __post_init__(self) -> None:
        parts = urlsplit(self.url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ConfigError(f"serving_metrics target {self.url!r} is not an http(s) URL")
        if self.server and self.server not in SERVERS:
            raise ConfigError(f"serving_metrics target {self.url}: unknown server {self.server!r}; "
                              f"use one of {', '.join(SERVERS)}")
        self.host = self.host or parts.hostname
        self.backend = self.backend or parts.netloc


@dataclass(frozen=True)
class ServingMetricsConfig(ComponentConfig):
    """``[serving_metrics]``: the ``/metrics`` URLs to scrape (a URL, or a table of :class:`Target` fields)."""

    section = "serving_metrics"
    targets: list[str | dict[str, str]] = config_field([])
    interval_s: float = 5.0
    timeout_s: float = 3.0
    max_body_bytes: int = 16 * 1024 * 1024

    def validate(self, where: str) -> None:
        interval(where, interval_s=self.interval_s)
        positive(where, timeout_s=self.timeout_s, max_body_bytes=self.max_body_bytes)
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


class ServingMetricsScraper:
    """Collector scraping serving engines (``[serving_metrics] targets``)."""

    name = "serving_metrics"

    def __init__(self, config: ServingMetricsConfig | Mapping[str, Any] | None = None) -> None:
        cfg = config if isinstance(config, ServingMetricsConfig) else ServingMetricsConfig.from_config(config)
        self.targets = cfg.target_list()
        self.interval_s = cfg.interval_s
        self.timeout_s = cfg.timeout_s
        self.max_body_bytes = cfg.max_body_bytes
        self._previous: dict[tuple[str, str], InstanceSnapshot] = {}
        self.errors: dict[str, str] = {}

    def start(self) -> None:
        """Nothing to acquire: every collect() is a fresh HTTP GET."""

    def fetch(self, target: Target) -> str:
        """GET the exposition text, bounded; InputError (one line) on any failure."""
        req = urllib.request.Request(target.url, headers={"Accept": "text/plain;version=0.0.4"})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                body = resp.read(self.max_body_bytes + 1)
        except (urllib.error.URLError, OSError, ValueError) as exc:
            reason = getattr(exc, "reason", exc)
            raise InputError(f"{target.url}: scrape failed: {reason}") from None
        if len(body) > self.max_body_bytes:
            raise InputError(f"{target.url}: response exceeds {self.max_body_bytes} bytes")
        return body.decode("utf-8", errors="replace")

    def rows_from_text(self, target: Target, text: str, ts_ns: int) -> dict[str, list[Any]]:
        """Rows (``serving_metrics`` columns) of one scrape, updating the histogram baseline of this target."""
        return SERVING_METRICS.columns_of(self._rows(target, text, ts_ns))

    def _rows(self, target: Target, text: str, ts_ns: int) -> list[dict[str, Any]]:
        series = parse_exposition(text, target.url)
        server = target.server or detect_server(series, target.url)
        rows = []
        for model, snap in aggregate(series, server, target.model).items():
            prev = self._previous.get((target.url, model))
            lat = bucket_delta(snap.latency_buckets, prev.latency_buckets if prev else None)
            ttft = bucket_delta(snap.ttft_buckets, prev.ttft_buckets if prev else None)
            self._previous[(target.url, model)] = snap
            rows.append({
                "ts": encode_ts(ts_ns), "host": target.host, "backend": target.backend, "server": server,
                "model": model, "queue_length": snap.queue_length, "running_requests": snap.running_requests,
                "kv_cache_usage_ratio": snap.kv_cache_usage_ratio, "requests_total": snap.requests_total,
                "latency_p50_seconds": histogram_quantile(0.5, lat),
                "latency_p99_seconds": histogram_quantile(0.99, lat),
                "ttft_p99_seconds": histogram_quantile(0.99, ttft),
            })
        return rows

    def collect(self) -> dict[str, dict[str, list[Any]]]:
        """Scrape every target; a failing target is logged and skipped (others still count)."""
        rows: list[dict[str, Any]] = []
        for target in self.targets:
            try:
                rows += self._rows(target, self.fetch(target), time.time_ns())
            except InputError as exc:
                self.errors[target.url] = str(exc)
                log.warning("%s", exc)
                continue
            self.errors.pop(target.url, None)
        return {SERVING_METRICS.name: SERVING_METRICS.columns_of(rows)} if rows else {}

    def close(self) -> None:
        """Nothing held between scrapes."""


def create(config: dict[str, Any], context: Context) -> ServingMetricsScraper:
    """``triscope run`` entry point (``[run] collectors = ["serving_metrics"]``); rows go back through collect()."""
    return ServingMetricsScraper(ServingMetricsConfig.from_config(config))
