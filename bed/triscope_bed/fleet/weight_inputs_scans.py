"""The weight engine's store reader as one query per input (seven scans of the raw tables): the
reference the store readers (``triscope.analyzers.routing.store_latest``, from the newest-row tables,
and ``store_inputs.read_inputs_scan``, one scan per raw table) are checked equal to
(tests/test_routing_inputs_equal.py) and timed against (bench/weight_update.py).
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any

from triscope.analyzers.routing.config import NAN, WeightParams
from triscope.analyzers.routing.model import BackendInputs
from triscope.analyzers.routing.store_inputs import Readings, assemble, counter_rise, finite, read_gpus
from triscope.schema import REQUESTS, SCRAPE_HEALTH, SERVING_METRICS, qualified
from triscope.store.base import Store

UNHEALTHY_STATES = ("lost", "unavailable")


def _ns(t: float) -> int:
    return int(t * 1e9)


def _backend_names(store: Store, params: WeightParams, p: dict[str, Any]) -> list[str]:
    names = set(params.backends)
    if params.discover:
        for table in (SERVING_METRICS, SCRAPE_HEALTH, REQUESTS):
            rows = store.query(f"SELECT DISTINCT backend FROM {qualified(store, table)} "
                               "WHERE ts >= fromUnixTimestamp64Nano({since:Int64}) AND backend != ''", p).rows
            names.update(str(r[0]) for r in rows)
    return sorted(names)


_PREEMPT = "isFinite(preemptions_total) AND ts >= fromUnixTimestamp64Nano({pstart:Int64})"


def _serving(store: Store, p: dict[str, Any]) -> dict[str, dict[str, float]]:
    sql = f"""
SELECT backend,
       toUnixTimestamp64Nano(max(ts)) AS last_ns,
       argMax(kv_cache_usage_ratio, ts) AS kv,
       argMax(latency_p99_seconds, ts) AS p99,
       maxIf(requests_total, ts >= fromUnixTimestamp64Nano({{wstart:Int64}})) AS rt_hi,
       minIf(requests_total, ts >= fromUnixTimestamp64Nano({{wstart:Int64}})) AS rt_lo,
       toUnixTimestamp64Nano(maxIf(ts, ts >= fromUnixTimestamp64Nano({{wstart:Int64}}))) AS w_hi,
       toUnixTimestamp64Nano(minIf(ts, ts >= fromUnixTimestamp64Nano({{wstart:Int64}}))) AS w_lo,
       countIf(ts >= fromUnixTimestamp64Nano({{wstart:Int64}})) AS w_n,
       argMax(sleep_state, ts) AS sleep,
       argMaxIf(preemptions_total, ts, {_PREEMPT}) AS pre_hi,
       argMinIf(preemptions_total, ts, {_PREEMPT}) AS pre_lo,
       countIf({_PREEMPT}) AS pre_n
FROM {qualified(store, SERVING_METRICS)}
WHERE ts >= fromUnixTimestamp64Nano({{since:Int64}}) AND ts <= fromUnixTimestamp64Nano({{until:Int64}})
GROUP BY backend"""
    out = {}
    for r in store.query(sql, p).dicts():
        qps = NAN
        span = (int(r["w_hi"]) - int(r["w_lo"])) / 1e9
        if int(r["w_n"]) >= 2 and span > 0 and math.isfinite(finite(r["rt_hi"])) and math.isfinite(finite(r["rt_lo"])):
            qps = max(0.0, (finite(r["rt_hi"]) - finite(r["rt_lo"])) / span)
        out[str(r["backend"])] = {"last": int(r["last_ns"]) / 1e9, "kv": finite(r["kv"]), "p99": finite(r["p99"]),
                                  "qps": qps, "sleep": finite(r["sleep"]),
                                  "preemptions": counter_rise(finite(r["pre_hi"]), finite(r["pre_lo"]),
                                                              int(r["pre_n"]))}
    return out


def _requests(store: Store, p: dict[str, Any], params: WeightParams
              ) -> tuple[dict[str, float], dict[str, dict[str, float]], dict[str, float]]:
    """(qps, per-class p99, newest row time) per backend over the window."""
    sql = f"""
SELECT backend, if(request_class IN {{classes:Array(String)}}, request_class, {{default:String}}) AS cls,
       count() AS n, quantileExactIf(0.99)(latency_seconds, isFinite(latency_seconds)) AS p99,
       toUnixTimestamp64Nano(max(ts)) AS last_ns
FROM {qualified(store, REQUESTS)}
WHERE ts >= fromUnixTimestamp64Nano({{wstart:Int64}}) AND ts <= fromUnixTimestamp64Nano({{until:Int64}})
GROUP BY backend, cls"""
    qps: dict[str, float] = defaultdict(float)
    p99: dict[str, dict[str, float]] = defaultdict(dict)
    last: dict[str, float] = {}
    q = {**p, "classes": list(params.classes), "default": params.default_class}
    for r in store.query(sql, q).dicts():
        b = str(r["backend"])
        qps[b] += int(r["n"]) / params.window_s
        if math.isfinite(finite(r["p99"])):
            p99[b][str(r["cls"])] = finite(r["p99"])
        last[b] = max(last.get(b, 0.0), int(r["last_ns"]) / 1e9)
    return dict(qps), dict(p99), last


def _scrapes(store: Store, p: dict[str, Any]) -> dict[str, tuple[float, str, float]]:
    """(up of the latest scrape, its error, the time of the last scrape that answered, NaN if none within
    the look-back) per backend; a backend with several targets is up when its latest scrapes all answered."""
    sql = f"""
SELECT backend, min(up_last) AS up_latest, anyIf(err, up_last = 0) AS error, min(ok_ns) AS ok_ns FROM (
    SELECT backend, target, argMax(up, ts) AS up_last, argMax(error, ts) AS err,
           toUnixTimestamp64Nano(maxIf(ts, up = 1)) AS ok_ns
    FROM {qualified(store, SCRAPE_HEALTH)}
    WHERE ts >= fromUnixTimestamp64Nano({{since:Int64}}) AND ts <= fromUnixTimestamp64Nano({{until:Int64}})
    GROUP BY backend, target)
GROUP BY backend"""
    out = {}
    for r in store.query(sql, p).dicts():
        up = float(r["up_latest"])
        ok = int(r["ok_ns"]) / 1e9 if int(r["ok_ns"]) > 0 else NAN
        out[str(r["backend"])] = (up, str(r["error"]) if up == 0 else "", ok)
    return out


def _span_tail(store: Store, p: dict[str, Any], params: WeightParams) -> dict[str, tuple[float, float]]:
    """(spans within ``window_s``, failed requests in a row at its end) per backend with spans within ``lookback_s``."""
    sql = f"""
SELECT backend, countIf(ts >= fromUnixTimestamp64Nano({{wstart:Int64}})) AS n,
       arraySlice(arrayMap(x -> x.2, arraySort(groupArrayIf((ts, status = 'error'),
                                                            ts >= fromUnixTimestamp64Nano({{wstart:Int64}})))),
                  -{{k:UInt32}}) AS tail
FROM {qualified(store, REQUESTS)}
WHERE ts >= fromUnixTimestamp64Nano({{since:Int64}}) AND ts <= fromUnixTimestamp64Nano({{until:Int64}})
GROUP BY backend"""
    out = {}
    for r in store.query(sql, {**p, "k": max(1, params.down_after_errors)}).dicts():
        tail = [int(x) for x in r["tail"]]
        trailing = 0
        for failed in reversed(tail):
            if not failed:
                break
            trailing += 1
        out[str(r["backend"])] = (float(r["n"]), float(trailing))
    return out


def _gpu_map(store: Store, p: dict[str, Any]) -> dict[str, set[tuple[str, str]]]:
    rows = store.query(f"SELECT DISTINCT backend, host, gpu FROM {qualified(store, REQUESTS)} "
                       "WHERE ts >= fromUnixTimestamp64Nano({since:Int64}) AND gpu != ''", p).rows
    out: dict[str, set[tuple[str, str]]] = defaultdict(set)
    for backend, host, gpu in rows:
        out[str(backend)].add((str(host), str(gpu)))
    return out


def read_inputs(store: Store, params: WeightParams, now: float) -> list[BackendInputs]:
    """One :class:`BackendInputs` per known backend, from the newest rows within ``lookback_s``."""
    p = {"since": _ns(now - params.lookback_s), "wstart": _ns(now - params.window_s), "until": _ns(now) + 1,
         "pstart": _ns(now - params.preemption_lookback_s)}
    names = _backend_names(store, params, p)
    if not names:
        return []
    serving = _serving(store, p)
    qps_req, p99_req, last_req = _requests(store, p, params)
    scrapes = _scrapes(store, p)
    tails = _span_tail(store, p, params)
    gpu_of = _gpu_map(store, p)
    return assemble(names, params, now, Readings(serving, qps_req, p99_req, last_req, scrapes, tails, gpu_of,
                                                 read_gpus(store, p)))
