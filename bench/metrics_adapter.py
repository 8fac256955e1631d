"""Scrape vLLM-style ``/metrics`` of live backends into the weight engine's inputs (bench helper).

This is the adapter path of the closed-loop bench: each engine update scrapes every backend
(``vllm:kv_cache_usage_perc``, ``vllm:num_requests_*``, ``vllm:request_success_total`` and the
per-class latency histogram the simulator exposes in place of request spans) and turns the
histogram deltas over ``window_s`` into per-class P99s, like the serving-metrics collector
does from vLLM's histograms. ``run_feed_worker`` runs triscope's real ``WeightFeed`` (HTTP feed +
HAProxy agent) on these inputs in its own process.
"""

from __future__ import annotations

import json
import math
import re
import signal
import threading
import time
import urllib.request
from collections import deque
from collections.abc import Callable
from typing import Any

NAN = float("nan")
_LINE = re.compile(r'^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{(.*)\})?\s+(\S+)')
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')
CLASS_HIST = "triscope_sim_request_latency_seconds"


def parse_prometheus(text: str) -> list[tuple[str, dict[str, str], float]]:
    """Samples of a Prometheus text exposition: (name, labels, value)."""
    out = []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _LINE.match(line)
        if not m:
            continue
        labels = dict(_LABEL.findall(m.group(2) or ""))
        try:
            value = float(m.group(3))
        except ValueError:
            continue
        out.append((m.group(1), labels, value))
    return out


def histogram_quantile(q: float, buckets: list[tuple[float, float]]) -> float:
    """Prometheus-style quantile from cumulative (upper, count) buckets, linear within a bucket."""
    buckets = sorted(buckets)
    if not buckets or buckets[-1][1] <= 0:
        return NAN
    total = buckets[-1][1]
    rank = q * total
    lower_bound, lower_count = 0.0, 0.0
    for upper, count in buckets:
        if count >= rank:
            if math.isinf(upper):
                return lower_bound
            span = count - lower_count
            frac = (rank - lower_count) / span if span > 0 else 1.0
            return lower_bound + (upper - lower_bound) * frac
        lower_bound, lower_count = upper, count
    return buckets[-1][0]


class BackendProbe:
    """One backend's scrape history; ``sample()`` scrapes and returns BackendInputs fields."""

    def __init__(self, name: str, base_url: str, window_s: float = 5.0, timeout_s: float = 0.5,
                 min_count: int = 3) -> None:
        self.name = name
        self.base_url = base_url.rstrip("/")
        self.window_s = window_s
        self.timeout_s = timeout_s
        self.min_count = min_count
        self.history: deque[tuple[float, dict[str, dict[float, float]], float]] = deque()
        self.last: dict[str, Any] = {}
        self.collector = "bench parser"
        self._scraper: Any = None
        try:  # the real serving-metrics collector parses the vLLM families when it is installed
            from triscope.collectors.serving_metrics import ServingMetricsScraper, Target

            self._scraper = ServingMetricsScraper({})
            self._target = Target(url=self.base_url + "/metrics", server="vllm", backend=name)
            self.collector = "triscope.collectors.serving_metrics"
        except ImportError:
            pass

    def scrape(self) -> str:
        with urllib.request.urlopen(self.base_url + "/metrics", timeout=self.timeout_s) as resp:
            return resp.read(4 << 20).decode()

    def sample(self, now: float | None = None) -> dict[str, Any]:
        """Scrape once; a dict of BackendInputs keyword arguments (``healthy=False`` on failure)."""
        now = time.time() if now is None else now
        try:
            text = self.scrape()
            samples = parse_prometheus(text)
        except (OSError, ValueError):
            return {"backend": self.name, "healthy": False, "sources": {"serving": now}}
        kv = running = waiting = success = NAN
        if self._scraper is not None:
            try:
                rows = self._scraper.rows_from_text(self._target, text, int(now * 1e9))
                kv, success = rows["kv_cache_usage_ratio"][0], rows["requests_total"][0]
                running, waiting = rows["running_requests"][0], rows["queue_length"][0]
                samples = [x for x in samples if x[0].startswith(CLASS_HIST)]
            except Exception:
                return {"backend": self.name, "healthy": False, "sources": {"serving": now}}
        hist: dict[str, dict[float, float]] = {}
        for name, labels, value in samples:
            if name == "vllm:kv_cache_usage_perc":
                kv = value
            elif name == "vllm:num_requests_running":
                running = value
            elif name == "vllm:num_requests_waiting":
                waiting = value
            elif name == "vllm:request_success_total":
                success = value if math.isnan(success) else success + value
            elif name == CLASS_HIST + "_bucket":
                le = labels.get("le", "+Inf")
                hist.setdefault(labels.get("request_class", ""), {})[float(le.replace("+Inf", "inf"))] = value
        self.history.append((now, hist, success))
        while len(self.history) > 2 and self.history[1][0] <= now - self.window_s:
            self.history.popleft()
        t0, old_hist, old_success = self.history[0]
        p99: dict[str, float] = {}
        for cls, buckets in hist.items():
            before = old_hist.get(cls, {}) if t0 < now else {}
            delta = [(le, count - before.get(le, 0.0)) for le, count in buckets.items()]
            if max((c for _, c in delta), default=0.0) >= self.min_count:
                p99[cls] = histogram_quantile(0.99, delta)
        qps = (success - old_success) / (now - t0) if now > t0 and not math.isnan(success) else NAN
        self.last = {"kv": kv, "running": running, "waiting": waiting}
        return {"backend": self.name, "kv_cache_usage_ratio": kv, "qps": qps, "p99_seconds": p99,
                "queue_length": waiting, "running_requests": running,
                "healthy": True, "sources": {"serving": now}}


def inputs_fn(probes: list[BackendProbe]) -> Callable[[], list]:
    """A ``WeightFeed(inputs_fn=...)`` callable scraping ``probes`` on every engine update."""
    from triscope.exporters.weights import BackendInputs

    def fn() -> list:
        now = time.time()
        return [BackendInputs(**p.sample(now)) for p in probes]

    return fn


def weights_config(overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """The config tree for the bench's feed: defaults + ``[weights]`` overrides, ephemeral ports."""
    from triscope.config import load_config

    config = load_config(None)
    weights = dict(config.get("weights", {}))
    for key, value in (overrides or {}).items():
        weights[key] = value
    feed = dict(weights.get("feed", {}))
    feed.update({"bind": "127.0.0.1", "port": 0, "agent_port": 0})
    weights["feed"] = feed
    weights["history"] = False
    weights["discover"] = False
    config["weights"] = weights
    return config


class _FallbackFeed:
    """Used only while ``triscope.exporters.feed`` is absent: the real engine (compute_weights)
    behind a minimal agent-check server speaking the documented protocol (``ready NN%``/``drain``)."""

    def __init__(self, params: Any, store: Any = None, inputs_fn: Callable[[], list] | None = None) -> None:
        self.params, self.inputs_fn = params, inputs_fn
        self.result: Any = None
        self.state: Any = None
        self._stop = threading.Event()
        self.http_port = -1
        self.agent_port = -1
        self._lock = threading.Lock()

    def update(self) -> None:
        from triscope.exporters.weights import compute_weights

        assert self.inputs_fn is not None
        result, state = compute_weights(self.inputs_fn(), self.state, self.params, time.time())
        with self._lock:
            self.result, self.state = result, state

    def _line(self, name: str) -> str:
        with self._lock:
            bw = self.result.backends.get(name) if self.result is not None else None
        if bw is None:
            return "ready 100%\n"
        return "drain\n" if bw.state == "drain" else f"ready {bw.lb_weight}%\n"

    def start(self) -> None:
        import socketserver

        feed = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                self.request.settimeout(1.0)
                try:
                    name = self.request.recv(256).decode(errors="replace").strip()
                    self.request.sendall(feed._line(name).encode())
                except OSError:
                    pass

        socketserver.ThreadingTCPServer.allow_reuse_address = True
        self._server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.agent_port = self._server.server_address[1]
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        self.update()

        def loop() -> None:
            while not self._stop.wait(self.params.interval_s):
                try:
                    self.update()
                except Exception as exc:
                    print(f"feed update failed: {exc}", flush=True)

        threading.Thread(target=loop, daemon=True).start()

    def close(self) -> None:
        self._stop.set()
        self._server.shutdown()
        self._server.server_close()


def run_feed_worker(backends: dict[str, str], overrides: dict[str, Any], window_s: float,
                    ready: Callable[[dict[str, Any]], None] | None = None,
                    stop: threading.Event | None = None) -> None:
    """Run triscope's WeightFeed on live scrapes of ``backends`` ({name: base_url}) until ``stop``."""
    from triscope.exporters.weights import WeightParams

    try:
        from triscope.exporters.feed import WeightFeed
        kind = "triscope.exporters.feed"
    except ImportError:
        WeightFeed, kind = _FallbackFeed, "fallback agent (triscope.exporters.feed absent)"

    params = WeightParams.from_config(weights_config(overrides))
    probes = [BackendProbe(name, url, window_s=window_s) for name, url in backends.items()]
    kind += f"; vLLM metrics parsed by {probes[0].collector}" if probes else ""
    feed = WeightFeed(params, store=None, inputs_fn=inputs_fn(probes))
    feed.start()
    stop = stop or threading.Event()
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
        signal.signal(signal.SIGINT, lambda *_: stop.set())
    try:
        info = {"http_port": feed.http_port, "agent_port": feed.agent_port,
                "interval_s": params.interval_s, "feed": kind}
        if ready is not None:
            ready(info)
        else:
            print(json.dumps({"ready": info}), flush=True)
        stop.wait()
    finally:
        feed.close()
