"""The weight feed: a periodic engine update plus the HTTP and HAProxy-agent servers that publish it.

``WeightFeed(params, store=..., inputs_fn=...)`` runs :func:`~triscope.exporters.weights.compute_weights`
every ``interval_s`` on inputs read from the store (or returned by ``inputs_fn``) and serves:

* ``GET /v1/weights`` (JSON document of docs/weights.md), ``GET /metrics`` (Prometheus text),
  ``GET /healthz``;
* ``POST /v3/discovery:endpoints`` (Envoy REST EDS, :mod:`triscope.exporters.envoy_eds`) and
  ``GET /v1/traefik`` (Traefik HTTP provider, :mod:`triscope.exporters.traefik_provider`), both
  imported lazily: 503 with a one-line JSON error when the module is absent;
* the HAProxy agent-check port (:mod:`triscope.exporters.haproxy_agent`).

Servers bind ``[weights.feed] bind`` (127.0.0.1); request bodies over ``max_body_bytes`` get 413.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import logging
import threading
import time
from collections.abc import Callable, Sequence
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Any

from triscope.errors import ConfigError
from triscope.exporters import prometheus_text
from triscope.exporters._servers import BoundedThreadingMixIn
from triscope.exporters.haproxy_agent import AgentServer
from triscope.exporters.weights import (
    BackendInputs,
    EngineState,
    WeightParams,
    WeightsResult,
    compute_weights,
    read_inputs,
    with_address,
)

log = logging.getLogger(__name__)

JSON_TYPE = "application/json"
HISTORY_MAX_ROWS = 200_000
"""History rows kept in memory while the store refuses them; the oldest are dropped beyond this."""
InputsFn = Callable[[], Sequence[BackendInputs]]


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _json_error(message: str) -> bytes:
    return json.dumps({"error": message}).encode() + b"\n"


class WeightFeed:
    """Engine update loop + HTTP feed + HAProxy agent for one set of :class:`WeightParams`.

    ``store`` is a :class:`~triscope.store.base.Store` or a zero-argument callable opening one
    (``triscope run`` passes its opener); ``inputs_fn`` replaces the store reader entirely.
    ``port``/``agent_port``/``bind`` override ``params.feed``; a port of -1 turns that server off.
    """

    def __init__(self, params: WeightParams, store: Any = None, inputs_fn: InputsFn | None = None,
                 clock: Callable[[], float] = time.time, bind: str | None = None, port: int | None = None,
                 agent_port: int | None = None) -> None:
        if store is None and inputs_fn is None:
            raise ConfigError("weight feed needs a store or an inputs_fn")
        feed_cfg = dict(params.feed)
        self.params = params
        self.clock = clock
        self.bind = str(bind if bind is not None else feed_cfg.get("bind", "127.0.0.1"))
        self._port_cfg = int(port if port is not None else feed_cfg.get("port", 9470))
        self._agent_port_cfg = int(agent_port if agent_port is not None else feed_cfg.get("agent_port", 9471))
        self.max_body_bytes = int(feed_cfg.get("max_body_bytes", 1 << 20))
        if self.max_body_bytes < 0:
            raise ConfigError("[weights.feed] max_body_bytes must be >= 0")
        self.max_connections = int(feed_cfg.get("max_connections", 512))
        if self.max_connections < 1:
            raise ConfigError("[weights.feed] max_connections must be >= 1")
        self._store_arg = store
        self._store: Any = None
        self._owns_store = False
        self.inputs_fn = inputs_fn
        self._state: EngineState | None = None
        self._result: WeightsResult | None = None
        self._weights_body: bytes = b""
        self._lock = threading.Lock()
        self._update_lock = threading.Lock()
        self._stop = threading.Event()
        self._loop: threading.Thread | None = None
        self._http: HTTPServer | None = None
        self._http_thread: threading.Thread | None = None
        self._agent: AgentServer | None = None
        self.updates_total = 0
        self.update_errors_total = 0
        self.last_update = 0.0
        self.last_error = ""
        self._history: list[dict[str, Any]] = []
        self._history_flushed_at = 0.0
        self.history_rows_written = 0
        self.history_rows_dropped = 0

    # ------------------------------------------------------------------ engine

    @property
    def result(self) -> WeightsResult | None:
        """The latest engine result (None before the first successful update)."""
        return self._result

    @property
    def state(self) -> EngineState | None:
        return self._state

    def _inputs(self, now: float) -> list[BackendInputs]:
        if self.inputs_fn is not None:
            return list(self.inputs_fn())
        if self._store is None:
            arg = self._store_arg
            if callable(arg) and not hasattr(arg, "query"):
                self._store, self._owns_store = arg(), True
            else:
                self._store = arg
        return read_inputs(self._store, self.params, now)

    def update(self) -> WeightsResult:
        """Read inputs, run the engine once, publish the result; errors propagate (the loop logs them)."""
        with self._update_lock:
            inputs = [with_address(i, self.params) for i in self._inputs(self.clock())]
            now = self.clock()  # after the read: ages include the time the read took
            result, state = compute_weights(inputs, self._state, self.params, now)
            body = json.dumps(result.to_dict(), separators=(",", ":")).encode() + b"\n"
            with self._lock:
                self._result, self._state, self._weights_body = result, state, body
                self.updates_total += 1
                self.last_update = now
            if self._records_history():
                self._history.extend(history_rows(result))
                overflow = len(self._history) - HISTORY_MAX_ROWS
                if overflow > 0:
                    del self._history[:overflow]
                    self.history_rows_dropped += overflow
            return result

    def _records_history(self) -> bool:
        return bool(self.params.history) and self.inputs_fn is None

    def flush_history(self) -> int:
        """Write buffered ``weights_history`` rows to the store; returns the rows written."""
        if not self._history or self._store is None:
            return 0
        from triscope.schema import qualified

        with self._update_lock:
            rows, self._history = self._history, []
            columns = {k: [r[k] for r in rows] for k in rows[0]}
            try:
                self._store.insert(qualified(self._store, "weights_history"), columns)
            except Exception:
                self._history = rows + self._history  # retried at the next flush
                raise
            self.history_rows_written += len(rows)
            return len(rows)

    def inputs_age_seconds(self) -> float:
        """Age of the oldest backend input at the last update (NaN before one)."""
        result = self._result
        if result is None or not result.backends:
            return float("nan")
        return max(b.age_seconds for b in result.backends.values())

    def _run_loop(self) -> None:
        interval = self.params.interval_s
        deadline = time.monotonic()
        while True:
            deadline += interval
            now = time.monotonic()
            if deadline < now:
                deadline = now + interval
            if self._stop.wait(deadline - now):
                return
            self._safe_update()
            if self._records_history() and time.monotonic() - self._history_flushed_at >= self.params.history_flush_s:
                self._history_flushed_at = time.monotonic()
                self._safe_flush()

    def _safe_flush(self) -> None:
        try:
            self.flush_history()
        except Exception as exc:
            log.warning("weights history not written (%d rows buffered): %s", len(self._history), _one_line(exc))

    def _safe_update(self) -> None:
        try:
            self.update()
        except Exception as exc:
            self.update_errors_total += 1
            message = _one_line(exc)
            if message != self.last_error:
                log.warning("weights update failed: %s", message)
            self.last_error = message
        else:
            self.last_error = ""

    def healthy(self) -> bool:
        """True while the loop runs and the last update is younger than ``3 * interval_s + 5``."""
        running = self._loop is not None and self._loop.is_alive()
        return running and self.last_update > 0 and (
            self.clock() - self.last_update) < 3 * self.params.interval_s + 5.0

    # ------------------------------------------------------------------ servers

    @property
    def http_port(self) -> int:
        """Bound HTTP port (-1 when off or not started)."""
        return int(self._http.server_address[1]) if self._http is not None else -1

    @property
    def agent_port(self) -> int:
        """Bound HAProxy agent port (-1 when off or not started)."""
        return self._agent.port if self._agent is not None else -1

    @property
    def urls(self) -> dict[str, str]:
        """Endpoint URLs of the running feed."""
        out: dict[str, str] = {}
        if self._http is not None:
            base = f"http://{self.bind}:{self.http_port}"
            out.update({"weights": f"{base}/v1/weights", "metrics": f"{base}/metrics",
                        "envoy_eds": f"{base}/v3/discovery:endpoints", "traefik": f"{base}/v1/traefik",
                        "healthz": f"{base}/healthz"})
        if self._agent is not None:
            out["haproxy_agent"] = f"tcp://{self.bind}:{self.agent_port}"
        return out

    def start(self) -> WeightFeed:
        """First update (a failure is logged, not raised), then the servers and the update loop."""
        self._safe_update()
        try:
            if self._port_cfg >= 0:
                self._http = _make_http_server(self, self.bind, self._port_cfg, self.max_connections)
                self._http_thread = threading.Thread(target=self._http.serve_forever, kwargs={"poll_interval": 0.2},
                                                     name="triscope-feed-http", daemon=True)
                self._http_thread.start()
            if self._agent_port_cfg >= 0:
                inflight = {key: b.max_inflight for n, b in self.params.backends.items() if b.max_inflight > 0
                            for key in (n, b.address) if key}
                self._agent = AgentServer(lambda: self._result, self.bind, self._agent_port_cfg,
                                          max_connections=self.max_connections, max_inflight=inflight).start()
        except OSError as exc:
            self.close()
            raise ConfigError(f"weight feed cannot listen on {self.bind}: {_one_line(exc)}") from None
        self._stop.clear()
        self._loop = threading.Thread(target=self._run_loop, name="triscope-feed-update", daemon=True)
        self._loop.start()
        log.info("weight feed: %s", ", ".join(f"{k} {v}" for k, v in self.urls.items()))
        return self

    def close(self) -> None:
        """Stop the loop and both servers; idempotent."""
        self._stop.set()
        if self._loop is not None:
            self._loop.join(timeout=5.0)
            self._loop = None
        if self._records_history():
            self._safe_flush()
        if self._http is not None:
            if self._http_thread is not None:
                with contextlib.suppress(Exception):
                    self._http.shutdown()
                self._http_thread.join(timeout=2.0)
            self._http.server_close()
            self._http = None
            self._http_thread = None
        if self._agent is not None:
            self._agent.close()
            self._agent = None
        if self._owns_store and self._store is not None:
            with contextlib.suppress(Exception):
                self._store.close()
            self._store, self._owns_store = None, False

    def __enter__(self) -> WeightFeed:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ responses

    def weights_response(self) -> tuple[int, str, bytes]:
        with self._lock:
            body = self._weights_body
        if not body:
            return 503, JSON_TYPE, _json_error(f"no weights computed yet{': ' + self.last_error if self.last_error else ''}")
        return 200, JSON_TYPE, body

    def metrics_response(self) -> tuple[int, str, bytes]:
        body = prometheus_text.render_weights(self._result, self.updates_total, self.update_errors_total,
                                              self.last_update, self.inputs_age_seconds())
        return 200, prometheus_text.CONTENT_TYPE, body

    def _plugin(self, module: str, what: str) -> Any:
        name = f"triscope.exporters.{module}"
        try:
            return importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name in (name, f"exporters.{module}"):
                return None
            raise

    def envoy_response(self, body: bytes) -> tuple[int, str, bytes]:
        mod = self._plugin("envoy_eds", "Envoy EDS")
        if mod is None:
            return 503, JSON_TYPE, _json_error("Envoy EDS is not available: triscope.exporters.envoy_eds is absent")
        result = self._result
        if result is None:
            return 503, JSON_TYPE, _json_error("no weights computed yet")
        status, out = mod.eds_response(result, body, self.params)
        return int(status), JSON_TYPE, out

    def traefik_response(self) -> tuple[int, str, bytes]:
        mod = self._plugin("traefik_provider", "Traefik")
        if mod is None:
            return 503, JSON_TYPE, _json_error(
                "Traefik provider is not available: triscope.exporters.traefik_provider is absent")
        result = self._result
        if result is None:
            return 503, JSON_TYPE, _json_error("no weights computed yet")
        return 200, JSON_TYPE, json.dumps(mod.traefik_config(result, self.params), sort_keys=True).encode()

    def health_response(self) -> tuple[int, str, bytes]:
        if self.healthy():
            return 200, "text/plain; charset=utf-8", b"ok\n"
        why = self.last_error or "no recent update"
        return 503, "text/plain; charset=utf-8", f"unhealthy: {why}\n".encode()


def _ns_text(t: float) -> str:
    ns = int(round(t * 1e9))
    return f"{ns // 1_000_000_000}.{ns % 1_000_000_000:09d}"


def history_rows(result: WeightsResult) -> list[dict[str, Any]]:
    """``weights_history`` rows (one per backend) of one engine result."""
    ts = _ns_text(result.computed_at)
    rows = []
    for name, b in sorted(result.backends.items()):
        f = b.factors
        rows.append({"ts": ts, "backend": name, "weight": float(b.weight), "target": float(b.target),
                     "lb_weight": int(b.lb_weight), "state": b.state, "reasons": ",".join(b.reasons),
                     "factor_memory": float(f.get("memory", 1.0)), "factor_kv_cache": float(f.get("kv_cache", 1.0)),
                     "factor_load": float(f.get("load", 1.0)), "factor_latency": float(f.get("latency", 1.0)),
                     "memory_used_ratio": float(b.inputs.memory_used_ratio),
                     "kv_cache_usage_ratio": float(b.inputs.kv_cache_usage_ratio), "qps": float(b.inputs.qps),
                     "input_age_seconds": float(b.age_seconds), "stale": int(result.stale),
                     "version": int(result.version)})
    return rows


def _make_http_server(feed: WeightFeed, bind: str, port: int, max_connections: int) -> HTTPServer:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        server_version = "triscope-feed"
        timeout = 10.0
        disable_nagle_algorithm = True  # headers and body are separate writes: no 40 ms delayed-ACK stall

        def log_request(self, code: int | str = "-", size: int | str = "-") -> None:
            pass  # per-request access logs cost more than the request itself at feed rates

        def log_message(self, format: str, *args: Any) -> None:
            log.debug("%s " + format, self.address_string(), *args)

        def _send(self, status: int, ctype: str, body: bytes, close: bool = False) -> None:
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            if close:
                self.send_header("Connection", "close")
                self.close_connection = True
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def _body(self) -> bytes | None:
            """The request body, or None after an error response (411/413/400)."""
            raw = self.headers.get("Content-Length")
            if self.headers.get("Transfer-Encoding", "").lower() not in ("", "identity"):
                self._send(411, JSON_TYPE, _json_error("chunked bodies are not accepted; send Content-Length"),
                           close=True)
                return None
            if raw is None:
                return b""
            try:
                length = int(raw)
                if length < 0:
                    raise ValueError
            except ValueError:
                self._send(400, JSON_TYPE, _json_error(f"bad Content-Length {raw!r}"), close=True)
                return None
            if length > feed.max_body_bytes:
                self._send(413, JSON_TYPE, _json_error(
                    f"request body of {length} bytes exceeds max_body_bytes {feed.max_body_bytes}"), close=True)
                return None
            return self.rfile.read(length) if length else b""

        def _route(self, method: str) -> None:
            body = self._body()
            if body is None:
                return
            path = self.path.split("?", 1)[0]
            try:
                if method == "GET" and path == "/v1/weights":
                    out = feed.weights_response()
                elif method == "GET" and path == "/metrics":
                    out = feed.metrics_response()
                elif method == "GET" and path == "/healthz":
                    out = feed.health_response()
                elif method == "GET" and path == "/v1/traefik":
                    out = feed.traefik_response()
                elif method == "POST" and path == "/v3/discovery:endpoints":
                    out = feed.envoy_response(body)
                elif path in ("/v1/weights", "/metrics", "/healthz", "/v1/traefik", "/v3/discovery:endpoints"):
                    out = (405, JSON_TYPE, _json_error(f"{method} not allowed on {path}"))
                else:
                    out = (404, JSON_TYPE, _json_error(f"no such endpoint {path}"))
            except Exception as exc:
                log.warning("feed %s %s failed: %s", method, path, _one_line(exc))
                out = (500, JSON_TYPE, _json_error(_one_line(exc)))
            self._send(*out)

        def do_GET(self) -> None:
            self._route("GET")

        def do_HEAD(self) -> None:
            self._route("GET")

        def do_POST(self) -> None:
            self._route("POST")

    class Server(BoundedThreadingMixIn, HTTPServer):
        allow_reuse_address = True
        request_queue_size = 128

    Server.max_connections = max_connections
    return Server((bind, port), Handler)


def factory(config: dict[str, Any], store: Any = None) -> WeightFeed:
    """Exporter for ``triscope run``: a :class:`WeightFeed` over ``[weights]`` reading ``store``
    (a Store or an opener; ``triscope run`` passes its opener)."""
    if store is None:
        from triscope.store import open_store

        def store() -> Any:
            return open_store(config)

    return WeightFeed(WeightParams.from_config(config), store=store)


__all__ = ["WeightFeed", "factory"]
