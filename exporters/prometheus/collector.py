"""The prometheus_client collector of the ``/metrics`` exporter: pipeline counters and derived families.

Pipeline health comes from the daemon's live counters (``context.stats``, read on every scrape; the
per-request picker's among them: :mod:`.picker`);
derived families come from :mod:`.queries`, cached for ``cache_s`` and computed on one worker
thread (chDB wants one connection per thread): a scrape waits at most ``query_timeout_s`` for a
refresh and otherwise serves the previous values. Names follow the Prometheus naming guide:
a ``triscope_`` prefix, base units (``_seconds``, ``_bytes``, ``_ratio`` for 0..1), ``_total``
on counters, HELP and TYPE on every family.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from triscope.errors import one_line
from triscope.exporters.prometheus.config import PrometheusConfig
from triscope.exporters.prometheus.picker import picker_families
from triscope.exporters.prometheus.queries import QUERIES, STALLS, Derived

log = logging.getLogger(__name__)

WRITER_COUNTERS = {
    "rows_submitted": "Rows collectors handed to the writer (durable in the spool when accepted).",
    "rows_written": "Rows inserted into the store, including replayed ones.",
    "rows_replayed": "Rows inserted from spool batches left by a previous run.",
    "rows_dropped": "Rows deleted from the spool because it exceeded spool_max_bytes.",
    "rows_rejected": "Rows the store refused as bad data (moved to spool/rejected/).",
    "batches_written": "Batches inserted into the store.",
    "insert_failures": "Failed insert attempts (store down or batch refused).",
}



_DERIVED_FAMILIES: list[tuple[str, str, str, tuple[str, ...], tuple[str, ...]]] = [
    # (family, kind, help, labels, sample keys)
    ("triscope_backend_requests_per_second", "gauge",
     "Request spans per second per backend over the last window_s seconds.", ("backend",),
     ("requests_per_second",)),
    ("triscope_backend_request_latency_p99_seconds", "gauge",
     "P99 end-to-end request latency per backend over the last window_s seconds: from request spans "
     "(source=requests) or as reported by the serving engine (source=serving_metrics).",
     ("backend", "source"), ("latency_p99", "serving_p99")),
    ("triscope_backend_kv_cache_usage_ratio", "gauge",
     "Latest KV-cache usage (0..1) per backend and model reported by the serving engine.",
     ("backend", "model"), ("kv_cache",)),
    ("triscope_gpu_memory_used_bytes", "gauge", "Latest GPU memory in use per host and GPU.",
     ("host", "gpu"), ("gpu_used",)),
    ("triscope_gpu_memory_total_bytes", "gauge", "GPU memory capacity per host and GPU.",
     ("host", "gpu"), ("gpu_total",)),
    ("triscope_gpu_memory_used_ratio", "gauge", "Latest GPU memory used / total (0..1) per host and GPU.",
     ("host", "gpu"), ("gpu_ratio",)),
    ("triscope_stall_time_ratio", "gauge",
     "Share of GPU time (0..1) per stall class over the last stall_window_s seconds "
     "(compute, io, comm, host, idle, unclassified; see docs/diagnose.md).", ("class",), ("stalls",)),
]


class TriscopeCollector:
    """A prometheus_client custom collector over the daemon's counters and the store."""

    def __init__(self, config: Mapping[str, Any], cfg: PrometheusConfig, opener: Callable[[], Any],
                 stats: Callable[[], Mapping[str, Any]]) -> None:
        self.config, self.cfg = config, cfg
        self.opener = opener
        self.stats = stats
        self._store: Any = None
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="prom-store")
        self._lock = threading.Lock()
        self._pending: concurrent.futures.Future[Derived] | None = None
        self._derived = Derived()
        self.query_errors: dict[str, int] = dict.fromkeys(QUERIES, 0)
        self.refresh_timeouts = 0
        self._last_batches = -1
        self._observe_lock = threading.Lock()
        self.last_write_unix: float | None = None
        self._last_warning: dict[str, str] = {}

    def _warn(self, what: str, exc: BaseException) -> None:
        """Log a failure once per new message (a store that stays down is not one line per scrape)."""
        text = one_line(exc)
        if self._last_warning.get(what) != text:
            log.warning("prometheus exporter: %s: %s", what, text)
        self._last_warning[what] = text

    def describe(self) -> list[Metric]:
        """Nothing: keeps registration from running a scrape (and a store query)."""
        return []

    # -- pipeline counters
    def observe(self) -> Mapping[str, Any]:
        """Read the daemon's stats and note when a write last happened (called by the poller too)."""
        try:
            snap = self.stats() or {}
        except Exception as exc:
            log.warning("prometheus exporter: stats callable failed: %s", exc)
            return {}
        writer = snap.get("writer") or {}
        batches = int(writer.get("batches_written", 0))
        with self._observe_lock:  # the poller and scrape threads both call this
            if "last_write_unix" in writer:
                self.last_write_unix = writer["last_write_unix"]
            elif batches > max(self._last_batches, 0):
                self.last_write_unix = time.time()
            self._last_batches = max(self._last_batches, batches)
        return snap

    def _pipeline(self, snap: Mapping[str, Any], store_ok: bool) -> Iterator[Metric]:
        writer = snap.get("writer") or {}
        if writer:
            for key, text in WRITER_COUNTERS.items():
                c = CounterMetricFamily(f"triscope_writer_{key}", text)
                c.add_metric([], float(writer.get(key, 0)))
                yield c
            for name, key, text in (
                    ("triscope_writer_pending_rows", "rows_pending",
                     "Rows accepted and spooled but not yet in the store (the writer's queue depth)."),
                    ("triscope_writer_memory_rows", "memory_rows", "Queued rows also held in memory."),
                    ("triscope_writer_spool_bytes", "spool_bytes", "Bytes of the writer's spool on disk.")):
                g = GaugeMetricFamily(name, text)
                g.add_metric([], float(writer.get(key, 0)))
                yield g
            if self.last_write_unix is not None:
                g = GaugeMetricFamily("triscope_writer_last_write_timestamp_seconds",
                                      "Unix time of the last batch the writer inserted into the store.")
                g.add_metric([], float(self.last_write_unix))
                yield g
        up = GaugeMetricFamily("triscope_store_up", "1 when the store takes writes (the writer's view, or the "
                               "exporter's last query when no writer runs in this process), else 0.")
        up.add_metric([], 1.0 if (writer.get("store_up", store_ok) if writer else store_ok) else 0.0)
        yield up
        collectors = snap.get("collectors") or {}
        not_started = snap.get("not_started") or {}
        if collectors or not_started:
            rows = CounterMetricFamily("triscope_collector_rows", "Rows a collector submitted, per table.",
                                       labels=["collector", "table"])
            errors = CounterMetricFamily("triscope_collector_errors",
                                         "Failed collect() calls and rejected submissions per collector.",
                                         labels=["collector"])
            running = GaugeMetricFamily("triscope_collector_up", "1 for a running collector, 0 for one that "
                                        "failed to start.", labels=["collector"])
            gaps = CounterMetricFamily("triscope_collector_gaps", "Gaps a collector knows of in its rows, by kind "
                                       "(blockio: missed_probe_runs, late_windows).", labels=["collector", "kind"])
            for name, c in sorted(collectors.items()):
                for table, n in sorted((c.get("tables") or {}).items()):
                    rows.add_metric([name, table], float(n))
                errors.add_metric([name], float(c.get("errors", 0)))
                running.add_metric([name], 1.0)
                for kind, n in sorted((c.get("gaps") or {}).items()):
                    gaps.add_metric([name, kind], float(n))
            for name in sorted(not_started):
                running.add_metric([name], 0.0)
            yield from (rows, errors, running, gaps)

    # -- derived values
    def _open(self) -> Any:
        if self._store is None:
            self._store = self.opener()
        return self._store

    def _refresh(self) -> Derived:
        """Run every query on the worker thread; a failing query's families are left empty (and counted)."""
        t0 = time.monotonic()
        now_ns = time.time_ns()
        out = Derived(at=time.monotonic())
        try:
            store = self._open()
        except Exception as exc:
            self._warn("store not available", exc)
            for name in QUERIES:
                self.query_errors[name] += 1
            out.duration_s = time.monotonic() - t0
            return out
        ok = False  # the store answered at least one query
        for name, fn in QUERIES.items():
            if name == STALLS and not self.cfg.stalls:
                continue
            try:
                if name == STALLS:
                    got = fn(store, now_ns, self.cfg.stall_window_s, self.config)
                else:
                    got = fn(store, now_ns, self.cfg.window_s)
            except Exception as exc:
                self.query_errors[name] += 1
                self._warn(f"{name} query failed", exc)
                continue
            self._last_warning.pop(f"{name} query failed", None)
            out.samples.update(got)
            ok = True
        out.ok = ok
        out.duration_s = time.monotonic() - t0
        return out

    def derived(self) -> Derived:
        """Cached derived values; refreshed (waiting up to query_timeout_s) when older than cache_s."""
        with self._lock:
            fresh = self._derived.at and time.monotonic() - self._derived.at < self.cfg.cache_s
            if fresh:
                return self._derived
            if self._pending is None:
                self._pending = self._executor.submit(self._refresh)
            pending = self._pending
        try:
            result = pending.result(timeout=self.cfg.query_timeout_s)
        except concurrent.futures.TimeoutError:
            with self._lock:
                self.refresh_timeouts += 1
                return self._derived
        with self._lock:
            if self._pending is pending:
                self._pending = None
                self._derived = result
            return self._derived

    def collect(self) -> Iterator[Metric]:
        """One scrape: pipeline counters (live) and derived families (cached)."""
        snap = self.observe()
        d = self.derived()
        yield from self._pipeline(snap, d.ok)
        yield from picker_families((snap.get("exporters") or {}).get("epp") or {})
        for family, kind, text, labels, keys in _DERIVED_FAMILIES:
            m: GaugeMetricFamily | CounterMetricFamily = (
                GaugeMetricFamily(family, text, labels=list(labels)) if kind == "gauge"
                else CounterMetricFamily(family, text, labels=list(labels)))
            for key in keys:
                for label_values, value in d.samples.get(key, []):
                    m.add_metric(list(label_values), value)
            yield m
        errors = CounterMetricFamily("triscope_exporter_store_query_errors",
                                     "Failed store queries of the Prometheus exporter, per query.", labels=["query"])
        for name, n in sorted(self.query_errors.items()):
            errors.add_metric([name], float(n))
        yield errors
        timeouts = CounterMetricFamily("triscope_exporter_refresh_timeouts",
                                       "Scrapes that served cached values because a refresh took longer "
                                       "than query_timeout_s.")
        timeouts.add_metric([], float(self.refresh_timeouts))
        yield timeouts
        duration = GaugeMetricFamily("triscope_exporter_refresh_duration_seconds",
                                     "Wall time of the last refresh of the store-derived metrics.")
        duration.add_metric([], d.duration_s)
        yield duration

    def close(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)
        if self._store is not None:
            store, self._store = self._store, None
            with contextlib.suppress(Exception):  # closing is best-effort
                store.close()
