"""The simulated inference engine: a KV pool, vLLM-style FCFS scheduling, and its ``/metrics`` text.

No GPU and no model: a request holds KV bytes and sleeps (asyncio) for its service time. The demo
and the closed-loop bench serve it over HTTP with :mod:`triscope_bed.engines.backend`; the model is
described in docs/demo.md and docs/closed_loop.md.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass, field

from triscope_bed.engines.engine_paged import PagedKV

GIB = 1024**3
MODEL = "sim/llava-onevision-7b"


@dataclass(frozen=True)
class RequestClass:
    """A request class: share of the traffic, SLA, KV and service time (bench), token counts (demo)."""

    name: str
    modality: str
    share: float
    sla_s: float
    kv_bytes: int
    service_s: float
    prompt_tokens: int
    completion_tokens: int


CLASSES: dict[str, RequestClass] = {c.name: c for c in (
    RequestClass("realtime_speech", "speech", 0.50, 0.200, int(0.25 * GIB), 0.040, 200, 20),
    RequestClass("interactive_image_text", "image", 0.35, 0.800, int(1.5 * GIB), 0.200, 1500, 100),
    RequestClass("offline_video", "video", 0.15, 5.000, int(6.0 * GIB), 1.200, 8000, 200),
)}

# vLLM's histogram buckets (vllm/v1/metrics/loggers.py).
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
# Finer buckets for the per-class latency histogram (what request spans would carry; vLLM has no class label).
CLASS_BUCKETS = (0.025, 0.05, 0.075, 0.1, 0.125, 0.15, 0.175, 0.2, 0.25, 0.3, 0.4, 0.5, 0.65, 0.8, 1.0,
                 1.25, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 6.5, 8.0, 10.0, 15.0, 20.0, 30.0, 60.0)


class Histogram:
    """A cumulative Prometheus histogram."""

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


@dataclass(frozen=True)
class EngineSpec:
    """One simulated engine's limits and costs."""

    name: str
    kv_capacity_bytes: float
    slots: int = 16
    """At most this many requests run at once (vLLM's ``max_num_seqs``)."""
    speed: float = 1.0
    batch_slowdown: float = 0.8
    """Service time grows by ``1 + batch_slowdown * running / slots``."""
    load_at_admission: bool = False
    """``running`` as this request was admitted (the demo), not once its scheduling pass is done (the bench)."""
    staged_fraction: float = 0.0
    """Share of a request's KV held from arrival (staged encoder inputs); a 503 when it does not fit."""
    max_waiting: int | None = None
    """Queued requests beyond which an arrival gets a 503 (vLLM itself queues without bound)."""
    model: str = MODEL
    kv_bytes_per_token: float = 128 * 1024
    prefill_s_per_token: float = 20e-6
    decode_s_per_token: float = 2e-3
    overhead_s: float = 0.0
    """Fixed time per request before it queues (HTTP, tokenizer), outside the batch; 0: none."""
    paged_kv: bool = False
    """vLLM's step loop: KV grows block by block while decoding, preemption (recompute) when a block
    is short, a step's prefill delays its decodes (:mod:`triscope_bed.engines.engine_paged`; costs from the
    per-token figures below); False: a request's whole KV is reserved at admission, its service time
    is fixed then, and nothing is ever preempted."""
    kv_block_tokens: int = 16
    """Paged KV: tokens per block (vLLM: 16 on GPUs, 128 on its CPU backend)."""
    kv_reserved_blocks: int = 0
    """Paged KV: blocks of the pool no request gets (vLLM v1 keeps one null block)."""
    watermark_blocks: int = 0
    """Paged KV: blocks an admission leaves free while something runs (vLLM's ``watermark``, 0 by default)."""


@dataclass(frozen=True)
class Served:
    """Timings of one finished request (seconds)."""

    queue_s: float
    ttft_s: float
    e2e_s: float
    prefill_s: float
    decode_s: float


@dataclass
class _Counters:
    success: dict[str, int] = field(default_factory=dict)
    refused: dict[str, int] = field(default_factory=dict)
    prompt_tokens: int = 0
    generation_tokens: int = 0
    e2e: Histogram = field(default_factory=lambda: Histogram(E2E_BUCKETS))
    ttft: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))
    queue_time: Histogram = field(default_factory=lambda: Histogram(E2E_BUCKETS))
    by_class: dict[str, Histogram] = field(default_factory=lambda: {c: Histogram(CLASS_BUCKETS) for c in CLASSES})


class Engine:
    """KV pool and scheduler of one engine; run on one asyncio loop (not thread-safe)."""

    def __init__(self, spec: EngineSpec) -> None:
        if spec.kv_capacity_bytes <= 0:
            raise ValueError(f"{spec.name}: the model weights leave no room for a KV cache")
        self.spec = spec
        self.capacity = spec.kv_capacity_bytes
        self.kv_used: float = 0
        self.pressure: float = 0
        self.running = 0
        self.waiting = 0
        self.queue: deque[tuple[asyncio.Future[float], float, float]] = deque()
        self.c = _Counters()
        self.peak_kv_ratio = 0.0
        self.paged: PagedKV | None = PagedKV(self) if spec.paged_kv else None

    def kv_ratio(self) -> float:
        return min(1.0, (self.kv_used + self.pressure) / self.capacity)

    def _schedule(self) -> None:
        """FCFS admission: start queued requests while a batch slot and their full KV fit.

        Like vLLM's scheduler it stops at the first request that does not fit (head-of-line), so a
        video waiting for KV blocks the speech requests queued behind it.
        """
        while self.queue and self.running < self.spec.slots:
            fut, kv_bytes, staged = self.queue[0]
            if fut.done():
                self.queue.popleft()
                continue
            grow = kv_bytes - staged
            if self.kv_used + self.pressure + grow > self.capacity and self.running > 0:
                return
            self.queue.popleft()
            self.kv_used += grow
            self.running += 1
            self.peak_kv_ratio = max(self.peak_kv_ratio, self.kv_ratio())
            fut.set_result(self.running / self.spec.slots)

    def refusal(self, kv_bytes: float, staged: float) -> str | None:
        """Why an arrival gets a 503 (None: it is queued)."""
        if kv_bytes > self.capacity:
            return "request exceeds the KV pool"
        if self.spec.max_waiting is not None and self.waiting >= self.spec.max_waiting:
            return "queue full"
        if self.kv_used + self.pressure + staged > self.capacity:
            return "out of memory: KV cache full"
        return None

    async def serve(self, cls: str, kv_bytes: float, work_s: tuple[float, float],
                    tokens: tuple[int, int] = (0, 0), prefix: tuple[tuple[int, ...], int] = ((), 0)) -> Served | str:
        """Queue, run and finish one request: its timings, or the reason for a 503.

        ``work_s`` is (prefill, decode) time on an idle engine; ``cls`` names the class ('' for none).
        With ``spec.paged_kv`` the request runs in the engine's step loop: KV from ``tokens`` (block by
        block), costs from the spec's per-token figures, ``prefix`` (block ids, tokens per id) looked up in
        its prefix cache; ``kv_bytes`` and ``work_s`` are not used.
        """
        t0 = time.monotonic()
        if self.spec.overhead_s > 0:
            await asyncio.sleep(self.spec.overhead_s)
        if self.paged is not None:
            return await self.paged.serve(cls, t0, tokens, prefix)
        staged = int(kv_bytes * self.spec.staged_fraction)
        reason = self.refusal(kv_bytes, staged)
        if reason is not None:
            self.c.refused[cls] = self.c.refused.get(cls, 0) + 1
            return reason
        self.kv_used += staged
        self.peak_kv_ratio = max(self.peak_kv_ratio, self.kv_ratio())
        fut: asyncio.Future[float] = asyncio.get_running_loop().create_future()
        self.queue.append((fut, kv_bytes, staged))
        self.waiting += 1
        admitted = False
        try:
            self._schedule()
            load = await fut
            admitted = True
        finally:
            self.waiting -= 1
            if not admitted:
                self.kv_used -= staged
        started = time.monotonic()
        try:
            if not self.spec.load_at_admission:  # the whole batch it joins, admitted in the same pass or before
                load = self.running / self.spec.slots
            factor = (1.0 + self.spec.batch_slowdown * load) / self.spec.speed
            prefill, decode = work_s[0] * factor, work_s[1] * factor
            await asyncio.sleep(prefill)
            ttft = time.monotonic() - t0
            self.c.ttft.observe(ttft)
            await asyncio.sleep(decode)
        finally:
            self.kv_used -= kv_bytes
            self.running -= 1
            self._schedule()
        done = time.monotonic()
        self.record(cls, t0, started, done, tokens)
        return Served(started - t0, ttft, done - t0, prefill, decode)

    def record(self, cls: str, t0: float, started: float, done: float, tokens: tuple[int, int]) -> None:
        """Count one finished request (arrived ``t0``, first admitted ``started``)."""
        c = self.c
        c.e2e.observe(done - t0)
        c.queue_time.observe(started - t0)
        if cls in c.by_class:
            c.by_class[cls].observe(done - t0)
        c.success[cls] = c.success.get(cls, 0) + 1
        c.prompt_tokens += tokens[0]
        c.generation_tokens += tokens[1]

    def _reschedule(self) -> None:
        if self.paged is not None:
            self.paged.kick()
        else:
            self._schedule()

    def reset(self) -> None:
        """Forget counters and pressure (in-flight requests keep running)."""
        self.pressure = 0
        self.c = _Counters()
        self.peak_kv_ratio = self.kv_ratio()
        if self.paged is not None:
            self.paged.preemptions = 0
        self._reschedule()

    def set_pressure(self, nbytes: float) -> None:
        """Pin ``nbytes`` of KV (a leak, a long-context tenant), bounded by the pool."""
        self.pressure = max(0, min(nbytes, self.capacity))
        self._reschedule()

    def kv_tokens(self) -> int:
        """Tokens' worth of KV the pool holds now: running and staged requests plus pinned pressure.

        What SGLang's ``/get_load`` reports as ``num_tokens`` (used KV slots), at this spec's bytes per token.
        """
        return int((self.kv_used + self.pressure) // self.spec.kv_bytes_per_token)

    def state_json(self) -> dict[str, object]:
        extra = {"preemptions": self.paged.preemptions} if self.paged is not None else {}
        return {**extra, "backend": self.spec.name, "kv_used_bytes": self.kv_used, "pressure_bytes": self.pressure,
                "kv_capacity_bytes": self.capacity, "kv_cache_usage_ratio": self.kv_ratio(),
                "peak_kv_ratio": self.peak_kv_ratio, "running": self.running, "waiting": self.waiting,
                "success": dict(self.c.success), "oom": dict(self.c.refused)}

    def metrics_text(self) -> str:
        """The Prometheus exposition: vLLM's names, labels and buckets, then the simulator's own families."""
        c, lab = self.c, f'engine="0",model_name="{self.spec.model}"'
        lines = [
            "# HELP vllm:num_requests_running Number of requests in model execution batches.",
            "# TYPE vllm:num_requests_running gauge",
            f"vllm:num_requests_running{{{lab}}} {float(self.running)}",
            "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.",
            "# TYPE vllm:num_requests_waiting gauge",
            f"vllm:num_requests_waiting{{{lab}}} {float(self.waiting)}",
            # as vLLM V1 (0.11+) exports it: "capacity" is every waiting request not deferred (no batch slot,
            # token budget or KV blocks for it yet); nothing here defers (no LoRA, no KV transfer)
            "# HELP vllm:num_requests_waiting_by_reason Number of waiting requests by reason.",
            "# TYPE vllm:num_requests_waiting_by_reason gauge",
            f'vllm:num_requests_waiting_by_reason{{{lab},reason="capacity"}} {float(self.waiting)}',
            f'vllm:num_requests_waiting_by_reason{{{lab},reason="deferred"}} 0.0',
            "# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.",
            "# TYPE vllm:kv_cache_usage_perc gauge",
            f"vllm:kv_cache_usage_perc{{{lab}}} {self.kv_ratio():.6f}",
            "# HELP vllm:request_success_total Count of successfully processed requests.",
            "# TYPE vllm:request_success_total counter",
            f'vllm:request_success_total{{{lab},finished_reason="stop"}} {float(sum(c.success.values()))}',
            "# HELP vllm:prompt_tokens_total Number of prefill tokens processed.",
            "# TYPE vllm:prompt_tokens_total counter",
            f"vllm:prompt_tokens_total{{{lab}}} {float(c.prompt_tokens)}",
            "# HELP vllm:generation_tokens_total Number of generation tokens processed.",
            "# TYPE vllm:generation_tokens_total counter",
            f"vllm:generation_tokens_total{{{lab}}} {float(c.generation_tokens)}",
            "# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.",
            "# TYPE vllm:time_to_first_token_seconds histogram",
            *c.ttft.render("vllm:time_to_first_token_seconds", lab),
            "# HELP vllm:e2e_request_latency_seconds Histogram of e2e request latency in seconds.",
            "# TYPE vllm:e2e_request_latency_seconds histogram",
            *c.e2e.render("vllm:e2e_request_latency_seconds", lab),
            "# HELP vllm:request_queue_time_seconds Histogram of time spent in WAITING phase for request.",
            "# TYPE vllm:request_queue_time_seconds histogram",
            *c.queue_time.render("vllm:request_queue_time_seconds", lab),
            "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig",
            "# TYPE vllm:cache_config_info gauge",
            *self._cache_config(),
            "# HELP triscope_sim_kv_capacity_bytes KV pool size of the simulated engine.",
            "# TYPE triscope_sim_kv_capacity_bytes gauge",
            f"triscope_sim_kv_capacity_bytes {float(self.capacity)}",
            "# HELP triscope_sim_request_latency_seconds Server-side latency by request class "
            "(what request spans carry; vLLM has no class label).",
            "# TYPE triscope_sim_request_latency_seconds histogram",
        ]
        for name, hist in c.by_class.items():
            lines += hist.render("triscope_sim_request_latency_seconds", f'request_class="{name}"')
        lines += [
            "# HELP triscope_sim_oom_rejections_total Requests refused with 503 (KV pool full or queue limit).",
            "# TYPE triscope_sim_oom_rejections_total counter",
        ]
        for name in CLASSES:
            lines.append(f'triscope_sim_oom_rejections_total{{request_class="{name}"}} '
                         f"{float(c.refused.get(name, 0))}")
        if self.paged is not None:
            cache = self.paged.cache
            lines += ["# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.",
                      "# TYPE vllm:num_preemptions_total counter",
                      f"vllm:num_preemptions_total{{{lab}}} {float(self.paged.preemptions)}",
                      "# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried "
                      "tokens.",
                      "# TYPE vllm:prefix_cache_queries_total counter",
                      f"vllm:prefix_cache_queries_total{{{lab}}} {float(cache.queried_tokens)}",
                      "# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.",
                      "# TYPE vllm:prefix_cache_hits_total counter",
                      f"vllm:prefix_cache_hits_total{{{lab}}} {float(cache.hit_tokens)}"]
        return "\n".join(lines) + "\n"

    def _cache_config(self) -> list[str]:
        """``vllm:cache_config_info``: the paged pool's real blocks, else the old fixed 16 x 128 KiB reading."""
        if self.paged is None:
            block, blocks = 16, int(self.capacity // (16 * 131072))
        else:
            block, blocks = self.paged.block_tokens, self.paged.total + self.spec.kv_reserved_blocks
        return [f'vllm:cache_config_info{{block_size="{block}",cache_dtype="auto",engine="0",'
                f'gpu_memory_utilization="0.9",num_gpu_blocks="{blocks}"}} 1.0']
