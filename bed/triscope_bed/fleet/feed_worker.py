"""triscope's weight feed on live scrapes of simulated backends (the closed-loop bench's adapter path).

Each engine update scrapes every backend's ``/metrics``, parses it with the serving-metrics
collector's parser (vLLM's gauges and success counter) and turns the deltas of the simulator's
per-class latency histogram over ``window_s`` into per-class P99s. ``python -m
triscope_bed.fleet.feed_worker --backends '{"b0": "http://127.0.0.1:18001"}'`` runs the real
``WeightFeed`` (HTTP feed + HAProxy agent) on these inputs and prints one JSON line when ready.
"""

from __future__ import annotations

import argparse
import json
import math
import signal
import sys
import threading
import time
import urllib.request
from collections import deque
from collections.abc import Callable
from typing import Any

from triscope.collectors.serving_metrics import aggregate
from triscope.errors import InputError
from triscope.prom_text import histogram_quantile, parse_exposition

NAN = float("nan")
CLASS_HIST = "triscope_sim_request_latency_seconds"


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
        self.last_ok = NAN
        self.failing_since = NAN

    def scrape(self) -> str:
        with urllib.request.urlopen(self.base_url + "/metrics", timeout=self.timeout_s) as resp:
            return str(resp.read(4 << 20).decode())

    def sample(self, now: float | None = None) -> dict[str, Any]:
        """Scrape once; a dict of BackendInputs keyword arguments (``scrape_up=0`` on failure: the
        engine reads the backend as down, as it reads a failed ``scrape_health`` row)."""
        now = time.time() if now is None else now
        try:
            series = parse_exposition(self.scrape(), self.base_url)
        except (OSError, ValueError, InputError) as exc:
            return self._failed(f"{self.base_url}/metrics: {type(exc).__name__}: {exc}", now)
        snaps = aggregate(series, "vllm")
        if not snaps:
            return self._failed(f"{self.base_url}/metrics: no vLLM metrics", now)
        self.last_ok = now
        snap = next(iter(snaps.values()))
        kv, success = snap.kv_cache_usage_ratio, snap.requests_total
        hist: dict[str, dict[float, float]] = {}
        for labels, value in series.get(CLASS_HIST + "_bucket", []):
            hist.setdefault(labels.get("request_class", ""), {})[float(labels.get("le", "+Inf"))] = value
        self.history.append((now, hist, success))
        while len(self.history) > 2 and self.history[1][0] <= now - self.window_s:
            self.history.popleft()
        t0, old_hist, old_success = self.history[0]
        p99: dict[str, float] = {}
        for cls, buckets in hist.items():
            before = old_hist.get(cls, {}) if t0 < now else {}
            delta = {le: count - before.get(le, 0.0) for le, count in buckets.items()}
            if max(delta.values(), default=0.0) >= self.min_count:
                p99[cls] = histogram_quantile(0.99, delta)
        qps = (success - old_success) / (now - t0) if now > t0 and not math.isnan(success) else NAN
        self.last = {"kv": kv, "running": snap.running_requests, "waiting": snap.queue_length}
        return {"backend": self.name, "kv_cache_usage_ratio": kv, "qps": qps, "p99_seconds": p99,
                "queue_length": snap.queue_length, "running_requests": snap.running_requests,
                "healthy": True, "sources": {"serving": now}, "scrape_up": 1.0}

    def _failed(self, error: str, now: float) -> dict[str, Any]:
        if not math.isfinite(self.failing_since):
            self.failing_since = now
        sources = {"serving": self.last_ok} if math.isfinite(self.last_ok) else {}
        return {"backend": self.name, "scrape_up": 0.0, "scrape_error": error.splitlines()[0][:300],
                "scrape_failing_s": now - self.failing_since, "sources": sources}


def inputs_fn(probes: list[BackendProbe]) -> Callable[[], list[Any]]:
    """A ``WeightFeed(inputs_fn=...)`` callable scraping ``probes`` on every engine update."""
    from triscope.analyzers.routing import BackendInputs

    def fn() -> list[Any]:
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


def run_feed_worker(backends: dict[str, str], overrides: dict[str, Any], window_s: float,
                    ready: Callable[[dict[str, Any]], None] | None = None,
                    stop: threading.Event | None = None) -> None:
    """Run triscope's WeightFeed on live scrapes of ``backends`` ({name: base_url}) until ``stop``."""
    from triscope.analyzers.routing import WeightParams
    from triscope.exporters.feed import WeightFeed

    params = WeightParams.from_config(weights_config(overrides))
    probes = [BackendProbe(name, url, window_s=window_s) for name, url in backends.items()]
    feed = WeightFeed(params, store=None, inputs_fn=inputs_fn(probes))
    feed.start()
    stop = stop or threading.Event()
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
        signal.signal(signal.SIGINT, lambda *_: stop.set())
    try:
        info = {"http_port": feed.http_port, "agent_port": feed.agent_port, "interval_s": params.interval_s,
                "feed": "triscope.exporters.feed; vLLM metrics parsed by triscope.collectors.serving_metrics"}
        if ready is not None:
            ready(info)
        else:
            print(json.dumps({"ready": info}), flush=True)
        stop.wait()
    finally:
        feed.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="triscope's weight feed on live scrapes of simulated backends")
    parser.add_argument("--backends", required=True, help='JSON object {"name": "http://host:port", ...}')
    parser.add_argument("--weights", default="", help="JSON object of [weights] overrides")
    parser.add_argument("--window-s", type=float, default=5.0, help="P99/QPS window")
    args = parser.parse_args(argv)
    run_feed_worker(json.loads(args.backends), json.loads(args.weights) if args.weights else {}, args.window_s)
    return 0


if __name__ == "__main__":
    sys.exit(main())
