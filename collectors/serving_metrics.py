"""Scrape vLLM, SGLang and TGI ``/metrics`` into ``serving_metrics``.

One row per scraped instance and model: queue length, running requests, KV-cache usage,
finished-requests counter, and p50/p99 end-to-end latency and p99 TTFT computed from the
*change* of the latency histograms since the previous scrape (NaN on the first scrape, and when
no request finished in between). Series of several engines in one instance (vLLM's ``engine``
label, data-parallel ranks) are aggregated: counts and histogram buckets are summed, KV-cache
usage is the mean over engines. Parsing uses ``prometheus_client.parser``.

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
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from triscope.errors import ConfigError, InputError
from triscope.schema import encode_ts

log = logging.getLogger(__name__)

TABLE = "serving_metrics"


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

Series = dict[str, list[tuple[dict[str, str], float]]]
"""Sample name -> [(labels, value)]."""


def parse_exposition(text: str, source: str = "metrics") -> Series:
    """All samples of a Prometheus text exposition; InputError (one line) when it is not one."""
    from prometheus_client.parser import text_string_to_metric_families

    series: Series = defaultdict(list)
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                series[sample.name].append((dict(sample.labels), float(sample.value)))
    except (ValueError, TypeError, IndexError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise InputError(f"{source}: not Prometheus text format: {first}") from None
    return dict(series)


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


def _le(text: str) -> float:
    return math.inf if text in ("+Inf", "Inf", "inf") else float(text)


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
            le = _le(labels.get("le", "+Inf"))
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


def bucket_delta(current: dict[float, float], previous: dict[float, float] | None) -> dict[float, float]:
    """Cumulative bucket counts observed between two scrapes; the current counts after a reset."""
    if not previous:
        return {}
    delta = {le: count - previous.get(le, 0.0) for le, count in current.items()}
    if any(v < 0 for v in delta.values()) or set(previous) - set(current):
        return dict(current)  # counter reset (restart): everything counted since the restart
    return delta


def histogram_quantile(q: float, buckets: dict[float, float]) -> float:
    """Quantile of cumulative buckets ``{le: count}`` by linear interpolation within the bucket
    (Prometheus ``histogram_quantile`` semantics); NaN when empty; the +Inf bucket yields the
    highest finite bound."""
    if not buckets:
        return math.nan
    edges = sorted(buckets)
    total = buckets[edges[-1]] if math.isinf(edges[-1]) else max(buckets.values())
    if total <= 0:
        return math.nan
    rank = q * total
    lower, below = 0.0, 0.0
    for le in edges:
        count = buckets[le]
        if count >= rank:
            if math.isinf(le):
                finite = [e for e in edges if not math.isinf(e)]
                return finite[-1] if finite else math.nan
            if count == below:
                return le
            return lower + (le - lower) * (rank - below) / (count - below)
        lower, below = le, count
    return edges[-1]


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


DEFAULTS: dict[str, Any] = {"targets": [], "interval_s": 5.0, "timeout_s": 3.0,
                            "max_body_bytes": 16 * 1024 * 1024}


class ServingMetricsScraper:
    """Collector scraping serving engines (``[serving_metrics] targets``)."""

    name = "serving_metrics"

    def __init__(self, config: dict[str, Any] | None = None) -> None:
        cfg = {**DEFAULTS, **((config or {}).get("serving_metrics", {}))}
        targets = []
        for t in cfg["targets"]:
            targets.append(Target(url=t) if isinstance(t, str) else Target(**t))
        self.targets = targets
        self.interval_s = float(cfg["interval_s"])
        self.timeout_s = float(cfg["timeout_s"])
        self.max_body_bytes = int(cfg["max_body_bytes"])
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
        """Rows of one scrape, updating the histogram baseline of this target."""
        series = parse_exposition(text, target.url)
        server = target.server or detect_server(series, target.url)
        cols: dict[str, list[Any]] = defaultdict(list)
        for model, snap in aggregate(series, server, target.model).items():
            prev = self._previous.get((target.url, model))
            lat = bucket_delta(snap.latency_buckets, prev.latency_buckets if prev else None)
            ttft = bucket_delta(snap.ttft_buckets, prev.ttft_buckets if prev else None)
            self._previous[(target.url, model)] = snap
            for key, value in (
                ("ts", encode_ts(ts_ns)), ("host", target.host), ("backend", target.backend),
                ("server", server), ("model", model), ("queue_length", snap.queue_length),
                ("running_requests", snap.running_requests),
                ("kv_cache_usage_ratio", snap.kv_cache_usage_ratio), ("requests_total", snap.requests_total),
                ("latency_p50_seconds", histogram_quantile(0.5, lat)),
                ("latency_p99_seconds", histogram_quantile(0.99, lat)),
                ("ttft_p99_seconds", histogram_quantile(0.99, ttft)),
            ):
                cols[key].append(value)
        return dict(cols)

    def collect(self) -> dict[str, dict[str, list[Any]]]:
        """Scrape every target; a failing target is logged and skipped (others still count)."""
        out: dict[str, list[Any]] = defaultdict(list)
        for target in self.targets:
            try:
                rows = self.rows_from_text(target, self.fetch(target), time.time_ns())
            except InputError as exc:
                self.errors[target.url] = str(exc)
                log.warning("%s", exc)
                continue
            self.errors.pop(target.url, None)
            for key, values in rows.items():
                out[key].extend(values)
        return {TABLE: dict(out)} if out else {}

    def close(self) -> None:
        """Nothing held between scrapes."""


def factory(config: dict[str, Any]) -> ServingMetricsScraper:
    """Collector factory for ``triscope run``."""
    return ServingMetricsScraper(config)
