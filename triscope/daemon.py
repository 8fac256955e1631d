"""``triscope run``: drive the configured collectors, hand their rows to the writer, run exporters.

Each collector runs in its own thread (a slow scrape does not delay a 10 Hz sampler): it calls
``collect()`` every ``interval_s`` and submits the rows to the :class:`~triscope.writer.Writer`.
SIGTERM or SIGINT stops the loops, takes a last ``collect()``, closes collectors and exporters,
and closes the writer, which writes what the store takes and leaves the rest in the spool.

Components are named in ``[run]`` by a registry key (:mod:`triscope.registry`) or by
``"package.module:create"``; every factory is ``create(config, context)`` (:mod:`triscope.component`).
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from triscope.collector_loop import CollectorLoop, RowCounter
from triscope.component import (
    Collector,
    ComponentConfig,
    Context,
    Exporter,
    Factory,
    ReportsStats,
    Rows,
    RowsAfterClose,
    non_negative,
    positive,
)
from triscope.conn_budget import BUDGET, raise_fd_limit
from triscope.errors import ConfigError, SpoolUnavailable, StoreError, TriscopeError
from triscope.registry import COLLECTORS, EXPORTERS, resolve
from triscope.schema import Table
from triscope.store.base import Store
from triscope.writer import Writer, WriterConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunConfig(ComponentConfig):
    """``[run]``: which components to run and how the daemon reports and stops."""

    section = "run"
    collectors: list[str] = field(default_factory=list)
    exporters: list[str] = field(default_factory=list)
    status_interval_s: float = 30.0
    shutdown_timeout_s: float = 10.0
    max_pending_rows: int = 200_000
    """Per collector: rows kept in memory while the writer's spool cannot take them."""

    def validate(self, where: str) -> None:
        non_negative(where, status_interval_s=self.status_interval_s)
        positive(where, shutdown_timeout_s=self.shutdown_timeout_s, max_pending_rows=self.max_pending_rows)


def _build(spec: str, factory: Factory, config: dict[str, Any], context: Context, kind: type) -> Any:
    """``factory(config, context)``, checked to return a ``kind`` (Collector or Exporter)."""
    try:
        component = factory(config, context)
    except TypeError as exc:
        raise ConfigError(f"{spec!r} is not a triscope component factory create(config, context): {exc}") from None
    if not isinstance(component, kind):
        raise ConfigError(f"{spec!r} did not return a {kind.__name__} (got {type(component).__name__})")
    return component


class Daemon:
    """The collectors, writer and exporters of one ``triscope run``."""

    def __init__(self, config: dict[str, Any], store_opener: Callable[[], Store] | None = None) -> None:
        from triscope.store import StoreConfig, open_store

        self.config = config
        self.run_cfg = RunConfig.from_config(config)
        StoreConfig.from_config(config)  # checked here so no mistake waits for the first insert
        self.writer_cfg = WriterConfig.from_config(config)
        from triscope.query_endpoint import QueryConfig

        self.query_cfg = QueryConfig.from_config(config)  # checked here, before anything is opened
        self.opener: Callable[[], Store] = store_opener or (lambda: open_store(config))
        if not self.run_cfg.collectors:
            raise ConfigError(f"[run] collectors is empty; name some of: {', '.join(sorted(COLLECTORS))}")
        self.collector_factories: list[tuple[str, Factory]] = [
            (n, resolve(n, COLLECTORS, "collector")) for n in self.run_cfg.collectors]
        self.exporter_factories: list[tuple[str, Factory]] = [
            (n, resolve(n, EXPORTERS, "exporter")) for n in self.run_cfg.exporters]
        self.stop = threading.Event()
        self.writer: Writer | None = None
        self.loops: list[CollectorLoop] = []
        self.exporters: list[Exporter] = []
        self.started: list[str] = []
        self.failed: dict[str, str] = {}
        self.query_endpoint: Any = None
        self.query_store: Store | None = None

    def _submit(self, table: Table, columns: Rows) -> int:
        if self.writer is None:
            raise SpoolUnavailable("the writer is not open yet")
        return self.writer.submit(table, columns)

    def start(self) -> None:
        """Build every component (a config mistake raises ConfigError before anything is opened),
        open the writer, start collectors (a failing one is reported and skipped) and exporters."""
        limit = raise_fd_limit()
        log.debug("file descriptors: %d; server connections at most %d", limit, BUDGET.limit)
        context = Context(open_store=self.opener, submit=self._submit, stats=self.stats)
        counters = {spec: RowCounter(self._submit) for spec, _ in self.collector_factories}
        collectors = [(spec, _build(spec, factory, self.config, replace(context, submit=counters[spec].submit),
                                    Collector))
                      for spec, factory in self.collector_factories]
        exporters = [_build(spec, factory, self.config, context, Exporter)
                     for spec, factory in self.exporter_factories]
        opened: list[Store] = []
        try:  # open now so a bad [store] section fails fast; an unreachable server is retried later
            opened.append(self.opener())
        except StoreError as exc:
            log.warning("store not reachable at start (%s); spooling until it is", exc)

        def connect() -> Store:
            return opened.pop() if opened else self.opener()

        self.writer = Writer.from_config(self.config, connect)
        self.writer.start()
        for spec, collector in collectors:
            try:
                collector.start()
            except TriscopeError as exc:
                self.failed[spec] = str(exc)
                log.error("collector %s not started: %s", spec, exc)
                continue
            loop = CollectorLoop(collector, self.writer, self.stop, self.run_cfg.max_pending_rows,
                                 counter=counters[spec])
            self.loops.append(loop)
            self.started.append(collector.name)
            loop.start()
        if not self.loops:
            self.writer.close(timeout_s=1.0)
            raise ConfigError("no collector could start: " + "; ".join(f"{k}: {v}" for k, v in self.failed.items()))
        for exporter in exporters:
            exporter.start()
            self.exporters.append(exporter)
        self._start_query_endpoint()
        log.info("triscope run: collectors %s; spool %s", ", ".join(self.started), self.writer.spool.dir)

    def _start_query_endpoint(self) -> None:
        """Serve the embedded store while this process holds it (``[query]``, docs/query.md)."""
        from triscope.query_endpoint import QueryEndpoint
        from triscope.store import StoreConfig

        cfg = self.query_cfg
        if not cfg.enabled or cfg.port == -1 or StoreConfig.from_config(self.config).backend != "embedded":
            return
        try:
            store = self.opener()
        except StoreError as exc:
            log.warning("query endpoint not started: %s", exc)
            return
        self.query_store = store
        try:
            self.query_endpoint = QueryEndpoint(store, cfg).start()
        except ConfigError as exc:  # collecting matters more than answering: say so, go on
            log.warning("query endpoint not started: %s; set [query] port (0 = any free one)", exc)

    def stats(self) -> dict[str, Any]:
        """Live counters: ``writer`` (:meth:`Writer.snapshot`), per-collector rows/errors, not started, and
        those of every exporter with a ``stats()`` (the per-request picker's), by its ``[run] exporters`` name."""
        return {"writer": self.writer.snapshot() if self.writer is not None else {},
                "connections": BUDGET.snapshot(),
                "collectors": {loop.collector.name: loop.counters() for loop in self.loops},
                "not_started": dict(self.failed),
                # started exporters are a prefix of the configured ones, in their order
                "exporters": {spec: dict(exporter.stats())
                              for (spec, _), exporter in zip(self.exporter_factories, self.exporters, strict=False)
                              if isinstance(exporter, ReportsStats)}}

    def wait(self) -> None:
        """Block until :meth:`request_stop` (a signal), logging writer status periodically."""
        every = self.run_cfg.status_interval_s
        while not self.stop.wait(every if every > 0 else None):
            log.info("%s", self.status_line())

    def status_line(self) -> str:
        """The periodic status: rows written, pending, dropped, rejected, store and spool state."""
        assert self.writer is not None
        s = self.writer.snapshot()
        errors = sum(loop.errors for loop in self.loops)
        waiting = sum(loop.pending_rows for loop in self.loops)
        dropped = s["rows_dropped"] + sum(loop.rows_dropped for loop in self.loops)
        spool = (f"failing ({s['spool_error']})" if s["spool_error"]
                 else f"refusing rows ({self._held_error()})" if waiting else "ok")
        store = "up" if s["store_up"] else f"down ({s['last_error']})"
        return (f"status: written {s['rows_written']}, pending {s['rows_pending']}, dropped {dropped}, "
                f"rejected {s['rows_rejected']}, store {store}, spool {spool}, collector errors {errors}, "
                f"rows waiting for the spool {waiting}")

    def _held_error(self) -> str:
        """The last error of a collector holding rows the spool refused."""
        return next((loop.last_error for loop in self.loops if loop.pending_rows and loop.last_error), "unknown")

    def request_stop(self, *_: object) -> None:
        self.stop.set()

    def shutdown(self) -> dict[str, Any]:
        """Stop loops, take a last sample, close everything; returns the run summary."""
        self.stop.set()
        for loop in self.loops:
            loop.join(timeout=self.run_cfg.shutdown_timeout_s)
        for loop in self.loops:
            loop.collect_once(final=True)
            with contextlib.suppress(Exception):
                loop.collector.close()
            if isinstance(loop.collector, RowsAfterClose) and loop.collector.ROWS_AFTER_CLOSE:
                loop.collect_once(final=True)
        for exporter in self.exporters:
            with contextlib.suppress(Exception):
                exporter.close()
        if self.query_endpoint is not None:
            self.query_endpoint.close()
            self.query_endpoint = None
        if self.query_store is not None:
            with contextlib.suppress(Exception):
                self.query_store.close()
            self.query_store = None
        assert self.writer is not None
        complete = self.writer.close(timeout_s=self.run_cfg.shutdown_timeout_s)
        return {"collectors": {loop.collector.name: {"rows": loop.rows, "errors": loop.errors,
                                                     "last_error": loop.last_error} for loop in self.loops},
                "lost": {loop.collector.name: loop.rows_lost for loop in self.loops if loop.rows_lost},
                "not_started": self.failed, "writer": self.writer.snapshot(), "flushed": complete}


def run(config: dict[str, Any], install_signals: bool = True) -> dict[str, Any]:
    """Run until SIGTERM/SIGINT; returns the summary of :meth:`Daemon.shutdown`."""
    daemon = Daemon(config)
    if install_signals:
        signal.signal(signal.SIGTERM, daemon.request_stop)
        signal.signal(signal.SIGINT, daemon.request_stop)
    daemon.start()
    try:
        daemon.wait()
    finally:
        summary = daemon.shutdown()
    return summary
