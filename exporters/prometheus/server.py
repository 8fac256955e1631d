"""The ``/metrics`` HTTP endpoint: the collector served on the daemon's server kit, and its factory."""

from __future__ import annotations

import gzip
import logging
import threading
from collections.abc import Mapping
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder

from triscope.component import Context
from triscope.errors import ConfigError
from triscope.exporters.prometheus.collector import TriscopeCollector
from triscope.exporters.prometheus.config import PrometheusConfig
from triscope.loop_http import Answer, BlockingHttpConnection, BlockingHttpServer
from triscope.loop_server import DEFAULT_HEADER_TIMEOUT_S

log = logging.getLogger(__name__)

WORKERS = 2
"""Scrapes rendered at once (each may query the store when its cache has expired)."""


class _Server(BlockingHttpServer):
    """GET/HEAD ``/metrics`` (and ``/``) render the registry off the loop; anything else is 404/405."""

    thread_name = "prometheus-http"
    body_limit_key = "nothing: /metrics takes no body"
    max_body_bytes = 64 * 1024

    def __init__(self, registry: CollectorRegistry, bind: str, port: int, max_connections: int) -> None:
        self.registry = registry
        super().__init__(bind, port, max_connections, 0, DEFAULT_HEADER_TIMEOUT_S, workers=WORKERS)

    def handle(self, conn: BlockingHttpConnection, method: str, path: str, body: bytes) -> Answer:
        if path not in ("/metrics", "/"):
            return 404, "text/plain", b"not found; metrics are at /metrics\n", ()
        if method not in ("GET", "HEAD"):
            return 405, "text/plain", b"method not allowed\n", (("Allow", "GET, HEAD"),)
        encoder, ctype = choose_encoder(conn.headers.get("accept", ""))
        payload = encoder(self.registry)
        if "gzip" in conn.headers.get("accept-encoding", ""):
            return 200, ctype, gzip.compress(payload, 1), (("Content-Encoding", "gzip"),)
        return 200, ctype, payload, ()


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
        self._poll_thread: threading.Thread | None = None
        self._stop = threading.Event()

    @property
    def port(self) -> int:
        """The bound port (useful with ``port = 0``)."""
        assert self._server is not None, "start() first"
        return self._server.port

    @property
    def url(self) -> str:
        host = self.cfg.listen
        return f"http://{'[' + host + ']' if ':' in host else host}:{self.port}/metrics"

    def start(self) -> None:
        """Bind ``listen:port`` and serve; ConfigError (one line) when the address is unusable."""
        try:
            self._server = _Server(self.registry, self.cfg.listen, self.cfg.port, self.cfg.max_connections)
        except OSError as exc:
            raise ConfigError(f"[prometheus] cannot listen on {self.cfg.listen}:{self.cfg.port}: "
                              f"{exc.strerror or exc}") from None
        self._server.start()
        self._poll_thread = threading.Thread(target=self._poll, name="prometheus-poll", daemon=True)
        self._poll_thread.start()
        log.info("prometheus exporter on %s", self.url)

    def _poll(self) -> None:
        while not self._stop.wait(self.cfg.poll_s):
            self.collector.observe()

    def close(self) -> None:
        """Stop serving and release the store; safe to call twice."""
        self._stop.set()
        if self._server is not None:
            self._server.close()
            self._server = None
        if self._poll_thread is not None:
            self._poll_thread.join(timeout=5)
            self._poll_thread = None
        self.collector.close()


def create(config: dict[str, Any], context: Context) -> PrometheusExporter:
    """``triscope run`` entry point (``[run] exporters = ["prometheus"]``)."""
    return PrometheusExporter(config, context)
