"""The serving fleet's signals in fixed windows, read from the store (every bound a query parameter).

One :class:`Window` per backend and window start: the engine's own figures (P99 from its histogram,
queue, running, KV usage, preemptions, requests waiting for capacity, finished requests), the request
spans' (per class: count, failures, P99), whether its scrape answered, and the LB's weight for it;
plus the hosts' block IO per window (:class:`IoWindow`: latency and the busiest disk's queue).
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from triscope.schema import (
    HOST_SAMPLES,
    IO_LATENCY,
    REQUESTS,
    SCRAPE_HEALTH,
    SERVING_METRICS,
    WEIGHTS_HISTORY,
    qualified,
)
from triscope.store.base import Store

NAN = math.nan


@dataclass
class ClassWindow:
    """One request class's spans on one backend in one window."""

    requests: int = 0
    failed: int = 0
    p99_seconds: float = NAN


@dataclass
class Window:
    """One backend's figures in one window (NaN: not measured)."""

    backend: str
    start_s: float
    engine_p99_seconds: float = NAN
    queue: float = NAN
    running: float = NAN
    kv_usage: float = NAN
    preemptions: float = NAN
    waiting_capacity: float = NAN
    finished_total: float = NAN
    """The engine's finished-requests counter at the end of the window (its rise is the completed rate)."""
    scraped: bool = False
    scrape_up: float = NAN
    """Share of the window's scrapes that answered: 0 is every one failed (one timed-out scrape of an
    overloaded engine that goes on answering is no outage)."""
    scrape_error: str = ""
    weight: float = NAN
    lb_state: str = ""
    cpu_wait_ratio: float = NAN
    """Share of the window its processes' threads waited runnable on a run queue (host collector)."""
    cpu_run_ratio: float = NAN
    """Cores its processes ran on over the window (CPU seconds per second)."""
    rss_bytes: float = NAN
    classes: dict[str, ClassWindow] = field(default_factory=dict)

    @property
    def requests(self) -> int:
        return sum(c.requests for c in self.classes.values())

    @property
    def failed(self) -> int:
        return sum(c.failed for c in self.classes.values())


def _f(value: Any) -> float:
    try:
        out = float(value)
    except (TypeError, ValueError):
        return NAN
    return out if math.isfinite(out) else NAN


@dataclass
class IoWindow:
    """The hosts' block IO in one window (the worst figures of any disk)."""

    latency_s: float = NAN
    """Read P99 (bpftrace), else the mean wait (diskstats)."""
    queue_depth: float = NAN
    """The busiest disk's average queue depth (requests in flight)."""
    device: str = ""
    """That disk."""
    ios_per_s: float = NAN
    """IOs per second on that disk."""


@dataclass
class HostWindow:
    """The hosts' pressure in one window (the worst host)."""

    psi_cpu_some: float = NAN
    psi_memory_some: float = NAN
    oom_kills: float = 0.0


def read_windows(store: Store, start_ns: int, end_ns: int, window_s: float, default_class: str,
                 known_classes: list[str]) -> tuple[dict[str, dict[float, Window]], dict[float, IoWindow]]:
    """Per backend, per window start (epoch seconds): its :class:`Window`; and per window the hosts'
    :class:`IoWindow`. Host pressure: :func:`read_host`."""
    p = {"start": start_ns, "end": end_ns, "w": int(window_s * 1000), "classes": known_classes,
         "default": default_class}
    bucket = "toUnixTimestamp64Milli(toStartOfInterval(ts, toIntervalMillisecond({w:UInt32}))) / 1000"
    span = "ts >= fromUnixTimestamp64Nano({start:Int64}) AND ts < fromUnixTimestamp64Nano({end:Int64})"
    out: dict[str, dict[float, Window]] = defaultdict(dict)

    def window(backend: str, t: float) -> Window:
        w = out[backend].get(t)
        if w is None:
            w = out[backend][t] = Window(backend, t)
        return w

    for r in store.query(f"""
SELECT backend, {bucket} AS t, max(latency_p99_seconds) AS p99, max(queue_length) AS q,
       max(running_requests) AS run, max(kv_cache_usage_ratio) AS kv,
       max(preemptions_total) - min(preemptions_total) AS pre, max(waiting_capacity) AS wcap,
       max(requests_total) AS fin
FROM {qualified(store, SERVING_METRICS)} WHERE {span} AND backend != '' GROUP BY backend, t""", p).dicts():
        w = window(str(r["backend"]), float(r["t"]))
        w.engine_p99_seconds, w.queue, w.running, w.kv_usage = _f(r["p99"]), _f(r["q"]), _f(r["run"]), _f(r["kv"])
        w.preemptions, w.waiting_capacity, w.finished_total = _f(r["pre"]), _f(r["wcap"]), _f(r["fin"])
    for r in store.query(f"""
SELECT backend, {bucket} AS t, if(request_class IN {{classes:Array(String)}}, request_class, {{default:String}}) AS c,
       count() AS n, countIf(status = 'error') AS n_failed,
       quantileExactIf(0.99)(latency_seconds, isFinite(latency_seconds) AND status != 'error') AS p99
FROM {qualified(store, REQUESTS)} WHERE {span} AND backend != '' GROUP BY backend, t, c""", p).dicts():
        w = window(str(r["backend"]), float(r["t"]))
        w.classes[str(r["c"])] = ClassWindow(int(r["n"]), int(r["n_failed"]), _f(r["p99"]))
    for r in store.query(f"""
SELECT backend, {bucket} AS t, avg(up) AS up_share, argMin(error, up) AS err
FROM {qualified(store, SCRAPE_HEALTH)} WHERE {span} GROUP BY backend, t""", p).dicts():
        w = window(str(r["backend"]), float(r["t"]))
        w.scraped, w.scrape_up, w.scrape_error = True, _f(r["up_share"]), str(r["err"])
    for r in store.query(f"""
SELECT backend, {bucket} AS t, avg(weight) AS w_avg, argMax(state, ts) AS lb_state
FROM {qualified(store, WEIGHTS_HISTORY)} WHERE {span} GROUP BY backend, t""", p).dicts():
        if str(r["backend"]) in out:
            w = window(str(r["backend"]), float(r["t"]))
            w.weight, w.lb_state = _f(r["w_avg"]), str(r["lb_state"])
    for r in store.query(f"""
SELECT backend, {bucket} AS t, sum(wait_seconds) / sum(window_seconds) AS wait_ratio,
       sum(cpu_seconds) / sum(window_seconds) AS run_ratio, max(rss_bytes) AS rss
FROM {qualified(store, HOST_SAMPLES)} WHERE {span} AND backend != '' GROUP BY backend, t""", p).dicts():
        if str(r["backend"]) in out:
            w = window(str(r["backend"]), float(r["t"]))
            w.cpu_wait_ratio, w.cpu_run_ratio, w.rss_bytes = _f(r["wait_ratio"]), _f(r["run_ratio"]), _f(r["rss"])
    # a fast disk (NVMe, a cloud volume) keeps its latency under a hog and shows it in the queue instead
    rows = store.query(f"""
SELECT t, max(lat) AS io_lat, max(qd) AS io_qd, argMax(device, qd) AS dev, argMax(ios, qd) AS io_rate FROM (
    SELECT {bucket} AS t, host, device,
           maxIf(if(isFinite(p99_seconds), p99_seconds, mean_seconds), op IN ('read', 'all')) AS lat,
           avgIf(queue_depth, isFinite(queue_depth)) AS qd, sum(ios) * 1000 / {{w:UInt32}} AS ios
    FROM {qualified(store, IO_LATENCY)} WHERE {span} GROUP BY t, host, device)
GROUP BY t""", p).dicts()
    io = {float(r["t"]): IoWindow(_f(r["io_lat"]), _f(r["io_qd"]), str(r["dev"]), _f(r["io_rate"])) for r in rows}
    return dict(out), io


def read_host(store: Store, start_ns: int, end_ns: int, window_s: float) -> dict[float, HostWindow]:
    """Per window: the worst host's CPU and memory pressure (PSI) and the OOM kills of every host."""
    p = {"start": start_ns, "end": end_ns, "w": int(window_s * 1000)}
    rows = store.query(f"""
SELECT toUnixTimestamp64Milli(toStartOfInterval(ts, toIntervalMillisecond({{w:UInt32}}))) / 1000 AS t,
       maxIfOrNull(psi_cpu_some, isFinite(psi_cpu_some)) AS cpu,
       maxIfOrNull(psi_memory_some, isFinite(psi_memory_some)) AS mem,
       if(countIf(isFinite(oom_kills)) = 0, nan, sumIf(oom_kills, isFinite(oom_kills))) AS ooms
FROM {qualified(store, HOST_SAMPLES)}
WHERE ts >= fromUnixTimestamp64Nano({{start:Int64}}) AND ts < fromUnixTimestamp64Nano({{end:Int64}}) AND backend = ''
GROUP BY t""", p).dicts()
    # An unread reading (node-exporter down, no PSI) stays NaN: missing, not calm.
    return {float(r["t"]): HostWindow(_f(r["cpu"]), _f(r["mem"]), _f(r["ooms"])) for r in rows}


__all__ = ["ClassWindow", "HostWindow", "IoWindow", "Window", "read_host", "read_windows"]
