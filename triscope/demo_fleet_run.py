"""The fleet part of ``triscope demo``: simulated backends, real collectors, real analyzers.

1. starts three :mod:`triscope.demo_fleet` backends on 127.0.0.1 (simulators; ``sim-small`` has half
   the GPU memory of the other two, so its KV pool fills first);
2. sends bursty open-loop traffic (Poisson arrivals, calm and burst phases, requests spread evenly
   over the backends, one thread per request) and records every request as an OpenTelemetry client
   span with ``gen_ai.*`` attributes through :class:`~triscope.collectors.otel_exporter.TriscopeSpanExporter`
   into ``requests``;
3. scrapes every backend's ``/metrics`` with the real
   :class:`~triscope.collectors.serving_metrics.ServingMetricsScraper` through the
   :class:`~triscope.writer.Writer` into ``serving_metrics``, and writes the simulators' GPU memory to
   ``gpu_samples`` (``source = 'demo-sim'``: simulated, there is no GPU);
4. runs the heatmap analyzer over the load window (PNG too) and replays the weight engine
   (:func:`~triscope.exporters.weights.read_inputs` + :func:`~triscope.exporters.weights.compute_weights`)
   once per second over the stored data, as the live feed would have run.
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
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from triscope.demo_fleet import CLASSES, GB, MODEL, DemoClass, SimBackend, SimSpec
from triscope.schema import qualified
from triscope.store import Store

SIM_SOURCE = "demo-sim"
SPECS = (
    SimSpec("sim-a", memory_total_bytes=12 * GB),
    SimSpec("sim-b", memory_total_bytes=12 * GB),
    SimSpec("sim-small", memory_total_bytes=6 * GB),
)
SMALL = "sim-small"


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
    out, t = [], 0.0
    while True:
        t += rng.expovariate(peak)
        if t >= seconds:
            return out
        now_rate = rate * burst if (t % period) / period >= 0.45 else rate
        if rng.random() < now_rate / peak:
            out.append(t)


def host_of(spec: SimSpec) -> str:
    return f"demo-{spec.name}"


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


def _request(tracer: Any, backend: SimBackend, cls: DemoClass, request_id: str, rng_tokens: tuple[int, int],
             tally: _Sent) -> None:
    """One request and its span (``gen_ai.*`` attributes, server timings when it succeeded)."""
    from opentelemetry.trace import SpanKind, Status, StatusCode

    prompt, completion = rng_tokens
    start = time.time_ns()
    status, doc = _post(backend.port, {"model": MODEL, "request_class": cls.name,
                                       "prompt_tokens": prompt, "max_tokens": completion})
    end = time.time_ns()
    attrs: dict[str, Any] = {
        "gen_ai.operation.name": "chat", "gen_ai.request.model": MODEL, "gen_ai.request.id": request_id,
        "gen_ai.request.modality": cls.modality, "triscope.request_class": cls.name,
        "server.address": "127.0.0.1", "server.port": backend.port,
        "host.name": host_of(backend.spec), "triscope.gpu": "0",
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


def _gpu_rows(backends: list[SimBackend], ts_text: str) -> dict[str, list[Any]]:
    """``gpu_samples`` rows (every NVML sampler column) with the simulated memory; the rest not measured."""
    from triscope.schema.gpu import GPU_SAMPLES

    cols: dict[str, list[Any]] = {c.name: [] for c in GPU_SAMPLES.columns}
    for b in backends:
        used, total = b.gpu_memory()
        known = {"ts": ts_text, "host": host_of(b.spec), "gpu": 0, "gpu_uuid": f"SIM-{b.spec.name}",
                 "gpu_model": f"simulated {total / GB:g} GB GPU (demo)", "source": SIM_SOURCE,
                 "memory_used_bytes": used, "memory_total_bytes": total, "state": "ok"}
        for col in GPU_SAMPLES.columns:
            default: Any = "" if "String" in col.type else 0 if col.type.startswith(("UInt", "Int")) else math.nan
            cols[col.name].append(known.get(col.name, default))
    return cols


def _every(interval_s: float, stop: threading.Event, fn: Any) -> threading.Thread:
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
    """Run the whole fleet part; returns the JSON-ready results (see the module docstring) and the
    :class:`~triscope.analyzers.heatmap.HeatmapResult`."""
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    from triscope.collectors.otel_exporter import TriscopeSpanExporter
    from triscope.collectors.serving_metrics import ServingMetricsScraper
    from triscope.schema import encode_ts
    from triscope.writer import Writer

    def say(text: str) -> None:
        if status is not None:
            status.update(text)

    backends = [SimBackend(spec).start() for spec in SPECS]
    tally = _Sent()
    writer = None
    provider = None
    try:
        with tempfile.TemporaryDirectory(prefix="triscope-demo-spool-") as spool:
            writer = Writer(store, spool, flush_interval_s=0.5, fsync=False)
            writer.start()
            scraper = ServingMetricsScraper({"serving_metrics": {"targets": [
                {"url": f"http://{b.address}/metrics", "server": "vllm", "host": host_of(b.spec)} for b in backends]}})

            def scrape() -> None:
                for table, cols in scraper.collect().items():
                    writer.submit(table, cols)

            def sample_gpus() -> None:
                writer.submit("gpu_samples", _gpu_rows(backends, encode_ts(time.time_ns())))

            exporter = TriscopeSpanExporter(store, interval_s=0.5)
            provider = TracerProvider(resource=Resource.create({"service.name": "triscope-demo-loadgen"}))
            provider.add_span_processor(BatchSpanProcessor(exporter, max_queue_size=1 << 16,
                                                           schedule_delay_millis=250, max_export_batch_size=2048))
            tracer = provider.get_tracer("triscope.demo")
            rng = random.Random(options.seed)
            offsets = arrivals(options.seconds, options.qps_per_backend * len(backends), options.burst_factor, rng)
            stop = threading.Event()
            t0_ns = time.time_ns()
            threads = [_every(options.scrape_interval_s, stop, scrape), _every(options.gpu_interval_s, stop, sample_gpus)]
            say(f"fleet: {len(offsets)} requests over {options.seconds:g}s to {len(backends)} simulated backends")
            t0 = time.monotonic()
            futures = []
            with ThreadPoolExecutor(max_workers=256, thread_name_prefix="demo-load") as pool:
                for i, offset in enumerate(offsets):
                    delay = t0 + offset - time.monotonic()
                    if delay > 0:
                        time.sleep(delay)
                    backend = backends[rng.randrange(len(backends))]
                    cls = rng.choices(CLASSES, weights=[c.share for c in CLASSES])[0]
                    tokens = (max(1, round(cls.prompt_tokens * rng.uniform(0.8, 1.2))),
                              max(1, round(cls.completion_tokens * rng.uniform(0.8, 1.2))))
                    futures.append(pool.submit(_request, tracer, backend, cls, f"demo-{t0_ns}-{i}", tokens, tally))
                load_end_ns = t0_ns + int(options.seconds * 1e9)
                say("fleet: waiting for the last requests")
            end_ns = time.time_ns()
            client_errors = sorted({_one_line(f.exception()) for f in futures if f.exception() is not None})
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
        for b in backends:
            b.close()
    say("fleet: heatmap and weights")
    out: dict[str, Any] = {
        "simulated": "backends and their GPU memory are simulated (triscope.demo_fleet); collectors, "
                     "store, heatmap and weight engine are the real ones",
        "window": {"start_ns": t0_ns, "load_end_ns": load_end_ns, "end_ns": end_ns},
        "options": {k: (str(v) if isinstance(v, Path) else v) for k, v in dataclasses.asdict(options).items()},
        "writer": writer_stats, "scrape_errors": scrape_errors, "span_rejected": exporter.rejected,
        "client_errors": client_errors,
    }
    names = {b.address: b for b in backends}
    out["backends"] = _backend_counts(store, backends, tally, t0_ns, end_ns)
    out["requests_sent"] = len(offsets)
    out["spans_stored"] = sum(r["spans_stored"] for r in out["backends"])
    out["heatmap"], heatmap = _heatmap(store, config, list(names), t0_ns, end_ns, options.png)
    out["weights"] = _weights(store, config, backends, t0_ns, load_end_ns)
    return out, heatmap


def _backend_counts(store: Store, backends: list[SimBackend], tally: _Sent, t0_ns: int, end_ns: int
                    ) -> list[dict[str, Any]]:
    """Per backend: what was sent, and what the store holds for it in the window."""
    p = {"t0": t0_ns, "t1": end_ns + 1, "names": [b.address for b in backends]}
    win = "ts >= fromUnixTimestamp64Nano({t0:Int64}) AND ts < fromUnixTimestamp64Nano({t1:Int64})"
    spans = dict(store.query(
        f"SELECT backend, count() FROM {qualified(store, 'requests')} WHERE {win} AND backend IN {{names:Array(String)}} "
        "GROUP BY backend", p).rows)
    p99 = dict(store.query(
        f"SELECT backend, quantileExact(0.99)(latency_seconds) FROM {qualified(store, 'requests')} "
        f"WHERE {win} AND backend IN {{names:Array(String)}} AND status = 'ok' GROUP BY backend", p).rows)
    scrapes = dict(store.query(
        f"SELECT backend, count() FROM {qualified(store, 'serving_metrics')} WHERE {win} "
        "AND backend IN {names:Array(String)} GROUP BY backend", p).rows)
    gpu = dict(store.query(
        f"SELECT host, count() FROM {qualified(store, 'gpu_samples')} WHERE {win} AND source = {{src:String}} "
        "GROUP BY host", {**p, "src": SIM_SOURCE}).rows)
    rows = []
    for b in backends:
        s = b.spec
        rows.append({
            "name": s.name, "address": b.address, "host": host_of(s),
            "gpu_memory_total_bytes": s.memory_total_bytes, "kv_pool_bytes": s.kv_capacity_bytes,
            "requests_sent": tally.sent.get(s.name, 0), "requests_ok": tally.ok.get(s.name, 0),
            "requests_failed": tally.errors.get(s.name, 0), "spans_stored": int(spans.get(b.address, 0)),
            "p99_latency_seconds": _num(p99.get(b.address)),
            "serving_metrics_rows": int(scrapes.get(b.address, 0)), "gpu_samples_rows": int(gpu.get(host_of(s), 0)),
        })
    return rows


def _heatmap(store: Store, config: dict[str, Any], names: list[str], t0_ns: int, end_ns: int,
             png: Path | None) -> tuple[dict[str, Any], Any]:
    from triscope.analyzers.heatmap import HeatmapSpec, compute_heatmap

    result = compute_heatmap(store, HeatmapSpec.from_config(config), t0_ns, end_ns + 1, backends=names)
    doc = {"requests": result.requests, "unmatched_requests": result.unmatched,
           "tensor_sum": int(result.tensor.sum()), "shape": list(result.tensor.shape),
           "nonzero_cells": int((result.tensor > 0).sum()),
           "latency_marginal": result.tensor.sum(axis=(0, 1)).tolist(), "patterns": result.patterns,
           "seconds": result.seconds, "png": None}
    if png is not None and result.requests:
        from triscope.commands.heatmap import write_png

        png.parent.mkdir(parents=True, exist_ok=True)
        write_png(result, str(png), None)
        doc["png"] = str(png)
    return doc, result


def _weights(store: Store, config: dict[str, Any], backends: list[SimBackend], t0_ns: int, load_end_ns: int
             ) -> dict[str, Any]:
    """Replay the engine every ``interval_s`` over the stored rows (inputs as of each instant)."""
    from triscope.exporters.weights import (
        BackendConfig,
        WeightParams,
        compute_weights,
        read_inputs,
        with_address,
    )

    params = WeightParams.from_config(config)
    params = dataclasses.replace(params, discover=False, history=False, backends={
        b.address: BackendConfig(b.address, host_of(b.spec), (0,), b.address) for b in backends})
    start, end = t0_ns / 1e9, load_end_ns / 1e9
    steps = max(1, int((end - start) / params.interval_s))
    times = [start + params.interval_s * (i + 1) for i in range(steps)]
    if end - times[-1] > 1e-3:
        times.append(end)
    state = None
    timeline: list[dict[str, Any]] = []
    result = None
    for now in times:
        inputs = [with_address(i, params) for i in read_inputs(store, params, now)]
        result, state = compute_weights(inputs, state, params, now)
        timeline.append({"t_s": round(now - start, 3), "stale": result.stale,
                         **{n: {"weight": w.weight, "drained": w.state == "drain"} for n, w in result.backends.items()}})
    assert result is not None
    doc = result.to_dict()
    by_addr = {b.address: b.spec.name for b in backends}
    for addr, entry in doc["backends"].items():
        entry["name"] = by_addr.get(addr, addr)
        seen = [t[addr] for t in timeline if addr in t]
        entry["min_weight"] = min(s["weight"] for s in seen) if seen else None
        entry["drained_updates"] = sum(1 for s in seen if s["drained"])
    doc["updates"] = len(timeline)
    doc["timeline"] = timeline
    return doc


def _one_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def _num(x: Any) -> float | None:
    try:
        v = float(x)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None
