"""Streaming reader for Kineto Chrome-trace JSON (``.json`` or gzip, detected by magic bytes).

Memory stays bounded by the block size, not the file size: the ``traceEvents`` array is cut
into blocks at ``}`` ``,`` ``{`` boundaries and each block is decoded as a JSON array with
msgspec into typed structs (unused fields are skipped without building Python objects).
A block cut at a wrong place (inside a string or a nested object) cannot decode as an
array of objects, so a failed block is re-read event by event with the stdlib decoder,
which also pinpoints real corruption by byte offset. Keys that come after the array
(``baseTimeNanoseconds`` often does) are parsed from the small tail. Event structs: :mod:`.events`;
gzip: :mod:`.gzip_stream`.

A file that is not a Kineto trace (a pickle, an HTML page, a JSON array, an execution trace, no
``traceEvents``) raises :class:`~.errors.NotATraceError` before anything is handed out. A run of
whitespace longer than the largest event accepted is dropped while streaming (it can only lie
between tokens of a trace that would be accepted), so whitespace cannot fill memory.
"""

from __future__ import annotations

import json
import re
import zlib
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from decimal import Decimal
from pathlib import Path
from typing import Any, BinaryIO

import msgspec

from triscope.collectors.kineto.errors import RefusedTraceError
from triscope.collectors.kineto.events import TraceEvent, event_problem
from triscope.collectors.kineto.formats import find_array
from triscope.collectors.kineto.gzip_stream import open_binary
from triscope.collectors.kineto.header import TraceHeader, document_without_events, early_metadata, tail_candidates
from triscope.errors import InputError

BLOCK_BYTES = 8 << 20
_MAX_STALL_BLOCKS = 8  # an event larger than this many blocks is treated as corruption
_WS = b" \t\r\n"
_NON_WS = re.compile(rb"[^ \t\r\n]")
_WS_SPAN = re.compile(rb"[ \t\r\n]*")
_SEPARATORS = re.compile(r"[ \t\r\n,]*")
MAX_EVENT_BYTES = 64 << 20
"""An event (with the whitespace around it) larger than this, or than ``_MAX_STALL_BLOCKS`` blocks,
is treated as corruption; longer whitespace runs are dropped while streaming."""
_block_decoder = msgspec.json.Decoder(list[TraceEvent])


RawSink = Callable[[bytes], bool]
"""Takes a block as JSON array text; returns False when it could not parse it."""

RawSubmit = Callable[[bytes, int], "Future[bytes | None]"]
"""Takes the events ``buf[:end]`` (comma-separated objects, no brackets), starts the work and
returns a future: None when it took them, else those same event bytes (refused). It must copy
what it keeps before returning: the reader then drops ``buf`` and reads on."""


def read_trace(path: str | Path, header: TraceHeader | None = None,
               block_bytes: int = BLOCK_BYTES, raw_sink: RawSink | None = None,
               raw_submit: RawSubmit | None = None,
               max_decompressed_bytes: int | None = None) -> Iterator[list[TraceEvent]]:
    """Yield blocks of events from a Kineto trace; fills ``header`` when the file has been read.

    With ``raw_sink``, each block is first offered as JSON array bytes (e.g. to ClickHouse's
    own JSON parser); only blocks it refuses are decoded here and yielded. ``raw_submit`` does
    the same one block ahead: while the sink works on a block (in another thread), the next
    block is read and cut, assuming the sink will take it; if it refuses, the reader steps back
    and decodes that block itself, exactly as with ``raw_sink``. The reader holds no copy of a
    block in flight (the sink hands refused bytes back), so memory stays near two blocks.
    Raises :class:`InputError` naming the file and byte offset on truncated or corrupt input;
    blocks yielded (or accepted by ``raw_sink``) before the error are complete and valid.
    Raises :class:`~.errors.RefusedTraceError` (nothing yielded) for a file that is not a Kineto
    trace or is unreadable from its start, and, at any point, for a gzip that decompresses to
    more than ``max_decompressed_bytes``.
    """
    header = header if header is not None else TraceHeader()
    with open_binary(path, max_decompressed_bytes) as stream:
        yield from _TraceParser(str(path), stream, header, block_bytes, raw_sink, raw_submit).blocks()


class _TraceParser:
    def __init__(self, name: str, stream: BinaryIO, header: TraceHeader, block_bytes: int,
                 raw_sink: RawSink | None, raw_submit: RawSubmit | None = None) -> None:
        self.name = name
        self.stream = stream
        self.header = header
        self.block_bytes = block_bytes
        self.raw_sink = raw_sink
        self.raw_submit = raw_submit
        self.consumed = 0  # decompressed bytes before the current buffer
        self.eof = False
        self.ws_run = 0  # length of the whitespace the stream read so far ends with
        self.max_event = max(_MAX_STALL_BLOCKS * block_bytes, MAX_EVENT_BYTES)

    def _read(self) -> bytes:
        while True:
            try:
                data = self.stream.read(self.block_bytes)
            except (EOFError, OSError, zlib.error) as exc:
                raise InputError(f"{self.name}: compressed data is corrupt or cut short "
                                 f"after {self.consumed} bytes ({exc})") from None
            if not data:
                self.eof = True
                return data
            if data.isspace() and not data.translate(None, _WS):  # C-speed: JSON whitespace only
                self.ws_run += len(data)
                if self.ws_run > self.max_event:
                    continue  # whitespace beyond any event we accept: between tokens, drop it
                return data
            tail = data[-256:]  # strip the last bytes only: no copy of a whole block per read
            if tail.rstrip(_WS):
                self.ws_run = len(tail) - len(tail.rstrip(_WS))
            else:
                self.ws_run = len(data) - len(data.rstrip(_WS))
            return data

    def _more(self) -> tuple[bytes, InputError | None]:
        """The next chunk, or the read error that ended the stream (refusals are raised)."""
        try:
            return self._read(), None
        except RefusedTraceError:
            raise
        except InputError as exc:
            return b"", exc

    def _grow(self, buf: bytes) -> tuple[bytes, InputError | None]:
        """``buf`` (no event boundary in it) with more data: read until a ``{`` arrives (only then can a
        boundary complete), the end, or more than the largest event, and join once (no quadratic copies)."""
        pieces, size = [buf], len(buf)
        while True:
            data, error = self._more()
            pieces.append(data)
            size += len(data)
            if not data or error is not None or b"{" in data or size > self.max_event:
                return b"".join(pieces), error

    def _error(self, offset: int, what: str) -> InputError:
        return InputError(f"{self.name}: {what} at byte {self.consumed + offset}")

    def _decode_array(self, buf: bytes, end: int) -> list[TraceEvent] | None:
        """Events ``buf[:end]`` (comma-separated objects) through the fast paths; None when they
        do not parse."""
        if self.raw_submit is not None:
            return [] if self.raw_submit(buf, end).result() is None else None
        array = _as_array(memoryview(buf)[:end])
        if self.raw_sink is not None:
            return [] if self.raw_sink(array) else None
        try:
            events = _block_decoder.decode(array)
        except msgspec.DecodeError:
            return None
        if any(event_problem(e) for e in events):
            return None  # the event-by-event decode names the event and its offset
        return events

    def blocks(self) -> Iterator[list[TraceEvent]]:
        buf, match = find_array(self._read, self.name, self.block_bytes)
        head = buf[: match.start()]
        early = early_metadata(head)
        if early is not None:
            self.header.metadata = early
        self.consumed += match.end()
        buf = buf[match.end():]
        read_error: InputError | None = None
        # raw_submit: (future of the block in flight, how many bytes it covers, the separator
        # after its last event); buf starts after them. The sink holds the only copy of the block.
        pending: tuple[Future[bytes | None], int, bytes] | None = None
        while not self.eof and read_error is None:
            if len(buf) < self.block_bytes:
                data, read_error = self._more()
                buf += data
                continue
            cut = last_boundary(buf)
            if cut is None:  # one huge event or an odd layout: read more before deciding, within bounds
                if len(buf) > self.max_event:
                    read_error = self._error(0, f"corrupt JSON (no event boundary within {len(buf)} bytes)")
                    break
                buf, read_error = self._grow(buf)
                continue
            refused = False
            if pending is not None:
                back, pending = self._put_back_if_refused(pending, buf), None
                if back is not None:  # refused: decode that block here, with what came since
                    buf, refused = back, True
            if self.raw_submit is not None and not refused:
                pending = (self.raw_submit(buf, cut[0]), cut[1], buf[cut[0]:cut[1]])
                self.consumed += cut[1]
                buf = buf[cut[1]:]
                continue
            events = None if refused else self._decode_array(buf, cut[0])
            if events is None:  # wrong cut or damage: decode event by event
                events, leftover, invalid = self._decode_slow(buf)
                if invalid is not None:  # keep the events before the invalid one, then report it
                    if events:
                        yield events
                    raise self._kept(invalid, len(events))
                if not events:
                    # No complete event yet: a huge event, or damage. Read on, within bounds.
                    if len(buf) > _MAX_STALL_BLOCKS * self.block_bytes:
                        raise self._error(0, "corrupt JSON (no complete event within "
                                             f"{len(buf)} bytes)")
                    data, read_error = self._more()
                    buf += data
                    continue
                self.consumed += len(buf) - len(leftover)
                buf = leftover
            else:
                self.consumed += cut[1]
                buf = buf[cut[1]:]
            if events:
                yield events
        if pending is not None and (back := self._put_back_if_refused(pending, buf)) is not None:
            buf = back  # the last block in flight was refused
        pending = None
        if read_error is not None:
            # Keep every complete event that arrived before the stream broke, then report.
            events, _, _ = self._decode_slow(buf)
            if events:
                yield events
            raise self._kept(read_error, len(events))
        # Several "]" can close a parseable document (a list-valued key after traceEvents, like
        # deviceProperties): the real end of traceEvents is the one that leaves the most keys after it.
        candidates = sorted(tail_candidates(head, buf), key=lambda c: -len(c[1]))
        for array_end, metadata in candidates:
            events = self._decode_array(buf, array_end) if _NON_WS.search(buf, 0, array_end) else []
            if events is not None:
                if events:
                    yield events
                self.header.metadata = metadata
                return
        # No clean split: decode event by event; the array ends where decoding stops at "]".
        events, rest, invalid = self._decode_slow(buf)
        tail: Any = None
        if invalid is None and rest.lstrip().startswith(b"]"):
            try:
                tail = document_without_events(head, rest.lstrip()[1:])
            except (json.JSONDecodeError, UnicodeDecodeError):
                tail = None
        if events:
            yield events
        if invalid is not None:
            raise self._kept(invalid, len(events))
        if not isinstance(tail, dict):
            raise self._kept(InputError(f"{self.name}: trace is truncated or corrupt after byte "
                                        f"{self.consumed + len(buf) - len(rest)}"), len(events))
        tail.pop("traceEvents", None)
        self.header.metadata = tail

    def _put_back_if_refused(self, pending: tuple[Future[bytes | None], int, bytes], buf: bytes) -> bytes | None:
        """Wait for the block in flight: None when the sink took it, else ``buf`` with that block's
        bytes put back in front (and ``consumed`` stepped back) so the reader decodes it itself."""
        future, covered, separator = pending
        events = future.result()
        if events is None:
            return None
        self.consumed -= covered
        return b"".join((events, separator, buf))

    @staticmethod
    def _kept(error: InputError, count: int) -> InputError:
        return InputError(f"{error}; the {count} complete events of the last block were kept")

    def _decode_slow(self, buf: bytes) -> tuple[list[TraceEvent], bytes, InputError | None]:
        """Decode events one at a time, up to the first that does not parse (it may continue in
        the next block, or be damage: the caller decides) or is invalid. Returns the events, the
        undecoded remainder, and the error naming the invalid item and its offset (or None)."""
        text = buf.decode("utf-8", errors="replace")
        decoder = json.JSONDecoder(parse_float=Decimal)
        events: list[TraceEvent] = []
        invalid: InputError | None = None
        pos = 0
        n = len(text)
        while True:
            pos = _SEPARATORS.match(text, pos).end()  # type: ignore[union-attr]  # always matches
            if pos >= n or text[pos] == "]":
                break
            try:
                obj, end = decoder.raw_decode(text, pos)
            except json.JSONDecodeError:
                break  # the event may continue in the next block; damage is reported at the end
            if not isinstance(obj, dict):
                invalid = self._error(len(text[:pos].encode()), "traceEvents item is not an object")
                break
            try:
                event = msgspec.convert(obj, TraceEvent)
            except msgspec.ValidationError as exc:
                problem: str | None = str(exc)
            else:
                problem = event_problem(event)
            if problem is not None:
                invalid = self._error(len(text[:pos].encode()), f"invalid event ({problem})")
                break
            events.append(event)
            pos = end
        return events, text[pos:].encode(), invalid


def _as_array(events: bytes | memoryview) -> bytes:
    """``[`` + comma-separated events + ``]`` in one copy."""
    return b"".join((b"[", events, b"]"))


def last_boundary(buf: bytes, end: int | None = None) -> tuple[int, int] | None:
    """Positions (end of ``}``, start of ``{``) of the last ``} , {`` boundary in ``buf[:end]``
    (searched in place: no copy of the prefix)."""
    limit = len(buf) if end is None else min(end, len(buf))
    pos = limit
    while True:
        comma = buf.rfind(b",", 0, pos)
        if comma <= 0:
            return None
        left = _ws_start(buf, comma) - 1
        right = _WS_SPAN.match(buf, comma + 1, limit).end()  # type: ignore[union-attr]  # always matches
        if left >= 0 and buf[left] == 0x7D and right < limit and buf[right] == 0x7B:
            return left + 1, right
        pos = comma


def _ws_start(buf: bytes, end: int) -> int:
    """Start of the whitespace run that ends at ``end`` (C-speed strips of small slices: a long run
    of hostile whitespace costs no Python loop per byte)."""
    pos = end
    while pos > 0:
        lo = max(0, pos - 4096)
        kept = buf[lo:pos].rstrip(_WS)
        if kept:
            return lo + len(kept)
        pos = lo
    return 0


def read_all(path: str | Path) -> tuple[TraceHeader, list[TraceEvent]]:
    """Read a whole trace into memory (small traces and tests)."""
    header = TraceHeader()
    events = [e for block in read_trace(path, header) for e in block]
    return header, events


__all__ = ["BLOCK_BYTES", "TraceHeader", "last_boundary", "read_all", "read_trace"]
