"""The insert pipeline: the reader's raw event blocks to ClickHouse's JSON parser, overlapped with reading.

Streaming (stores that read local files, as the embedded one does): one INSERT per file fed
through a named pipe (:class:`~.pipe_insert.PipeInsert`). Block by block (other stores, and the
fallback when a stream is refused): each block is spilled to files and inserted in a pipeline
thread, in two halves on two threads when large; a refused block is deleted by its block tag and
handed back to the reader, which decodes it in Python. The design and its measurements are in
docs/trace-breakdown.md.
"""

from __future__ import annotations

import os
import tempfile
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from triscope.collectors.kineto import runs
from triscope.collectors.kineto.pipe_insert import PipeInsert
from triscope.collectors.kineto.reader import last_boundary
from triscope.collectors.kineto.sql import JSON_STRUCTURE, insert_params, insert_sql
from triscope.errors import StoreError
from triscope.schema import TRACE_EVENTS, qualified
from triscope.store.base import Store

STREAM_INSERT_SETTINGS: dict[str, int] = {
    # 64k-row parts (fewer merges) and 1 MiB parser segments (small buffers); see docs/trace-breakdown.md
    "min_insert_block_size_rows": 65536,
    "min_chunk_bytes_for_parallel_parsing": 1 << 20,
    "max_block_size": 8192,
}
STREAM_BLOCK_BYTES = 1 << 20
"""Bytes the reader writes into the pipe at once when streaming: smaller keeps less in memory."""


class StreamRefused(Exception):
    """ClickHouse stopped reading the stream (its insert failed)."""


_TAKEN: Future[bytes | None] = Future()
_TAKEN.set_result(None)

_PIPELINES: list[ThreadPoolExecutor] = []
_PIPELINE_LOCK = threading.Lock()


def _pipeline(index: int) -> ThreadPoolExecutor:
    """One of the two threads that run inserts for every ingest of this process (0: streaming
    inserts, whole blocks and first halves, 1: second halves), so each store gets at most two
    extra chDB connections, closed with the store."""
    with _PIPELINE_LOCK:
        while len(_PIPELINES) <= index:
            name = f"triscope-ingest-{len(_PIPELINES)}"
            _PIPELINES.append(ThreadPoolExecutor(max_workers=1, thread_name_prefix=name))
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


class ClickHouseInserter:
    """Takes one file's raw event blocks (:meth:`submit` is the reader's ``raw_submit``).

    ``start()`` is called before each block and returns the file's rank (the first call claims
    it); ``on_progress`` gets the bytes handed over. Raises :class:`StreamRefused` (streaming)
    once ClickHouse has stopped reading.
    """

    def __init__(self, store: Store, run_id: str, stream: bool, start: Callable[[], int],
                 on_progress: Callable[[int], None] | None) -> None:
        self.store = store
        self.stream = stream
        self.sql = insert_sql(qualified(store, TRACE_EVENTS))
        self.params = insert_params(run_id)
        self._start = start
        self._on_progress = on_progress
        self._in_flight: list[Future[bytes | None]] = []
        self._pipe: PipeInsert | None = None

    def submit(self, buf: bytes, end: int) -> Future[bytes | None]:
        return self._to_pipe(buf, end) if self.stream else self._to_block(buf, end)

    def finish(self) -> bool:
        """Wait until nothing of the file is still being written; False when the stream failed."""
        wait(self._in_flight)
        if self._pipe is None:
            return True
        self._pipe.write(b"]")
        return self._pipe.finish() is None

    def _insert_part(self, part: Path, params: dict[str, Any]) -> bool:
        try:
            self.store.insert_from_json_file(self.sql, JSON_STRUCTURE, part, params)
        except StoreError:
            return False
        return True

    def _insert_block(self, spill: SpilledBlock, params: dict[str, Any]) -> bytes | None:
        """Insert a spilled block, its halves on two threads (one ClickHouse insert parses on one
        core); None when it went in, else the block's event bytes for the reader to decode."""
        try:
            if len(spill.parts) == 2:
                second = _pipeline(1).submit(self._insert_part, spill.parts[1], params)
                ok = self._insert_part(spill.parts[0], params)
                ok = second.result() and ok
            else:
                ok = self._insert_part(spill.parts[0], params)
            if ok:
                return None
            # Remove whatever part of the block got in; the reader then decodes it itself.
            runs.delete_block(self.store, params["run_id"], params["rank"], params["block"])
            return spill.events()
        finally:
            spill.remove()

    def _to_block(self, buf: bytes, end: int) -> Future[bytes | None]:
        """Spill the events ``buf[:end]`` to files and insert them in the pipeline thread (chDB
        releases the GIL: the reader cuts the next block meanwhile, and no copy stays in memory)."""
        self.params["rank"] = self._start()
        self.params["block"] = self.params.get("block", 0) + 1
        if self._on_progress:
            self._on_progress(end)
        try:
            spill = spill_block(buf, end)
        except OSError:  # no room for the files: the reader decodes this block itself
            refused: Future[bytes | None] = Future()
            refused.set_result(bytes(memoryview(buf)[:end]))
            return refused
        future = _pipeline(0).submit(self._insert_block, spill, dict(self.params))
        self._in_flight.append(future)
        return future

    def _to_pipe(self, buf: bytes, end: int) -> Future[bytes | None]:
        """Write the events ``buf[:end]`` into the file's one streaming INSERT."""
        self.params["rank"] = self._start()
        if self._pipe is None:
            self.params["block"] = 1
            params = dict(self.params)
            try:
                self._pipe = PipeInsert(lambda fifo: self.store.insert_from_json_file(
                    self.sql, JSON_STRUCTURE, fifo, params, settings=STREAM_INSERT_SETTINGS), _pipeline(0))
            except OSError:  # no named pipe here (or no room for one): block by block instead
                raise StreamRefused from None
            opening = b"["
        else:
            opening = b","
        if not self._pipe.write(opening, memoryview(buf)[:end]):
            raise StreamRefused
        if self._on_progress:
            self._on_progress(end)
        return _TAKEN
