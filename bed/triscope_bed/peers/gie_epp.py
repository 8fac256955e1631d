"""A re-implementation of the Gateway API Inference Extension Endpoint Picker's default profile.

GIE (kubernetes-sigs/gateway-api-inference-extension, read at 1748e829) is Go on Kubernetes; this
module is its scheduling path in pure Python so a bench can put it behind a real Envoy (see
:mod:`triscope_bed.peers.gie_extproc`). What is reproduced, with GIE's defaults:

* data layer: each pod's ``/metrics`` scraped every 50 ms; ``vllm:num_requests_waiting``,
  ``vllm:num_requests_running``, ``vllm:kv_cache_usage_perc`` and the ``block_size`` /
  ``num_gpu_blocks`` labels of ``vllm:cache_config_info``; a failed scrape keeps the last values
  and their timestamp;
* admission (legacy controller, flow control off): a request whose objective priority is < 0 is
  dropped with 429 when the pool saturation (mean over pods of ``max(waiting/5, kv/0.8)``, a pod
  with metrics older than 200 ms counting 1.0) is >= 1;
* the default profile: no filters; queue scorer (weight 2), kv-cache scorer (weight 2), prefix
  scorer (weight 3), each score clamped to [0, 1]; max-score picker, ties broken by a shuffle;
* the approximate prefix index: the prompt in 16-token x 4-char blocks (block size from the pods'
  ``cache_config_info``), at most 256 blocks, chained xxhash64 seeded by the model name, greedy
  match stopping at the first block no pod has, per-pod LRU of ``num_gpu_blocks`` entries (31,250
  when the pod does not report it), the chosen pod recorded after the pick.

The pods and their metrics are :mod:`triscope_bed.peers.gie_pods`, the prefix index
:mod:`triscope_bed.peers.gie_prefix`. Everything but :class:`MetricsScraper` is free of I/O: tests
drive :class:`EndpointPicker` with hand-made ``PodMetrics``.
"""

from __future__ import annotations

import functools
import json
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from triscope.errors import InputError
from triscope.http_fetch import fetch
from triscope.ticker import Ticker
from triscope_bed.peers.gie_pods import Pod, PodMetrics, parse_pod_metrics
from triscope_bed.peers.gie_prefix import PrefixIndexer, hash_prompt, user_input

OBJECTIVE_HEADER = "x-gateway-inference-objective"
"""GIE names the request's InferenceObjective in this header; the objective carries its priority."""
MAX_METRICS_BYTES = 1 << 20


@dataclass(frozen=True)
class GieParams:
    """The picker's knobs; the defaults are GIE's at 1748e829."""

    queue_weight: float = 2.0
    kv_weight: float = 2.0
    prefix_weight: float = 3.0
    queue_depth_threshold: int = 5
    kv_util_threshold: float = 0.8
    saturation_staleness_s: float = 0.2
    """The utilization detector's own staleness limit (its default, 200 ms)."""
    unready_after_s: float = 3.0
    """A pod whose scrapes have failed for this long leaves the candidates until one succeeds: what Kubernetes'
    readiness probe does to the InferencePool's endpoints (1 s period x 3 failures); 0 keeps every pod."""
    metrics_staleness_s: float = 2.0
    """EPP's ``--metrics-staleness-threshold``: only reported (GIE uses it for its pool gauges)."""
    refresh_s: float = 0.05
    block_size_tokens: int = 16
    chars_per_token: int = 4
    max_prefix_blocks: int = 256
    lru_capacity: int = 31_250
    auto_tune: bool = True
    """Block size and LRU capacity from the pods' ``vllm:cache_config_info`` when they report it."""
    default_model: str = "sim/llava-onevision-7b"
    """Model name for bodies without ``model`` (GIE answers those 400; the sim's clients omit it)."""
    objectives: dict[str, int] = field(default_factory=dict)
    """InferenceObjective name -> priority (Kubernetes objects in GIE); unknown or absent: 0."""


@dataclass
class Decision:
    """The picker's answer: a pod, or an HTTP status GIE would answer with (and its body)."""

    pod: Pod | None = None
    status: int = 200
    message: str = ""
    scores: dict[str, float] = field(default_factory=dict)
    prefix_match: dict[str, int] = field(default_factory=dict)
    total_blocks: int = 0
    saturation: float | None = None


def saturation(metrics: list[PodMetrics | None], now: float, p: GieParams) -> float:
    """Pool saturation of the utilization detector: mean per-pod roofline, stale pods at 1.0."""
    if not metrics:
        return 1.0
    total = 0.0
    for m in metrics:
        if m is None or now - m.updated > p.saturation_staleness_s:
            total += 1.0
        else:
            total += max(m.waiting / p.queue_depth_threshold, m.kv_usage / p.kv_util_threshold)
    return total / len(metrics)


def queue_scores(metrics: list[PodMetrics]) -> list[float]:
    """Min-max normalised waiting queue: shortest 1, longest 0, all equal 1."""
    qs = [m.waiting for m in metrics]
    lo, hi = min(qs), max(qs)
    return [1.0 if hi == lo else (hi - q) / (hi - lo) for q in qs]


def kv_scores(metrics: list[PodMetrics]) -> list[float]:
    return [1.0 - m.kv_usage for m in metrics]


def clamp(score: float) -> float:
    return 0.0 if score < 0 else 1.0 if score > 1 else score


class EndpointPicker:
    """GIE's request path (admission, prefix data, default profile, pick, record) on given pods.

    Thread-safe: one lock covers the prefix index and the tie-breaking RNG.
    """

    def __init__(self, params: GieParams | None = None, seed: int | None = None) -> None:
        self.params = params or GieParams()
        self.indexer = PrefixIndexer(self.params.lru_capacity)
        self.rng = random.Random(seed)
        self.lock = threading.Lock()

    def block_size(self, metrics: list[PodMetrics]) -> int:
        """Tokens per block: the first pod's reported block size under auto-tune, else the default."""
        p = self.params
        if p.auto_tune and metrics and metrics[0].block_size > 0:
            return metrics[0].block_size
        return p.block_size_tokens

    def decide(self, pods: list[tuple[Pod, PodMetrics | None]], body: bytes, headers: dict[str, str],
               now: float | None = None) -> Decision:
        """Pick a pod for a request with this (buffered) JSON body and these lower-cased headers."""
        now = time.monotonic() if now is None else now
        p = self.params
        try:
            doc = json.loads(body)
            if not isinstance(doc, dict):
                raise ValueError("not an object")
        except ValueError:
            return Decision(status=400, message="inference error: BadRequest - request body is not a JSON object")
        model = doc.get("model")
        if not isinstance(model, str):
            model = p.default_model
        priority = p.objectives.get(headers.get(OBJECTIVE_HEADER, ""), 0)
        sat = None
        if priority < 0:  # sheddable: GIE only measures the pool for these
            sat = saturation([m for _, m in pods], now, p)
            if sat >= 1.0:
                return Decision(status=429, saturation=sat, message="inference error: ResourceExhausted - "
                                "system saturated, sheddable request dropped")
        if not pods:
            return Decision(status=503, message="inference error: ServiceUnavailable - "
                            "failed to find endpoint candidates for serving the request")
        metrics = [m or PodMetrics() for _, m in pods]  # never scraped: GIE's zero-valued metrics
        block_tokens = self.block_size(metrics)
        text = user_input(doc)
        hashes = [] if text is None else hash_prompt(model, text[1], text[0], block_tokens * p.chars_per_token,
                                                     p.max_prefix_blocks)
        with self.lock:
            matched = self.indexer.match(hashes)
            total = len(hashes)
            prefix = [matched.get(pod.name, 0) / total if total else 0.0 for pod, _ in pods]
            score = [0.0] * len(pods)
            for weight, scores in ((p.queue_weight, queue_scores(metrics)), (p.kv_weight, kv_scores(metrics)),
                                   (p.prefix_weight, prefix)):
                score = [s + clamp(x) * weight for s, x in zip(score, scores, strict=True)]
            order = list(range(len(pods)))
            self.rng.shuffle(order)  # random tie break, then a stable sort by score
            order.sort(key=lambda i: -score[i])
            chosen, chosen_metrics = pods[order[0]]
            capacity = chosen_metrics.num_gpu_blocks if p.auto_tune and chosen_metrics else 0
            self.indexer.add(hashes, chosen.name, capacity)
        return Decision(chosen, 200, "", {pod.name: s for (pod, _), s in zip(pods, score, strict=True)},
                        matched, total, sat)

    def random_pod(self, pods: list[Pod]) -> Pod | None:
        """A body-less request (GET): GIE sends it to a random endpoint."""
        with self.lock:
            return self.rng.choice(pods) if pods else None


class MetricsScraper:
    """One thread per pod fetching ``http://<address>/metrics`` every ``refresh_s``."""

    def __init__(self, pods: list[Pod], params: GieParams, timeout_s: float = 1.0,
                 on_text: Callable[[Pod, str, float], None] | None = None,
                 on_error: Callable[[Pod, InputError], None] | None = None) -> None:
        self.pods = pods
        self.on_text = on_text
        """Called with each successful scrape's page and time, for a picker that reads more than GIE's gauges."""
        self.on_error = on_error
        """Called with each failed scrape's error (GIE itself only lets the pod's metrics go stale)."""
        self.params = params
        self.timeout_s = timeout_s
        self.metrics: dict[str, PodMetrics | None] = {pod.name: None for pod in pods}
        self.errors: dict[str, str] = {}
        self._tickers = [Ticker(f"gie-scrape-{pod.name}", params.refresh_s, functools.partial(self.scrape_once, pod))
                         for pod in pods]

    def start(self) -> MetricsScraper:
        for ticker in self._tickers:
            ticker.start()
        return self

    def stop(self) -> None:
        for ticker in self._tickers:
            ticker.stop(self.timeout_s + 1)

    def snapshot(self) -> list[tuple[Pod, PodMetrics | None]]:
        """The candidate pods and their latest metrics (unready pods left out, see ``unready_after_s``)."""
        now, limit = time.monotonic(), self.params.unready_after_s
        return [(pod, m) for pod in self.pods
                if (m := self.metrics[pod.name]) is None or limit <= 0 or pod.name not in self.errors
                or now - m.updated <= limit]

    def scrape_once(self, pod: Pod) -> None:
        try:
            text = fetch(f"http://{pod.address}/metrics", timeout_s=self.timeout_s, max_bytes=MAX_METRICS_BYTES)
            page = text.decode(errors="replace")
            metrics = self.metrics[pod.name] = parse_pod_metrics(page, time.monotonic())
            self.errors.pop(pod.name, None)
            if self.on_text is not None:
                self.on_text(pod, page, metrics.updated)
        except InputError as exc:  # keep the last values: they go stale by their timestamp
            self.errors[pod.name] = str(exc)
            if self.on_error is not None:
                self.on_error(pod, exc)

    def stale(self, now: float | None = None) -> list[str]:
        """Pods whose metrics are older than ``metrics_staleness_s`` (GIE's 2 s log/gauge threshold)."""
        now = time.monotonic() if now is None else now
        return [n for n, m in self.metrics.items() if m is None or now - m.updated > self.params.metrics_staleness_s]
