"""Collective operations of Kineto traces already in the store -> ``nccl_ops`` (source ``kineto``).

GPU collectives: every ``kernel_class = 'comm'`` kernel, with its parameters from the kernel's
own args (2024+ traces), else from the ``record_param_comms`` CPU op sharing its External id,
else from the ``record_param_comms`` op enclosing the runtime launch with the same correlation.
Host-side collectives (gloo, whose traces have no GPU kernels): the ``gloo:<collective>``
annotations the backend's worker threads record around each operation.
"""

from __future__ import annotations

import bisect
import json
import math
import statistics
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from typing import Any

from triscope.collectors.nccl.common import (
    NAN,
    backend_of,
    bandwidths,
    canonical_collective,
    dtype_bytes,
    new_row,
    replace_rows,
)
from triscope.errors import InputError
from triscope.schema import TRACE_EVENTS, TRACE_RUNS, encode_ts, qualified
from triscope.store.base import Store

HOST_COLLECTIVE_PATTERN = r"^(gloo|mpi|ucc|xccl):"
_PARAM_COLS = ("collective", "in_nelems", "out_nelems", "group_size", "dtype", "pg_name", "pg_ranks")


@dataclass
class _Run:
    rank: int
    host: str
    base_time_ns: int
    nranks: int  # world size when every process group has that size, else -1


def _runs(store: Store, run_id: str) -> dict[int, _Run]:
    res = store.query(
        f"SELECT rank, argMax(host, ingested_at), argMax(base_time_ns, ingested_at), "
        f"argMax(metadata_json, ingested_at) FROM {qualified(store, TRACE_RUNS)} "
        "WHERE run_id = {run_id:String} GROUP BY rank", {"run_id": run_id})
    out: dict[int, _Run] = {}
    for rank, host, base, meta_text in res.rows:
        out[int(rank)] = _Run(int(rank), str(host), int(base), _uniform_pg_size(meta_text))
    return out


def _uniform_pg_size(meta_text: str) -> int:
    try:
        info = json.loads(meta_text or "{}").get("distributedInfo") or {}
    except (ValueError, AttributeError):
        return -1
    sizes = {int(pg.get("pg_size", -1)) for pg in info.get("pg_config") or [] if isinstance(pg, dict)}
    if len(sizes) == 1:
        return sizes.pop()
    if not sizes and info.get("world_size"):
        return int(info["world_size"])
    return -1


def _params_row(values: dict[str, Any]) -> dict[str, Any] | None:
    return values if values.get("collective") else None


def extract_kineto(store: Store, run_id: str) -> list[dict[str, Any]]:
    """nccl_ops rows for every collective of one trace run (all ranks)."""
    runs = _runs(store, run_id)
    if not runs:
        raise InputError(f"trace run {run_id!r} is not in the store (ingest it with `triscope ingest trace`)")
    events = qualified(store, TRACE_EVENTS)
    p = {"run_id": run_id}
    params_sel = ", ".join(_PARAM_COLS)
    kernels = store.query(
        f"SELECT rank, name, device, stream, ts_ns, dur_ns, correlation, external_id, {params_sel} "
        f"FROM {events} WHERE run_id = {{run_id:String}} AND kind = 'kernel' AND kernel_class = 'comm' "
        "ORDER BY rank, ts_ns", p).dicts()
    rpc = store.query(
        f"SELECT rank, tid, ts_ns, dur_ns, external_id, {params_sel} FROM {events} "
        "WHERE run_id = {run_id:String} AND name = 'record_param_comms' ORDER BY rank, tid, ts_ns", p).dicts()
    launches = store.query(
        f"SELECT rank, tid, ts_ns, correlation FROM {events} WHERE run_id = {{run_id:String}} "
        "AND kind = 'runtime' AND correlation != 0 AND (rank, correlation) IN ("
        f"SELECT rank, correlation FROM {events} WHERE run_id = {{run_id:String}} "
        "AND kind = 'kernel' AND kernel_class = 'comm')", p).dicts()
    host_ops = store.query(
        f"SELECT rank, tid, name, ts_ns, dur_ns FROM {events} WHERE run_id = {{run_id:String}} "
        "AND kind IN ('user_annotation', 'cpu_op') AND match(name, {pattern:String}) ORDER BY rank, ts_ns",
        {**p, "pattern": HOST_COLLECTIVE_PATTERN}).dicts()

    by_ext = {(r["rank"], r["external_id"]): r for r in rpc if r["external_id"]}
    rpc_by_thread: dict[tuple[int, str], list[dict[str, Any]]] = defaultdict(list)
    for r in rpc:
        rpc_by_thread[(r["rank"], r["tid"])].append(r)
    starts = {k: [r["ts_ns"] for r in v] for k, v in rpc_by_thread.items()}
    launch_by_corr = {(r["rank"], r["correlation"]): r for r in launches}

    def enclosing_rpc(rank: int, corr: int) -> dict[str, Any] | None:
        launch = launch_by_corr.get((rank, corr))
        if launch is None:
            return None
        key = (rank, launch["tid"])
        i = bisect.bisect_right(starts.get(key, []), launch["ts_ns"]) - 1
        if i < 0:
            return None
        op = rpc_by_thread[key][i]
        return op if op["ts_ns"] + op["dur_ns"] >= launch["ts_ns"] else None

    rows: list[dict[str, Any]] = []
    for k in kernels:
        params = (_params_row(k) or _params_row(by_ext.get((k["rank"], k["external_id"])) or {})
                  or _params_row(enclosing_rpc(k["rank"], k["correlation"]) or {}) or k)
        rows.append(_row(run_id, runs, k["rank"], k["name"], k["ts_ns"], k["dur_ns"], params,
                         device=int(k["device"]), detail={"stream": k["stream"], "correlation": k["correlation"]}))
    for h in host_ops:
        rows.append(_row(run_id, runs, h["rank"], h["name"], h["ts_ns"], h["dur_ns"], {},
                         device=-1, detail={"tid": h["tid"], "host_side": True}))
    _number(rows)
    return rows


def _row(run_id: str, runs: dict[int, _Run], rank: int, name: str, ts_ns: int, dur_ns: int,
         params: dict[str, Any], device: int, detail: dict[str, Any]) -> dict[str, Any]:
    run = runs.get(int(rank)) or _Run(int(rank), "", 0, -1)
    collective = canonical_collective(str(params.get("collective") or "")) or canonical_collective(name)
    nranks = int(params.get("group_size") or 0) or run.nranks
    size = dtype_bytes(str(params.get("dtype") or ""))
    nelems = max(int(params.get("in_nelems") or 0), int(params.get("out_nelems") or 0))
    msg_bytes = nelems * size if nelems > 0 else NAN
    duration = dur_ns / 1e9
    alg, bus = bandwidths(msg_bytes, duration, collective, nranks)
    if params.get("pg_ranks"):
        detail = {**detail, "pg_ranks": params["pg_ranks"]}
    return new_row(
        ts=encode_ts(int(ts_ns) + run.base_time_ns), host=run.host, run_id=run_id, rank=int(rank),
        source="kineto", backend=backend_of(name), comm_id=str(params.get("pg_name") or ""),
        collective=collective, op_name=name, nranks=nranks, msg_bytes=msg_bytes,
        count=float(nelems) if nelems > 0 else NAN, dtype=str(params.get("dtype") or ""), device=device,
        duration_seconds=duration, algbw_bytes_per_second=alg, busbw_bytes_per_second=bus,
        state="completed", detail_json=detail,
    )


def _number(rows: list[dict[str, Any]]) -> None:
    """``seq``: the occurrence index of each (rank, comm, collective, host/GPU side) in time order.

    Ranks of one job run the same collectives in the same order per communicator, so equal
    ``seq`` across ranks names the same operation.
    """
    rows.sort(key=lambda r: (r["rank"], r["ts"].zfill(30)))
    counters: dict[tuple[Any, ...], int] = defaultdict(int)
    for r in rows:
        key = (r["rank"], r["comm_id"], r["collective"], r["device"] < 0)
        r["seq"] = counters[key]
        counters[key] += 1


@dataclass
class KinetoSummary:
    """What ``nccl kineto`` stored for one run, and why bus bandwidth is unknown where it is."""

    run_id: str
    rows: int = 0
    ranks: list[int] = field(default_factory=list)
    host_side: int = 0
    busbw_known: int = 0
    no_size: int = 0
    no_size_host_side: int = 0
    median_busbw_bytes_per_second: float | None = None
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def summarize(run_id: str, rows: list[dict[str, Any]]) -> KinetoSummary:
    """Counts of ``rows`` and one-line notes for a reader: no collectives, or bus bandwidth unknown and why."""
    known = [r["busbw_bytes_per_second"] for r in rows if math.isfinite(r["busbw_bytes_per_second"])]
    unsized = [r for r in rows if not math.isfinite(r["msg_bytes"])]
    out = KinetoSummary(run_id, len(rows), sorted({int(r["rank"]) for r in rows}), sum(r["device"] < 0 for r in rows),
                        len(known), len(unsized), sum(r["device"] < 0 for r in unsized),
                        statistics.median(known) if known else None)
    if not rows:
        out.notes.append("no collectives in this trace: no NCCL kernels and no gloo/mpi host-side annotations")
    if unsized:
        why = []
        if out.no_size - out.no_size_host_side:
            why.append(f"{out.no_size - out.no_size_host_side} NCCL kernels: the trace has no message sizes for them "
                       "(no collective args on the kernels and no record_param_comms op to take them from, as in "
                       "traces before 2024)")
        if out.no_size_host_side:
            why.append(f"{out.no_size_host_side} host-side (gloo) collectives: no message sizes are stored for them "
                       "(the ingest keeps no Input Dims); a Flight Recorder dump of the same job has them "
                       "(triscope nccl ingest)")
        out.notes.append(f"bus bandwidth unknown for {len(unsized)} of {len(rows)} collectives: " + "; ".join(why))
    rest = len(rows) - len(unsized) - len(known)
    if rest > 0:
        out.notes.append(f"bus bandwidth unknown for {rest} more: the group size is unknown or the collective has no "
                         "bus factor (Barrier, Gather, Scatter)")
    return out


def ingest_kineto_summary(store: Store, run_id: str) -> KinetoSummary:
    """Extract and store (replacing earlier extraction of the run); returns what was stored."""
    rows = extract_kineto(store, run_id)
    replace_rows(store, rows, "kineto", run_id)
    return summarize(run_id, rows)


def ingest_kineto_run(store: Store, run_id: str) -> int:
    """Extract and store (replacing earlier extraction of the run); returns rows written."""
    return ingest_kineto_summary(store, run_id).rows
