"""The data layer of the GIE endpoint picker (:mod:`triscope_bed.peers.gie_epp`): a pool's pods and the
values GIE's vLLM mapping reads from each pod's ``/metrics`` (no I/O here: the scraper fetches)."""

from __future__ import annotations

from dataclasses import dataclass

from triscope.errors import InputError
from triscope.prom_text import keep_families, parse_exposition


@dataclass(frozen=True)
class PodMetrics:
    """One scrape's worth of a pod's metrics; ``updated`` is ``time.monotonic()`` of the scrape."""

    waiting: int = 0
    running: int = 0
    kv_usage: float = 0.0
    block_size: int = 0
    num_gpu_blocks: int = 0
    updated: float = float("-inf")


@dataclass(frozen=True)
class Pod:
    """An endpoint of the pool: a name (GIE's namespaced name) and its ``IP:port``."""

    name: str
    address: str


FAMILIES = ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc",
            "vllm:cache_config_info")


def parse_pod_metrics(text: str, now: float) -> PodMetrics:
    """The values GIE's vLLM mapping reads from a ``/metrics`` page (InputError when none is there)."""
    series = parse_exposition(keep_families(text, FAMILIES), "metrics")

    def first(name: str) -> tuple[dict[str, str], float] | None:
        samples = series.get(name)
        return samples[0] if samples else None

    waiting, running, kv = first("vllm:num_requests_waiting"), first("vllm:num_requests_running"), \
        first("vllm:kv_cache_usage_perc")
    if waiting is None and running is None and kv is None:
        raise InputError("metrics: none of vLLM's queue/running/kv-cache gauges")
    block_size = num_blocks = 0
    info = first("vllm:cache_config_info")
    if info is not None:
        block_size = _int_label(info[0], "block_size")
        num_blocks = _int_label(info[0], "num_gpu_blocks")
    return PodMetrics(int(waiting[1]) if waiting else 0, int(running[1]) if running else 0,
                      kv[1] if kv else 0.0, block_size, num_blocks, now)


def _int_label(labels: dict[str, str], key: str) -> int:
    try:
        return int(labels.get(key, "0") or 0)
    except ValueError:
        return 0
