"""In-process OpenTelemetry ``SpanExporter`` writing request spans straight into the ``requests`` table.

Install it in a serving process next to (or instead of) an OTLP exporter::

    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    provider.add_span_processor(BatchSpanProcessor(TriscopeSpanExporter(store)))

``export`` only maps and buffers (it never waits on the store); a flush loop writes batches every
``interval_s`` or at ``batch_rows`` rows. ``force_flush`` and ``shutdown`` write what is buffered.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.trace import StatusCode

from triscope.collectors.row_buffer import FlushLoop, RowBuffer
from triscope.collectors.span_mapping import COLUMNS, SpanRejected, SpanView, is_request_span, map_span
from triscope.store import Store

log = logging.getLogger(__name__)


def view_of(span: ReadableSpan) -> SpanView:
    """The SDK span as the mapping's plain view."""
    ctx = span.context
    trace_id = ctx.trace_id.to_bytes(16, "big") if ctx is not None else b""
    span_id = ctx.span_id.to_bytes(8, "big") if ctx is not None else b""
    resource = dict(span.resource.attributes) if span.resource is not None else {}
    return SpanView(
        name=span.name, trace_id=trace_id, span_id=span_id,
        start_ns=int(span.start_time or 0), end_ns=int(span.end_time or 0),
        attributes=dict(span.attributes or {}), resource=resource,
        error=span.status is not None and span.status.status_code == StatusCode.ERROR,
    )


class TriscopeSpanExporter(SpanExporter):
    """Maps request spans to ``requests`` rows and writes them in batches."""

    def __init__(self, store: Store, interval_s: float = 1.0, batch_rows: int = 100_000,
                 buffer_rows: int = 1_000_000, all_spans: bool = False) -> None:
        self.buffer = RowBuffer({"requests": COLUMNS}, max_rows=buffer_rows)
        self.flusher = FlushLoop(store, self.buffer, interval_s, batch_rows)
        self.all_spans = all_spans
        self.rejected = 0
        self._shut = False
        self.flusher.start()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        if self._shut:
            return SpanExportResult.FAILURE
        rows: list[dict[str, Any]] = []
        for span in spans:
            view = view_of(span)
            if not (self.all_spans or is_request_span(view)):
                continue
            try:
                rows.append(map_span(view))
            except SpanRejected as exc:
                self.rejected += 1
                log.warning("span %r not stored: %s", span.name, exc)
        if rows and not self.buffer.add("requests", rows):
            log.warning("triscope span buffer full: %d span(s) dropped", len(rows))
            return SpanExportResult.FAILURE
        return SpanExportResult.SUCCESS

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        self.flusher.flush()
        return len(self.buffer) == 0

    def shutdown(self) -> None:
        if not self._shut:
            self._shut = True
            self.flusher.close()
