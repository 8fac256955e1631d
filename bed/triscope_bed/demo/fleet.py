"""The fleet part of ``triscope demo``: simulated backends, real collectors, real analyzers.

Three :mod:`triscope_bed.engines.backend` engines on 127.0.0.1 (``sim-small`` has half the GPU memory, so
its KV pool fills first) take bursty open-loop traffic; every request becomes an OpenTelemetry
span in ``requests``, the real serving-metrics collector scrapes ``/metrics`` into
``serving_metrics`` and the simulated GPU memory goes to ``gpu_samples`` (``source = 'demo-sim'``),
all through the writer; then :mod:`triscope_bed.demo.analysis` runs the heatmap and replays the
weight engine. docs/demo.md has the details.
"""

from __future__ import annotations

import dataclasses
import http.client
import json
import math
import random
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from triscope.schema import GPU_SAMPLES, encode_ts
from triscope.store import Store
from triscope_bed.engines.backend import BackgroundBackends, SimBackend
from triscope_bed.engines.engine import CLASSES, EngineSpec, RequestClass

GB = 10**9
MODEL = "sim/vlm-2b"
SIM_SOURCE = "demo-sim"


@dataclass(frozen=True)
class GpuSpec:
    """One demo backend's simulated GPU: its memory, the model weights, and the KV pool left."""

    name: str
    memory_total_bytes: float = 12 * GB
    weights_bytes: float = 2.5 * GB
    gpu_memory_utilization: float = 0.9
    max_waiting: int = 64

    @property
    def kv_capacity_bytes(self) -> float:
        return self.memory_total_bytes * self.gpu_memory_utilization - self.weights_bytes

    def engine(self) -> EngineSpec:
        return EngineSpec(self.name, self.kv_capacity_bytes, max_waiting=self.max_waiting, load_at_admission=True,
                          model=MODEL)


SPECS = (GpuSpec("sim-a", memory_total_bytes=12 * GB), GpuSpec("sim-b", memory_total_bytes=12 * GB),
         GpuSpec("sim-small", memory_total_bytes=6 * GB))


@dataclass
class FleetOptions:
    """Load shape and outputs of one fleet run."""

    seconds: float = 12.0
    qps_per_backend: float = 10.0   # calm phases; bursts multiply it
    burst_factor: float = 2.5
    scrape_interval_s: float = 0.5
    gpu_interval_s: float = 0.1
    seed: int = 7
    png: Path | None = None


@dataclass
class _Sent:
    """Client-side tally (the ground truth the store is checked against)."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    sent: dict[str, int] = field(default_factory=dict)
    ok: dict[str, int] = field(default_factory=dict)
    errors: dict[str, int] = field(default_factory=dict)

    def add(self, name: str, ok: bool) -> None:
        with self.lock:
            self.sent[name] = self.sent.get(name, 0) + 1
            target = self.ok if ok else self.errors
            target[name] = target.get(name, 0) + 1


def arrivals(seconds: float, rate: float, burst: float, rng: random.Random) -> list[float]:
    """Arrival offsets of a Poisson process whose rate is ``rate`` in calm phases and ``rate * burst``
    in bursts (the last 55 % of every ~4 s period, so the run ends in a burst); by thinning."""
    periods = max(1, round(seconds / 4))
    period = seconds / periods
    peak = rate * max(1.0, burst)
    out: list[float] = []
    t = 0.0
    while True:
        t += rng.expovariate(peak)
        if t >= seconds:
            return out
        now_rate = rate * burst if (t % period) / period >= 0.45 else rate
        if rng.random() < now_rate / peak:
            out.append(t)


def host_of(name: str) -> str:
    return f"demo-{name}"


def gpu_memory(backend: SimBackend, gpu: GpuSpec) -> tuple[float, float]:
    """Simulated (used, total) GPU bytes: weights + KV held by admitted requests."""
    return gpu.weights_bytes + backend.engine.kv_used, gpu.memory_total_bytes


def _post(port: int, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        data = resp.read(1 << 20)
        try:
            doc = json.loads(data or b"{}")
        except ValueError:
            doc = {"error": "reply is not JSON"}
        return resp.status, doc
    except (OSError, http.client.HTTPException) as exc:
        return 0, {"error": str(exc).splitlines()[0] if str(exc) else type(exc).__name__}
    finally:
        conn.close()


def _request(tracer: Any, backend: SimBackend, cls: RequestClass, request_id: str, tokens: tuple[int, int],
             tally: _Sent) -> None:
    """One request and its span (``gen_ai.*`` attributes, server timings when it succeeded)."""
    from opentelemetry.trace import SpanKind, Status, StatusCode

    prompt, completion = tokens
    start = time.time_ns()
    status, doc = _post(backend.port, {"model": MODEL, "request_class": cls.name,
                                       "prompt_tokens": prompt, "max_tokens": completion})
    end = time.time_ns()
    attrs: dict[str, Any] = {
        "gen_ai.operation.name": "chat", "gen_ai.request.model": MODEL, "gen_ai.request.id": request_id,
        "gen_ai.request.modality": cls.modality, "triscope.request_class": cls.name,
        "server.address": "127.0.0.1", "server.port": backend.port,
        "host.name": host_of(backend.spec.name), "triscope.gpu": "0",
    }
    if status == 200:
        try:
            t, usage = doc["timings"], doc["usage"]
            attrs.update({
                "gen_ai.response.model": str(doc.get("model", MODEL)),
                "gen_ai.usage.input_tokens": int(usage["prompt_tokens"]),
                "gen_ai.usage.output_tokens": int(usage["completion_tokens"]),
                "gen_ai.latency.e2e": float(t["e2e_s"]), "gen_ai.latency.time_to_first_token": float(t["ttft_s"]),
                "gen_ai.latency.time_in_queue": float(t["queue_s"]),
                "gen_ai.latency.time_in_model_prefill": float(t["prefill_s"]),
                "gen_ai.latency.time_in_model_decode": float(t["decode_s"]),
            })
        except (KeyError, TypeError, ValueError):
            status, doc = 0, {"error": "reply without usage/timings"}
    span = tracer.start_span(f"chat {MODEL}", kind=SpanKind.CLIENT, start_time=start, attributes=attrs)
    if status != 200:
        span.set_status(Status(StatusCode.ERROR, f"HTTP {status}: {doc.get('error', '')}"))
    span.end(end_time=end)
    tally.add(backend.spec.name, status == 200)


# Columns the simulator does not model read NaN, as for a sampler that cannot measure them.
_UNMEASURED = {c.name: math.nan for c in GPU_SAMPLES.columns if c.type.startswith("Float")}


def gpu_rows(backends: list[SimBackend], gpus: dict[str, GpuSpec], ts_text: str) -> dict[str, list[Any]]:
    """``gpu_samples`` rows (every NVML sampler column) with the simulated memory."""
    rows = []
    for b in backends:
        used, total = gpu_memory(b, gpus[b.spec.name])
        rows.append({"ts": ts_text, "host": host_of(b.spec.name), "gpu": 0, "gpu_uuid": f"SIM-{b.spec.name}",
                     "gpu_model": f"simulated {total / GB:g} GB GPU (demo)", "source": SIM_SOURCE,
                     "memory_used_bytes": used, "memory_total_bytes": total, "state": "ok"})
    return GPU_SAMPLES.columns_of(rows, defaults=_UNMEASURED)


def _every(interval_s: float, stop: threading.Event, fn: Callable[[], None]) -> threading.Thread:
    def loop() -> None:
        while True:
            fn()
            if stop.wait(interval_s):
                fn()  # one last sample after the load
                return

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    return thread


def run_fleet(store: Store, config: dict[str, Any], options: FleetOptions,
              status: Any = None) -> tuple[dict[str, Any], Any]:
    """Run the whole fleet part; the JSON-ready results and the heatmap result."""
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    from triscope.collectors.otel_exporter import TriscopeSpanExporter
    from triscope.collectors.serving_metrics import ServingMetricsConfig, ServingMetricsScraper
    from triscope.writer import Writer
    from triscope_bed.demo.analysis import backend_counts, heatmap_doc, replay_weights

    def say(text: str) -> None:
        if status is not None:
            status.update(text)

    gpus = {g.name: g for g in SPECS}
    backends = [SimBackend(g.engine()) for g in SPECS]
    fleet = BackgroundBackends(backends)
    tally = _Sent()
    writer = None
    provider = None
    try:
        fleet.start()
        with tempfile.TemporaryDirectory(prefix="triscope-demo-spool-") as spool:
            writer = Writer(store, spool, flush_interval_s=0.5, fsync=False)
            writer.start()
            submit = writer.submit
            scraper = ServingMetricsScraper(ServingMetricsConfig.from_mapping({"targets": [
                {"url": f"http://{b.address}/metrics", "server": "vllm", "host": host_of(b.spec.name)}
                for b in backends]}))

            def scrape() -> None:
                for table, cols in scraper.collect().items():
                    submit(table, cols)

            def sample_gpus() -> None:
                submit(GPU_SAMPLES, gpu_rows(backends, gpus, encode_ts(time.time_ns())))

            exporter = TriscopeSpanExporter(writer)  # spans take the same write path as the scrapes
            provider = TracerProvider(resource=Resource.create({"service.name": "triscope-demo-loadgen"}))
            provider.add_span_processor(BatchSpanProcessor(exporter, max_queue_size=1 << 16,
                                                           schedule_delay_millis=250, max_export_batch_size=2048))
            tracer = provider.get_tracer("triscope.demo")
            rng = random.Random(options.seed)
            offsets = arrivals(options.seconds, options.qps_per_backend * len(backends), options.burst_factor, rng)
            stop = threading.Event()
            t0_ns = time.time_ns()
            threads = [_every(options.scrape_interval_s, stop, scrape),
                       _every(options.gpu_interval_s, stop, sample_gpus)]
            say(f"fleet: {len(offsets)} requests over {options.seconds:g}s to {len(backends)} simulated backends")
            classes = list(CLASSES.values())
            t0 = time.monotonic()
            futures = []
            with ThreadPoolExecutor(max_workers=256, thread_name_prefix="demo-load") as pool:
                for i, offset in enumerate(offsets):
                    delay = t0 + offset - time.monotonic()
                    if delay > 0:
                        time.sleep(delay)
                    backend = backends[rng.randrange(len(backends))]
                    cls = rng.choices(classes, weights=[c.share for c in classes])[0]
                    tokens = (max(1, round(cls.prompt_tokens * rng.uniform(0.8, 1.2))),
                              max(1, round(cls.completion_tokens * rng.uniform(0.8, 1.2))))
                    futures.append(pool.submit(_request, tracer, backend, cls, f"demo-{t0_ns}-{i}", tokens, tally))
                load_end_ns = t0_ns + int(options.seconds * 1e9)
                say("fleet: waiting for the last requests")
            end_ns = time.time_ns()
            client_errors = sorted({_one_line(exc) for f in futures if (exc := f.exception()) is not None})
            stop.set()
            for thread in threads:
                thread.join(timeout=10)
            say("fleet: flushing spans, serving metrics and GPU samples")
            provider.force_flush()
            provider.shutdown()
            provider = None
            writer.close()
            writer_stats = dict(writer.stats)
            writer = None
            scrape_errors = dict(scraper.errors)
    finally:
        if provider is not None:
            provider.shutdown()
        if writer is not None:
            writer.close()
        fleet.close()
    say("fleet: heatmap and weights")
    out: dict[str, Any] = {
        "simulated": "backends and their GPU memory are simulated (the test bed, triscope_bed); collectors, "
                     "store, heatmap and weight engine are the real ones",
        "window": {"start_ns": t0_ns, "load_end_ns": load_end_ns, "end_ns": end_ns},
        "options": {k: (str(v) if isinstance(v, Path) else v) for k, v in dataclasses.asdict(options).items()},
        "writer": writer_stats, "scrape_errors": scrape_errors, "span_rejected": exporter.rejected,
        "client_errors": client_errors,
    }
    rows = []
    for b in backends:
        gpu = gpus[b.spec.name]
        rows.append({"name": gpu.name, "address": b.address, "host": host_of(gpu.name),
                     "gpu_memory_total_bytes": gpu.memory_total_bytes, "kv_pool_bytes": gpu.kv_capacity_bytes,
                     "requests_sent": tally.sent.get(gpu.name, 0), "requests_ok": tally.ok.get(gpu.name, 0),
                     "requests_failed": tally.errors.get(gpu.name, 0)})
    out["backends"] = backend_counts(store, rows, t0_ns, end_ns, SIM_SOURCE)
    out["requests_sent"] = len(offsets)
    out["spans_stored"] = sum(r["spans_stored"] for r in out["backends"])
    addresses = [b.address for b in backends]
    out["heatmap"], heatmap = heatmap_doc(store, config, addresses, t0_ns, end_ns, options.png)
    out["weights"] = replay_weights(store, config, rows, t0_ns, load_end_ns)
    return out, heatmap


def _one_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]
