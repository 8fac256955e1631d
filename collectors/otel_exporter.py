"""In-process OpenTelemetry ``SpanExporter`` writing request spans into ``requests`` through a triscope writer.

Install it in a serving process next to (or instead of) an OTLP exporter::

    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    provider.add_span_processor(BatchSpanProcessor(TriscopeSpanExporter(store_or_writer_or_config)))

``export`` maps spans and submits them to a :class:`triscope.writer.Writer` (spooled on disk when
it returns; it never waits on the store). Given a Writer, its owner flushes and closes it; given a
Store or a config mapping, the exporter opens its own writer (see :func:`writer_for`) and
``force_flush`` / ``shutdown`` flush / close it.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from typing import Any

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.trace import StatusCode

from triscope.collectors.otlp.links import SpanMapper
from triscope.collectors.span_mapping import DEFAULT_RULES, SpanRules, SpanView
from triscope.errors import ConfigError, TriscopeError
from triscope.schema import REQUESTS
from triscope.store.base import Store
from triscope.writer import Writer, WriterConfig

log = logging.getLogger(__name__)


def view_of(span: ReadableSpan) -> SpanView:
    """The SDK span as the mapping's plain view."""
    ctx = span.context
    trace_id = ctx.trace_id.to_bytes(16, "big") if ctx is not None else b""
    span_id = ctx.span_id.to_bytes(8, "big") if ctx is not None else b""
    resource = dict(span.resource.attributes) if span.resource is not None else {}
    parent = span.parent.span_id.to_bytes(8, "big") if span.parent is not None else b""
    return SpanView(
        name=span.name, trace_id=trace_id, span_id=span_id,
        start_ns=int(span.start_time or 0), end_ns=int(span.end_time or 0),
        attributes=dict(span.attributes or {}), resource=resource,
        error=span.status is not None and span.status.status_code == StatusCode.ERROR,
        parent_span_id=parent, kind=int(span.kind.value) + 1,  # the SDK counts from 0 (internal), OTLP from 1
    )


def writer_for(target: Any, spool_dir: str | None = None, **settings: Any) -> tuple[Writer, bool]:
    """``(writer, owned)`` for ``target``: a Writer as is (not owned); for a Store, a new writer on
    ``spool_dir`` (default: a new folder under the temp dir); for a config mapping, a new
    writer from its ``[store]``/``[writer]`` sections (``spool_dir`` overrides ``[writer] spool_dir``).
    ``settings`` are :class:`~triscope.writer.WriterConfig` fields for a new writer."""
    if isinstance(target, Writer):
        return target, False
    if isinstance(target, Store):
        return Writer(target, spool_dir or tempfile.mkdtemp(prefix="triscope-spool-otel-"), **settings), True
    if isinstance(target, Mapping):
        from triscope.store import open_store

        section = {**settings, **dict(target.get("writer") or {})}
        if spool_dir:
            section["spool_dir"] = spool_dir
        WriterConfig.from_mapping(section, "[writer]")  # one-line ConfigError before anything opens
        return Writer.from_config({**target, "writer": section}, lambda: open_store(target)), True
    raise ConfigError(f"TriscopeSpanExporter: need a Writer, Store or config mapping, not {type(target).__name__}")


class TriscopeSpanExporter(SpanExporter):
    """Maps request spans to ``requests`` rows and submits them to a writer.

    ``interval_s``, ``batch_rows`` and ``buffer_rows`` set the flush interval, batch size and
    in-memory row bound of a writer the exporter opens itself (not of a caller's Writer). Given a
    bare Store and no ``spool_dir``, the spool is a temporary folder, removed once it is empty at
    shutdown: pass ``spool_dir`` to have a restarted process replay what the store did not take.
    ``rules`` say which attributes name the backend and model (the ``[otlp]`` defaults otherwise).
    """

    def __init__(self, target: Any, interval_s: float = 1.0, batch_rows: int = 100_000,
                 buffer_rows: int = 1_000_000, all_spans: bool = False, *, spool_dir: str | None = None,
                 rules: SpanRules = DEFAULT_RULES) -> None:
        self._temp_spool = tempfile.mkdtemp(prefix="triscope-spool-otel-") if (
            isinstance(target, Store) and not spool_dir) else None
        self.writer, self.owns_writer = writer_for(target, spool_dir or self._temp_spool, flush_interval_s=interval_s,
                                                   batch_rows=batch_rows, max_memory_rows=buffer_rows)
        self.all_spans = all_spans
        self.mapper = SpanMapper(rules, all_spans)
        self.rejected = 0
        self.rows = 0
        self._shut = False
        if self.owns_writer:
            self.writer.start()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        if self._shut:
            return SpanExportResult.FAILURE
        batch = self.mapper.map(view_of(span) for span in spans)
        if batch.rejected:
            self.rejected += batch.rejected
            log.warning("%d span(s) not stored; first: %s", batch.rejected, batch.first_error)
        if batch.rows:
            try:
                self.rows += self.writer.submit(REQUESTS, batch.columns)
            except TriscopeError as exc:  # the spool cannot take rows now: the SDK counts the batch as failed
                log.warning("triscope span exporter: %d span(s) not stored: %s", batch.rows, exc)
                return SpanExportResult.FAILURE
        return SpanExportResult.SUCCESS

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        """Write what is spooled now (an owned writer only); False when the store did not take it in time."""
        return self.writer.flush(timeout_s=timeout_millis / 1000) if self.owns_writer else True

    def shutdown(self) -> None:
        """Refuse further spans; close an owned writer (what the store does not take stays spooled)."""
        if not self._shut:
            self._shut = True
            if self.owns_writer and self.writer.close() and self._temp_spool:
                shutil.rmtree(self._temp_spool, ignore_errors=True)
