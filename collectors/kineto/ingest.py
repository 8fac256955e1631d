"""Ingest Kineto traces (files or multi-rank directories) into ``trace_runs``/``trace_events``."""

from __future__ import annotations

import json
import math
import os
import re
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any

from triscope.collectors.kineto import classify
from triscope.collectors.kineto.classify import GPU_WORK_KINDS, KIND_BY_CATEGORY, event_kind, kernel_class
from triscope.collectors.kineto.pipe_insert import PipeInsert
from triscope.collectors.kineto.reader import (
    BLOCK_BYTES,
    INT64_MAX,
    INT64_MIN,
    TraceEvent,
    TraceHeader,
    event_args,
    last_boundary,
    read_trace,
    us_to_ns,
)
from triscope.errors import InputError, StoreError
from triscope.schema import qualified
from triscope.schema.trace import TRACE_EVENTS, TRACE_RUNS
from triscope.store.base import Store

BATCH_ROWS = 200_000
TRACE_SUFFIXES = (".json", ".json.gz", ".pt.trace.json", ".pt.trace.json.gz")
_RANK_IN_NAME = re.compile(r"rank[_-]?(\d+)", re.IGNORECASE)
_RUN_SUFFIX = re.compile(r"([_.-]?rank[_-]?\d+)?(\.pt\.trace)?\.json(\.gz)?$", re.IGNORECASE)


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


class PartialTraceError(InputError):
    """A damaged trace: the events before the damage went in, as ``result`` (status partial)."""

    def __init__(self, message: str, result: IngestResult) -> None:
        super().__init__(message)
        self.result = result


@dataclass
class _Columns:
    data: dict[str, list[Any]] = field(default_factory=lambda: {c: [] for c in TRACE_EVENTS.column_names()})

    def __len__(self) -> int:
        return len(self.data["name"])

    def clear(self) -> None:
        for values in self.data.values():
            values.clear()


_DECIMAL_TEXT = re.compile(r"[+-]?\d+")
_NUMBER_TEXT = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?")


def _int(value: Any, default: int) -> int:
    """An ``args`` value as Int64 the way ClickHouse's ``JSONExtract(..., 'Nullable(Int64)')`` reads it.

    Integers in range as they are (booleans as 0/1), floats and numeric text truncated toward zero,
    anything out of Int64 range, other text (hex, padded with spaces), objects, arrays and null
    -> ``default``. (ClickHouse reads the text "nan" as Int64 min; here it is ``default``.)
    """
    if isinstance(value, int):
        if INT64_MIN <= value <= INT64_MAX:
            return value
        value = float(value)  # ClickHouse's JSON parser reads integers beyond Int64 as doubles
    elif isinstance(value, str):
        if _DECIMAL_TEXT.fullmatch(value):
            number = int(value)
            return number if INT64_MIN <= number <= INT64_MAX else default
        if not _NUMBER_TEXT.fullmatch(value):
            return default
        value = float(value)
    elif not isinstance(value, float):
        return default
    if not math.isfinite(value):
        return default
    out = int(value)
    return out if INT64_MIN <= out <= INT64_MAX else default


def _text(value: Any) -> str:
    """An ``args`` value as text the way ClickHouse's ``JSONExtractString`` reads it: strings as they
    are, null as empty, other values as their JSON text (``7``, ``true``, ``{"a":1}``; an object's
    or a float's text is re-serialized here, so its spacing or digits may differ from the file)."""
    if isinstance(value, str):
        return value
    if value is None:
        return ""
    if isinstance(value, Decimal):
        return str(value)
    return json.dumps(value, separators=(",", ":"), default=str)


def _append_block(cols: _Columns, events: list[TraceEvent], run_id: str, rank: int) -> None:
    """Append the complete (ph=X) events of one block."""
    xs = [e for e in events if e.ph == "X"]
    if not xs:
        return
    d = cols.data
    kinds = [event_kind(e.cat) for e in xs]
    names = [e.name for e in xs]
    args = [event_args(e) for e in xs]
    n = len(xs)
    d["run_id"].extend([run_id] * n)
    d["rank"].extend([rank] * n)
    d["kind"].extend(kinds)
    d["category"].extend([e.cat for e in xs])
    d["kernel_class"].extend([kernel_class(k, nm) for k, nm in zip(kinds, names, strict=True)])
    d["name"].extend(names)
    d["pid"].extend([str(e.pid) for e in xs])
    d["tid"].extend([str(e.tid) for e in xs])
    d["ts_ns"].extend([us_to_ns(e.ts) for e in xs])
    d["dur_ns"].extend([us_to_ns(e.dur) for e in xs])
    d["device"].extend([_int(a.device, -1) if a else -1 for a in args])
    d["stream"].extend([_int(a.stream, -1) if a else -1 for a in args])
    d["correlation"].extend([_int(a.correlation, 0) if a else 0 for a in args])
    d["external_id"].extend([
        _int(a.external_id if a.external_id is not None else a.external_id_legacy, 0) if a else 0 for a in args
    ])
    d["collective"].extend([_text(a.collective) if a else "" for a in args])
    d["in_nelems"].extend([_int(a.in_nelems, 0) if a else 0 for a in args])
    d["out_nelems"].extend([_int(a.out_nelems, 0) if a else 0 for a in args])
    d["group_size"].extend([_int(a.group_size, 0) if a else 0 for a in args])
    d["dtype"].extend([_text(a.dtype) if a else "" for a in args])
    d["pg_name"].extend([_text(a.pg_name) if a else "" for a in args])
    d["pg_ranks"].extend([_text(a.pg_ranks) if a else "" for a in args])
    d["ingest_block"].extend([0] * n)


_JSON_STRUCTURE = ("ph String, cat String, name String, pid String, tid String, "
                   "ts Decimal(38, 6), dur Decimal(38, 6), args String")


# args keys read in ClickHouse -> the value stored when absent or unreadable (as in _append_block)
_ARG_INTS = {"device": -1, "stream": -1, "correlation": 0, "External id": 0, "external id": 0}
_COMM_INTS = {"In msg nelems": 0, "Out msg nelems": 0, "Group size": 0}
_COMM_TEXTS = ("Collective name", "dtype", "Process Group Name", "Process Group Ranks")
_ARG_DEFAULTS: dict[str, int | str] = {**_ARG_INTS, **_COMM_INTS, **dict.fromkeys(_COMM_TEXTS, "")}


def _tuple_type(ints: Mapping[str, int], texts: tuple[str, ...] = ()) -> str:
    fields = [f"`{k}` Nullable(Int64)" for k in ints] + [f"`{k}` Nullable(String)" for k in texts]
    return f"Tuple({', '.join(fields)})"


def _args_tuple(ints: Mapping[str, int], texts: tuple[str, ...] = ()) -> str:
    """One ``JSONExtract`` of several ``args`` keys as a named tuple: the JSON is parsed once per
    row instead of once per key. Ints follow :func:`_int`, texts :func:`_text`."""
    return f"JSONExtract(object_args, '{_tuple_type(ints, texts)}')"


def _arg(tuple_name: str, key: str) -> str:
    """One key of an extracted args tuple, its default when absent."""
    default = _ARG_DEFAULTS[key]
    return f"ifNull(tupleElement({tuple_name}, '{key}'), {default if isinstance(default, int) else repr(default)})"


def _fast_insert_sql(table: str) -> str:
    """INSERT ... SELECT doing in ClickHouse what :func:`_append_block` does in Python."""
    gpu = ", ".join(f"'{k}'" for k in sorted(GPU_WORK_KINDS))
    comm = _args_tuple(_COMM_INTS, _COMM_TEXTS)
    return f"""
INSERT INTO {table} ({", ".join(TRACE_EVENTS.column_names())})
SELECT run_id, rank, kind, category, kernel_class, name, pid, tid, device, stream, ts_ns, dur_ns,
       correlation, external_id, collective, in_nelems, out_nelems, group_size, dtype, pg_name, pg_ranks,
       ingest_block
FROM (
  SELECT
    {{run_id:String}} AS run_id,
    {{rank:Int32}} AS rank,
    {{block:UInt32}} AS ingest_block,
    transform(lower(cat), {{cats:Array(String)}}, {{kinds:Array(String)}}, 'other') AS kind,
    cat AS category,
    multiIf(kind NOT IN ({gpu}), '',
            kind != 'kernel' OR match(name, '^(Memcpy|Memset|dma)'), 'memory',
            match(replaceRegexpOne(name, '^void ', ''), {{comm_re:String}}), 'comm',
            'compute') AS kernel_class,
    name, pid, tid,
    -- args that are not an object carry no keys (JSONExtract would read an array's items as the tuple's)
    if(startsWith(trimLeft(args), '{{'), args, '') AS object_args,
    {_args_tuple(_ARG_INTS)} AS a,
    toInt32({_arg("a", "device")}) AS device,
    {_arg("a", "stream")} AS stream,
    toInt64(round(ts * 1000)) AS ts_ns,
    toInt64(round(dur * 1000)) AS dur_ns,
    {_arg("a", "correlation")} AS correlation,
    ifNull(tupleElement(a, 'External id'), {_arg("a", "external id")}) AS external_id,
    position(object_args, 'Collective name') > 0 AS has_comm,  -- skip parsing comm args on other events
    if(has_comm, {comm}, CAST(NULL, 'Nullable({_tuple_type(_COMM_INTS, _COMM_TEXTS)})')) AS c,
    {_arg("c", "Collective name")} AS collective,
    {_arg("c", "In msg nelems")} AS in_nelems,
    {_arg("c", "Out msg nelems")} AS out_nelems,
    toInt32({_arg("c", "Group size")}) AS group_size,
    {_arg("c", "dtype")} AS dtype,
    {_arg("c", "Process Group Name")} AS pg_name,
    {_arg("c", "Process Group Ranks")} AS pg_ranks
  FROM json_input
  WHERE ph = 'X'
)"""


def default_run_id(path: Path) -> str:
    """Run id for a path: a directory's name, or a file's name without rank and extension."""
    if path.is_dir():
        return path.resolve().name
    stem = _RUN_SUFFIX.sub("", path.name)
    return stem or path.name


def rank_from_name(path: Path) -> int | None:
    match = _RANK_IN_NAME.search(path.name)
    return int(match.group(1)) if match else None


def delete_rank(store: Store, run_id: str, rank: int) -> None:
    """Remove earlier rows of (run_id, rank) so a re-ingest replaces them."""
    params = {"run_id": run_id, "rank": rank}
    where = "run_id = {run_id:String} AND rank = {rank:Int32}"
    existing = store.query(f"SELECT (SELECT count() FROM {qualified(store, TRACE_EVENTS.name)} WHERE {where}) + "
                           f"(SELECT count() FROM {qualified(store, TRACE_RUNS.name)} WHERE {where})", params)
    if not existing.scalar():
        return  # nothing to replace: skip the mutations
    _delete_where(store, where, params, TRACE_EVENTS.name)
    _delete_where(store, where, params, TRACE_RUNS.name)


def _delete_where(store: Store, where: str, params: dict[str, Any], table: str = TRACE_EVENTS.name) -> None:
    """Delete rows synchronously (``ALTER ... DELETE`` on the local tables in cluster mode)."""
    if store.cluster:
        store.command(f"ALTER TABLE {qualified(store, table)}_local ON CLUSTER `{store.cluster}` "
                      f"DELETE WHERE {where} SETTINGS mutations_sync = 2", params)
    else:
        store.command(f"DELETE FROM {qualified(store, table)} WHERE {where}", params)


def ingest_trace(store: Store, path: str | Path, run_id: str | None = None, rank: int | None = None,
                 on_progress: Callable[[int], None] | None = None,
                 batch_rows: int = BATCH_ROWS, default_rank: int = 0,
                 taken: set[tuple[str, int]] | None = None,
                 use_clickhouse_json: bool = True, block_bytes: int = BLOCK_BYTES,
                 stream: bool | None = None, pending_runs: list[dict[str, Any]] | None = None) -> IngestResult:
    """Stream one trace file into the store; a cut-short file keeps its complete events.

    The rank is ``rank`` when given, else the trace's ``distributedInfo.rank``, else a
    ``rank<N>`` in the file name, else ``default_rank``.
    Events are parsed by ClickHouse's JSON reader (``use_clickhouse_json``). With ``stream``
    (default: when the store reads local files, as the embedded one does) the whole file goes in
    as one INSERT fed through a named pipe; should ClickHouse refuse anything in it, that file's
    rows are removed and it goes in again block by block. Block by block (the other stores), a
    block ClickHouse refuses is decoded in Python instead. ``taken`` holds (run_id, rank) pairs already written by this batch of files: a file that
    would overwrite one of them is refused instead. With ``pending_runs`` the file's
    ``trace_runs`` row is appended there for the caller to write (see :func:`ingest_paths`).
    Raises :class:`PartialTraceError` (an :class:`InputError`) after recording the partial run
    when the file is damaged.
    """
    path = Path(path)
    taken = taken if taken is not None else set()
    started = time.perf_counter()
    run_id = run_id or default_run_id(path)
    header = TraceHeader()
    guessed_rank = rank if rank is not None else rank_from_name(path)
    result = IngestResult(str(path), run_id, guessed_rank if guessed_rank is not None else default_rank)
    cols = _Columns()
    events_table = qualified(store, TRACE_EVENTS.name)
    first_block = True

    def flush() -> None:
        if len(cols):
            store.insert(events_table, cols.data)
            cols.clear()

    fast_sql = _fast_insert_sql(events_table)
    fast_params: dict[str, Any] = {
        "run_id": run_id, "cats": list(KIND_BY_CATEGORY), "kinds": list(KIND_BY_CATEGORY.values()),
        "comm_re": classify.comm_kernel_pattern(),
    }

    def start() -> None:
        nonlocal first_block
        if first_block:
            first_block = False
            if rank is None and header.rank is not None:
                result.rank = header.rank
            _claim(taken, path, run_id, result.rank)
            delete_rank(store, run_id, result.rank)
            fast_params["rank"] = result.rank

    def insert_part(part: Path, params: dict[str, Any]) -> bool:
        try:
            store.insert_from_json_file(fast_sql, _JSON_STRUCTURE, part, params)
        except StoreError:
            return False
        return True

    def insert_block(spill: SpilledBlock, params: dict[str, Any]) -> bytes | None:
        """Insert a spilled block, its halves on two threads (one ClickHouse insert parses on one
        core); None when it went in, else the block's event bytes for the reader to decode."""
        try:
            if len(spill.parts) == 2:
                second = _pipeline(1).submit(insert_part, spill.parts[1], params)
                ok = insert_part(spill.parts[0], params)
                ok = second.result() and ok
            else:
                ok = insert_part(spill.parts[0], params)
            if ok:
                return None
            # Remove whatever part of the block got in; the reader then decodes it itself.
            _delete_where(store, "run_id = {run_id:String} AND rank = {rank:Int32} AND ingest_block = {block:UInt32}",
                          {k: params[k] for k in ("run_id", "rank", "block")})
            return spill.events()
        finally:
            spill.remove()

    def submit(buf: bytes, end: int) -> Future[bytes | None]:
        """Spill the events ``buf[:end]`` to files and insert them in the pipeline thread (chDB
        releases the GIL: the reader cuts the next block meanwhile, and no copy stays in memory)."""
        start()
        fast_params["block"] = fast_params.get("block", 0) + 1
        if on_progress:
            on_progress(end)
        try:
            spill = spill_block(buf, end)
        except OSError:  # no room for the files: the reader decodes this block itself
            refused: Future[bytes | None] = Future()
            refused.set_result(bytes(memoryview(buf)[:end]))
            return refused
        future = _pipeline(0).submit(insert_block, spill, dict(fast_params))
        in_flight.append(future)
        return future

    pipe: PipeInsert | None = None

    def submit_to_pipe(buf: bytes, end: int) -> Future[bytes | None]:
        """Write the events ``buf[:end]`` into the file's one streaming INSERT."""
        nonlocal pipe
        start()
        if pipe is None:
            fast_params["block"] = 1
            params = dict(fast_params)
            try:
                pipe = PipeInsert(lambda fifo: store.insert_from_json_file(
                    fast_sql, _JSON_STRUCTURE, fifo, params, settings=STREAM_INSERT_SETTINGS), _pipeline(0))
            except OSError:  # no named pipe here (or no room for one): block by block instead
                raise _StreamRefused from None
            opening = b"["
        else:
            opening = b","
        if not pipe.write(opening, memoryview(buf)[:end]):
            raise _StreamRefused
        if on_progress:
            on_progress(end)
        return _TAKEN

    if stream is None:
        stream = store.reads_local_files
    raw_submit = (submit_to_pipe if stream else submit) if use_clickhouse_json else None
    in_flight: list[Future[bytes | None]] = []
    failure: InputError | None = None
    stream_failed = False
    try:
        try:
            # streaming, a block is only what goes into the pipe at once: smaller keeps less in memory
            read_bytes = min(block_bytes, STREAM_BLOCK_BYTES) if stream else block_bytes
            for block in read_trace(path, header, block_bytes=read_bytes, raw_submit=raw_submit):
                start()
                _append_block(cols, block, run_id, result.rank)
                if on_progress:
                    on_progress(sum(len(e.name) + 96 for e in block))  # approximate bytes
                if len(cols) >= batch_rows:
                    flush()
        finally:
            wait(in_flight)  # nothing of this file is still being written when it is counted
            if pipe is not None:
                pipe.write(b"]")
                stream_failed = pipe.finish() is not None
        flush()
    except _StreamRefused:
        stream_failed = True
    except RankTakenError:
        raise  # refused before anything of this file went in: no run to record
    except InputError as exc:
        flush()
        failure = exc
        result.status, result.error = "partial", str(exc)
    if stream_failed:
        # ClickHouse refused something in the stream: this file goes in again block by block,
        # where a refused block is decoded in Python.
        taken.discard((run_id, result.rank))
        delete_rank(store, run_id, result.rank)
        return ingest_trace(store, path, run_id=run_id, rank=rank, on_progress=on_progress, batch_rows=batch_rows,
                            default_rank=default_rank, taken=taken, block_bytes=block_bytes, stream=False,
                            pending_runs=pending_runs)
    if first_block and failure is None:
        _claim(taken, path, run_id, result.rank)
        delete_rank(store, run_id, result.rank)  # a trace with no events still replaces an old one
    if failure is None and rank is None and header.rank is not None and header.rank != result.rank:
        try:
            _claim(taken, path, run_id, header.rank)
        except RankTakenError:
            taken.discard((run_id, result.rank))
            delete_rank(store, run_id, result.rank)  # nothing of this file stays under its guessed rank
            raise
        _move_rank(store, run_id, result.rank, header.rank)  # rank was only known from the tail
        taken.discard((run_id, result.rank))
        result.rank = header.rank
    counts = store.query(
        f"SELECT count(), countIf(kind IN {tuple(sorted(GPU_WORK_KINDS))}) FROM {events_table} "
        "WHERE run_id = {run_id:String} AND rank = {rank:Int32}", {"run_id": run_id, "rank": result.rank})
    result.events, result.gpu_events = (int(v) for v in counts.rows[0])
    result.base_time_ns = header.base_time_ns
    result.seconds = time.perf_counter() - started
    if pending_runs is None:
        _insert_runs(store, [_run_row(path, result, header)])
    else:
        pending_runs.append(_run_row(path, result, header))
    if failure is not None:
        raise PartialTraceError(str(failure), result) from None
    return result


STREAM_INSERT_SETTINGS: dict[str, int] = {
    # parts of 64k rows: 8 MB blocks gave 14k-row parts, and merging them took more memory than
    # the inserts; 1 MiB segments for the parallel parser (10 MiB by default) keep its buffers small
    "min_insert_block_size_rows": 65536,
    "min_chunk_bytes_for_parallel_parsing": 1 << 20,
    "max_block_size": 8192,
}


STREAM_BLOCK_BYTES = 1 << 20


class _StreamRefused(Exception):
    """ClickHouse stopped reading the stream (its insert failed)."""


_TAKEN: Future[bytes | None] = Future()
_TAKEN.set_result(None)

_PIPELINES: list[ThreadPoolExecutor] = []
_PIPELINE_LOCK = threading.Lock()


def _pipeline(index: int) -> ThreadPoolExecutor:
    """One of the two threads that run inserts for every ingest of this process (0: streaming
    inserts, whole blocks and first halves, 1: second halves), so each store gets at most two extra chDB
    connections, closed with the store."""
    with _PIPELINE_LOCK:
        while len(_PIPELINES) <= index:
            _PIPELINES.append(ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"triscope-ingest-{len(_PIPELINES)}"))
        return _PIPELINES[index]


def split_point(buf: bytes, end: int, min_bytes: int = 1 << 20) -> tuple[int, int] | None:
    """Where to cut the events ``buf[:end]`` in two: the event boundary nearest before the middle
    (None when they are small or no boundary is found). A cut inside a string only makes a half
    fail to parse, and the block then goes to the Python decoder."""
    if end < min_bytes:
        return None
    cut = last_boundary(buf, end=end // 2)
    return cut if cut is not None and cut[0] > 0 else None


@dataclass
class SpilledBlock:
    """A block of events written as one or two JSON-array files (its halves), for ClickHouse to
    read; ``separator`` is the text between the halves, so :meth:`events` gives back the exact
    bytes."""

    parts: list[Path]
    separator: bytes = b""

    def events(self) -> bytes:
        """The block's events as they were in the trace (no brackets)."""
        texts = [part.read_bytes()[1:-1] for part in self.parts]
        return self.separator.join(texts)

    def remove(self) -> None:
        for part in self.parts:
            part.unlink(missing_ok=True)


def spill_block(buf: bytes, end: int, min_split_bytes: int = 1 << 20) -> SpilledBlock:
    """Write the events ``buf[:end]`` as JSON arrays to temporary files, in two halves when large
    (each written straight from ``buf``: no copy of the block is made in memory). Raises OSError
    (nothing left behind) when the files cannot be written."""
    view = memoryview(buf)
    cut = split_point(buf, end, min_split_bytes)
    ranges = [(0, end)] if cut is None else [(0, cut[0]), (cut[1], end)]
    spill = SpilledBlock([], b"" if cut is None else bytes(view[cut[0]:cut[1]]))
    try:
        for first, last in ranges:
            fd, name = tempfile.mkstemp(prefix="triscope-trace-block-", suffix=".json")
            spill.parts.append(Path(name))
            with os.fdopen(fd, "wb") as fh:
                fh.write(b"[")
                fh.write(view[first:last])
                fh.write(b"]")
    except OSError:
        spill.remove()
        raise
    return spill


class RankTakenError(InputError):
    """Two files of one batch are the same rank of the same run; the second is not ingested."""


def _claim(taken: set[tuple[str, int]], path: Path, run_id: str, rank: int) -> None:
    if (run_id, rank) in taken:
        raise RankTakenError(f"{path}: rank {rank} of run {run_id!r} was already ingested from another file "
                         "in this batch; give each job its own directory or --run-id")
    taken.add((run_id, rank))


def _move_rank(store: Store, run_id: str, old: int, new: int) -> None:
    """Re-key rows written under a guessed rank (rank is part of the sorting key: copy, then delete)."""
    delete_rank(store, run_id, new)
    table = qualified(store, TRACE_EVENTS.name)
    cols = TRACE_EVENTS.column_names()
    select = ", ".join("{new:Int32}" if c == "rank" else c for c in cols)
    # Explicit column list: chDB silently inserts nothing for a self-INSERT ... SELECT * without it.
    store.command(
        f"INSERT INTO {table} ({', '.join(cols)}) SELECT {select} FROM {table} "
        "WHERE run_id = {run_id:String} AND rank = {old:Int32}",
        {"new": new, "old": old, "run_id": run_id},
    )
    _delete_where(store, "run_id = {run_id:String} AND rank = {rank:Int32}", {"run_id": run_id, "rank": old})


RUNS_PER_INSERT = 64  # trace_runs rows written together (each carries up to 1 MB of metadata)
_RUN_COLUMNS = {
    "run_id": "String", "rank": "Int32", "source_path": "String", "source_bytes": "UInt64", "host": "String",
    "base_time_ns": "Int64", "time_base": "String", "event_count": "UInt64", "gpu_event_count": "UInt64",
    "status": "String", "error": "String", "metadata_json": "String",
}


def _run_row(path: Path, result: IngestResult, header: TraceHeader) -> dict[str, Any]:
    """The ``trace_runs`` row of one ingested file."""
    meta = header.metadata
    return {
        "run_id": result.run_id, "rank": result.rank, "source_path": str(path.resolve()),
        "source_bytes": path.stat().st_size, "host": str(meta.get("host_name", "")),
        "base_time_ns": header.base_time_ns, "time_base": "relative" if header.base_time_ns else "absolute",
        "event_count": result.events, "gpu_event_count": result.gpu_events, "status": result.status,
        "error": result.error, "metadata_json": json.dumps(meta, default=str)[:1_000_000],
    }


def _insert_runs(store: Store, rows: list[dict[str, Any]]) -> None:
    """Write ``trace_runs`` rows in one parameterized VALUES insert (one part for a whole batch of
    files instead of one per file: ~5 ms each on the embedded store)."""
    if not rows:
        return
    values, params = [], {}
    for i, row in enumerate(rows):
        values.append("(" + ", ".join(f"{{{name}_{i}:{kind}}}" for name, kind in _RUN_COLUMNS.items()) + ", now64(3))")
        params.update({f"{name}_{i}": row[name] for name in _RUN_COLUMNS})
    store.command(f"INSERT INTO {qualified(store, TRACE_RUNS.name)} ({', '.join(_RUN_COLUMNS)}, ingested_at) "
                  f"VALUES {', '.join(values)}", params)


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


def ingest_paths(store: Store, paths: Iterable[str | Path], run_id: str | None = None,
                 on_progress: Callable[[int], None] | None = None,
                 on_file: Callable[[IngestResult | InputError], None] | None = None) -> list[IngestResult]:
    """Ingest files and directories; a damaged file is reported and the others still go in."""
    results: list[IngestResult] = []
    taken: set[tuple[str, int]] = set()
    pending_runs: list[dict[str, Any]] = []
    try:
        with store.releasing_memory():
            _ingest_each(store, expand_paths(paths), run_id, on_progress, on_file, results, taken, pending_runs)
    finally:
        _insert_runs(store, pending_runs)  # the runs of every file that went in, also when one failed
    return results


def _ingest_each(store: Store, files: list[tuple[Path, str | None]], run_id: str | None,
                 on_progress: Callable[[int], None] | None,
                 on_file: Callable[[IngestResult | InputError], None] | None,
                 results: list[IngestResult], taken: set[tuple[str, int]],
                 pending_runs: list[dict[str, Any]]) -> None:
    for index, (file, dir_run) in enumerate(files):
        try:
            # Files of a directory with no rank in name or metadata are ranked by their order.
            res = ingest_trace(store, file, run_id=run_id or dir_run, on_progress=on_progress,
                               default_rank=index, taken=taken, pending_runs=pending_runs)
        except InputError as exc:
            if isinstance(exc, PartialTraceError):
                results.append(exc.result)  # what went in before the damage is listed too
            if on_file:
                on_file(exc)
            continue
        results.append(res)
        if on_file:
            on_file(res)
        if len(pending_runs) >= RUNS_PER_INSERT:
            _insert_runs(store, pending_runs)
            pending_runs.clear()
