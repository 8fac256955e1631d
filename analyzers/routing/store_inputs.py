"""The weight engine's inputs from a scan of the raw rows, and what both store readers share.

:func:`read_inputs_scan` reads the latest GPU memory, serving metrics and request stats per backend
with one query per raw table and update (``serving_metrics``, ``scrape_health``, ``requests``,
``gpu_samples``): the tables are sorted by backend (or host, GPU) then time, so at a fleet's width
nearly every granule holds some backend's newest rows and a query over the look-back reads its
columns whole; a second query over the same table would pay that again. Names, the GPU map, the
span tail and the window statistics therefore come from the same scan, each bound written as an
``-If`` condition, and aggregations whose keys lead the sort key run in its order. The engine reads
the same from the newest-row tables (``store_latest``); it calls the scans here for keys whose
newest row is after ``now``, and shares :func:`assemble`.
See docs/weights.md ("Backend identity across tables", "Store reader") for how backends map to GPUs
and what each update reads. All time bounds are query parameters (epoch nanoseconds); the reader
never formats values into SQL.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from triscope.analyzers.routing.config import NAN, WeightParams
from triscope.analyzers.routing.model import SOURCE_GPU, SOURCE_REQUESTS, SOURCE_SERVING, BackendInputs
from triscope.schema import GPU_SAMPLES, REQUESTS, SCRAPE_HEALTH, SERVING_METRICS, qualified
from triscope.store.base import Store

UNHEALTHY_STATES = ("lost", "unavailable")


def _ns(t: float) -> int:
    return int(t * 1e9)


def finite(x: Any) -> float:
    """A store cell as a float; NaN for NULL, text or infinities."""
    try:
        v = float(x)
    except (TypeError, ValueError):
        return NAN
    return v if math.isfinite(v) else NAN


UNTIL = "ts <= fromUnixTimestamp64Nano({until:Int64})"
WINDOW = f"ts >= fromUnixTimestamp64Nano({{wstart:Int64}}) AND {UNTIL}"
PREEMPT = f"isFinite(preemptions_total) AND ts >= fromUnixTimestamp64Nano({{pstart:Int64}}) AND {UNTIL}"


def counter_rise(hi: float, lo: float, n: int) -> float:
    """A counter's rise between its first and last sample (after a reset: its value since); NaN
    with fewer than two samples."""
    if n < 2 or not (math.isfinite(hi) and math.isfinite(lo)):
        return NAN
    return hi - lo if hi >= lo else hi


def only(column: str, keys: Sequence[str] | None) -> str:
    """The condition keeping the rows of ``keys`` (all rows when None): ``{keys:Array(String)}``."""
    return "" if keys is None else f" AND {column} IN {{keys:Array(String)}}"


def serving_reading(r: dict[str, Any]) -> dict[str, float]:
    """One backend's serving inputs from its row: the latest gauges, QPS over the window (the counter's
    rise over the time between its first and last scrape in it) and the preemptions counter's rise."""
    qps = NAN
    span = (int(r["w_hi"]) - int(r["w_lo"])) / 1e9
    if int(r["w_n"]) >= 2 and span > 0 and math.isfinite(finite(r["rt_hi"])) and math.isfinite(finite(r["rt_lo"])):
        qps = max(0.0, (finite(r["rt_hi"]) - finite(r["rt_lo"])) / span)
    return {"last": int(r["last_ns"]) / 1e9, "kv": finite(r["kv"]), "p99": finite(r["p99"]), "qps": qps,
            "sleep": finite(r["sleep"]),
            "preemptions": counter_rise(finite(r["pre_hi"]), finite(r["pre_lo"]), int(r["pre_n"]))}


def serving_scan(store: Store, p: dict[str, Any], names: set[str], keys: Sequence[str] | None = None
                 ) -> dict[str, dict[str, float]]:
    """Per backend (of ``keys`` when given) with scrapes in [since, until]: :func:`serving_reading`;
    adds to ``names`` every backend scraped since ``since``."""
    sql = f"""
SELECT backend, countIf({UNTIL}) AS n,
       toUnixTimestamp64Nano(maxIf(ts, {UNTIL})) AS last_ns,
       argMaxIf(kv_cache_usage_ratio, ts, {UNTIL}) AS kv,
       argMaxIf(latency_p99_seconds, ts, {UNTIL}) AS p99,
       maxIf(requests_total, {WINDOW}) AS rt_hi,
       minIf(requests_total, {WINDOW}) AS rt_lo,
       toUnixTimestamp64Nano(maxIf(ts, {WINDOW})) AS w_hi,
       toUnixTimestamp64Nano(minIf(ts, {WINDOW})) AS w_lo,
       countIf({WINDOW}) AS w_n,
       argMaxIf(sleep_state, ts, {UNTIL}) AS sleep,
       argMaxIf(preemptions_total, ts, {PREEMPT}) AS pre_hi,
       argMinIf(preemptions_total, ts, {PREEMPT}) AS pre_lo,
       countIf({PREEMPT}) AS pre_n
FROM {qualified(store, SERVING_METRICS)}
WHERE ts >= fromUnixTimestamp64Nano({{since:Int64}}){only("backend", keys)}
GROUP BY backend
SETTINGS optimize_aggregation_in_order = 1"""
    out = {}
    for r in store.query(sql, {**p, "keys": list(keys or ())}).dicts():
        name = str(r["backend"])
        if name:
            names.add(name)
        if int(r["n"]):  # else only rows after ``until``: named, not measured
            out[name] = serving_reading(r)
    return out


class Spans:
    """What one scan of the request spans since ``since`` gives the engine, per backend."""

    def __init__(self) -> None:
        self.qps: dict[str, float] = defaultdict(float)
        self.p99: dict[str, dict[str, float]] = defaultdict(dict)
        self.last: dict[str, float] = {}
        self.tails: dict[str, tuple[float, float]] = {}
        self.gpus: dict[str, set[tuple[str, str]]] = defaultdict(set)


def spans_scan(store: Store, p: dict[str, Any], params: WeightParams, names: set[str]) -> Spans:
    """QPS, per-class P99 and newest span over the window, (spans in the window, failed requests in a
    row at its end) for backends with spans in [since, until], and the GPUs spans name since
    ``since``; adds to ``names`` every backend with spans since ``since``.

    One scan grouped by (backend, class, host, gpu); the class's P99 merges the exact-quantile
    states of its (host, gpu) groups, so it is the quantile of all its spans."""
    k = max(1, params.down_after_errors)
    # a window longer than the look-back reads spans before ``since`` for QPS and P99 only
    look = "ts >= fromUnixTimestamp64Nano({since:Int64})"
    tail_if = f"{WINDOW} AND {look}"
    sql = f"""
SELECT backend, cls, sum(i_seen) AS seen, sum(i_look) AS n_look, sum(i_n) AS n, sum(i_tail_n) AS n_tail,
       quantileExactIfMerge(0.99)(i_p99) AS p99, toUnixTimestamp64Nano(max(i_last)) AS last_ns,
       arraySlice(arraySort(arrayFlatten(groupArray(i_tail))), -{{k:UInt32}}) AS tail,
       groupArrayIf((host, gpu), gpu != '' AND i_seen > 0) AS gpus
FROM (
    SELECT backend, if(request_class IN {{classes:Array(String)}}, request_class, {{default:String}}) AS cls,
           host, gpu, countIf({look}) AS i_seen, countIf({look} AND {UNTIL}) AS i_look, countIf({WINDOW}) AS i_n,
           countIf({tail_if}) AS i_tail_n,
           quantileExactIfState(0.99)(latency_seconds, isFinite(latency_seconds) AND {WINDOW}) AS i_p99,
           maxIf(ts, {WINDOW}) AS i_last,
           arraySlice(arraySort(groupArrayIf((toUnixTimestamp64Nano(ts), status = 'error'), {tail_if})),
                      -{{k:UInt32}}) AS i_tail
    FROM {qualified(store, REQUESTS)}
    WHERE ts >= fromUnixTimestamp64Nano({{rstart:Int64}})
    GROUP BY backend, cls, host, gpu)
GROUP BY backend, cls
SETTINGS optimize_aggregation_in_order = 1"""
    q = {**p, "classes": list(params.classes), "default": params.default_class, "k": k,
         "rstart": min(p["since"], p["wstart"])}
    out = Spans()
    counts: dict[str, float] = {}
    tails: dict[str, list[tuple[int, int]]] = defaultdict(list)
    for r in store.query(sql, q).dicts():
        b = str(r["backend"])
        if b and int(r["seen"]):
            names.add(b)
        out.gpus[b].update((str(h), str(g)) for h, g in r["gpus"])
        if int(r["n_look"]):
            counts[b] = counts.get(b, 0.0) + int(r["n_tail"])
            tails[b].extend((int(t), int(f)) for t, f in r["tail"])
        if int(r["n"]):  # the class has spans within the window
            out.qps[b] += int(r["n"]) / params.window_s
            if math.isfinite(finite(r["p99"])):
                out.p99[b][str(r["cls"])] = finite(r["p99"])
            out.last[b] = max(out.last.get(b, 0.0), int(r["last_ns"]) / 1e9)
    for b, n in counts.items():
        out.tails[b] = (n, trailing_failures(tails[b], k))
    return out


def trailing_failures(tail: list[tuple[int, int]], k: int) -> float:
    """Failed requests in a row at the end of the newest ``k`` of ``tail`` ((start ns, failed) pairs)."""
    trailing = 0
    for _, failed in reversed(sorted(tail)[-k:]):
        if not failed:
            break
        trailing += 1
    return float(trailing)


def scrapes_scan(store: Store, p: dict[str, Any], names: set[str], keys: Sequence[str] | None = None
                 ) -> dict[str, tuple[float, str, float]]:
    """(up of the latest scrape, its error, the time of the last scrape that answered, NaN if none within
    the look-back) per backend (of ``keys`` when given); a backend with several targets is up when its
    latest scrapes all answered. Adds to ``names`` every backend with scrapes since ``since``."""
    sql = f"""
SELECT backend, sum(i_n) AS n, minIf(i_up, i_n > 0) AS up_latest, anyIf(i_err, i_n > 0 AND i_up = 0) AS error,
       minIf(i_ok_ns, i_n > 0) AS ok_ns FROM (
    SELECT backend, target, countIf({UNTIL}) AS i_n, argMaxIf(up, ts, {UNTIL}) AS i_up,
           argMaxIf(error, ts, {UNTIL}) AS i_err,
           toUnixTimestamp64Nano(maxIf(ts, up = 1 AND {UNTIL})) AS i_ok_ns
    FROM {qualified(store, SCRAPE_HEALTH)}
    WHERE ts >= fromUnixTimestamp64Nano({{since:Int64}}){only("backend", keys)}
    GROUP BY backend, target)
GROUP BY backend"""
    out = {}
    for r in store.query(sql, {**p, "keys": list(keys or ())}).dicts():
        name = str(r["backend"])
        if name:
            names.add(name)
        if not int(r["n"]):
            continue
        up = float(r["up_latest"])
        ok = int(r["ok_ns"]) / 1e9 if int(r["ok_ns"]) > 0 else NAN
        out[name] = (up, str(r["error"]) if up == 0 else "", ok)
    return out


def read_gpus(store: Store, p: dict[str, Any], hosts: Sequence[str] | None = None
              ) -> dict[tuple[str, str], dict[str, Any]]:
    """Latest sample per (host, gpu index) (of ``hosts`` when given), also reachable by (host, uuid)."""
    sql = f"""
SELECT host, gpu, argMax(gpu_uuid, ts) AS uuid, toUnixTimestamp64Nano(max(ts)) AS last_ns,
       argMax(memory_used_bytes, ts) AS used, argMax(memory_total_bytes, ts) AS total, argMax(state, ts) AS state
FROM {qualified(store, GPU_SAMPLES)}
WHERE ts >= fromUnixTimestamp64Nano({{since:Int64}}) AND {UNTIL}{only("host", hosts)}
GROUP BY host, gpu
SETTINGS optimize_aggregation_in_order = 1"""
    out: dict[tuple[str, str], dict[str, Any]] = {}
    for r in store.query(sql, {**p, "keys": list(hosts or ())}).dicts():
        add_gpu(out, r)
    return out


def add_gpu(out: dict[tuple[str, str], dict[str, Any]], r: dict[str, Any]) -> None:
    """One GPU's newest sample from its row, under (host, index) and (host, uuid)."""
    sample = {"last": int(r["last_ns"]) / 1e9, "used": finite(r["used"]), "total": finite(r["total"]),
              "state": str(r["state"])}
    out[(str(r["host"]), str(int(r["gpu"])))] = sample
    if r["uuid"]:
        out[(str(r["host"]), str(r["uuid"]))] = sample


def bounds(params: WeightParams, now: float) -> dict[str, int]:
    """The query parameters of an update at ``now``: the look-back's start, the window's, ``until``
    (``now`` included) and the preemption look-back's start, in epoch nanoseconds."""
    return {"since": _ns(now - params.lookback_s), "wstart": _ns(now - params.window_s), "until": _ns(now) + 1,
            "pstart": _ns(now - params.preemption_lookback_s)}


def read_with(store: Store, params: WeightParams, now: float, serving: Callable[..., dict[str, Any]],
              scrapes: Callable[..., dict[str, Any]], spans: Callable[..., Spans],
              gpus: Callable[..., dict[tuple[str, str], dict[str, Any]]]) -> list[BackendInputs]:
    """The store readers' common frame: the bounds, the backends found by the ``serving``, ``scrapes`` and
    ``spans`` readers (each ``(store, bounds, found)``, spans with the params too), then :func:`assemble`."""
    p = bounds(params, now)
    if not params.discover and not params.backends:
        return []
    found = set(params.backends)
    engine = serving(store, p, found)
    scraped = scrapes(store, p, found)
    req = spans(store, p, params, found)
    names = sorted(found) if params.discover else sorted(params.backends)
    if not names:
        return []
    return assemble(names, params, now, Readings(engine, req.qps, req.p99, req.last, scraped, req.tails, req.gpus,
                                                 gpus(store, p)))


def read_inputs_scan(store: Store, params: WeightParams, now: float) -> list[BackendInputs]:
    """One :class:`BackendInputs` per known backend, from the raw rows within ``lookback_s`` (one scan
    per table); :func:`~triscope.analyzers.routing.store_latest.read_inputs` reads the same from the
    newest-row tables."""
    return read_with(store, params, now, serving_scan, scrapes_scan, spans_scan, read_gpus)


@dataclass(frozen=True)
class Readings:
    """What the store said, per table, that :func:`assemble` turns into each backend's inputs."""

    serving: dict[str, dict[str, float]]
    qps: dict[str, float]
    p99: dict[str, dict[str, float]]
    last_request: dict[str, float]
    scrapes: dict[str, tuple[float, str, float]]
    tails: dict[str, tuple[float, float]]
    gpu_of: dict[str, set[tuple[str, str]]]
    gpus: dict[tuple[str, str], dict[str, Any]]


def assemble(names: list[str], params: WeightParams, now: float, r: Readings) -> list[BackendInputs]:
    """One :class:`BackendInputs` per name from the readings: its worst-filled GPU, its engine's scrape,
    its spans (the engine's own P99 and QPS where no span says), its scrape health and span tail."""
    out = []
    for name in names:
        cfg = params.backends.get(name)
        if cfg and cfg.gpus:
            keys = {(cfg.host, str(g)) for g in cfg.gpus}
        else:
            keys = r.gpu_of.get(name, set())
            if cfg and cfg.host:
                keys = {(cfg.host, g) for _, g in keys} or keys
        samples = [r.gpus[k] for k in sorted(keys) if k in r.gpus]
        used = total = NAN
        healthy = all(s["state"] not in UNHEALTHY_STATES for s in samples)
        sources: dict[str, float] = {}
        measured = [s for s in samples if math.isfinite(s["used"]) and math.isfinite(s["total"]) and s["total"] > 0]
        if measured:
            worst = max(measured, key=lambda s: s["used"] / s["total"])
            used, total = worst["used"], worst["total"]
        if samples:
            sources[SOURCE_GPU] = min(s["last"] for s in samples)
        srv = r.serving.get(name)
        kv = sleep = preemptions = NAN
        p99 = dict(r.p99.get(name, {}))
        qps = r.qps.get(name, NAN)
        if srv is not None:
            sources[SOURCE_SERVING] = srv["last"]
            kv, sleep, preemptions = srv["kv"], srv["sleep"], srv["preemptions"]
            if not p99 and math.isfinite(srv["p99"]):
                p99[params.default_class] = srv["p99"]
            if not math.isfinite(qps):
                qps = srv["qps"]
        if name in r.last_request:
            sources[SOURCE_REQUESTS] = r.last_request[name]
        up, scrape_error, last_ok = r.scrapes.get(name, (NAN, "", NAN))
        failing = (now - last_ok if math.isfinite(last_ok) else params.lookback_s) if up == 0 else NAN
        spans, trailing = r.tails.get(name, (NAN, NAN))
        out.append(BackendInputs(name, memory_used_bytes=used, memory_total_bytes=total, kv_cache_usage_ratio=kv,
                                 qps=qps, capacity_qps=cfg.capacity_qps if cfg and cfg.capacity_qps > 0 else NAN,
                                 p99_seconds=p99, healthy=healthy, sources=sources,
                                 address=cfg.address if cfg else "", sleep_state=sleep, preemptions=preemptions,
                                 scrape_up=up, scrape_error=scrape_error, scrape_failing_s=failing,
                                 span_count=spans, trailing_errors=trailing))
    return out
