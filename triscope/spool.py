"""On-disk batch spool: the writer's write-ahead log, one file per batch.

Every batch the writer builds lives in a file of ``directory`` from its first row on:

* ``<seq>-<batch_id>-<table>.open``: being filled; each submit appends one frame with a
  single ``write()``, so rows survive ``kill -9`` as soon as the submit returns.
* ``<seq>-<batch_id>-<table>-<rows>.batch``: sealed (fsynced, renamed); waiting to be inserted.
  The writer inserts it with ``insert_deduplication_token = batch_id`` and deletes it afterwards,
  so a crash between the insert and the delete replays it harmlessly.
* ``rejected/``: batches the store refused while it was otherwise healthy (bad data), kept
  for inspection instead of blocking the queue.

A frame is a 4-byte little-endian length and a msgpack map ``{column: [values]}``. A torn last
frame (crash inside a ``write()``) is cut off when the file is recovered; its submit never returned.
``seq`` orders batches across restarts. The directory is ``flock``-ed by its one owner.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import fcntl
import logging
import os
import re
import shutil
import struct
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from triscope.errors import StoreError

log = logging.getLogger(__name__)

_LEN = struct.Struct("<I")
_NAME = re.compile(r"(?P<seq>\d{20})-(?P<id>[0-9a-f]{32})-(?P<table>[a-z0-9_]+)(?:-(?P<rows>\d+))?"
                   r"\.(?P<kind>open|batch)")
TABLE_NAME = re.compile(r"[a-z][a-z0-9_]*")


def _enc_hook(obj: Any) -> Any:
    """msgpack for values msgspec does not know: numpy arrays and scalars, Decimals, dates."""
    if hasattr(obj, "tolist"):
        return obj.tolist()
    if hasattr(obj, "item"):
        return obj.item()
    if isinstance(obj, dt.date):
        return obj.isoformat()
    return str(obj)


_encoder = msgspec.msgpack.Encoder(enc_hook=_enc_hook)
_decoder = msgspec.msgpack.Decoder(dict[str, list[Any]])


@dataclass
class SpoolFile:
    """One batch file: where it is, which table, its id (the dedup token) and its rows."""

    path: Path
    table: str
    batch_id: str
    seq: int
    rows: int
    size: int


class OpenBatch:
    """A batch being filled: an ``.open`` file with one frame per :meth:`append`."""

    def __init__(self, path: Path, table: str, batch_id: str, seq: int) -> None:
        self.path, self.table, self.batch_id, self.seq = path, table, batch_id, seq
        self.rows = 0
        self.size = 0
        self.created = time.monotonic()
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o600)

    def append(self, columns: Mapping[str, Sequence[Any]], rows: int) -> int:
        """Write one frame (a single write call); returns its size in bytes."""
        payload = _encoder.encode(columns)
        frame = _LEN.pack(len(payload)) + payload
        view = memoryview(frame)
        try:
            while view:
                done = os.write(self._fd, view)
                view = view[done:]
        except OSError:
            # Cut the torn frame off, so frames appended later are not hidden behind it.
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, self.size)
            raise
        self.rows += rows
        self.size += len(frame)
        return len(frame)

    def seal(self, fsync: bool) -> SpoolFile:
        """fsync, close and rename to ``.batch``; the file is then complete and immutable.

        Safe to call again after an OSError: it resumes where it failed."""
        if self._fd >= 0:
            if fsync:
                os.fsync(self._fd)
            os.close(self._fd)
            self._fd = -1
        final = self.path.with_name(f"{self.path.stem}-{self.rows}.batch")
        os.rename(self.path, final)
        if fsync:
            try:
                _fsync_dir(final.parent)
            except OSError as exc:  # the batch is renamed and its data synced: queue it, say so
                log.warning("spool: fsync of %s failed (%s); batch %s kept", final.parent, exc, final.name)
        return SpoolFile(final, self.table, self.batch_id, self.seq, self.rows, self.size)

    def abandon(self) -> None:
        """Close without sealing (the file stays ``.open``; recovery seals it later)."""
        if self._fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = -1


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


_MAP_MARKERS = frozenset([*range(0x80, 0x90), 0xDE, 0xDF])  # how a msgpack map starts


def _frame_at(data: bytes, pos: int, names: set[str]) -> tuple[dict[str, list[Any]], int, int] | None:
    """The frame starting at ``pos`` (columns, rows, end), or None when it is not a whole, valid
    frame with the batch's column names (``names``; any when empty)."""
    if pos + _LEN.size >= len(data):
        return None
    (n,) = _LEN.unpack_from(data, pos)
    end = pos + _LEN.size + n
    if n == 0 or end > len(data) or data[pos + _LEN.size] not in _MAP_MARKERS:
        return None
    try:
        frame = _decoder.decode(data[pos + _LEN.size:end])
    except msgspec.DecodeError:
        return None
    lengths = {len(v) for v in frame.values()}
    if len(lengths) != 1 or (names and set(frame) != names):
        return None
    return frame, lengths.pop(), end


def read_frames(path: Path) -> tuple[dict[str, list[Any]], int, int]:
    """Columns of every valid frame in ``path`` (concatenated), their row count, and the end of
    the last valid frame.

    A damaged frame in the middle (a bad length or payload) is skipped and reading resumes at the
    next valid frame, so one bad write does not hide the good frames after it; a torn tail ends
    the file.
    """
    data = path.read_bytes()
    out: dict[str, list[Any]] = {}
    rows = good = pos = 0
    while pos + _LEN.size <= len(data):
        found = _frame_at(data, pos, set(out))
        if found is None:
            pos = next((p for p in range(pos + 1, len(data) - _LEN.size)
                        if _frame_at(data, p, set(out)) is not None), len(data))
            continue
        frame, n, end = found
        for name, values in frame.items():
            out.setdefault(name, []).extend(values)
        rows += n
        pos = good = end
    return out, rows, good


class Spool:
    """The spool directory of one writer (exclusive ``flock``)."""

    def __init__(self, directory: str | os.PathLike[str], fsync: bool = True) -> None:
        self.dir = Path(directory)
        self.fsync = fsync
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / "rejected").mkdir(exist_ok=True)
        self._lock_file = open(self.dir / "LOCK", "a+")  # noqa: SIM115 - held for the spool's life
        try:
            fcntl.flock(self._lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock_file.close()
            raise StoreError(f"spool {self.dir} is in use by another triscope writer") from None
        self._seq = 0
        self._seq_lock = threading.Lock()

    def _next_seq(self) -> int:
        with self._seq_lock:
            self._seq = max(self._seq + 1, time.time_ns())
            return self._seq

    def open_batch(self, table: str) -> OpenBatch:
        """A new, empty ``.open`` batch for ``table``."""
        if not TABLE_NAME.fullmatch(table):
            raise ValueError(f"bad table name {table!r}")
        seq, batch_id = self._next_seq(), uuid.uuid4().hex
        return OpenBatch(self.dir / f"{seq:020d}-{batch_id}-{table}.open", table, batch_id, seq)

    def recover(self) -> list[SpoolFile]:
        """Every batch left on disk, oldest first; ``.open`` files are cut to whole frames and sealed."""
        found: list[SpoolFile] = []
        for path in sorted(self.dir.iterdir()):
            m = _NAME.fullmatch(path.name)
            if m is None:
                continue
            seq = int(m["seq"])
            with self._seq_lock:
                self._seq = max(self._seq, seq)
            if m["kind"] == "batch":
                found.append(SpoolFile(path, m["table"], m["id"], seq, int(m["rows"]), path.stat().st_size))
                continue
            _, rows, good = read_frames(path)
            size = path.stat().st_size
            if good < size:
                log.warning("spool: %s ends in a torn frame; kept %d rows (%d of %d bytes)",
                            path.name, rows, good, size)
                os.truncate(path, good)
            if rows == 0:
                path.unlink()
                continue
            final = path.with_name(f"{path.stem}-{rows}.batch")
            os.rename(path, final)
            found.append(SpoolFile(final, m["table"], m["id"], seq, rows, good))
        if found and self.fsync:
            _fsync_dir(self.dir)
        return found

    def load(self, item: SpoolFile) -> tuple[dict[str, list[Any]], int]:
        """The columns of a sealed batch and the rows it lost to damage (a copy of a damaged file
        is kept in ``rejected/``); StoreError when no frame is readable."""
        columns, rows, _ = read_frames(item.path)
        if rows == 0:
            raise StoreError(f"spool file {item.path.name} has no readable frame (its name says {item.rows} rows)")
        lost = max(0, item.rows - rows)
        if lost:
            kept = self.dir / "rejected" / f"damaged-{item.path.name}"
            with contextlib.suppress(OSError):
                shutil.copyfile(item.path, kept)
            log.error("spool: %s is damaged: %d of %d rows readable; writing those, copy kept as %s",
                      item.path.name, rows, item.rows, kept.name)
        return columns, lost

    def remove(self, item: SpoolFile) -> None:
        """Delete a batch that is in the store."""
        with contextlib.suppress(FileNotFoundError):
            item.path.unlink()

    def reject(self, item: SpoolFile) -> Path:
        """Move a batch the store refused into ``rejected/``."""
        target = self.dir / "rejected" / item.path.name
        with contextlib.suppress(FileNotFoundError):
            os.rename(item.path, target)
        return target

    def close(self) -> None:
        """Release the directory lock."""
        if not self._lock_file.closed:
            fcntl.flock(self._lock_file, fcntl.LOCK_UN)
            self._lock_file.close()
