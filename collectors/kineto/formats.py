"""Recognise files that are not Kineto traces from their first bytes, before anything is ingested."""

from __future__ import annotations

import re
from collections.abc import Callable

from triscope.collectors.kineto.errors import NotATraceError, RefusedTraceError
from triscope.errors import InputError

_ARRAY_START = re.compile(rb'"traceEvents"\s*:\s*\[')
_NON_WS = re.compile(rb"[^ \t\r\n]")
# Top-level keys of other PyTorch outputs (both keys of a pair must be present).
_OTHER_FORMATS = (
    (re.compile(rb'"nodes"\s*:\s*\['), re.compile(rb'"schema"\s*:'),
     "a PyTorch execution trace (ExecutionTraceObserver: schema + nodes)"),
    (re.compile(rb'"segments"\s*:\s*\['), re.compile(rb'"device_traces"\s*:'),
     "a memory snapshot (torch.cuda.memory._snapshot: segments + device_traces)"),
)
_FIRST_BYTE = {
    ord("["): "a JSON array (e.g. a memory timeline from export_memory_timeline)",
    0x80: "a Python pickle (e.g. a memory snapshot from torch.cuda.memory._dump_snapshot)",
    ord("<"): "HTML or XML (e.g. export_memory_timeline's .html)",
}


def other_format(head: bytes) -> str | None:
    """What ``head`` (the first bytes read, no ``traceEvents`` array in them yet) is when it is
    recognisably not a Kineto trace, else None (read on)."""
    first = _NON_WS.search(head)
    if first is None:
        return None
    if head[first.start()] != ord("{"):
        return _FIRST_BYTE.get(head[first.start()], "not a JSON object")
    for key, other_key, kind in _OTHER_FORMATS:
        if key.search(head) and other_key.search(head):
            return kind
    return None


def find_array(read: Callable[[], bytes], name: str, block_bytes: int) -> tuple[bytes, re.Match[bytes]]:
    """Read (``read()`` gives the next chunk, b"" at the end) until the ``traceEvents`` array opens:
    (what was read, the match). NotATraceError for other files, RefusedTraceError when the file is
    unreadable from its start: in both cases nothing of it has been handed out."""
    buf = b""
    match = None
    while match is None:
        try:
            data = read()
        except RefusedTraceError:
            raise
        except InputError as exc:
            raise RefusedTraceError(f"{exc}; nothing of it was kept") from None
        if not data:
            if not buf.strip():
                raise NotATraceError(f"{name}: empty file, not a Kineto trace")
            raise NotATraceError(f"{name}: not a Kineto trace (no traceEvents array in this JSON)")
        searched = max(0, len(buf) - 1024)  # the key may straddle two reads
        buf += data
        match = _ARRAY_START.search(buf, searched)
        if match is None:
            if len(buf) <= 2 * block_bytes and (kind := other_format(buf)) is not None:
                raise NotATraceError(f"{name}: not a Kineto trace: {kind}")
            if len(buf) > 64 * block_bytes:
                raise NotATraceError(f"{name}: not a Kineto trace (no traceEvents array in the first "
                                     f"{len(buf):,} bytes)")
    return buf, match
