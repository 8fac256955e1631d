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
from triscope.collectors.kineto.classify import GPU_WORK_KINDS
from triscope.collectors.kineto.reader import TraceHeader
from triscope.errors import InputError
from triscope.schema import TRACE_EVENTS, TRACE_RUNS, qualified
from triscope.store.base import Store

TRACE_SUFFIXES = (".json", ".json.gz", ".pt.trace.json", ".pt.trace.json.gz")
RUNS_PER_INSERT = 64  # trace_runs rows written together (each carries up to 1 MB of metadata)
_RANK_IN_NAME = re.compile(r"rank[_-]?(\d+)", re.IGNORECASE)
_RUN_SUFFIX = re.compile(r"([_.-]?rank[_-]?\d+)?(\.pt\.trace)?\.json(\.gz)?$", re.IGNORECASE)
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


class RankTakenError(InputError):
    """Two files of one batch are the same rank of the same run; the second is not ingested."""


def default_run_id(path: Path) -> str:
    """Run id for a path: a directory's name, or a file's name without rank and extension."""
    if path.is_dir():
        return path.resolve().name
    stem = _RUN_SUFFIX.sub("", path.name)
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


def claim(taken: set[tuple[str, int]], path: Path, run_id: str, rank: int) -> None:
    """Mark (run_id, rank) as written by this batch; RankTakenError when another file has it."""
    if (run_id, rank) in taken:
        raise RankTakenError(f"{path}: rank {rank} of run {run_id!r} was already ingested from another file "
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


def event_counts(store: Store, run_id: str, rank: int) -> tuple[int, int]:
    """(events, GPU work events) stored for (run_id, rank)."""
    counts = store.query(
        f"SELECT count(), countIf(kind IN {tuple(sorted(GPU_WORK_KINDS))}) FROM {qualified(store, TRACE_EVENTS)} "
        f"WHERE {_RANK_WHERE}", {"run_id": run_id, "rank": rank})
    events, gpu = (int(v) for v in counts.rows[0])
    return events, gpu


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
