"""Ingest Kineto traces (files or multi-rank directories) into ``trace_runs``/``trace_events``.

One file: :func:`ingest_trace` reads it (:mod:`.reader`), hands the raw event blocks to ClickHouse
(:mod:`.pipeline`, SQL in :mod:`.sql`), decodes in Python what ClickHouse refuses (:mod:`.decode`)
and records the run (:mod:`.runs`). Every write goes straight to the store, keyed by run id
(:mod:`triscope.collectors.ingest_sink`). A refused file (:mod:`.errors`: not a trace, too large,
rank taken, another job) leaves nothing behind. How it works and why: docs/trace-breakdown.md.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from triscope.collectors import ingest_sink
from triscope.collectors.kineto import runs
from triscope.collectors.kineto.config import TraceIngestConfig
from triscope.collectors.kineto.decode import append_block
from triscope.collectors.kineto.errors import NotATraceError, OtherJobError, RefusedTraceError, SkippedTraceError
from triscope.collectors.kineto.jobs import other_jobs
from triscope.collectors.kineto.pipeline import STREAM_BLOCK_BYTES, ClickHouseInserter, StreamRefused
from triscope.collectors.kineto.reader import BLOCK_BYTES, TraceHeader, read_trace
from triscope.collectors.kineto.runs import (
    RUNS_PER_INSERT,
    IngestResult,
    RankTakenError,
    default_run_id,
    expand_paths,
    rank_from_name,
)
from triscope.errors import InputError
from triscope.schema import TRACE_EVENTS
from triscope.store.base import Store

BATCH_ROWS = 200_000

__all__ = ["IngestResult", "PartialTraceError", "RankTakenError", "RefusedTraceError", "expand_paths",
           "ingest_paths", "ingest_trace"]


class PartialTraceError(InputError):
    """A damaged trace: the events before the damage went in, as ``result`` (status partial)."""

    def __init__(self, message: str, result: IngestResult) -> None:
        super().__init__(message)
        self.result = result


def ingest_trace(store: Store, path: str | Path, run_id: str | None = None, rank: int | None = None,
                 on_progress: Callable[[int], None] | None = None,
                 batch_rows: int = BATCH_ROWS, default_rank: int = 0,
                 taken: set[tuple[str, int]] | None = None,
                 use_clickhouse_json: bool = True, block_bytes: int = BLOCK_BYTES,
                 stream: bool | None = None, pending_runs: list[dict[str, Any]] | None = None,
                 max_decompressed_bytes: int | None = TraceIngestConfig.max_decompressed_bytes) -> IngestResult:
    """Stream one trace file into the store; a cut-short file keeps its complete events.

    The rank is ``rank`` when given, else the trace's ``distributedInfo.rank``, else a
    ``rank<N>`` in the file name, else ``default_rank``. Events are parsed by ClickHouse's JSON
    reader (``use_clickhouse_json``): with ``stream`` (default: when the store reads local files)
    as one INSERT through a named pipe, redone block by block should ClickHouse refuse anything
    in it; block by block, a refused block is decoded in Python. ``taken`` holds the (run_id,
    rank) pairs this batch already wrote: a file that would overwrite one is refused. With
    ``pending_runs`` the file's ``trace_runs`` row is appended there for the caller to write.
    Raises :class:`PartialTraceError` (an :class:`InputError`) after recording the partial run
    when the file is damaged, and :class:`RefusedTraceError` (nothing kept, no run recorded) when it
    is not a Kineto trace, is unreadable from its start, or decompresses to more than
    ``max_decompressed_bytes``.
    """
    path = Path(path)
    taken = taken if taken is not None else set()
    started = time.perf_counter()
    run_id = run_id or default_run_id(path)
    header = TraceHeader()
    guessed_rank = rank if rank is not None else rank_from_name(path)
    result = IngestResult(str(path), run_id, guessed_rank if guessed_rank is not None else default_rank)
    cols = TRACE_EVENTS.empty_columns()
    first_block = True

    def flush() -> None:
        if cols["name"]:
            ingest_sink.insert_columns(store, TRACE_EVENTS, cols)
            for values in cols.values():
                values.clear()

    def start() -> int:
        """Before the first block: the rank is final (header read), claimed, and its old rows gone.
        A rank not known yet (it may come in the tail) is the default one, or a provisional negative
        rank when this batch has the default already; the rows move at the end (:func:`_final_rank`)."""
        nonlocal first_block
        if first_block:
            first_block = False
            if rank is None and header.rank is not None:
                result.rank = header.rank
            elif guessed_rank is None and (run_id, result.rank) in taken:
                result.rank = min([-1] + [r - 1 for run, r in taken if run == run_id and r < 0])
            runs.claim(taken, path, run_id, result.rank)
            runs.delete_rank(store, run_id, result.rank)
        return result.rank

    if stream is None:
        stream = store.reads_local_files
    inserter = ClickHouseInserter(store, run_id, stream, start, on_progress) if use_clickhouse_json else None
    failure: InputError | None = None
    stream_failed = False
    try:
        try:
            read_bytes = min(block_bytes, STREAM_BLOCK_BYTES) if stream else block_bytes
            for block in read_trace(path, header, block_bytes=read_bytes,
                                    raw_submit=inserter.submit if inserter else None,
                                    max_decompressed_bytes=max_decompressed_bytes):
                start()
                append_block(cols, block, run_id, result.rank)
                if on_progress:
                    on_progress(sum(len(e.name) + 96 for e in block))  # approximate bytes
                if len(cols["name"]) >= batch_rows:
                    flush()
        finally:
            if inserter is not None:
                stream_failed = not inserter.finish()
        flush()
    except StreamRefused:
        stream_failed = True
    except RankTakenError:
        raise  # refused before anything of this file went in: no run to record
    except RefusedTraceError:
        if not first_block:  # what went in before the refusal goes again
            taken.discard((run_id, result.rank))
            runs.delete_rank(store, run_id, result.rank)
        raise
    except InputError as exc:
        flush()
        failure = exc
        result.status, result.error = "partial", str(exc)
    if stream_failed:  # this file goes in again block by block, where a refused block is decoded in Python
        taken.discard((run_id, result.rank))
        runs.delete_rank(store, run_id, result.rank)
        return ingest_trace(store, path, run_id=run_id, rank=rank, on_progress=on_progress, batch_rows=batch_rows,
                            default_rank=default_rank, taken=taken, block_bytes=block_bytes, stream=False,
                            pending_runs=pending_runs, max_decompressed_bytes=max_decompressed_bytes)
    if first_block and failure is None:  # a trace with no events still replaces an old one
        start()
    _final_rank(store, taken, path, result, rank, header, default_rank, failure is None)
    runs.summarize(store, result, header)
    result.seconds = time.perf_counter() - started
    row = runs.run_row(path, result, header)
    if pending_runs is None:
        runs.insert_runs(store, [row])
    else:
        pending_runs.append(row)
    if failure is not None:
        raise PartialTraceError(str(failure), result) from None
    return result


def _final_rank(store: Store, taken: set[tuple[str, int]], path: Path, result: IngestResult, rank: int | None,
                header: TraceHeader, default_rank: int, complete: bool) -> None:
    """Move the rows to the rank found in the tail, or from a provisional rank to the default one."""
    if complete and rank is None and header.rank is not None and header.rank != result.rank:
        _rekey(store, taken, path, result, header.rank)  # rank was only known from the tail
    elif rank is None and result.rank < 0:
        _rekey(store, taken, path, result, default_rank, known=False)


def _rekey(store: Store, taken: set[tuple[str, int]], path: Path, result: IngestResult, rank: int,
           known: bool = True) -> None:
    """Move the file's rows from the rank guessed at the start to ``rank``, found in the tail (or the
    default rank, ``known`` False)."""
    try:
        runs.claim(taken, path, result.run_id, rank, known)
    except RankTakenError:
        taken.discard((result.run_id, result.rank))
        runs.delete_rank(store, result.run_id, result.rank)  # nothing of this file stays under its guessed rank
        raise
    runs.move_rank(store, result.run_id, result.rank, rank)
    taken.discard((result.run_id, result.rank))
    result.rank = rank


def ingest_paths(store: Store, paths: Iterable[str | Path], run_id: str | None = None,
                 on_progress: Callable[[int], None] | None = None,
                 on_file: Callable[[IngestResult | InputError], None] | None = None,
                 settings: TraceIngestConfig | None = None) -> list[IngestResult]:
    """Ingest files and directories; a damaged file is reported and the others still go in.

    ``on_file`` gets each file's result or error: a file of a directory that is not a Kineto trace
    as a :class:`SkippedTraceError` (a warning), files of another job than the rest of their run
    as an :class:`OtherJobError` after the batch (their rows removed, they leave ``results``).
    """
    settings = settings or TraceIngestConfig()
    results: list[IngestResult] = []
    taken: set[tuple[str, int]] = set()
    pending_runs: list[dict[str, Any]] = []
    try:
        with store.releasing_memory():
            _ingest_each(store, expand_paths(paths), run_id, on_progress, on_file, results, taken, pending_runs,
                         settings)
            _refuse_other_jobs(store, results, pending_runs, settings, on_file)
    finally:
        runs.insert_runs(store, pending_runs)  # the runs of every file that went in, also when one failed
    return results


def _ingest_each(store: Store, files: list[tuple[Path, str | None]], run_id: str | None,
                 on_progress: Callable[[int], None] | None,
                 on_file: Callable[[IngestResult | InputError], None] | None,
                 results: list[IngestResult], taken: set[tuple[str, int]],
                 pending_runs: list[dict[str, Any]], settings: TraceIngestConfig) -> None:
    for file, dir_run in files:
        try:
            res = ingest_trace(store, file, run_id=run_id or dir_run, on_progress=on_progress, taken=taken,
                               pending_runs=pending_runs, max_decompressed_bytes=settings.max_decompressed_bytes)
        except InputError as exc:
            if isinstance(exc, PartialTraceError):
                results.append(exc.result)  # what went in before the damage is listed too
            if isinstance(exc, NotATraceError) and dir_run is not None:
                exc = SkippedTraceError(f"{exc}; skipped")  # a stray file in a job's directory is no rank
            if on_file:
                on_file(exc)
            continue
        results.append(res)
        if on_file:
            on_file(res)
        if len(pending_runs) >= RUNS_PER_INSERT:
            runs.insert_runs(store, pending_runs)
            pending_runs.clear()


def _refuse_other_jobs(store: Store, results: list[IngestResult], pending_runs: list[dict[str, Any]],
                       settings: TraceIngestConfig,
                       on_file: Callable[[IngestResult | InputError], None] | None) -> None:
    """Remove the files of each run that belong to another job than the rest (:mod:`.jobs`)."""
    by_run: dict[str, list[IngestResult]] = {}
    for res in results:
        by_run.setdefault(res.run_id, []).append(res)
    for run_id, members in by_run.items():
        for res, why in other_jobs(members, settings.same_job_within_s):
            runs.delete_rank(store, run_id, res.rank)
            results.remove(res)
            pending_runs[:] = [r for r in pending_runs if (r["run_id"], r["rank"]) != (run_id, res.rank)]
            if on_file:
                on_file(OtherJobError(
                    f"{res.path}: refused: another job than the other files of run {run_id!r} ({why}); "
                    "give each job its own directory or --run-id ([ingest] same_job_within_s)"))
