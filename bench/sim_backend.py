"""Simulated GPU inference backends for the closed-loop bench (no GPU needed).

Each backend is an asyncio HTTP/1.1 server on 127.0.0.1 that behaves like a vLLM engine
under load, at the level a load balancer can see:

* every request holds GPU memory that depends on its modality (speech < image-text < video):
  on arrival its staged inputs (``staged_fraction`` of its KV), once running its full KV;
  an arrival whose staged inputs do not fit is refused with ``503`` (out of memory);
* at most ``slots`` requests run at once (``max_num_seqs``) and only while their KV fits;
  the rest wait FCFS with head-of-line blocking, as in vLLM's scheduler;
* a running request's service time grows with the batch it joins
  (``base / speed * (1 + batch_slowdown * running / slots)``), so latency grows with load;
* ``GET /metrics`` serves vLLM's Prometheus names (``vllm:kv_cache_usage_perc``,
  ``vllm:num_requests_running``, ``vllm:num_requests_waiting``, ``vllm:request_success_total``,
  latency histograms with vLLM's buckets) plus a few ``triscope_sim_*`` counters.

Control endpoints (bench use only): ``POST /sim/pressure?bytes=N`` pins ``N`` extra KV bytes
(a memory leak / a long-context tenant), ``POST /sim/reset`` clears state and counters,
``GET /sim/state`` returns JSON.

Run ``python bench/sim_backend.py --backend b0:18001:40:16:1.0 --backend b1:18002:20:16:0.5``
(``name:port:kv_gib:slots:speed``); it prints one JSON line when all ports are listening.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from urllib.parse import parse_qs, urlsplit

# the cumulative Prometheus histogram and vLLM latency families the demo simulator uses too
from triscope.demo_fleet import Histogram, latency_histograms

GIB = 1024**3
MAX_HEADER_BYTES = 16 * 1024
MAX_BODY_BYTES = 64 * 1024
MODEL = "sim/llava-onevision-7b"


@dataclass(frozen=True)
class RequestClass:
    """A request class: its SLA, KV footprint, base service time and default traffic share."""

    name: str
    modality: str
    sla_s: float
    kv_bytes: int
    service_s: float
    share: float


CLASSES: dict[str, RequestClass] = {
    c.name: c
    for c in (
        RequestClass("realtime_speech", "speech", 0.200, int(0.25 * GIB), 0.040, 0.50),
        RequestClass("interactive_image_text", "image", 0.800, int(1.5 * GIB), 0.200, 0.35),
        RequestClass("offline_video", "video", 5.000, int(6.0 * GIB), 1.200, 0.15),
    )
}

# vLLM's histogram buckets (vllm/v1/metrics/loggers.py).
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
QUEUE_BUCKETS = E2E_BUCKETS
# Finer buckets for the per-class latency histogram (stands in for request spans, see metrics_text).
CLASS_BUCKETS = (0.025, 0.05, 0.075, 0.1, 0.125, 0.15, 0.175, 0.2, 0.25, 0.3, 0.4, 0.5, 0.65, 0.8, 1.0,
                 1.25, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 6.5, 8.0, 10.0, 15.0, 20.0, 30.0, 60.0)


@dataclass
class BackendSpec:
    """Static description of one simulated backend."""

    name: str
    port: int
    kv_gib: float = 40.0
    slots: int = 16
    speed: float = 1.0
    batch_slowdown: float = 0.8
    staged_fraction: float = 0.25
    host: str = "127.0.0.1"

    @classmethod
    def parse(cls, text: str) -> BackendSpec:
        """``name:port[:kv_gib[:slots[:speed]]]``."""
        parts = text.split(":")
        if len(parts) < 2:
            raise ValueError(f"backend spec {text!r}: expected name:port[:kv_gib[:slots[:speed]]]")
        spec = cls(parts[0], int(parts[1]))
        if len(parts) > 2:
            spec.kv_gib = float(parts[2])
        if len(parts) > 3:
            spec.slots = int(parts[3])
        if len(parts) > 4:
            spec.speed = float(parts[4])
        return spec

    def to_arg(self) -> str:
        return f"{self.name}:{self.port}:{self.kv_gib}:{self.slots}:{self.speed}"


@dataclass
class SimState:
    """Mutable state and counters of one backend."""

    kv_used: int = 0
    pressure: int = 0
    running: int = 0
    waiting: int = 0
    queue: deque = field(default_factory=deque)
    success: dict[str, int] = field(default_factory=dict)
    oom: dict[str, int] = field(default_factory=dict)
    e2e: Histogram = field(default_factory=lambda: Histogram(E2E_BUCKETS))
    ttft: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))
    queue_time: Histogram = field(default_factory=lambda: Histogram(QUEUE_BUCKETS))
    by_class: dict[str, Histogram] = field(
        default_factory=lambda: {c: Histogram(CLASS_BUCKETS) for c in CLASSES})
    peak_kv_ratio: float = 0.0


class SimBackend:
    """One simulated inference engine."""

    def __init__(self, spec: BackendSpec) -> None:
        self.spec = spec
        self.capacity = int(spec.kv_gib * GIB)
        self.state = SimState()
        self.server: asyncio.AbstractServer | None = None

    # -- model -----------------------------------------------------------------------------
    def kv_ratio(self) -> float:
        return min(1.0, (self.state.kv_used + self.state.pressure) / self.capacity)

    def _schedule(self) -> None:
        """FCFS admission: start queued requests while a batch slot and their full KV fit.

        Like vLLM's scheduler, it stops at the first request that does not fit (head-of-line),
        so a video waiting for KV blocks the speech requests queued behind it.
        """
        st = self.state
        while st.queue and st.running < self.spec.slots:
            fut, cls, staged = st.queue[0]
            if fut.done():
                st.queue.popleft()
                continue
            grow = cls.kv_bytes - staged
            if st.kv_used + st.pressure + grow > self.capacity and st.running > 0:
                return
            st.queue.popleft()
            st.kv_used += grow
            st.running += 1
            st.peak_kv_ratio = max(st.peak_kv_ratio, self.kv_ratio())
            fut.set_result(None)

    async def infer(self, cls: RequestClass) -> tuple[int, dict]:
        """Serve one request; returns (status, body).

        On arrival the request's inputs are staged in GPU memory (``staged_fraction`` of its KV,
        e.g. image/video encoder tensors); if they do not fit it is refused with 503. It then
        waits FCFS for a batch slot and its full KV, runs, and frees its memory.
        """
        st = self.state
        t0 = time.monotonic()
        staged = int(cls.kv_bytes * self.spec.staged_fraction)
        if st.kv_used + st.pressure + staged > self.capacity or cls.kv_bytes > self.capacity:
            st.oom[cls.name] = st.oom.get(cls.name, 0) + 1
            return 503, {"error": "out of memory: KV cache full", "backend": self.spec.name}
        st.kv_used += staged
        st.peak_kv_ratio = max(st.peak_kv_ratio, self.kv_ratio())
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        st.queue.append((fut, cls, staged))
        st.waiting += 1
        admitted = False
        try:
            self._schedule()
            await fut
            admitted = True
        finally:
            st.waiting -= 1
            if not admitted:
                st.kv_used -= staged
        started = time.monotonic()
        try:
            load = st.running / self.spec.slots
            service = cls.service_s / self.spec.speed * (1.0 + self.spec.batch_slowdown * load)
            prefill = 0.3 * service
            await asyncio.sleep(prefill)
            st.ttft.observe(time.monotonic() - t0)
            await asyncio.sleep(service - prefill)
        finally:
            st.kv_used -= cls.kv_bytes
            st.running -= 1
            self._schedule()
        done = time.monotonic()
        st.e2e.observe(done - t0)
        st.queue_time.observe(started - t0)
        st.by_class[cls.name].observe(done - t0)
        st.success[cls.name] = st.success.get(cls.name, 0) + 1
        return 200, {"backend": self.spec.name, "class": cls.name,
                     "queue_s": round(started - t0, 6), "latency_s": round(done - t0, 6)}

    def reset(self) -> None:
        """Forget counters and pressure (in-flight requests keep running)."""
        st, fresh = self.state, SimState()
        st.pressure = 0
        st.success, st.oom, st.by_class = fresh.success, fresh.oom, fresh.by_class
        st.e2e, st.ttft, st.queue_time = fresh.e2e, fresh.ttft, fresh.queue_time
        st.peak_kv_ratio = self.kv_ratio()
        self._schedule()

    # -- exposition ------------------------------------------------------------------------
    def metrics_text(self) -> str:
        st = self.state
        lab = f'engine="0",model_name="{MODEL}"'
        lines = [
            "# HELP vllm:num_requests_running Number of requests in model execution batches.",
            "# TYPE vllm:num_requests_running gauge",
            f"vllm:num_requests_running{{{lab}}} {float(st.running)}",
            "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.",
            "# TYPE vllm:num_requests_waiting gauge",
            f"vllm:num_requests_waiting{{{lab}}} {float(st.waiting)}",
            "# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.",
            "# TYPE vllm:kv_cache_usage_perc gauge",
            f"vllm:kv_cache_usage_perc{{{lab}}} {self.kv_ratio():.6f}",
            "# HELP vllm:request_success_total Count of successfully processed requests.",
            "# TYPE vllm:request_success_total counter",
            f'vllm:request_success_total{{{lab},finished_reason="stop"}} {float(sum(st.success.values()))}',
            *latency_histograms(st.ttft, st.e2e, st.queue_time, lab),
            "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig",
            "# TYPE vllm:cache_config_info gauge",
            f'vllm:cache_config_info{{block_size="16",cache_dtype="auto",engine="0",'
            f'gpu_memory_utilization="0.9",num_gpu_blocks="{self.capacity // (16 * 131072)}"}} 1.0',
            "# HELP triscope_sim_kv_capacity_bytes KV pool size of the simulated engine.",
            "# TYPE triscope_sim_kv_capacity_bytes gauge",
            f"triscope_sim_kv_capacity_bytes {float(self.capacity)}",
            "# HELP triscope_sim_request_latency_seconds Server-side latency by request class "
            "(what request spans carry; vLLM has no class label).",
            "# TYPE triscope_sim_request_latency_seconds histogram",
        ]
        for name, hist in st.by_class.items():
            lines += hist.render("triscope_sim_request_latency_seconds", f'request_class="{name}"')
        lines += [
            "# HELP triscope_sim_oom_rejections_total Requests refused with 503 because the KV pool was full.",
            "# TYPE triscope_sim_oom_rejections_total counter",
        ]
        for name in CLASSES:
            lines.append(f'triscope_sim_oom_rejections_total{{request_class="{name}"}} '
                         f"{float(st.oom.get(name, 0))}")
        return "\n".join(lines) + "\n"

    def state_json(self) -> dict:
        st = self.state
        return {"backend": self.spec.name, "kv_used_bytes": st.kv_used, "pressure_bytes": st.pressure,
                "kv_capacity_bytes": self.capacity, "kv_cache_usage_ratio": self.kv_ratio(),
                "peak_kv_ratio": st.peak_kv_ratio, "running": st.running, "waiting": st.waiting,
                "success": dict(st.success), "oom": dict(st.oom)}

    # -- HTTP ------------------------------------------------------------------------------
    async def start(self) -> None:
        self.server = await asyncio.start_server(self._serve_conn, self.spec.host, self.spec.port,
                                                 limit=MAX_HEADER_BYTES, backlog=1024)

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
            with contextlib.suppress(Exception):
                await self.server.wait_closed()

    async def _serve_conn(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
                    return
                lines = head.decode("latin-1").split("\r\n")
                try:
                    method, target, _version = lines[0].split(" ", 2)
                except ValueError:
                    await _respond(writer, 400, {"error": "bad request line"}, close=True)
                    return
                headers = {}
                for line in lines[1:]:
                    if ":" in line:
                        k, v = line.split(":", 1)
                        headers[k.strip().lower()] = v.strip()
                length = int(headers.get("content-length", "0") or 0)
                if length > MAX_BODY_BYTES:
                    await _respond(writer, 413, {"error": "body too large"}, close=True)
                    return
                if length:
                    await reader.readexactly(length)
                close = headers.get("connection", "").lower() == "close"
                status, body, ctype = await self._route(method, target)
                await _respond(writer, status, body, close=close, ctype=ctype,
                               extra={"X-Backend": self.spec.name})
                if close:
                    return
        except (ConnectionError, asyncio.IncompleteReadError):
            return
        finally:
            with contextlib.suppress(Exception):
                writer.close()

    async def _route(self, method: str, target: str) -> tuple[int, object, str]:
        url = urlsplit(target)
        path = url.path
        if path.startswith("/v1/infer/"):
            cls = CLASSES.get(path.rsplit("/", 1)[-1])
            if cls is None:
                return 404, {"error": "unknown request class"}, "application/json"
            status, body = await self.infer(cls)
            return status, body, "application/json"
        if path == "/metrics":
            return 200, self.metrics_text(), "text/plain; version=0.0.4; charset=utf-8"
        if path in ("/health", "/healthz"):
            return 200, {"status": "ok"}, "application/json"
        if path == "/sim/state":
            return 200, self.state_json(), "application/json"
        if path == "/sim/reset" and method == "POST":
            self.reset()
            return 200, self.state_json(), "application/json"
        if path == "/sim/pressure" and method == "POST":
            try:
                value = int(parse_qs(url.query).get("bytes", ["0"])[0])
            except ValueError:
                return 400, {"error": "bytes must be an integer"}, "application/json"
            self.state.pressure = max(0, min(value, self.capacity))
            self._schedule()
            return 200, self.state_json(), "application/json"
        return 404, {"error": f"no route {path}"}, "application/json"


_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 413: "Payload Too Large",
            503: "Service Unavailable"}


async def _respond(writer: asyncio.StreamWriter, status: int, body: object, close: bool = False,
                   ctype: str = "application/json", extra: dict[str, str] | None = None) -> None:
    data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
    head = [f"HTTP/1.1 {status} {_REASONS.get(status, 'OK')}", f"Content-Type: {ctype}",
            f"Content-Length: {len(data)}"]
    for k, v in (extra or {}).items():
        head.append(f"{k}: {v}")
    if close:
        head.append("Connection: close")
    writer.write(("\r\n".join(head) + "\r\n\r\n").encode() + data)
    await writer.drain()


async def serve(specs: list[BackendSpec]) -> None:
    """Run all backends until SIGTERM/SIGINT."""
    backends = [SimBackend(s) for s in specs]
    for b in backends:
        await b.start()
    print(json.dumps({"ready": [b.spec.to_arg() for b in backends]}), flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    for b in backends:
        await b.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", action="append", required=True,
                        help="name:port[:kv_gib[:slots[:speed]]] (repeat)")
    parser.add_argument("--batch-slowdown", type=float, default=0.8,
                        help="service-time growth at a full batch (1 + x * running/slots)")
    parser.add_argument("--staged-fraction", type=float, default=0.25,
                        help="share of a request's KV held from arrival (staged inputs) before it runs")
    args = parser.parse_args(argv)
    try:
        specs = [BackendSpec.parse(s) for s in args.backend]
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for s in specs:
        s.batch_slowdown = args.batch_slowdown
        s.staged_fraction = args.staged_fraction
    asyncio.run(serve(specs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
