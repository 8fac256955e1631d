"""``triscope run``: drive the configured collectors, hand their rows to the writer, run exporters.

Each collector runs in its own thread (a slow scrape does not delay a 10 Hz sampler): it calls
``collect()`` every ``interval_s`` and submits the rows to the :class:`~triscope.writer.Writer`.
SIGTERM or SIGINT stops the loops, takes a last ``collect()``, closes collectors and exporters,
and closes the writer, which writes what the store takes and leaves the rest in the spool.

Collectors and exporters are named in ``[run]`` by a registry key (:data:`COLLECTORS`,
:data:`EXPORTERS`) or by ``"package.module:factory"``; a factory takes the whole config and
returns an object with ``start()``/``close()`` (collectors also ``name``, ``interval_s``,
``collect()``, see :class:`triscope.collector.Collector`). Exporters may also take the store
opener as a second argument (``factory(config, open_store)``) and a third, a zero-argument
callable returning the pipeline's live counters (``factory(config, open_store, stats)``, see
:meth:`Daemon.stats`).
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import logging
import signal
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from triscope.errors import ConfigError, InputError, TriscopeError
from triscope.writer import Writer

log = logging.getLogger(__name__)

COLLECTORS: dict[str, str] = {
    "blockio": "triscope.collectors.blockio:bpftrace_factory",  # diskstats fallback when not root
    "blockio_bpftrace": "triscope.collectors.blockio:bpftrace_factory",
    "blockio_diskstats": "triscope.collectors.blockio:diskstats_factory",
    "blockio_ebpf_exporter": "triscope.collectors.blockio:ebpf_exporter_factory",
    "serving_metrics": "triscope.collectors.serving_metrics:factory",
    "otlp": "triscope.collectors.otlp_receiver:factory",
    "nvml": "triscope.collectors.nvml:factory",
    "dcgm": "triscope.collectors.dcgm:factory",
    "torch_allocator": "triscope.collectors.torch_allocator:factory",
}
"""Collector names usable in ``[run] collectors``; any ``module:callable`` works too."""

EXPORTERS: dict[str, str] = {
    "prometheus": "triscope.exporters.prometheus:factory",
    "weights_feed": "triscope.exporters.feed:factory",
}
"""Exporter names usable in ``[run] exporters``; any ``module:callable`` works too."""

DEFAULTS: dict[str, Any] = {"collectors": [], "exporters": [], "status_interval_s": 30.0,
                            "shutdown_timeout_s": 10.0}


def resolve(spec: str, registry: Mapping[str, str], kind: str) -> Callable[..., Any]:
    """The factory named by a registry key or ``module:callable``; ConfigError (one line) otherwise."""
    target = registry.get(spec, spec)
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"unknown {kind} {spec!r}; use one of {', '.join(sorted(registry)) or '(none)'} "
                          "or 'package.module:factory'")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        raise ConfigError(f"{kind} {spec!r}: module {exc.name} is not available") from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise ConfigError(f"{kind} {spec!r}: {module_name} has no factory {attr!r}")
    return factory


class CollectorLoop(threading.Thread):
    """Calls one collector every ``interval_s`` and submits its rows."""

    def __init__(self, collector: Any, writer: Writer, stop: threading.Event) -> None:
        super().__init__(name=f"collect-{collector.name}", daemon=True)
        self.collector, self.writer, self.stop = collector, writer, stop
        self.interval_s = max(0.001, float(getattr(collector, "interval_s", 1.0)))
        self.rows = 0
        self.rows_by_table: dict[str, int] = {}
        self.errors = 0
        self.last_error = ""

    def _error(self, message: str) -> None:
        self.errors += 1
        if message != self.last_error:  # one line per new problem, not one per tick
            log.warning("collector %s: %s", self.collector.name, message)
        self.last_error = message

    def collect_once(self) -> int:
        """One collect() and submit; errors are logged and counted, never raised."""
        try:
            out = self.collector.collect()
        except Exception as exc:  # noqa: BLE001 - a failing source must not stop the daemon
            self._error(f"collect failed: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}")
            return 0
        n = 0
        for table, columns in (out or {}).items():
            try:
                k = self.writer.submit(table, columns)
            except InputError as exc:
                self._error(str(exc))
                continue
            n += k
            self.rows_by_table[table] = self.rows_by_table.get(table, 0) + k
        self.rows += n
        return n

    def run(self) -> None:
        deadline = time.monotonic()
        while not self.stop.is_set():
            self.collect_once()
            deadline += self.interval_s
            now = time.monotonic()
            if deadline < now:  # overran: skip the missed ticks rather than bursting
                deadline = now + self.interval_s
            self.stop.wait(deadline - now)


def _call_factory(factory: Callable[..., Any], config: dict[str, Any], opener: Callable[[], Any],
                  stats: Callable[[], dict[str, Any]]) -> Any:
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        params = {}
    if len(params) >= 3:
        return factory(config, opener, stats)
    return factory(config, opener) if len(params) >= 2 else factory(config)


class Daemon:
    """The collectors, writer and exporters of one ``triscope run``."""

    def __init__(self, config: dict[str, Any], store_opener: Callable[[], Any] | None = None) -> None:
        from triscope.store import open_store

        self.config = config
        self.run_cfg = {**DEFAULTS, **(config.get("run") or {})}
        self.opener = store_opener or (lambda: open_store(config))
        names = self.run_cfg["collectors"]
        if isinstance(names, str) or not isinstance(names, list):
            raise ConfigError("[run] collectors must be a list of names")
        if not names:
            raise ConfigError(f"[run] collectors is empty; name some of: {', '.join(sorted(COLLECTORS))}")
        self.collector_factories = [(n, resolve(n, COLLECTORS, "collector")) for n in names]
        self.exporter_factories = [(n, resolve(n, EXPORTERS, "exporter")) for n in self.run_cfg["exporters"]]
        self.stop = threading.Event()
        self.writer: Writer | None = None
        self.loops: list[CollectorLoop] = []
        self.exporters: list[Any] = []
        self.started: list[str] = []
        self.failed: dict[str, str] = {}

    def start(self) -> None:
        """Open the writer, start collectors (a failing one is reported and skipped) and exporters."""
        from triscope.errors import StoreError

        opened: list[Any] = []
        try:  # open now so a bad [store] section fails fast; an unreachable server is retried later
            opened.append(self.opener())
        except StoreError as exc:
            log.warning("store not reachable at start (%s); spooling until it is", exc)

        def connect() -> Any:
            return opened.pop() if opened else self.opener()

        self.writer = Writer.from_config(self.config, connect)
        self.writer.start()
        for spec, factory in self.collector_factories:
            try:
                collector = factory(self.config)
                collector.start()
            except TriscopeError as exc:
                self.failed[spec] = str(exc)
                log.error("collector %s not started: %s", spec, exc)
                continue
            loop = CollectorLoop(collector, self.writer, self.stop)
            self.loops.append(loop)
            self.started.append(collector.name)
            loop.start()
        if not self.loops:
            self.writer.close(timeout_s=1.0)
            raise ConfigError("no collector could start: " + "; ".join(f"{k}: {v}" for k, v in self.failed.items()))
        for _spec, factory in self.exporter_factories:
            exporter = _call_factory(factory, self.config, self.opener, self.stats)
            exporter.start()
            self.exporters.append(exporter)
        log.info("triscope run: collectors %s; spool %s", ", ".join(self.started), self.writer.spool.dir)

    def stats(self) -> dict[str, Any]:
        """Live counters: ``writer`` (:meth:`Writer.snapshot`), per-collector rows/errors, not started."""
        return {"writer": self.writer.snapshot() if self.writer is not None else {},
                "collectors": {loop.collector.name: {"rows": loop.rows, "errors": loop.errors,
                                                     "tables": dict(loop.rows_by_table)} for loop in self.loops},
                "not_started": dict(self.failed)}

    def wait(self) -> None:
        """Block until :meth:`request_stop` (a signal), logging writer status periodically."""
        every = float(self.run_cfg["status_interval_s"])
        while not self.stop.wait(every if every > 0 else None):
            assert self.writer is not None
            s = self.writer.snapshot()
            log.info("status: written %d, pending %d, dropped %d, rejected %d, store %s",
                     s["rows_written"], s["rows_pending"], s["rows_dropped"], s["rows_rejected"],
                     "up" if s["store_up"] else f"down ({s['last_error']})")

    def request_stop(self, *_: object) -> None:
        self.stop.set()

    def shutdown(self) -> dict[str, Any]:
        """Stop loops, take a last sample, close everything; returns the run summary."""
        self.stop.set()
        for loop in self.loops:
            loop.join(timeout=float(self.run_cfg["shutdown_timeout_s"]))
        for loop in self.loops:
            loop.collect_once()
            with contextlib.suppress(Exception):
                loop.collector.close()
            if getattr(loop.collector, "buffer", None) is not None:  # receivers: what arrived while closing
                loop.collect_once()
        for exporter in self.exporters:
            with contextlib.suppress(Exception):
                exporter.close()
        assert self.writer is not None
        complete = self.writer.close(timeout_s=float(self.run_cfg["shutdown_timeout_s"]))
        return {"collectors": {loop.collector.name: {"rows": loop.rows, "errors": loop.errors,
                                                     "last_error": loop.last_error} for loop in self.loops},
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
