"""One ClickHouse INSERT fed through a named pipe while the caller writes to it.

The embedded store reads local files, and a named pipe is one: ClickHouse parses the JSON as it
arrives (on several cores, with its parallel parser) and writes parts of the size its insert
settings ask for, while the reader is still decompressing and cutting the trace. Nothing of the
trace is held in memory beyond the block being written.
"""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
from collections.abc import Callable
from concurrent.futures import Executor, wait
from pathlib import Path


class PipeInsert:
    """Runs ``insert(pipe_path)`` on ``executor`` and feeds it through :meth:`write`."""

    def __init__(self, insert: Callable[[Path], None], executor: Executor) -> None:
        self._dir = tempfile.mkdtemp(prefix="triscope-trace-pipe-")
        self.path = Path(self._dir) / "events.json"
        os.mkfifo(self.path, 0o600)
        self._future = executor.submit(insert, self.path)
        self._fd: int | None = None
        self.broken = False

    def _open(self) -> bool:
        """Open the write end once ClickHouse has opened the read end; False when the insert
        ended (failed) before it did."""
        while True:
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_NONBLOCK)
            except OSError as exc:
                if exc.errno != errno.ENXIO:  # ENXIO: no reader yet
                    raise
                if self._future.done():
                    return False
                wait([self._future], timeout=0.002)
                continue
            os.set_blocking(fd, True)
            self._fd = fd
            return True

    def write(self, *chunks: bytes | memoryview) -> bool:
        """Write ``chunks`` in order; False (and nothing more is written) once ClickHouse has
        stopped reading, i.e. the insert failed."""
        if self.broken:
            return False
        if self._fd is None and not self._open():
            self.broken = True
            return False
        assert self._fd is not None
        try:
            for chunk in chunks:
                view = memoryview(chunk)
                while view:
                    view = view[os.write(self._fd, view):]
        except BrokenPipeError:
            self.broken = True
            return False
        return True

    def finish(self) -> BaseException | None:
        """Close the pipe (end of input), wait for the insert and return the error it raised."""
        try:
            if self._fd is None and not self.broken:
                self._open()  # an insert waiting to open the pipe must see its end
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None
            return self._future.exception()
        finally:
            shutil.rmtree(self._dir, ignore_errors=True)
