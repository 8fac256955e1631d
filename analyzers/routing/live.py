"""A backend's live signals for the per-request picker, read from its ``/metrics`` page (vLLM, SGLang).

Only the handful of families the picker weighs are parsed (:func:`triscope.prom_text.keep_families`).
An engine exporting several series of a gauge (data-parallel engines, several models) is summed for
requests and capacity and averaged for the usage ratio.
"""

from __future__ import annotations

import math

from triscope.analyzers.routing.picker import LiveSignals
from triscope.errors import InputError
from triscope.prom_text import Series, keep_families, parse_exposition

_RUNNING = ("vllm:num_requests_running", "sglang:num_running_reqs")
_WAITING = ("vllm:num_requests_waiting", "sglang:num_queue_reqs")
_KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "sglang:token_usage")
_VLLM_CACHE_INFO = "vllm:cache_config_info"
_SGLANG_TOKENS = "sglang:max_total_num_tokens"
# V1 registers the counter as vllm:num_preemptions (exposed with _total); SGLang's preemption is a retraction
_PREEMPTIONS = ("vllm:num_preemptions_total", "vllm:num_preemptions", "sglang:num_retracted_requests_total")
_WAITING_BY_REASON = "vllm:num_requests_waiting_by_reason"
FAMILIES = frozenset((*_RUNNING, *_WAITING, *_KV_USAGE, *_PREEMPTIONS, _VLLM_CACHE_INFO, _SGLANG_TOKENS,
                      _WAITING_BY_REASON))


def live_signals(text: str, now: float, source: str = "metrics", requested: float = math.nan) -> LiveSignals:
    """The picker's view of one scrape answered at ``now`` (sent at ``requested``); InputError (one line)
    when the page has none of its gauges."""
    series = parse_exposition(keep_families(text, FAMILIES), source)
    running, waiting, usage = _first(series, _RUNNING), _first(series, _WAITING), _first(series, _KV_USAGE)
    if not (running or waiting or usage):
        raise InputError(f"{source}: none of vLLM's or SGLang's running / waiting / KV-usage gauges")
    return LiveSignals(
        waiting=sum(waiting) if waiting else math.nan,
        running=sum(running) if running else math.nan,
        kv_usage=sum(usage) / len(usage) if usage else math.nan,
        kv_capacity_tokens=_capacity_tokens(series),
        updated=now,
        requested=requested,
        preemptions_total=sum(p) if (p := _first(series, _PREEMPTIONS)) else math.nan,
        waiting_for_capacity=sum(v for labels, v in series.get(_WAITING_BY_REASON, [])
                                 if labels.get("reason") == "capacity" and math.isfinite(v))
        if _WAITING_BY_REASON in series else math.nan,
    )


def _first(series: Series, names: tuple[str, ...]) -> list[float]:
    """Finite values of the first of ``names`` the page has."""
    for name in names:
        if series.get(name):
            return [v for _, v in series[name] if math.isfinite(v)]
    return []


def _capacity_tokens(series: Series) -> float:
    """KV tokens the engine can hold: vLLM's cache blocks (less block 0, its null block) x block size,
    or SGLang's ``max_total_num_tokens``; NaN when the page says neither."""
    total = 0.0
    for labels, _ in series.get(_VLLM_CACHE_INFO, []):
        try:
            blocks, size = int(labels.get("num_gpu_blocks") or 0), int(labels.get("block_size") or 0)
        except ValueError:
            continue
        total += max(0, blocks - 1) * size
    if total > 0:
        return total
    tokens = [v for _, v in series.get(_SGLANG_TOKENS, []) if math.isfinite(v) and v > 0]
    return sum(tokens) if tokens else math.nan
