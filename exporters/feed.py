"""The weight feed: a periodic engine update plus the HTTP and HAProxy-agent servers that publish it.

``WeightFeed(params, store=..., inputs_fn=..., submit=...)`` runs
:func:`~triscope.analyzers.routing.compute_weights` every ``interval_s`` on inputs read from the
store (or returned by ``inputs_fn``), hands ``weights_history`` rows to ``submit`` (the writer)
and serves ``GET /v1/weights``, ``GET /metrics``, ``GET /healthz``, every LB format of
:mod:`triscope.exporters.formats` and the HAProxy agent port (:mod:`triscope.exporters.haproxy_agent`).
Servers bind ``[weights.feed] bind`` (127.0.0.1).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from triscope.analyzers.routing import (
    BackendInputs,
    EngineState,
    WeightParams,
    WeightsResult,
    compute_weights,
    forget,
    read_inputs,
    with_address,
)
from triscope.component import Context, Submit
from triscope.errors import ConfigError
from triscope.exporters import prometheus_text
from triscope.exporters.feed_history import History
from triscope.exporters.feed_http import json_error, one_line
from triscope.exporters.feed_process import FeedProcess, agent_table
from triscope.exporters.feed_server import FeedHTTPServer
from triscope.exporters.formats import FORMATS, WEIGHTS_PATH, polled_paths, renderer
from triscope.exporters.haproxy_agent import AgentServer

log = logging.getLogger(__name__)

JSON_TYPE = "application/json"
InputsFn = Callable[[], Sequence[BackendInputs]]
Response = tuple[int, str, bytes]
MAX_UNKNOWN_REMEMBERED = 10_000


class WeightFeed:
    """Engine update loop + HTTP feed + HAProxy agent for one set of :class:`WeightParams`.

    ``store`` is a :class:`~triscope.store.base.Store` or a zero-argument callable opening one
    (``triscope run`` passes its opener); ``inputs_fn`` replaces the store reader entirely.
    ``submit`` takes the history rows (updates read from a store, ``[weights] history = true``).
    ``port``/``agent_port``/``bind`` override ``params.feed``; a port of -1 turns that server off.
    """

    def __init__(self, params: WeightParams, store: Any = None, inputs_fn: InputsFn | None = None,
                 clock: Callable[[], float] = time.time, bind: str | None = None, port: int | None = None,
                 agent_port: int | None = None, submit: Submit | None = None) -> None:
        if store is None and inputs_fn is None:
            raise ConfigError("weight feed needs a store or an inputs_fn")
        self.params = params
        self.clock = clock
        self.bind = bind if bind is not None else params.feed.bind
        self._port_cfg = port if port is not None else params.feed.port
        self._agent_port_cfg = agent_port if agent_port is not None else params.feed.agent_port
        self.max_body_bytes = params.feed.max_body_bytes
        self.max_connections = params.feed.max_connections
        self._store_arg = store
        self._store: Any = None
        self._owns_store = False
        self.inputs_fn = inputs_fn
        self.history = History(submit) if submit is not None else None
        """Where the history rows of each update go (None: nowhere)."""
        self._state: EngineState | None = None
        self._result: WeightsResult | None = None
        self._weights_body: bytes = b""
        self._lock = threading.Lock()
        self._update_lock = threading.Lock()
        self._stop = threading.Event()
        self._loop: threading.Thread | None = None
        self._http: FeedHTTPServer | None = None
        self._agent: AgentServer | None = None
        self._process: FeedProcess | None = None
        self._max_inflight = {key: b.max_inflight for n, b in params.backends.items() if b.max_inflight > 0
                              for key in (n, b.address) if key}
        self.updates_total = 0
        self.update_errors_total = 0
        self.last_update = 0.0
        self.last_error = ""
        self._unknown_seen: set[str] = set()
        self.fallback = False
        """True while the published result is the equal-weights fallback of failing updates."""

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
            self._publish(result, state)
            with self._lock:
                self._count_unknown(result.unknown_backends)
                self.updates_total += 1
                self.last_update = now
                self.fallback = False
            if self.history is not None and self.records_history():
                self.history.record(result)
            return result

    def _count_unknown(self, names: Sequence[str]) -> None:
        """Remember names seen only in spans (bounded: a flood of random names cannot grow it)."""
        for name in names:
            if name not in self._unknown_seen and len(self._unknown_seen) < MAX_UNKNOWN_REMEMBERED:
                self._unknown_seen.add(name)
                log.info("weight feed: %s is seen only in request spans (not configured, no scrape): not published",
                         name)

    @property
    def unknown_backends_seen_total(self) -> int:
        return len(self._unknown_seen)

    def _publish(self, result: WeightsResult, state: EngineState) -> None:
        body = json.dumps(result.to_dict(), separators=(",", ":")).encode() + b"\n"
        with self._lock:
            self._result, self._state, self._weights_body = result, state, body
        if self._process is not None:
            self._process.publish(agent_table(result, self._max_inflight), self._polled_responses())

    def _polled_responses(self) -> dict[tuple[str, str], tuple[bytes, bytes]]:
        """The encoded answers of the routes load balancers poll (:func:`~triscope.exporters.formats.polled_paths`),
        for the serving process's table; it passes other requests on."""
        if self._http is None:
            return {}
        http = self._http
        return {("GET", path): (http.response("GET", path, b"", False), http.response("GET", path, b"", True))
                for path in polled_paths()}

    def _fall_back(self) -> None:
        """After a failed update: once the last good result is older than ``stale_after_s`` (or there
        is none), publish equal weights marked stale over every backend known (configured or seen),
        rather than freezing old weights; with none known, keep answering 503 (an LB keeps what it
        has) instead of an empty host list."""
        now = self.clock()
        if self._result is not None and not self.fallback and now - self.last_update <= self.params.stale_after_s:
            return
        with self._update_lock:
            configured = [with_address(BackendInputs(name), self.params) for name in self.params.backends]
            result, state = compute_weights(configured, self._state, self.params, now)
            if not result.backends:
                return
            self._publish(result, state)
            self.fallback = True

    def forget(self, names: Sequence[str] | None = None) -> tuple[str, ...]:
        """Stop publishing the named backends (default: every absent one); returns the names removed.
        A backend that reports again comes back as new."""
        with self._update_lock:
            if self._state is None:
                return ()
            state, removed = forget(self._state, names)
            self._state = state
        if removed:
            log.info("weight feed: forgot %s", ", ".join(removed))
        return removed

    def records_history(self) -> bool:
        """True when updates hand ``weights_history`` rows to the writer."""
        return self.params.history and self.inputs_fn is None and self.history is not None

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
            self.step()

    def step(self) -> None:
        """One turn of the update loop: :meth:`update`; on a failure, count it, log it once and fall
        back to equal weights marked stale when the last good result is too old."""
        try:
            self.update()
        except Exception as exc:
            self.update_errors_total += 1
            message = one_line(exc)
            if message != self.last_error:
                log.warning("weights update failed: %s", message)
            self.last_error = message
            try:
                self._fall_back()
            except Exception as fallback_exc:  # the engine on no inputs: never expected, never fatal
                log.warning("weights fallback failed: %s", one_line(fallback_exc))
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
        if self._process is not None:
            return self._process.port("http")
        return self._http.port if self._http is not None else -1

    @property
    def agent_port(self) -> int:
        """Bound HAProxy agent port (-1 when off or not started)."""
        if self._process is not None:
            return self._process.port("agent")
        return self._agent.port if self._agent is not None else -1

    @property
    def urls(self) -> dict[str, str]:
        """Endpoint URLs of the running feed."""
        out: dict[str, str] = {}
        if self.http_port >= 0:
            base = f"http://{self.bind}:{self.http_port}"
            out.update({"weights": f"{base}{WEIGHTS_PATH}", "metrics": f"{base}/metrics"})
            out.update({name: f"{base}{fmt.path}" for name, fmt in FORMATS.items()})
            out["healthz"] = f"{base}/healthz"
        if self.agent_port >= 0:
            out["haproxy_agent"] = f"tcp://{self.bind}:{self.agent_port}"
        return out

    def start(self) -> WeightFeed:
        """First update (a failure is logged, not raised), then the servers and the update loop."""
        self.step()
        feed = self.params.feed
        try:
            if feed.serve_process and max(self._port_cfg, self._agent_port_cfg) >= 0:
                self._start_process()
            else:
                if self._port_cfg >= 0:
                    self._http = FeedHTTPServer(self, self.bind, self._port_cfg, self.max_connections,
                                                feed.max_connections_per_client, feed.header_timeout_s).start()
                if self._agent_port_cfg >= 0:
                    self._agent = AgentServer(lambda: self._result, self.bind, self._agent_port_cfg,
                                              max_connections=self.max_connections, max_inflight=self._max_inflight,
                                              max_per_client=feed.max_connections_per_client).start()
        except OSError as exc:
            self.close()
            raise ConfigError(f"weight feed cannot listen on {self.bind}: {one_line(exc)}") from None
        self._stop.clear()
        self._loop = threading.Thread(target=self._run_loop, name="triscope-feed-update", daemon=True)
        self._loop.start()
        log.info("weight feed: %s", ", ".join(f"{k} {v}" for k, v in self.urls.items()))
        return self

    def _start_process(self) -> None:
        """The ports in a serving process; the HTTP routes it passes on reach this feed on loopback."""
        feed = self.params.feed
        if self._port_cfg >= 0:
            self._http = FeedHTTPServer(self, "127.0.0.1", 0, self.max_connections, self.max_connections,
                                        feed.header_timeout_s).start()
        process = FeedProcess(self.bind, self._agent_port_cfg if self._agent_port_cfg >= 0 else None,
                              self._port_cfg if self._port_cfg >= 0 else None, self.max_connections,
                              feed.max_connections_per_client, self._http.port if self._http is not None else -1,
                              self.max_body_bytes, feed.header_timeout_s)
        self._process = process.start(agent_table(self._result, self._max_inflight), self._polled_responses())

    def close(self) -> None:
        """Stop the loop and both servers; idempotent."""
        self._stop.set()
        if self._loop is not None:
            self._loop.join(timeout=5.0)
            self._loop = None
        if self._process is not None:  # first: it passes requests on to the HTTP server below
            self._process.close()
            self._process = None
        if self._http is not None:
            self._http.close()
            self._http = None
        if self._agent is not None:
            self._agent.close()
            self._agent = None
        if self._owns_store and self._store is not None:
            try:
                self._store.close()
            except Exception as exc:
                log.debug("weight feed: closing the store: %s", one_line(exc))
            self._store, self._owns_store = None, False

    def __enter__(self) -> WeightFeed:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ responses

    def weights_response(self) -> Response:
        with self._lock:
            body = self._weights_body
        if not body:
            why = f": {self.last_error}" if self.last_error else ""
            return 503, JSON_TYPE, json_error(f"no weights computed yet{why}")
        return 200, JSON_TYPE, body

    def metrics_response(self) -> Response:
        body = prometheus_text.render_weights(self._result, self.updates_total, self.update_errors_total,
                                              self.last_update, self.inputs_age_seconds(),
                                              self.unknown_backends_seen_total)
        return 200, prometheus_text.CONTENT_TYPE, body

    def format_response(self, name: str, request_body: bytes) -> Response:
        """The LB format ``name`` of :data:`~triscope.exporters.formats.FORMATS` for the latest result."""
        fmt = FORMATS[name]
        render = renderer(fmt)
        if render is None:
            module = fmt.render.partition(":")[0]
            return 503, JSON_TYPE, json_error(f"{name} is not available: {module} is absent")
        result = self._result
        if result is None:
            return 503, JSON_TYPE, json_error("no weights computed yet")
        return render(result, self.params, request_body)

    def health_response(self) -> Response:
        if self.healthy():
            return 200, "text/plain; charset=utf-8", b"ok\n"
        why = self.last_error or "no recent update"
        return 503, "text/plain; charset=utf-8", f"unhealthy: {why}\n".encode()


def create(config: dict[str, Any], context: Context) -> WeightFeed:
    """Exporter for ``triscope run``: a :class:`WeightFeed` over ``[weights]`` reading the store
    through ``context.open_store`` and handing history rows to ``context.submit``."""
    return WeightFeed(WeightParams.from_config(config), store=context.open_store, submit=context.submit)


__all__ = ["WeightFeed", "create"]
