"""The ``/metrics`` HTTP endpoint: a bounded WSGI server around the collector, and its factory."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

from prometheus_client import CollectorRegistry, make_wsgi_app

from triscope.component import Context
from triscope.errors import ConfigError
from triscope.exporters.prometheus.collector import TriscopeCollector
from triscope.exporters.prometheus.config import PrometheusConfig
from triscope.httpserver import BoundedRequestMixIn, BoundedServerMixIn, serve_in_thread, stop

log = logging.getLogger(__name__)


class _Server(BoundedServerMixIn, WSGIServer):
    name = "prometheus"


class _QuietHandler(BoundedRequestMixIn, WSGIRequestHandler):  # a scrape in progress is not a slow client
    def log_message(self, format: str, *args: Any) -> None:
        log.debug("prometheus exporter: " + format, *args)


def _only_metrics(app: Callable[..., Any]) -> Callable[..., Any]:
    """GET/HEAD /metrics (and /) go to ``app``; anything else is 404/405 with no body read."""
    def wrapped(environ: dict[str, Any], start_response: Callable[..., Any]) -> Any:
        if environ.get("PATH_INFO", "/") not in ("/metrics", "/"):
            start_response("404 Not Found", [("Content-Type", "text/plain")])
            return [b"not found; metrics are at /metrics\n"]
        if environ.get("REQUEST_METHOD") not in ("GET", "HEAD"):
            start_response("405 Method Not Allowed", [("Content-Type", "text/plain"), ("Allow", "GET, HEAD")])
            return [b"method not allowed\n"]
        return app(environ, start_response)
    return wrapped


class PrometheusExporter:
    """The ``/metrics`` HTTP endpoint (an :class:`triscope.component.Exporter`).

    ``config`` is the whole configuration (``[prometheus]``, and the sections the stall query
    reads); ``context`` gives the store opener and the daemon's live counters.
    """

    def __init__(self, config: Mapping[str, Any], context: Context) -> None:
        self.cfg = PrometheusConfig.from_config(config)
        self.collector = TriscopeCollector(config, self.cfg, context.open_store, context.stats)
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self.collector)
        self._server: _Server | None = None
        self._threads: list[threading.Thread] = []
        self._stop = threading.Event()

    @property
    def port(self) -> int:
        """The bound port (useful with ``port = 0``)."""
        assert self._server is not None, "start() first"
        return int(self._server.server_address[1])

    @property
    def url(self) -> str:
        host = self.cfg.listen
        return f"http://{'[' + host + ']' if ':' in host else host}:{self.port}/metrics"

    def start(self) -> None:
        """Bind ``listen:port`` and serve; ConfigError (one line) when the address is unusable."""
        try:
            self._server = _Server((self.cfg.listen, self.cfg.port), _QuietHandler,
                                   max_connections=self.cfg.max_connections)
        except OSError as exc:
            raise ConfigError(f"[prometheus] cannot listen on {self.cfg.listen}:{self.cfg.port}: "
                              f"{exc.strerror or exc}") from None
        self._server.set_app(_only_metrics(make_wsgi_app(self.registry)))
        poll = threading.Thread(target=self._poll, name="prometheus-poll", daemon=True)
        poll.start()
        self._threads = [serve_in_thread(self._server, "prometheus-http"), poll]
        log.info("prometheus exporter on %s", self.url)

    def _poll(self) -> None:
        while not self._stop.wait(self.cfg.poll_s):
            self.collector.observe()

    def close(self) -> None:
        """Stop serving and release the store; safe to call twice."""
        self._stop.set()
        if self._server is not None:
            stop(self._server, self._threads[0] if self._threads else None)
            self._server = None
        for t in self._threads:
            t.join(timeout=5)
        self._threads = []
        self.collector.close()


def create(config: dict[str, Any], context: Context) -> PrometheusExporter:
    """``triscope run`` entry point (``[run] exporters = ["prometheus"]``)."""
    return PrometheusExporter(config, context)
