"""Spans to ``requests`` columns, with a request span's parent linked in (shared by the OTLP receiver
and the in-process exporter).

A gateway's CLIENT span (or any HTTP span) that is the parent of an ``llm_request`` span in the
same trace passes its address, port and model attributes to the child, which vLLM's span lacks.
With ``all_spans`` such a parent is the same request as its child: it is not stored as a row of
its own. Parents and children are matched within one batch and, through a bounded cache of the
last ``cache_spans`` parents and children, across batches (see docs/run.md for the one order that
cannot be undone: a parent stored in an earlier batch than its child under ``all_spans``).

A request that never reached an engine leaves no engine span: a gateway's CLIENT span that ended in
error (connection refused, a 5xx) and has no request child is stored as that backend's failed
request (``status = 'error'``), so a dead backend's error ratio is not 0. A child that arrives after
its failed parent was stored in an earlier batch counts twice, the same one order as above.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from triscope.collectors.span_mapping import (
    DEFAULT_RULES,
    SpanRejected,
    SpanRules,
    SpanView,
    backend_of,
    is_request_span,
    map_span,
)
from triscope.schema import REQUESTS

Key = tuple[bytes, bytes]
CLIENT = 3  # OTLP SpanKind: a gateway's call to a backend (a SERVER span's address is its own)


@dataclass
class MappedBatch:
    """``requests`` columns for a batch of spans, and what did not become a row."""

    columns: dict[str, list[Any]] = field(default_factory=REQUESTS.empty_columns)
    rows: int = 0
    rejected: int = 0
    first_error: str = ""
    merged: int = 0
    """Non-request parents counted as their request child's row (``all_spans``)."""
    unreached: int = 0
    """Failed gateway CLIENT spans with no engine span under them, stored as failed requests."""

    def add(self, row: Mapping[str, Any]) -> None:
        for name, values in self.columns.items():  # column lists, not row dicts: a third of the memory
            values.append(row[name])
        self.rows += 1

    def reject(self, span: SpanView, reason: str) -> None:
        self.rejected += 1
        self.first_error = self.first_error or f"span {span.name[:200]!r}: {reason}"


class _Lru:
    def __init__(self, size: int) -> None:
        self.size = size
        self._items: OrderedDict[Key, Mapping[str, Any]] = OrderedDict()

    def get(self, key: Key) -> Mapping[str, Any] | None:
        return self._items.get(key)

    def put(self, key: Key, value: Mapping[str, Any]) -> None:
        self._items[key] = value
        self._items.move_to_end(key)
        while len(self._items) > self.size:
            self._items.popitem(last=False)

    def __len__(self) -> int:
        return len(self._items)


class SpanMapper:
    """Maps batches of :class:`SpanView` with ``rules``; thread-safe (one lock around the caches)."""

    def __init__(self, rules: SpanRules = DEFAULT_RULES, all_spans: bool = False, cache_spans: int = 20_000) -> None:
        self.rules = rules
        self.all_spans = all_spans
        self._keys = rules.link_keys
        self._parents = _Lru(cache_spans)   # (trace, span id) of a non-request span -> its link attributes
        self._children = _Lru(cache_spans)  # (trace, parent span id) of a stored request span
        self._lock = threading.Lock()

    def map(self, spans: Iterable[SpanView | str]) -> MappedBatch:
        """Rows for ``spans``; a string stands for a span a decoder could not read (its reason)."""
        out = MappedBatch()
        requests: list[SpanView] = []
        others: list[SpanView] = []
        for span in spans:
            if isinstance(span, str):
                out.rejected += 1
                out.first_error = out.first_error or span
            elif is_request_span(span):
                requests.append(span)
            elif self.all_spans or any(k in self._keys for k in span.attributes):
                others.append(span)  # kept only as a row (all_spans) or for what it tells its children
        local: dict[Key, Mapping[str, Any]] = {}
        for span in others:
            link = {k: v for k, v in span.attributes.items() if k in self._keys}
            local[(span.trace_id, span.span_id)] = link
        claimed = {(s.trace_id, s.parent_span_id) for s in requests if any(s.parent_span_id)}
        with self._lock:
            for key, attrs in local.items():
                if attrs:
                    self._parents.put(key, attrs)
            found = {key: local.get(key) or self._parents.get(key) for key in claimed}
            for key in claimed:
                self._children.put(key, {})
            merged = {(s.trace_id, s.span_id) for s in others
                      if (s.trace_id, s.span_id) in claimed or self._children.get((s.trace_id, s.span_id))
                      is not None}
        for span in requests:
            parent = found.get((span.trace_id, span.parent_span_id)) if any(span.parent_span_id) else None
            self._map_one(replace(span, parent=parent) if parent else span, out)
        for span in others:
            if (span.trace_id, span.span_id) in merged:
                if self.all_spans:
                    out.merged += 1
            elif self.all_spans:
                self._map_one(span, out)
            elif self._unreached(span):
                out.unreached += 1
                self._map_one(span, out)
        return out

    def _unreached(self, span: SpanView) -> bool:
        """A failed call to a backend named on the span itself (not the gateway's own resource)."""
        return (span.error and span.kind == CLIENT
                and any(name in span.attributes for name in self.rules.address_attributes)
                and bool(backend_of(span, self.rules)))

    def _map_one(self, span: SpanView, out: MappedBatch) -> None:
        try:
            out.add(map_span(span, self.rules))
        except SpanRejected as exc:
            out.reject(span, str(exc))
