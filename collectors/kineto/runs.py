"""Runs bookkeeping of trace ingest: run ids and ranks of files, replacing a (run, rank), ``trace_runs`` rows.

Writes go through :mod:`triscope.collectors.ingest_sink` (straight to the store, keyed by run id).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from triscope.collectors import ingest_sink
from triscope.collectors.kineto import classify
from triscope.collectors.kineto.classify import GPU_WORK_KINDS
from triscope.collectors.kineto.errors import RankTakenError
from triscope.collectors.kineto.reader import TraceHeader
from triscope.collectors.kineto.sql import kernel_class_sql
from triscope.errors import InputError
from triscope.schema import TRACE_EVENTS, TRACE_RUNS, qualified
from triscope.store.base import Store

TRACE_SUFFIXES = (".json", ".json.gz", ".pt.trace.json", ".pt.trace.json.gz")
RUNS_PER_INSERT = 64  # trace_runs rows written together (each carries up to 1 MB of metadata)
_RANK_IN_NAME = re.compile(r"rank[_-]?(\d+)", re.IGNORECASE)
_TRACE_SUFFIX = re.compile(r"(\.pt\.trace)?\.json(\.gz)?$", re.IGNORECASE)
_RANK_WHERE = "run_id = {run_id:String} AND rank = {rank:Int32}"


@dataclass
class IngestResult:
    """What one trace file produced."""

    path: str
    run_id: str
    rank: int
    events: int = 0
    gpu_events: int = 0
    status: str = "complete"
    error: str = ""
    seconds: float = 0.0
    base_time_ns: int = 0
    device_type: str = ""
    """What ran the device work: GPU (CUDA, ROCm), MTIA, ...; empty when the trace has no device activity."""
    profiler_ranges: int = 0
    """Range-profiler measurements (``cuda_profiler_range``): device activity recorded without kernel events."""
    world_size: int | None = None
    start_ns: int | None = None
    """UTC epoch ns of the first and last event; None when the trace's clock is not absolute."""
    end_ns: int | None = None


def default_run_id(path: Path) -> str:
    """Run id for a path: a directory's name (one job, each file a rank), or a file's name without its
    extension, rank included (``mtia_rank_0.json.gz`` is run ``mtia_rank_0``)."""
    if path.is_dir():
        return path.resolve().name
    stem = _TRACE_SUFFIX.sub("", path.name)
    return stem or path.name


def rank_from_name(path: Path) -> int | None:
    match = _RANK_IN_NAME.search(path.name)
    return int(match.group(1)) if match else None


def expand_paths(paths: Iterable[str | Path]) -> list[tuple[Path, str | None]]:
    """Trace files for the given paths; files of one directory share the directory's run id."""
    out: list[tuple[Path, str | None]] = []
    for raw in paths:
        path = Path(raw)
        if path.is_dir():
            files = sorted(p for p in path.iterdir() if p.is_file() and p.name.endswith(TRACE_SUFFIXES))
            if not files:
                raise InputError(f"{path}: no .json or .json.gz trace files in this directory")
            out.extend((f, default_run_id(path)) for f in files)
        elif path.exists():
            out.append((path, None))
        else:
            raise InputError(f"{path}: no such file or directory")
    return out


def claim(taken: set[tuple[str, int]], path: Path, run_id: str, rank: int, known: bool = True) -> None:
    """Mark (run_id, rank) as written by this batch; RankTakenError when another file has it
    (``known``: the rank came from the file, not the default)."""
    if (run_id, rank) in taken:
        why = "" if known else " (the file has no rank in its metadata or name: the default rank)"
        raise RankTakenError(f"{path}: rank {rank}{why} of run {run_id!r} was already ingested from another file "
                             "in this batch; give each job its own directory or --run-id")
    taken.add((run_id, rank))


def delete_rank(store: Store, run_id: str, rank: int) -> None:
    """Remove earlier rows of (run_id, rank) so a re-ingest replaces them."""
    params = {"run_id": run_id, "rank": rank}
    if not ingest_sink.has_rows(store, (TRACE_EVENTS, TRACE_RUNS), _RANK_WHERE, params):
        return  # nothing to replace: skip the mutations
    ingest_sink.delete_rows(store, TRACE_EVENTS, _RANK_WHERE, params)
    ingest_sink.delete_rows(store, TRACE_RUNS, _RANK_WHERE, params)


def delete_block(store: Store, run_id: str, rank: int, block: int) -> None:
    """Remove the events of one block of a file (a block ClickHouse refused part of)."""
    ingest_sink.delete_rows(store, TRACE_EVENTS, _RANK_WHERE + " AND ingest_block = {block:UInt32}",
                            {"run_id": run_id, "rank": rank, "block": block})


def move_rank(store: Store, run_id: str, old: int, new: int) -> None:
    """Re-key rows written under a guessed rank (rank is part of the sorting key: copy, then delete)."""
    delete_rank(store, run_id, new)
    ingest_sink.copy_rows(store, TRACE_EVENTS, "run_id = {run_id:String} AND rank = {old:Int32}",
                          {"new": new, "old": old, "run_id": run_id}, {"rank": "{new:Int32}"})
    ingest_sink.delete_rows(store, TRACE_EVENTS, _RANK_WHERE, {"run_id": run_id, "rank": old})


def summarize(store: Store, result: IngestResult, header: TraceHeader) -> None:
    """Fill ``result`` from what the store holds for its (run, rank): counts, device type, times;
    device work of categories not known by name is recognised first (:func:`recognise_device_work`)."""
    gpu = tuple(sorted(GPU_WORK_KINDS))
    params = {"run_id": result.run_id, "rank": result.rank}
    sql = (f"SELECT count(), countIf(kind IN {gpu}), min(ts_ns), max(ts_ns + dur_ns), "
           f"groupUniqArrayIf(8)(category, kind IN {gpu}), countIf(kind = 'other' AND stream != -1), "
           "countIf(kind = 'profiler_range'), groupUniqArrayIf(8)(category, kind = 'profiler_range') "
           f"FROM {qualified(store, TRACE_EVENTS)} WHERE {_RANK_WHERE}")
    row = store.query(sql, params).rows[0]
    if row[5] and recognise_device_work(store, result.run_id, result.rank):
        row = store.query(sql, params).rows[0]
    result.events, result.gpu_events, result.profiler_ranges = int(row[0]), int(row[1]), int(row[6])
    result.device_type = "/".join(sorted({classify.device_type(c) for c in row[4] or row[7]}))
    result.base_time_ns = header.base_time_ns
    result.world_size = header.world_size
    lo, hi = header.base_time_ns + int(row[2]), header.base_time_ns + int(row[3])
    if result.events and lo >= _ABSOLUTE_NS:  # relative clocks without a base say nothing of the date
        result.start_ns, result.end_ns = lo, hi


_ABSOLUTE_NS = 946_684_800 * 10**9  # 2000-01-01: earlier epoch times are a relative clock
_HOST_KINDS = ("cpu_op", "user_annotation", "runtime", "python")


def recognise_device_work(store: Store, run_id: str, rank: int) -> bool:
    """Events of unknown categories that carry a stream on a pid with no host events are device work
    (Kineto writes device activity under the device index as pid): re-key them as kernels (kind is
    part of the sorting key: copy, then delete). True when any were found."""
    params: dict[str, Any] = {"run_id": run_id, "rank": rank}
    host = store.query(f"SELECT DISTINCT pid FROM {qualified(store, TRACE_EVENTS)} "
                       f"WHERE {_RANK_WHERE} AND kind IN {_HOST_KINDS}", params).rows
    params.update(host_pids=[r[0] for r in host], comm_re=classify.comm_kernel_pattern())
    where = _RANK_WHERE + " AND kind = 'other' AND stream != -1 AND NOT has({host_pids:Array(String)}, pid)"
    if not ingest_sink.has_rows(store, (TRACE_EVENTS,), where, params):
        return False
    ingest_sink.copy_rows(store, TRACE_EVENTS, where, params, {
        "kind": "'kernel'", "kernel_class": kernel_class_sql("'kernel'"),
        "device": "if(device = -1, toInt32OrDefault(pid, toInt32(-1)), device)"})
    ingest_sink.delete_rows(store, TRACE_EVENTS, where, params)
    return True


def run_row(path: Path, result: IngestResult, header: TraceHeader) -> dict[str, Any]:
    """The ``trace_runs`` row of one ingested file (``ingested_at`` is set by the store)."""
    meta = header.metadata
    return {
        "run_id": result.run_id, "rank": result.rank, "source_path": str(path.resolve()),
        "source_bytes": path.stat().st_size, "host": str(meta.get("host_name", "")),
        "base_time_ns": header.base_time_ns, "time_base": "relative" if header.base_time_ns else "absolute",
        "event_count": result.events, "gpu_event_count": result.gpu_events, "status": result.status,
        "error": result.error, "metadata_json": json.dumps(meta, default=str)[:1_000_000],
    }


def insert_runs(store: Store, rows: list[dict[str, Any]]) -> None:
    """Write ``trace_runs`` rows in one insert: one part for a whole batch of files instead of one
    per file (~5 ms each on the embedded store)."""
    ingest_sink.insert_values(store, TRACE_RUNS, rows, {"ingested_at": "now64(3)"})
