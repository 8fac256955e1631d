"""Open a trace file, decompressing gzip (detected by its magic bytes) as a stream that keeps what it read."""

from __future__ import annotations

import zlib
from pathlib import Path
from typing import BinaryIO

from triscope.collectors.kineto.errors import TraceTooLargeError
from triscope.errors import InputError


class GzipStream:
    """Streaming gzip decompression that hands out every byte decoded before damage.

    ``gzip.GzipFile.read`` raises on a cut-short file without returning what it had already
    decompressed; this reader returns that data first and raises on the next call. Every member
    of a multi-member file is read (as ``gzip`` does). Output is bounded per call (``read(size)``
    never inflates more than ``size`` bytes, so a bomb cannot blow up one call) and in total:
    past ``max_bytes`` decompressed bytes it raises :class:`TraceTooLargeError`.
    """

    def __init__(self, raw: BinaryIO, chunk: int = 1 << 20, max_bytes: int | None = None, name: str = "") -> None:
        self.raw = raw
        self.chunk = chunk
        self.max_bytes = max_bytes
        self.name = name
        self.inflater = zlib.decompressobj(wbits=31)
        self.feed = b""  # compressed bytes not yet taken by the inflater
        self.total = 0  # decompressed bytes handed out
        self.members = 1
        self.pending: InputError | OSError | None = None
        self.done = False

    def _next_input(self) -> bool:
        """Fill ``feed``: the rest of this member, or the start of the next one. False at a clean end."""
        if self.inflater.eof:
            rest = self.inflater.unused_data or self.raw.read(self.chunk)
            if not rest:
                return False
            self.inflater = zlib.decompressobj(wbits=31)
            self.members += 1
            self.feed = rest
        elif not self.feed:
            self.feed = self.raw.read(self.chunk)
            if not self.feed:
                raise EOFError("compressed file ended before the end-of-stream marker")
        return True

    def read(self, size: int) -> bytes:
        if self.pending is not None:
            error, self.pending = self.pending, None
            raise error
        out: list[bytes] = []
        have = 0
        while have < size and not self.done:
            try:
                if not self._next_input():
                    self.done = True
                    break
                data = self.inflater.decompress(self.feed, size - have)
                self.feed = self.inflater.unconsumed_tail
            except (zlib.error, EOFError) as exc:
                self.done = True
                self.pending = OSError(str(exc))
                break
            out.append(data)
            have += len(data)
            self.total += len(data)
            if self.max_bytes is not None and self.total > self.max_bytes:
                self.done = True
                raise TraceTooLargeError(f"{self.name}: decompresses to more than {self.max_bytes:,} bytes "
                                         "(limit [ingest] max_decompressed_bytes / --max-decompressed-bytes); "
                                         "nothing of it was kept")
        result = b"".join(out)
        if not result and self.pending is not None:
            error, self.pending = self.pending, None
            raise error
        return result

    def close(self) -> None:
        self.raw.close()

    def __enter__(self) -> GzipStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_binary(path: str | Path, max_decompressed_bytes: int | None = None) -> BinaryIO:
    """Open ``path`` for reading, decompressing gzip when the file starts with its magic bytes
    (at most ``max_decompressed_bytes`` of it)."""
    path = Path(path)
    try:
        raw = open(path, "rb")  # noqa: SIM115 - returned to the caller
    except OSError as exc:
        raise InputError(f"{path}: cannot open ({exc.strerror})") from None
    if raw.read(2) == b"\x1f\x8b":
        raw.seek(0)
        return GzipStream(raw, max_bytes=max_decompressed_bytes, name=str(path))  # type: ignore[return-value]
    raw.seek(0)
    return raw
