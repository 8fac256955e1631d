"""The trace document around ``traceEvents``: its other top-level keys (:class:`TraceHeader`), read
from what comes before the array and from the tail after it."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any


@dataclass
class TraceHeader:
    """Top-level keys of the trace other than ``traceEvents``, known once reading has finished."""

    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def base_time_ns(self) -> int:
        return int(self.metadata.get("baseTimeNanoseconds") or 0)

    @property
    def rank(self) -> int | None:
        return self._distributed("rank")

    @property
    def world_size(self) -> int | None:
        return self._distributed("world_size")

    def _distributed(self, key: str) -> int | None:
        info = self.metadata.get("distributedInfo") or {}
        value = info.get(key) if isinstance(info, dict) else None
        return value if isinstance(value, int) and not isinstance(value, bool) else None


def document_without_events(head: bytes, after_array: bytes) -> Any:
    """The document with an empty ``traceEvents``: ``head`` (up to the key) + ``[]`` + what follows the
    array's ``]``. Raises ValueError (JSONDecodeError, UnicodeDecodeError) when it does not parse."""
    return json.loads(head + b'"traceEvents": []' + after_array)


def tail_candidates(head: bytes, buf: bytes) -> Iterator[tuple[int, dict[str, Any]]]:
    """Possible ``]`` closing traceEvents in the last buffer, last first: those after which
    the rest of the document parses. Yields (offset of that ``]``, top-level metadata)."""
    pos = len(buf)
    for _ in range(64):
        close = buf.rfind(b"]", 0, pos)
        if close < 0:
            return
        before = buf[:close].rstrip()
        if not before or before.endswith(b"}"):
            try:
                meta = document_without_events(head, buf[close + 1:])
            except (json.JSONDecodeError, UnicodeDecodeError):
                meta = None
            if isinstance(meta, dict):
                meta.pop("traceEvents", None)
                yield close, meta
        pos = close


def early_metadata(head: bytes) -> dict[str, Any] | None:
    """Keys before traceEvents (often distributedInfo with the rank), best effort: None when they do not parse."""
    text = head.rstrip()
    if text.endswith(b","):
        text = text[:-1]
    try:
        meta = json.loads(text + b"}")
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    return meta if isinstance(meta, dict) else None
