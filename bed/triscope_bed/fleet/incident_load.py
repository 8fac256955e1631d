"""The load of ``bench/incidents.py``: open-loop arrivals of the vLLM test bed's request classes, each
request's span sent to the daemon like a gateway's (on fleets whose engines send none), and what the
client saw of each request (the ground truth of a breach)."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from triscope_bed.engines.vllm_cpu import SERVED_MODEL
from triscope_bed.fleet.incident_fleet import Engine, Fleet
from triscope_bed.reports.incident_score import Sent
from triscope_bed.workloads.vllm_load import CLASSES, RequestClass

MIX = {"realtime_speech": 0.5, "interactive_image_text": 0.35, "offline_video": 0.15}
"""Share of each request class in the load (the routing classes of docs/weights.md)."""
LONG_PROMPT = RequestClass("offline_video", "long-document", text_tokens=420, media_tokens=0, output_tokens=64)
"""A long prompt that still fits ``--max-model-len 512``: four of them fill a 1,024-token KV cache twice over."""
PER_BACKEND = 32
"""Requests in flight per backend at most, the rest waiting at the client (their wait counts in the latency the
client sees), as an LB's per-server ``maxconn`` does. Without a bound, a backlog piles into the engine: vLLM,
whose KV cache holds a few requests here, preempts and recomputes them over and over (hundreds waiting,
thousands of preemptions) and does not recover at the rate that built the backlog. A pool shared by all
backends (96) coupled them instead: a slowed engine held every worker, and the others' arrivals came late
and in a burst."""


@dataclass
class Tally:
    sent: int = 0
    ok: int = 0
    failed: int = 0
    errors: dict[str, int] = field(default_factory=dict)


class LoadGen:
    """Open-loop load: Poisson arrivals at ``rate`` x ``factor`` requests/s over the fleet, classes from
    :data:`MIX`, backends uniformly at random, or ``skew`` of it to one backend; ``long_to`` turns a share of
    one backend's requests into long prompts. With ``tracer`` each request's span (a gateway's CLIENT span
    naming the backend, ``triscope.request_class``, failure status) goes to the daemon."""

    def __init__(self, fleet: Fleet, rate: float, seed: int, tracer: Any = None,
                 per_backend: int = PER_BACKEND) -> None:
        self.fleet, self.rate, self.tracer = fleet, rate, tracer
        self.per_backend = per_backend
        self.factor = 1.0
        self.skew: tuple[str, float] | None = None
        self.long_to: tuple[str, float, float] | None = None
        """(backend, share, extra): that share of the requests routed to the backend are :data:`LONG_PROMPT`,
        and long prompts are added to it at ``extra`` times its fair share of the rate."""
        self.sent: list[Sent] = []
        self.arrivals: list[tuple[float, str]] = []
        """(wall time, request class) of every arrival, sent or still waiting for a worker."""
        self.rng = random.Random(seed)
        self.stop_event = threading.Event()
        self.pools: dict[str, ThreadPoolExecutor] = {}
        self.tally = Tally()
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self._run, daemon=True, name="load-arrivals")

    def start(self) -> LoadGen:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.stop_event.set()
        self.thread.join(timeout=10)
        for pool in list(self.pools.values()):
            pool.shutdown(wait=True, cancel_futures=True)

    def _pool(self, address: str) -> ThreadPoolExecutor:
        """The backend's own connections: a slow backend holds only its own, as behind an LB's per-server
        maxconn (the arrivals of the others neither wait for it nor come in a burst after it)."""
        if address not in self.pools:
            self.pools[address] = ThreadPoolExecutor(self.per_backend, thread_name_prefix=f"load-{address}")
        return self.pools[address]

    def _pick(self) -> Engine:
        engines = self.fleet.engines
        if self.skew is not None and self.rng.random() < self.skew[1]:
            return self.fleet.by_address(self.skew[0])
        if self.skew is not None:
            others = [e for e in engines if e.address != self.skew[0]]
            return self.rng.choice(others or engines)
        return self.rng.choice(engines)

    def _run(self) -> None:
        names, weights = list(MIX), list(MIX.values())
        nxt = time.monotonic()
        while not self.stop_event.is_set():
            long_to, base = self.long_to, self.rate * self.factor
            extra = base / len(self.fleet.engines) * long_to[2] if long_to is not None else 0.0
            nxt += self.rng.expovariate(base + extra)
            delay = nxt - time.monotonic()
            if delay > 0:
                self.stop_event.wait(delay)
            cls = CLASSES[self.rng.choices(names, weights)[0]]
            if long_to is not None and self.rng.random() < extra / (base + extra):
                e, cls = self.fleet.by_address(long_to[0]), LONG_PROMPT  # the tenant's own requests
            else:
                e = self._pick()
                if long_to is not None and e.address == long_to[0] and self.rng.random() < long_to[1]:
                    cls = LONG_PROMPT
            arrival = time.time()
            with self.lock:
                self.arrivals.append((arrival, cls.name))
            self._pool(e.address).submit(self._one, e, cls, random.Random(self.rng.random()), arrival)

    def _one(self, e: Engine, cls: RequestClass, rng: random.Random, arrival: float) -> None:
        start = time.time_ns()
        ok, err = self.fleet.request(e, cls, rng)
        end = time.time_ns()
        with self.lock:
            self.sent.append(Sent(start / 1e9, e.address, cls.name, (end - start) / 1e9, ok, arrival))
            self.tally.sent += 1
            if ok:
                self.tally.ok += 1
            else:
                self.tally.failed += 1
                key = err[:60]
                self.tally.errors[key] = self.tally.errors.get(key, 0) + 1
        if self.tracer is not None:
            from opentelemetry.trace import SpanKind, Status, StatusCode

            attrs = {"gen_ai.operation.name": "text_completion", "gen_ai.request.model": SERVED_MODEL,
                     "triscope.request_class": cls.name, "server.address": "127.0.0.1", "server.port": e.port,
                     "gen_ai.usage.input_tokens": cls.prompt_tokens, "gen_ai.usage.output_tokens": cls.output_tokens}
            span = self.tracer.start_span(f"text_completion {SERVED_MODEL}", kind=SpanKind.CLIENT, start_time=start,
                                          attributes=attrs)
            if not ok:
                span.set_status(Status(StatusCode.ERROR, err[:200]))
            span.end(end_time=end)


def client_tracer(otlp_url: str) -> tuple[Any, Callable[[], None]]:
    """A tracer whose spans go to ``otlp_url`` over OTLP/HTTP, and its shutdown."""
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider(resource=Resource.create({"service.name": "bench-gateway"}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=otlp_url, timeout=5),
                                                   max_queue_size=1 << 15, schedule_delay_millis=500))
    return provider.get_tracer("triscope.bench.incidents"), provider.shutdown


__all__ = ["LONG_PROMPT", "MIX", "PER_BACKEND", "LoadGen", "Tally", "client_tracer"]
