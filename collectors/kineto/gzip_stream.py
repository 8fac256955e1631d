"""Open a trace file, decompressing gzip (detected by its magic bytes) as a stream that keeps what it read."""

from __future__ import annotations

import zlib
from pathlib import Path
from typing import BinaryIO

from triscope.errors import InputError


class GzipStream:
    """Streaming gzip decompression that hands out every byte decoded before damage.

    ``gzip.GzipFile.read`` raises on a cut-short file without returning what it had already
    decompressed; this reader returns that data first and raises on the next call.
    """

    def __init__(self, raw: BinaryIO, chunk: int = 1 << 20) -> None:
        self.raw = raw
        self.chunk = chunk
        self.inflater = zlib.decompressobj(wbits=31)
        self.pending: InputError | OSError | None = None
        self.done = False

    def read(self, size: int) -> bytes:
        if self.pending is not None:
            error, self.pending = self.pending, None
            raise error
        out: list[bytes] = []
        have = 0
        while have < size and not self.done:
            compressed = self.raw.read(self.chunk)
            try:
                if not compressed:
                    self.done = True
                    if not self.inflater.eof:
                        raise EOFError("compressed file ended before the end-of-stream marker")
                    break
                data = self.inflater.decompress(compressed)
                while self.inflater.eof and self.inflater.unused_data:  # next gzip member
                    rest = self.inflater.unused_data
                    self.inflater = zlib.decompressobj(wbits=31)
                    data += self.inflater.decompress(rest)
            except (zlib.error, EOFError) as exc:
                self.done = True
                self.pending = OSError(str(exc))
                break
            out.append(data)
            have += len(data)
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


def open_binary(path: str | Path) -> BinaryIO:
    """Open ``path`` for reading, decompressing gzip when the file starts with its magic bytes."""
    path = Path(path)
    try:
        raw = open(path, "rb")  # noqa: SIM115 - returned to the caller
    except OSError as exc:
        raise InputError(f"{path}: cannot open ({exc.strerror})") from None
    if raw.read(2) == b"\x1f\x8b":
        raw.seek(0)
        return GzipStream(raw)  # type: ignore[return-value]
    raw.seek(0)
    return raw
