"""Prometheus ``/metrics`` exporter: pipeline health of ``triscope run`` plus metrics derived from the store.

Run it as ``[run] exporters = ["prometheus"]``; the ``[prometheus]`` section (:data:`DEFAULTS`)
sets ``listen`` (127.0.0.1) and ``port``. Two kinds of metric families:

- pipeline health, read on every scrape from the daemon's live counters (the ``stats``
  callable :meth:`triscope.daemon.Daemon.stats` passes): writer rows submitted / written /
  replayed / dropped / rejected (``_total``), rows in the spool queue, spool bytes, the last
  successful write (``_timestamp_seconds``), rows and errors per collector, store up;
- derived metrics, computed with parameterized SQL over the last ``window_s`` seconds of the
  store (request rate and P99 latency per backend, GPU memory, KV-cache usage, stall time
  shares over ``stall_window_s``). They are cached for ``cache_s`` seconds and computed on one
  worker thread (chDB wants one connection per thread); a scrape waits at most
  ``query_timeout_s`` for a refresh and otherwise serves the previous values.

Names follow the Prometheus naming guide: a ``triscope_`` prefix, base units in the name
(``_seconds``, ``_bytes``, ``_ratio`` for 0..1), ``_total`` on counters, HELP and TYPE on every family.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import math
import socket
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from triscope.errors import ConfigError
from triscope.schema import qualified

log = logging.getLogger(__name__)

DEFAULTS: dict[str, Any] = {
    "listen": "127.0.0.1",
    "port": 9472,
    "window_s": 60.0,
    "stall_window_s": 60.0,
    "stalls": True,
    "cache_s": 5.0,
    "query_timeout_s": 5.0,
    "poll_s": 0.5,
}
"""``[prometheus]`` keys and defaults."""

WRITER_COUNTERS = {
    "rows_submitted": "Rows collectors handed to the writer (durable in the spool when accepted).",
    "rows_written": "Rows inserted into the store, including replayed ones.",
    "rows_replayed": "Rows inserted from spool batches left by a previous run.",
    "rows_dropped": "Rows deleted from the spool because it exceeded spool_max_bytes.",
    "rows_rejected": "Rows the store refused as bad data (moved to spool/rejected/).",
    "batches_written": "Batches inserted into the store.",
    "insert_failures": "Failed insert attempts (store down or batch refused).",
}


def prometheus_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """The ``[prometheus]`` section over :data:`DEFAULTS`, checked (ConfigError, one line)."""
    section = dict(config.get("prometheus") or {})
    unknown = set(section) - set(DEFAULTS)
    if unknown:
        raise ConfigError(f"[prometheus] has unknown keys: {', '.join(sorted(unknown))}")
    cfg = {**DEFAULTS, **section}
    try:
        out = {k: (bool(v) if isinstance(DEFAULTS[k], bool) else type(DEFAULTS[k])(v)) for k, v in cfg.items()}
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"[prometheus] has a bad value: {exc}") from None
    if not 0 <= out["port"] <= 65535:
        raise ConfigError(f"[prometheus] port {out['port']} is not in 0..65535")
    for key in ("window_s", "stall_window_s", "query_timeout_s", "poll_s"):
        if out[key] <= 0:
            raise ConfigError(f"[prometheus] {key} must be > 0")
    if out["cache_s"] < 0:
        raise ConfigError("[prometheus] cache_s must be >= 0")
    return out


# ---------------------------------------------------------------- derived metrics (store queries)

@dataclass
class Derived:
    """One refresh of the store-derived values; ``samples[family] = [(labels, value), ...]``."""

    at: float = 0.0
    duration_s: float = 0.0
    samples: dict[str, list[tuple[tuple[str, ...], float]]] = field(default_factory=dict)
    ok: bool = False  # the store answered at least one query


def _range(now_ns: int, window_s: float) -> dict[str, int]:
    return {"start": now_ns - int(window_s * 1e9), "end": now_ns}


_IN_RANGE = "ts >= fromUnixTimestamp64Nano({start:Int64}) AND ts <= fromUnixTimestamp64Nano({end:Int64})"


def query_requests(store: Any, now_ns: int, window_s: float) -> dict[str, list[tuple[tuple[str, ...], float]]]:
    """Request rate and P99 latency per backend from request spans in the window."""
    rows = store.query(
        f"SELECT backend, count(), quantileIf(0.99)(latency_seconds, isFinite(latency_seconds)), "
        f"countIf(isFinite(latency_seconds)) FROM {qualified(store, 'requests')} WHERE {_IN_RANGE} "
        "GROUP BY backend ORDER BY backend", _range(now_ns, window_s)).rows
    rate = [((str(b),), int(n) / window_s) for b, n, _p99, _k in rows]
    p99 = [((str(b), "requests"), float(p)) for b, _n, p, k in rows if int(k) > 0]
    return {"requests_per_second": rate, "latency_p99": p99}


def query_serving(store: Any, now_ns: int, window_s: float) -> dict[str, list[tuple[tuple[str, ...], float]]]:
    """Latest KV-cache usage and engine-reported P99 per backend and model from serving metrics."""
    rows = store.query(
        "SELECT backend, model, "
        "argMaxIf(kv_cache_usage_ratio, ts, isFinite(kv_cache_usage_ratio)), countIf(isFinite(kv_cache_usage_ratio)), "
        "argMaxIf(latency_p99_seconds, ts, isFinite(latency_p99_seconds)), countIf(isFinite(latency_p99_seconds)) "
        f"FROM {qualified(store, 'serving_metrics')} WHERE {_IN_RANGE} GROUP BY backend, model "
        "ORDER BY backend, model", _range(now_ns, window_s)).rows
    kv = [((str(b), str(m)), float(v)) for b, m, v, n, _p, _k in rows if int(n) > 0]
    p99: dict[str, float] = {}
    for b, _m, _v, _n, p, k in rows:  # one engine-reported P99 per backend: the worst model's
        if int(k) > 0:
            p99[str(b)] = max(p99.get(str(b), -math.inf), float(p))
    return {"kv_cache": kv, "serving_p99": [((b, "serving_metrics"), v) for b, v in sorted(p99.items())]}


def query_gpu(store: Any, now_ns: int, window_s: float) -> dict[str, list[tuple[tuple[str, ...], float]]]:
    """Latest GPU memory used / total per host and GPU in the window."""
    rows = store.query(
        "SELECT host, gpu, argMaxIf(memory_used_bytes, ts, isFinite(memory_used_bytes)), "
        "argMaxIf(memory_total_bytes, ts, isFinite(memory_total_bytes) AND memory_total_bytes > 0), "
        "countIf(isFinite(memory_used_bytes)), countIf(isFinite(memory_total_bytes) AND memory_total_bytes > 0) "
        f"FROM {qualified(store, 'gpu_samples')} WHERE {_IN_RANGE} GROUP BY host, gpu ORDER BY host, gpu",
        _range(now_ns, window_s)).rows
    used, total, ratio = [], [], []
    for host, gpu, u, t, nu, nt in rows:
        labels = (str(host), str(gpu))
        if int(nu) > 0:
            used.append((labels, float(u)))
        if int(nt) > 0:
            total.append((labels, float(t)))
        if int(nu) > 0 and int(nt) > 0:
            ratio.append((labels, float(u) / float(t)))
    return {"gpu_used": used, "gpu_total": total, "gpu_ratio": ratio}


def query_stalls(store: Any, now_ns: int, window_s: float,
                 config: Mapping[str, Any]) -> dict[str, list[tuple[tuple[str, ...], float]]]:
    """Share of time per stall class over the window (the classifier of ``triscope diagnose``)."""
    from triscope.analyzers.stalls import diagnose_stalls

    report = diagnose_stalls(store, now_ns - int(window_s * 1e9), now_ns, dict(config))
    return {"stalls": [((cls,), float(share)) for cls, share in sorted(report.shares().items())]}


QUERIES: dict[str, Callable[..., dict[str, list[tuple[tuple[str, ...], float]]]]] = {
    "requests": query_requests,
    "serving_metrics": query_serving,
    "gpu_samples": query_gpu,
    "stalls": query_stalls,
}


# ---------------------------------------------------------------- the collector

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

    def __init__(self, config: Mapping[str, Any], cfg: Mapping[str, Any],
                 opener: Callable[[], Any] | None, stats: Callable[[], Mapping[str, Any]] | None) -> None:
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
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if self._last_warning.get(what) != text:
            log.warning("prometheus exporter: %s: %s", what, text)
        self._last_warning[what] = text

    def describe(self) -> list[Metric]:
        """Nothing: keeps registration from running a scrape (and a store query)."""
        return []

    # -- pipeline counters
    def observe(self) -> Mapping[str, Any]:
        """Read the daemon's stats and note when a write last happened (called by the poller too)."""
        if self.stats is None:
            return {}
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
            for name, c in sorted(collectors.items()):
                for table, n in sorted((c.get("tables") or {}).items()):
                    rows.add_metric([name, table], float(n))
                errors.add_metric([name], float(c.get("errors", 0)))
                running.add_metric([name], 1.0)
            for name in sorted(not_started):
                running.add_metric([name], 0.0)
            yield from (rows, errors, running)

    # -- derived values
    def _open(self) -> Any:
        if self._store is None:
            if self.opener is None:
                from triscope.store import open_store

                self._store = open_store(dict(self.config))
            else:
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
            if name == "stalls" and not self.cfg["stalls"]:
                continue
            try:
                if name == "stalls":
                    got = fn(store, now_ns, self.cfg["stall_window_s"], self.config)
                else:
                    got = fn(store, now_ns, self.cfg["window_s"])
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
            fresh = self._derived.at and time.monotonic() - self._derived.at < self.cfg["cache_s"]
            if fresh:
                return self._derived
            if self._pending is None:
                self._pending = self._executor.submit(self._refresh)
            pending = self._pending
        try:
            result = pending.result(timeout=self.cfg["query_timeout_s"])
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
        for family, kind, text, labels, keys in _DERIVED_FAMILIES:
            m: Metric = GaugeMetricFamily(family, text, labels=list(labels)) if kind == "gauge" else \
                CounterMetricFamily(family, text, labels=list(labels))
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


# ---------------------------------------------------------------- HTTP server

class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True
    allow_reuse_address = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        log.debug("prometheus exporter: " + format, *args)


def _only_metrics(app: Callable[..., Any]) -> Callable[..., Any]:
    """GET/HEAD /metrics (and /) go to ``app``; anything else is 404/405 with no body read."""
    def wrapped(environ: dict[str, Any], start_response: Callable[..., Any]) -> Any:
        if environ.get("PATH_INFO", "/") not in ("/metrics", "/"):
            start_response("404 Not Found", [("Content-Type", "text/plain")])
            return [b"not found; metrics are at /metrics\n"]
        if environ.get("REQUEST_METHOD") not in ("GET", "HEAD"):
            start_response("405 Method Not Allowed", [("Content-Type", "text/plain"), ("Allow", "GET, HEAD")])
            return [b"method not allowed\n"]
        return app(environ, start_response)
    return wrapped


class PrometheusExporter:
    """The ``/metrics`` HTTP endpoint (``start()``/``close()``, as the daemon expects)."""

    def __init__(self, config: Mapping[str, Any], opener: Callable[[], Any] | None = None,
                 stats: Callable[[], Mapping[str, Any]] | None = None) -> None:
        self.cfg = prometheus_config(config)
        self.collector = TriscopeCollector(config, self.cfg, opener, stats)
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self.collector)
        self._server: _Server | None = None
        self._threads: list[threading.Thread] = []
        self._stop = threading.Event()

    @property
    def port(self) -> int:
        """The bound port (useful with ``port = 0``)."""
        assert self._server is not None, "start() first"
        return int(self._server.server_address[1])

    @property
    def url(self) -> str:
        host = self.cfg["listen"]
        return f"http://{'[' + host + ']' if ':' in host else host}:{self.port}/metrics"

    def start(self) -> None:
        """Bind ``listen:port`` and serve; ConfigError (one line) when the address is unusable."""
        server_cls = _Server
        if ":" in self.cfg["listen"]:
            server_cls = type("_Server6", (_Server,), {"address_family": socket.AF_INET6})
        try:
            self._server = make_server(self.cfg["listen"], self.cfg["port"],
                                       _only_metrics(make_wsgi_app(self.registry)), server_cls,
                                       handler_class=_QuietHandler)
        except OSError as exc:
            raise ConfigError(f"[prometheus] cannot listen on {self.cfg['listen']}:{self.cfg['port']}: "
                              f"{exc.strerror or exc}") from None
        serve = threading.Thread(target=self._server.serve_forever, name="prometheus-http", daemon=True)
        poll = threading.Thread(target=self._poll, name="prometheus-poll", daemon=True)
        self._threads = [serve, poll]
        for t in self._threads:
            t.start()
        log.info("prometheus exporter on %s", self.url)

    def _poll(self) -> None:
        while not self._stop.wait(self.cfg["poll_s"]):
            self.collector.observe()

    def close(self) -> None:
        """Stop serving and release the store; safe to call twice."""
        self._stop.set()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        for t in self._threads:
            t.join(timeout=5)
        self._threads = []
        self.collector.close()


def factory(config: dict[str, Any], open_store: Callable[[], Any] | None = None,
            stats: Callable[[], Mapping[str, Any]] | None = None) -> PrometheusExporter:
    """The exporter for ``[run] exporters = ["prometheus"]``."""
    return PrometheusExporter(config, open_store, stats)
