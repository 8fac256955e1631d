"""Store reader of the weight engine from the newest-row tables and the window's rows only.

What the engine takes as each backend's latest values (its gauges, its scrape's outcome, its GPUs'
memory, the GPUs its spans name) comes from the ``*_latest`` tables (``triscope.schema.latest``): one
row per key, kept on insert, instead of the raw rows of the look-back. What it computes over its
window (span counts, exact P99, the errors in a row at its end, the requests counter's rise) and the
preemption look-back comes from the rows of that range only, read from the ``*_recent`` tables (the
last hours of those columns, sorted by time) so that a query finds them without reading every granule
of the raw table; a range older than they hold is read from the raw table. The answer is the raw scan's
(:func:`~triscope.analyzers.routing.store_inputs.read_inputs_scan`), to the bit: a key whose newest
row is after ``now`` (a past ``now``, a host's clock ahead) is read from the raw rows, that key only.
See docs/weights.md ("Store reader").
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from typing import Any

from triscope.analyzers.routing.config import NAN, WeightParams
from triscope.analyzers.routing.model import BackendInputs
from triscope.analyzers.routing.store_inputs import (
    PREEMPT,
    UNTIL,
    WINDOW,
    Spans,
    add_gpu,
    finite,
    read_gpus,
    read_with,
    scrapes_scan,
    serving_reading,
    serving_scan,
)
from triscope.schema import REQUESTS, qualified
from triscope.schema.gpu import GPU_LATEST
from triscope.schema.latest import Recent
from triscope.schema.requests import (
    REQUESTS_LATEST,
    REQUESTS_RECENT,
    SCRAPES_LATEST,
    SERVING_LATEST,
    SERVING_RECENT,
)
from triscope.store.base import Store

_SINCE = "ts >= fromUnixTimestamp64Nano({since:Int64})"
# rows of a latest table older than the look-back cannot hold a key's newest row within it
_LATEST_WHERE = f"WHERE {_SINCE}"
_NO_WINDOW = {"rt_hi": 0.0, "rt_lo": 0.0, "w_hi": 0, "w_lo": 0, "w_n": 0, "pre_hi": 0.0, "pre_lo": 0.0, "pre_n": 0}


def by_time(store: Store, recent: Recent, from_ns: int) -> str:
    """Where to read ``recent``'s columns from ``from_ns`` on: its table while it holds that range, else the raw one."""
    return qualified(store, recent.table if recent.covers(from_ns / 1e9, time.time()) else recent.source)


def _split_later(rows: list[dict[str, Any]], p: dict[str, Any],
                 names: set[str]) -> tuple[list[dict[str, Any]], list[str]]:
    """A latest table's rows per backend: each backend named is added to ``names``; the rows whose newest
    is at or before ``until``, and the backends whose newest is after it (read from the raw rows)."""
    fresh, later = [], []
    for r in rows:
        name = str(r["backend"])
        if name:
            names.add(name)
        if int(r["last_ns"]) > p["until"]:
            later.append(name)
        else:
            fresh.append(r)
    return fresh, later


def _serving(store: Store, p: dict[str, Any], names: set[str]) -> dict[str, dict[str, float]]:
    """:func:`serving_scan`'s answer: the gauges from ``serving_metrics_latest``, the counters from
    the rows of the window and the preemption look-back."""
    latest = f"""
SELECT backend, toUnixTimestamp64Nano(max(ts)) AS last_ns, argMaxMerge(kv_cache_usage_ratio) AS kv,
       argMaxMerge(latency_p99_seconds) AS p99, argMaxMerge(sleep_state) AS sleep
FROM {qualified(store, SERVING_LATEST.table)} {_LATEST_WHERE}
GROUP BY backend"""
    wfrom = max(p["since"], min(p["wstart"], p["pstart"]))  # the scan's rows are since ``since``
    window = f"""
SELECT backend,
       maxIf(requests_total, {WINDOW}) AS rt_hi, minIf(requests_total, {WINDOW}) AS rt_lo,
       toUnixTimestamp64Nano(maxIf(ts, {WINDOW})) AS w_hi, toUnixTimestamp64Nano(minIf(ts, {WINDOW})) AS w_lo,
       countIf({WINDOW}) AS w_n,
       argMaxIf(preemptions_total, ts, {PREEMPT}) AS pre_hi, argMinIf(preemptions_total, ts, {PREEMPT}) AS pre_lo,
       countIf({PREEMPT}) AS pre_n
FROM {by_time(store, SERVING_RECENT, wfrom)}
WHERE ts >= fromUnixTimestamp64Nano({{wfrom:Int64}}) AND {UNTIL}
GROUP BY backend"""
    counters = {str(r["backend"]): r for r in store.query(window, {**p, "wfrom": wfrom}).dicts()}
    fresh, later = _split_later(store.query(latest, p).dicts(), p, names)
    out = {str(r["backend"]): serving_reading({**_NO_WINDOW, **counters.get(str(r["backend"]), {}), **r})
           for r in fresh}
    if later:
        out.update(serving_scan(store, p, names, later))
    return out


def _spans(store: Store, p: dict[str, Any], params: WeightParams, names: set[str]) -> Spans:
    """:func:`~triscope.analyzers.routing.store_inputs.spans_scan`'s answer: backends and their GPUs
    from ``requests_latest``, the window's statistics from its raw rows (the failed spans in a row at
    its end from each class's newest failures and newest answered span: collecting every span's
    status costs more than the rest of the query)."""
    latest = f"""
SELECT backend, host, gpu, toUnixTimestamp64Nano(max(ts)) AS last_ns
FROM {qualified(store, REQUESTS_LATEST.table)} {_LATEST_WHERE}
GROUP BY backend, host, gpu"""
    k = max(1, params.down_after_errors)
    window = f"""
SELECT backend, if(request_class IN {{classes:Array(String)}}, request_class, {{default:String}}) AS cls,
       count() AS n, countIf({_SINCE}) AS n_tail,
       quantileExactIf(0.99)(latency_seconds, isFinite(latency_seconds)) AS p99,
       toUnixTimestamp64Nano(max(ts)) AS last_ns,
       toUnixTimestamp64Nano(maxIf(ts, status != 'error' AND {_SINCE})) AS ok_ns,
       arraySlice(arraySort(groupArrayIf(toUnixTimestamp64Nano(ts), status = 'error' AND {_SINCE})),
                  -{{k:UInt32}}) AS errors
FROM {by_time(store, REQUESTS_RECENT, p["wstart"])}
WHERE {WINDOW}
GROUP BY backend, cls"""
    out = Spans()
    measured: set[str] = set()  # backends with spans in [since, until]
    later: set[str] = set()  # with their newest after ``until``
    for r in store.query(latest, p).dicts():
        b = str(r["backend"])
        if b:
            names.add(b)
        if r["gpu"] != "":
            out.gpus[b].add((str(r["host"]), str(r["gpu"])))
        (later if int(r["last_ns"]) > p["until"] else measured).add(b)
    later -= measured
    if later:
        rows = store.query(f"SELECT DISTINCT backend FROM {qualified(store, REQUESTS)} "
                           f"WHERE {_SINCE} AND {UNTIL} AND backend IN {{keys:Array(String)}}",
                           {**p, "keys": sorted(later)}).rows
        measured.update(str(b) for (b,) in rows)
    counts: dict[str, int] = dict.fromkeys(measured, 0)
    last_ok: dict[str, int] = {}
    errors: dict[str, list[int]] = defaultdict(list)
    q = {**p, "classes": list(params.classes), "default": params.default_class, "k": k}
    for r in store.query(window, q).dicts():
        b = str(r["backend"])
        if b in counts:
            counts[b] += int(r["n_tail"])
            last_ok[b] = max(last_ok.get(b, 0), int(r["ok_ns"]))
            errors[b].extend(int(t) for t in r["errors"])
        out.qps[b] += int(r["n"]) / params.window_s
        if math.isfinite(finite(r["p99"])):  # the class has finite latencies in the window
            out.p99[b][str(r["cls"])] = finite(r["p99"])
        out.last[b] = max(out.last.get(b, 0.0), int(r["last_ns"]) / 1e9)
    for b, n in counts.items():
        out.tails[b] = (float(n), trailing_errors(errors[b], last_ok.get(b, 0), k))
    return out


def trailing_errors(errors: list[int], last_ok: int, k: int) -> float:
    """Failed requests in a row at the end of the newest ``k`` spans, from the start times of each
    class's newest ``k`` failed spans and of the newest answered one (0: none): the failed spans
    started at or after it, at most ``k``. What :func:`trailing_failures` counts over (start, failed)
    pairs, which order a failed span after an answered one that started at the same nanosecond; a
    class's newest ``k`` failures hold every one that can count."""
    return float(min(k, sum(1 for t in errors if t >= last_ok)))


def _scrapes(store: Store, p: dict[str, Any], names: set[str]) -> dict[str, tuple[float, str, float]]:
    """:func:`scrapes_scan`'s answer from ``scrape_health_latest``."""
    sql = f"""
SELECT backend, min(up_last) AS up_latest, anyIf(err, up_last = 0) AS error,
       min(if(ok_ns >= {{since:Int64}}, ok_ns, 0)) AS ok_ns, max(last_ns) AS last_ns FROM (
    SELECT backend, target, argMaxMerge(up) AS up_last, argMaxMerge(error) AS err,
           toUnixTimestamp64Nano(max(ok_ts)) AS ok_ns, toUnixTimestamp64Nano(max(ts)) AS last_ns
    FROM {qualified(store, SCRAPES_LATEST.table)} {_LATEST_WHERE}
    GROUP BY backend, target)
GROUP BY backend"""
    fresh, later = _split_later(store.query(sql, p).dicts(), p, names)
    out = {}
    for r in fresh:
        up, ok = float(r["up_latest"]), int(r["ok_ns"])
        out[str(r["backend"])] = (up, str(r["error"]) if up == 0 else "", ok / 1e9 if ok > 0 else NAN)
    if later:
        out.update(scrapes_scan(store, p, names, later))
    return out


def _gpus(store: Store, p: dict[str, Any]) -> dict[tuple[str, str], dict[str, Any]]:
    """:func:`read_gpus`'s answer from ``gpu_samples_latest``."""
    sql = f"""
SELECT host, gpu, argMaxMerge(gpu_uuid) AS uuid, toUnixTimestamp64Nano(max(ts)) AS last_ns,
       argMaxMerge(memory_used_bytes) AS used, argMaxMerge(memory_total_bytes) AS total,
       argMaxMerge(state) AS state
FROM {qualified(store, GPU_LATEST.table)} {_LATEST_WHERE}
GROUP BY host, gpu"""
    rows = store.query(sql, p).dicts()
    later = {str(r["host"]) for r in rows if int(r["last_ns"]) > p["until"]}
    out: dict[tuple[str, str], dict[str, Any]] = {}
    for r in rows:
        if str(r["host"]) not in later:
            add_gpu(out, r)
    if later:
        out.update(read_gpus(store, p, sorted(later)))
    return out


def read_inputs(store: Store, params: WeightParams, now: float) -> list[BackendInputs]:
    """One :class:`BackendInputs` per known backend, from the newest rows within ``lookback_s``."""
    return read_with(store, params, now, _serving, _scrapes, _spans, _gpus)
