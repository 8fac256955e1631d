"""A **simulator** of vLLM-style inference backends for ``triscope demo`` (no GPU, no model).

Nothing here runs a model or touches a GPU. Each :class:`SimBackend` is a threaded HTTP server on
127.0.0.1 that behaves, at the level a load balancer and a metrics scraper can see, like one vLLM
engine on one GPU:

* ``POST /v1/completions`` with ``{"prompt_tokens": N, "max_tokens": M}``
  holds ``(N + M) * kv_bytes_per_token`` of KV cache while it runs. At most ``slots`` requests run
  at once (``max_num_seqs``) and only while their KV fits in the pool; the rest wait FCFS with
  head-of-line blocking, as in vLLM's scheduler. Beyond ``max_waiting`` queued requests it answers
  ``503`` (the simulator's admission limit; vLLM itself queues without bound).
* Service time is ``(N * prefill_s_per_token + M * decode_s_per_token) / speed`` times
  ``1 + batch_slowdown * running / slots``: latency grows with load (batching and queueing).
  The time is spent in ``time.sleep``; the reply carries queue time, TTFT and end-to-end latency.
* ``GET /metrics`` serves vLLM's Prometheus names and buckets (``vllm:num_requests_running``,
  ``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc``, ``vllm:request_success_total``,
  ``vllm:e2e_request_latency_seconds``, ``vllm:time_to_first_token_seconds``,
  ``vllm:request_queue_time_seconds``, token counters).
* :meth:`SimBackend.gpu_memory` is the *simulated* GPU memory in use: model weights plus the KV
  blocks held by admitted requests. Real vLLM preallocates its whole KV pool, so NVML on a real
  vLLM GPU reads nearly flat at ``gpu_memory_utilization``; the simulator reports what is
  allocated instead (what the torch allocator, or an engine allocating on demand, shows).
"""

from __future__ import annotations

import json
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

GB = 10**9
MAX_BODY_BYTES = 64 * 1024
MODEL = "sim/vlm-2b"

# vLLM's histogram buckets (vllm/v1/metrics/loggers.py).
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)


@dataclass(frozen=True)
class DemoClass:
    """A request class of the demo load: modality, token counts and share of the traffic."""

    name: str
    modality: str
    prompt_tokens: int
    completion_tokens: int
    share: float


CLASSES: tuple[DemoClass, ...] = (
    DemoClass("realtime_speech", "speech", 200, 20, 0.50),
    DemoClass("interactive_image_text", "image", 1500, 100, 0.35),
    DemoClass("offline_video", "video", 8000, 200, 0.15),
)
CLASS_BY_NAME = {c.name: c for c in CLASSES}


class Histogram:
    """A cumulative Prometheus histogram (callers hold the backend lock)."""

    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = buckets
        self.counts = [0] * len(buckets)
        self.total = 0.0
        self.n = 0

    def observe(self, value: float) -> None:
        for i, upper in enumerate(self.buckets):
            if value <= upper:
                self.counts[i] += 1
                break
        self.total += value
        self.n += 1

    def render(self, name: str, labels: str) -> list[str]:
        out, cumulative = [], 0
        for upper, count in zip(self.buckets, self.counts, strict=True):
            cumulative += count
            out.append(f'{name}_bucket{{{labels},le="{upper}"}} {float(cumulative)}')
        out += [f'{name}_bucket{{{labels},le="+Inf"}} {float(self.n)}', f"{name}_count{{{labels}}} {float(self.n)}",
                f"{name}_sum{{{labels}}} {self.total}"]
        return out


def latency_histograms(ttft: Histogram, e2e: Histogram, queue_time: Histogram, labels: str) -> list[str]:
    """vLLM's three latency histogram families (HELP, TYPE and series) for one engine."""
    return [
        "# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.",
        "# TYPE vllm:time_to_first_token_seconds histogram",
        *ttft.render("vllm:time_to_first_token_seconds", labels),
        "# HELP vllm:e2e_request_latency_seconds Histogram of e2e request latency in seconds.",
        "# TYPE vllm:e2e_request_latency_seconds histogram",
        *e2e.render("vllm:e2e_request_latency_seconds", labels),
        "# HELP vllm:request_queue_time_seconds Histogram of time spent in WAITING phase for request.",
        "# TYPE vllm:request_queue_time_seconds histogram",
        *queue_time.render("vllm:request_queue_time_seconds", labels),
    ]


@dataclass(frozen=True)
class SimSpec:
    """One simulated backend: its (simulated) GPU and engine limits."""

    name: str
    memory_total_bytes: float = 12 * GB
    weights_bytes: float = 2.5 * GB
    gpu_memory_utilization: float = 0.9
    kv_bytes_per_token: float = 128 * 1024
    slots: int = 16
    max_waiting: int = 64
    speed: float = 1.0
    batch_slowdown: float = 0.8
    prefill_s_per_token: float = 20e-6
    decode_s_per_token: float = 2e-3

    @property
    def kv_capacity_bytes(self) -> float:
        return self.memory_total_bytes * self.gpu_memory_utilization - self.weights_bytes


@dataclass
class _Counters:
    running: int = 0
    waiting: int = 0
    kv_used: float = 0.0
    success: int = 0
    rejected: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    e2e: Histogram = field(default_factory=lambda: Histogram(E2E_BUCKETS))
    ttft: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))
    queue_time: Histogram = field(default_factory=lambda: Histogram(E2E_BUCKETS))


class SimBackend:
    """One simulated engine and its HTTP server (``start`` / ``close``)."""

    def __init__(self, spec: SimSpec, host: str = "127.0.0.1", port: int = 0) -> None:
        if spec.kv_capacity_bytes <= 0:
            raise ValueError(f"{spec.name}: the model weights leave no room for a KV cache")
        self.spec = spec
        self.c = _Counters()
        self._cond = threading.Condition()
        self._queue: deque[object] = deque()
        self._server = ThreadingHTTPServer((host, port), _handler_for(self))
        self._server.daemon_threads = True
        self._thread: threading.Thread | None = None

    @property
    def address(self) -> str:
        host, port = self._server.server_address[:2]
        return f"{host}:{port}"

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    def start(self) -> SimBackend:
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.2},
                                        name=f"sim-{self.spec.name}", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)

    # ---- model ---------------------------------------------------------------------------
    def kv_usage_ratio(self) -> float:
        with self._cond:
            return min(1.0, self.c.kv_used / self.spec.kv_capacity_bytes)

    def gpu_memory(self) -> tuple[float, float]:
        """Simulated (used, total) GPU bytes: weights + KV held by admitted requests."""
        with self._cond:
            return self.spec.weights_bytes + self.c.kv_used, self.spec.memory_total_bytes

    def serve(self, prompt_tokens: int, completion_tokens: int) -> tuple[int, dict[str, Any]]:
        """Queue, run and finish one request; (HTTP status, reply body)."""
        s, c = self.spec, self.c
        kv = (prompt_tokens + completion_tokens) * s.kv_bytes_per_token
        t0 = time.monotonic()
        ticket = object()
        with self._cond:
            if kv > s.kv_capacity_bytes or c.waiting >= s.max_waiting:
                c.rejected += 1
                why = "request exceeds the KV pool" if kv > s.kv_capacity_bytes else "queue full"
                return 503, {"error": why, "backend": s.name}
            self._queue.append(ticket)
            c.waiting += 1
            while not (self._queue[0] is ticket and c.running < s.slots
                       and (c.kv_used + kv <= s.kv_capacity_bytes or c.running == 0)):
                self._cond.wait()
            self._queue.popleft()
            c.waiting -= 1
            c.running += 1
            c.kv_used += kv
            load = c.running / s.slots
            self._cond.notify_all()
        started = time.monotonic()
        factor = (1.0 + s.batch_slowdown * load) / s.speed
        prefill = prompt_tokens * s.prefill_s_per_token * factor
        decode = completion_tokens * s.decode_s_per_token * factor
        try:
            time.sleep(prefill)
            ttft = time.monotonic() - t0
            time.sleep(decode)
        finally:
            with self._cond:
                c.running -= 1
                c.kv_used -= kv
                self._cond.notify_all()
        e2e = time.monotonic() - t0
        with self._cond:
            c.success += 1
            c.prompt_tokens += prompt_tokens
            c.generation_tokens += completion_tokens
            c.e2e.observe(e2e)
            c.ttft.observe(ttft)
            c.queue_time.observe(started - t0)
        return 200, {"backend": s.name, "model": MODEL,
                     "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens},
                     "timings": {"queue_s": started - t0, "ttft_s": ttft, "e2e_s": e2e,
                                 "prefill_s": prefill, "decode_s": decode}}

    def metrics_text(self) -> str:
        """The Prometheus exposition, vLLM's names and labels."""
        lab = f'engine="0",model_name="{MODEL}"'
        with self._cond:
            c = self.c
            kv = min(1.0, c.kv_used / self.spec.kv_capacity_bytes)
            lines = [
                "# HELP vllm:num_requests_running Number of requests in model execution batches.",
                "# TYPE vllm:num_requests_running gauge",
                f"vllm:num_requests_running{{{lab}}} {float(c.running)}",
                "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.",
                "# TYPE vllm:num_requests_waiting gauge",
                f"vllm:num_requests_waiting{{{lab}}} {float(c.waiting)}",
                "# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.",
                "# TYPE vllm:kv_cache_usage_perc gauge",
                f"vllm:kv_cache_usage_perc{{{lab}}} {kv:.6f}",
                "# HELP vllm:request_success_total Count of successfully processed requests.",
                "# TYPE vllm:request_success_total counter",
                f'vllm:request_success_total{{{lab},finished_reason="stop"}} {float(c.success)}',
                "# HELP vllm:prompt_tokens_total Number of prefill tokens processed.",
                "# TYPE vllm:prompt_tokens_total counter",
                f"vllm:prompt_tokens_total{{{lab}}} {float(c.prompt_tokens)}",
                "# HELP vllm:generation_tokens_total Number of generation tokens processed.",
                "# TYPE vllm:generation_tokens_total counter",
                f"vllm:generation_tokens_total{{{lab}}} {float(c.generation_tokens)}",
                *latency_histograms(c.ttft, c.e2e, c.queue_time, lab),
            ]
        return "\n".join(lines) + "\n"


def _handler_for(backend: SimBackend) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:
            """Quiet: the demo prints its own summary."""

        def _send(self, status: int, body: bytes, ctype: str = "application/json") -> None:
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _json(self, status: int, doc: dict[str, Any]) -> None:
            self._send(status, json.dumps(doc).encode())

        def do_GET(self) -> None:
            if self.path == "/metrics":
                self._send(200, backend.metrics_text().encode(), "text/plain; version=0.0.4; charset=utf-8")
            elif self.path in ("/health", "/healthz"):
                self._json(200, {"status": "ok"})
            else:
                self._json(404, {"error": f"no route {self.path}"})

        def do_POST(self) -> None:
            try:
                length = int(self.headers.get("Content-Length") or 0)
            except ValueError:
                length = -1
            if not 0 <= length <= MAX_BODY_BYTES:
                self.close_connection = True
                self._json(413 if length > 0 else 400, {"error": "bad or too large body"})
                return
            raw = self.rfile.read(length)
            if self.path != "/v1/completions":
                self._json(404, {"error": f"no route {self.path}"})
                return
            try:
                doc = json.loads(raw or b"{}")
                prompt, completion = int(doc["prompt_tokens"]), int(doc["max_tokens"])
                if not (0 < prompt <= 1_000_000 and 0 < completion <= 1_000_000):
                    raise ValueError
            except (ValueError, KeyError, TypeError):
                self._json(400, {"error": "body needs positive integer prompt_tokens and max_tokens"})
                return
            status, body = backend.serve(prompt, completion)
            self._json(status, body)

    return Handler
