"""The ``serving_metrics`` collector: every target fetched concurrently with a total deadline, parsed on its own.

A target's failure (no answer, deadline, oversized or malformed exposition, a bucket ``le="abc"``)
is that target's error only: the others' rows are still returned. Every scrape, failed or not, also
writes one ``scrape_health`` row per target (``up`` 1 or 0, as Prometheus' synthetic ``up``): the
weight engine reads a refused scrape as a backend that is down, not as one whose numbers are late.
Each failure is counted (:meth:`ServingMetricsScraper.take_errors`, read by the collector loop) and
logged once per change of state, not once per tick. Histogram baselines are kept per target for the
models of its last scrape only, at most ``max_models_per_target``, so label churn cannot grow them.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from triscope.collectors.serving_metrics.aggregate import InstanceSnapshot, aggregate
from triscope.collectors.serving_metrics.engines import detect_server
from triscope.collectors.serving_metrics.targets import ServingMetricsConfig, Target
from triscope.errors import InputError, one_line
from triscope.http_client import HttpClientConfig
from triscope.prom_text import bucket_delta, histogram_quantile, parse_exposition
from triscope.schema import SCRAPE_HEALTH, SERVING_METRICS, Table, encode_ts
from triscope.target_pool import TargetPool
from triscope.tick_clock import TickClock

log = logging.getLogger("triscope.collectors.serving_metrics")

LOG_EVERY_S = 60.0
"""A failing target's changing error is logged at most this often (every failure is still counted)."""
MAX_MESSAGE = 300


def printable(text: str) -> str:
    """One line of at most MAX_MESSAGE characters, control and non-printable characters escaped."""
    out = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text[:MAX_MESSAGE])
    return out[:MAX_MESSAGE] + ("..." if len(text) > MAX_MESSAGE else "")


_GAUGES = ("queue_length", "running_requests", "kv_cache_usage_ratio", "requests_total", "preemptions_total",
           "sleep_state", "waiting_capacity", "waiting_deferred", "swapped_requests", "prefix_cache_queries_total",
           "prefix_cache_hits_total")
_QUANTILES = (("latency_p50_seconds", "latency", 0.5), ("latency_p99_seconds", "latency", 0.99),
              ("ttft_p99_seconds", "ttft", 0.99), ("queue_time_p99_seconds", "queue_time", 0.99),
              ("itl_p99_seconds", "itl", 0.99))


@dataclass(frozen=True)
class _Fetched:
    """One fetch's outcome: the body or the error, and how long it took."""

    body: bytes | None
    error: str
    seconds: float


def _timed_fetch(url: str, http: HttpClientConfig) -> _Fetched:
    started = time.monotonic()
    try:
        body = http.get(url)
    except InputError as exc:
        return _Fetched(None, str(exc).splitlines()[0], time.monotonic() - started)
    except Exception as exc:  # any failure of one target is that target's error only
        return _Fetched(None, f"{url}: {type(exc).__name__}: {one_line(exc)}", time.monotonic() - started)
    return _Fetched(body, "", time.monotonic() - started)


@dataclass
class _State:
    """What the scraper remembers of one target between scrapes."""

    error: str = ""
    logged_at: float = -math.inf
    previous: dict[str, InstanceSnapshot] = field(default_factory=dict)


class ServingMetricsScraper:
    """Collector scraping serving engines (``[serving_metrics] targets``)."""

    name = "serving_metrics"

    def __init__(self, config: ServingMetricsConfig | Mapping[str, Any] | None = None) -> None:
        cfg = config if isinstance(config, ServingMetricsConfig) else ServingMetricsConfig.from_config(config)
        self.targets = cfg.target_list()
        self.interval_s = cfg.interval_s
        self._clock = TickClock(cfg.interval_s)
        self.http = cfg.http
        if self.http.timeout_s > cfg.interval_s and self.targets:  # a scrape still in flight skips ticks
            log.warning("serving_metrics: timeout_s %g exceeds interval_s %g: a target that stops answering is "
                        "scraped every %g s, not every %g s", self.http.timeout_s, cfg.interval_s,
                        self.http.timeout_s, cfg.interval_s)
        self.timeout_s = self.http.timeout_s
        self.max_models = cfg.max_models_per_target
        self._state: dict[str, _State] = {t.url: _State() for t in self.targets}
        self._pool: TargetPool[_Fetched] = TargetPool("serving-metrics", self.http.max_parallel, self.timeout_s)
        self._new_errors: list[str] = []
        self.errors: dict[str, str] = {}
        """url -> the one-line error of each target failing now."""
        self.errors_total = 0
        # The daemon's last collect may run on its main thread while the loop's is still in flight.
        self._lock = threading.Lock()

    def start(self) -> None:
        """Nothing to acquire: the scrape threads start with the first collect()."""

    def fetch(self, target: Target) -> str:
        """GET the exposition text within ``timeout_s`` in total; InputError (one line) on any failure."""
        return self.http.get(target.url).decode("utf-8", errors="replace")

    def rows_from_text(self, target: Target, text: str, ts_ns: int) -> dict[str, list[Any]]:
        """Rows (``serving_metrics`` columns) of one scrape, updating the histogram baseline of this target."""
        rows, _dropped = self._rows(target, text, ts_ns)
        return SERVING_METRICS.columns_of(rows)

    def _rows(self, target: Target, text: str, ts_ns: int) -> tuple[list[dict[str, Any]], int]:
        series = parse_exposition(text, target.url)
        server = target.server or detect_server(series, target.url)
        snaps = aggregate(series, server, target.model, target.url)
        dropped = max(0, len(snaps) - self.max_models)
        state = self._state.setdefault(target.url, _State())
        previous, state.previous = state.previous, {}
        rows = []
        for model, snap in list(snaps.items())[:self.max_models]:
            prev = previous.get(model)
            state.previous[model] = snap  # only this scrape's models: churned labels are forgotten
            row: dict[str, Any] = {"ts": encode_ts(ts_ns), "host": target.host, "backend": target.backend,
                                   "server": server, "model": model}
            row.update({key: snap.get(key) for key in _GAUGES})
            for column, hist, q in _QUANTILES:
                if hist in snap.buckets:
                    delta = bucket_delta(snap.buckets[hist], prev.buckets.get(hist) if prev else None)
                    row[column] = histogram_quantile(q, delta)
                else:  # an engine's own quantile (Triton summaries), NaN when absent
                    row[column] = snap.get(column)
            rows.append(row)
        return rows, dropped

    def take_errors(self) -> list[str]:
        """One-line messages of the target failures since the last call (the collector loop counts them)."""
        with self._lock:
            taken, self._new_errors = self._new_errors, []
        return taken

    def _fail(self, target: Target, message: str) -> None:
        state = self._state.setdefault(target.url, _State())
        message = printable(message)
        self.errors_total += 1
        self._new_errors.append(message)
        self.errors[target.url] = message
        now = time.monotonic()
        # when it starts failing, then at most once a minute: garbage differs every tick
        if not state.error or (message != state.error and now - state.logged_at >= LOG_EVERY_S):
            log.warning("serving_metrics: %s", message)
            state.logged_at = now
        state.error = message

    def _ok(self, target: Target) -> None:
        state = self._state.setdefault(target.url, _State())
        if state.error:
            log.warning("serving_metrics: %s answers again", target.url)
        state.error = ""
        self.errors.pop(target.url, None)

    def collect(self) -> dict[Table, dict[str, list[Any]]]:
        """Scrape every target once, concurrently; a failing target is counted and skipped, never raised."""
        if not self.targets:
            return {}
        with self._lock:
            return self._collect()

    def _collect(self) -> dict[Table, dict[str, list[Any]]]:
        ts_ns = self._clock.now_ns()
        started = time.monotonic()
        futures = self._pool.run({t.url: partial(_timed_fetch, t.url, self.http) for t in self.targets})
        rows: list[dict[str, Any]] = []
        health: list[dict[str, Any]] = []
        for target in self.targets:
            error, seconds = self._scrape_one(target, futures.get(target.url), ts_ns, rows)
            if not seconds >= 0:
                seconds = time.monotonic() - started
            health.append({"ts": encode_ts(ts_ns), "host": target.host, "backend": target.backend,
                           "target": target.url, "up": 0 if error else 1, "error": error,
                           "duration_seconds": seconds})
        out = {SCRAPE_HEALTH: SCRAPE_HEALTH.columns_of(health)}
        if rows:
            out[SERVING_METRICS] = SERVING_METRICS.columns_of(rows)
        return out

    def _scrape_one(self, target: Target, future: Future[_Fetched] | None, ts_ns: int,
                    rows: list[dict[str, Any]]) -> tuple[str, float]:
        """Parse one target's answer into ``rows``; (its error or "", the fetch's seconds or NaN)."""
        if future is None:  # still fetching since an earlier collect: not fetched twice
            message = f"{target.url}: the previous scrape has not finished"
            self._fail(target, message)
            return message, math.nan
        if not future.done():
            message = f"{target.url}: no answer within {self.timeout_s:g} s"
            self._fail(target, message)
            return message, math.nan
        fetched = future.result()
        if fetched.body is None:
            self._fail(target, fetched.error)
            return fetched.error, fetched.seconds
        try:
            got, dropped = self._rows(target, fetched.body.decode("utf-8", errors="replace"), ts_ns)
        except InputError as exc:
            message = str(exc).splitlines()[0]
            self._fail(target, message)
            return message, fetched.seconds
        except Exception as exc:  # a target's bad input must never cost the others their rows
            message = f"{target.url}: {type(exc).__name__}: {one_line(exc)}"
            self._fail(target, message)
            return message, fetched.seconds
        rows += got
        if dropped:  # it answered: up, but the extra models are counted as an error
            self._fail(target, f"{target.url}: {len(got) + dropped} models exposed, more than "
                               f"max_models_per_target = {self.max_models}; {dropped} dropped")
        else:
            self._ok(target)
        return "", fetched.seconds

    def close(self) -> None:
        """Stop the scrape threads without waiting for a fetch in flight (each ends by its deadline)."""
        self._pool.close()


__all__ = ["ServingMetricsScraper"]
