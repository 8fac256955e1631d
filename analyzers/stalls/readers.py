"""What the stall classifier reads from the store: samples, block-IO, serving queues and trace intervals."""

from __future__ import annotations

from typing import Any

import numpy as np

from triscope.analyzers.trace_breakdown import GPU_WORK, device_kind
from triscope.errors import InputError
from triscope.schema import (
    GPU_SAMPLES,
    IO_LATENCY,
    REQUESTS,
    SERVING_METRICS,
    TRACE_EVENTS,
    TRACE_RUNS,
    qualified,
)
from triscope.store.base import Store

_HOST_COMM = r"^(gloo|mpi|ucc|xccl):"
_NOT_HOST_WORK = r"Synchronize|^c10d::|^record_param_comms$|^nccl:|^ProfilerStep"
_IN_RANGE = "ts >= fromUnixTimestamp64Nano({start:Int64}) AND ts < fromUnixTimestamp64Nano({end:Int64})"
# What a trace recorded: not the profiler's own span (category Trace) nor ProfilerStep annotations, which
# can run far past the last recorded event (13 s around 1.5 ms of activity in a Triton sample).
_RECORDED = "NOT (category = 'Trace' OR (kind IN ('user_annotation', 'cpu_op') AND startsWith(name, 'ProfilerStep')))"


def _range_params(start_ns: int, end_ns: int) -> dict[str, Any]:
    return {"start": int(start_ns), "end": int(end_ns)}


def _decimal(column: str) -> str:
    """A Float32 column as the Float64 of its shortest decimal text (0.33, not 0.33000001311302185): the value
    the row-format readers get, so every command shows the same figure for the same sample."""
    return f"toFloat64(toString(ifNull({column}, nan)))"


def samples(store: Store, start_ns: int, end_ns: int) -> dict[str, Any]:
    """Columns host, gpu_index, gpu_model, ts_ns, sm, dram, l2, util (NaN where not reported) of every GPU sample
    in the range, sorted by host, gpu and time. A range without samples (a serving fleet without GPU telemetry)
    is answered without the columnar reader's imports."""
    params = _range_params(start_ns, end_ns)
    if not store.query(f"SELECT count() FROM {qualified(store, GPU_SAMPLES)} WHERE {_IN_RANGE}", params).scalar():
        return {k: np.zeros(0, dtype=object if k in ("host", "gpu_model") else np.float64)
                for k in ("host", "gpu_index", "gpu_model", "ts_ns", "sm", "dram", "l2", "util")}
    return store.query_columns(
        "SELECT host, toInt64(gpu) AS gpu_index, gpu_model, toUnixTimestamp64Nano(ts) AS ts_ns, "
        f"{_decimal('sm_active_ratio')} AS sm, {_decimal('dram_active_ratio')} AS dram, "
        f"{_decimal('l2_bandwidth_ratio')} AS l2, {_decimal('gpu_util_ratio')} AS util "
        f"FROM {qualified(store, GPU_SAMPLES)} WHERE {_IN_RANGE} ORDER BY host, gpu_index, ts_ns", params)


def io_rows(store: Store, start_ns: int, end_ns: int) -> list[tuple[Any, ...]]:
    """(host, device, op, start_ns, end_ns, p99_seconds, queue_depth): read rows, or 'all' where no read rows.

    window_seconds is Float32: the end is rounded to the microsecond so 0.1 s does not spill into the next window.
    """
    io = qualified(store, IO_LATENCY)
    return store.query(
        "SELECT host, device, op, toUnixTimestamp64Nano(ts) AS t, "
        "t + toInt64(round(greatest(window_seconds, 0) * 1e6)) * 1000, p99_seconds, queue_depth "
        f"FROM {io} "
        "WHERE ts < fromUnixTimestamp64Nano({end:Int64}) "
        "AND ts >= fromUnixTimestamp64Nano({start:Int64}) - INTERVAL 1 HOUR "
        "AND (op = 'read' OR (op = 'all' AND (host, device) NOT IN (SELECT host, device FROM "
        f"{io} WHERE op = 'read' AND ts < fromUnixTimestamp64Nano({{end:Int64}}) "
        "AND ts >= fromUnixTimestamp64Nano({start:Int64}) - INTERVAL 1 HOUR))) ORDER BY host, device, t",
        _range_params(start_ns, end_ns)).rows


def serving_queue(store: Store, start_ns: int, end_ns: int) -> list[tuple[Any, ...]]:
    """(host, ts_ns, queue_length) of every finite serving-queue sample in the range."""
    return store.query(
        f"SELECT host, toUnixTimestamp64Nano(ts), queue_length FROM {qualified(store, SERVING_METRICS)} "
        f"WHERE {_IN_RANGE} AND isFinite(queue_length) ORDER BY host, ts", _range_params(start_ns, end_ns)).rows


def device_type(category: str) -> str:
    """The device a device-work category ran on, as ``collectors.kineto.classify.device_type`` names it
    (in lower case: ``gpu``, ``mtia``)."""
    return device_kind(category).lower()


def trace_parts(store: Store, start_ns: int, end_ns: int, run_ids: list[str] | None) -> list[dict[str, Any]]:
    """(run, rank) traces overlapping the range, with host, clock base, recorded span (first to last
    recorded event, see ``_RECORDED``), main device and its type (``gpu``, ``mtia``, ...)."""
    params: dict[str, Any] = _range_params(start_ns, end_ns)
    where = ""
    if run_ids:
        where = "WHERE run_id IN {runs:Array(String)}"
        params["runs"] = list(run_ids)
    rows = store.query(
        "SELECT e.run_id, e.rank, r.host, r.base, e.lo + r.base, e.hi + r.base, e.dev, e.dev_cat, e.has_dev FROM ("
        f"  SELECT run_id, rank, countIf({_RECORDED}) > 0 AS recorded, "
        f"  if(recorded, minIf(ts_ns, {_RECORDED}), min(ts_ns)) AS lo, "
        f"  if(recorded, maxIf(ts_ns + dur_ns, {_RECORDED}), max(ts_ns + dur_ns)) AS hi, "
        f"  if(countIf({GPU_WORK}) > 0, topKIf(1)(device, {GPU_WORK})[1], -1) AS dev, "
        f"  countIf({GPU_WORK}) > 0 AS has_dev, "
        f"  if(has_dev, topKIf(1)(category, {GPU_WORK})[1], '') AS dev_cat "
        f"  FROM {qualified(store, TRACE_EVENTS)} {where} GROUP BY run_id, rank) AS e "
        "INNER JOIN (SELECT run_id, rank, argMax(host, ingested_at) AS host, "
        f"  argMax(base_time_ns, ingested_at) AS base FROM {qualified(store, TRACE_RUNS)} GROUP BY run_id, rank) AS r "
        "ON e.run_id = r.run_id AND e.rank = r.rank "
        "WHERE e.lo + r.base < {end:Int64} AND e.hi + r.base > {start:Int64} ORDER BY e.run_id, e.rank",
        params).rows
    return [{"run_id": r[0], "rank": int(r[1]), "host": r[2], "base": int(r[3]), "lo": int(r[4]),
             "hi": int(r[5]), "device": int(r[6]), "device_type": device_type(str(r[7])), "has_device": bool(r[8])}
            for r in rows]


def trace_span(store: Store, run_ids: list[str]) -> tuple[int, int]:
    """UTC epoch ns span covered by the given trace runs."""
    return span_of(trace_parts(store, -(2**62), 2**62, run_ids), run_ids)


def span_of(parts: list[dict[str, Any]], run_ids: list[str]) -> tuple[int, int]:
    """UTC epoch ns span covered by ``trace_parts`` of the given runs."""
    if not parts:
        raise InputError(f"no trace events for run(s) {', '.join(run_ids)}")
    return min(p["lo"] for p in parts), max(p["hi"] for p in parts)


def trace_intervals(store: Store, part: dict[str, Any], start_ns: int, end_ns: int,
                    limit: int) -> dict[str, Any]:
    """Absolute-ns intervals per class for one (run, rank): gpu, gpu_compute, comm, host, steps."""
    base = part["base"]
    params = {"run_id": part["run_id"], "rank": part["rank"], "lo": start_ns - base, "hi": end_ns - base,
              "host_comm": _HOST_COMM, "not_work": _NOT_HOST_WORK, "limit": limit + 1}
    res = store.query_columns(
        f"SELECT toUInt8(multiIf({GPU_WORK} AND kernel_class = 'comm', 1, "
        f"{GPU_WORK} AND kernel_class IN ('compute', ''), 2, "
        f"{GPU_WORK}, 3, "
        "kind IN ('user_annotation', 'cpu_op') AND match(name, {host_comm:String}), 4, "
        "kind = 'user_annotation' AND startsWith(name, 'ProfilerStep#'), 5, "
        "kind IN ('cpu_op', 'runtime') AND NOT match(name, {not_work:String}), 6, 0)) AS cls, "
        "ts_ns, ts_ns + dur_ns AS te, if(cls = 5, name, '') AS step_name "
        f"FROM {qualified(store, TRACE_EVENTS)} "
        "WHERE run_id = {run_id:String} AND rank = {rank:Int32} AND ts_ns < {hi:Int64} "
        "AND ts_ns + dur_ns > {lo:Int64} AND cls != 0 LIMIT {limit:UInt64}", params)
    cls = np.asarray(res.get("cls", []), dtype=np.uint8)
    if len(cls) > limit:
        raise InputError(f"trace {part['run_id']} rank {part['rank']} has more than {limit} events in the range; "
                         "narrow --since/--until or raise [stalls] max_trace_events")
    ts = np.asarray(res.get("ts_ns", []), dtype=np.int64) + base
    te = np.asarray(res.get("te", []), dtype=np.int64) + base
    names = np.asarray(res.get("step_name", []), dtype=object)

    def pick(*codes: int) -> tuple[np.ndarray, np.ndarray]:
        m = np.isin(cls, codes)
        return ts[m], te[m]

    steps = cls == 5
    return {"gpu": pick(1, 2, 3), "gpu_compute": pick(2), "comm": pick(1, 4), "host": pick(6),
            "steps": (ts[steps], te[steps], names[steps]), "has_gpu": part["has_device"]}


def model_gpus(store: Store, model: str, start_ns: int, end_ns: int) -> set[tuple[str, str]]:
    """(host, gpu) pairs that served ``model`` in the range (gpu '' = the whole host)."""
    params = {**_range_params(start_ns, end_ns), "model": model}
    pairs = {(h, g) for h, g in store.query(
        f"SELECT DISTINCT host, gpu FROM {qualified(store, REQUESTS)} WHERE model = {{model:String}} "
        f"AND {_IN_RANGE}", params).rows}
    pairs |= {(h, "") for (h,) in store.query(
        f"SELECT DISTINCT host FROM {qualified(store, SERVING_METRICS)} WHERE model = {{model:String}} "
        f"AND {_IN_RANGE}", params).rows}
    return pairs
