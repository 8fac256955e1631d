"""Admission: backend drain with hysteresis, and per-class limits on KV usage and batch occupancy."""

from __future__ import annotations

import math
from collections.abc import Mapping

from triscope.analyzers.routing.config import NAN, WeightParams
from triscope.analyzers.routing.model import DRAIN, READY, BackendInputs, BackendWeight


def over_limit(ratio: float, limit: float, release: float, was_over: bool) -> bool:
    """``ratio >= limit``, or ``>= release`` once over (hysteresis); False when not measured."""
    return math.isfinite(ratio) and ratio >= (release if was_over else limit)


def drain_reasons(inputs: BackendInputs, was_drained: bool, params: WeightParams) -> tuple[str, ...]:
    """Why a backend must be drained now (empty: it may serve). Hysteresis while already drained."""
    reasons = []
    if over_limit(inputs.memory_used_ratio, params.drain_memory_ratio, params.release_memory_ratio, was_drained):
        reasons.append("memory")
    if over_limit(inputs.kv_cache_usage_ratio, params.drain_kv_ratio, params.release_kv_ratio, was_drained):
        reasons.append("kv_cache")
    if not inputs.healthy:
        reasons.append("health")
    if math.isfinite(inputs.sleep_state) and inputs.sleep_state > 0:  # a sleeping engine holds no weights
        reasons.append("sleep")
    return tuple(reasons)


def down_reasons(inputs: BackendInputs, expected_spans: float, params: WeightParams) -> tuple[str, ...]:
    """Why a backend does not answer now (empty: nothing says so). ``expected_spans``: the request
    spans its share of the fleet's traffic would have made within ``window_s``."""
    reasons = []
    # refused: nothing listens, the process is gone; a scrape that only times out may be an overloaded
    # engine, down once it has failed for stale_after_s
    if inputs.scrape_up == 0 and ("refused" in inputs.scrape_error.lower()
                                  or inputs.scrape_failing_s >= params.stale_after_s):
        reasons.append("scrape_failed")
    if params.down_after_errors > 0 and inputs.trailing_errors >= params.down_after_errors:
        reasons.append("requests_failing")
    if (params.down_silent_requests > 0 and inputs.span_count == 0
            and expected_spans >= params.down_silent_requests):
        reasons.append("spans_stopped")
    return tuple(reasons)


def batch_occupancy(inputs: BackendInputs, max_num_seqs: int) -> float:
    """``(running + waiting) / max_num_seqs``: how full the engine's batch is, and past 1 how
    many requests queue behind it; NaN when unknown (no ``max_num_seqs`` or no running gauge)."""
    if max_num_seqs <= 0 or not math.isfinite(inputs.running_requests):
        return NAN
    waiting = inputs.queue_length if math.isfinite(inputs.queue_length) else 0.0
    return max(0.0, inputs.running_requests + waiting) / max_num_seqs


def class_admission(backends: Mapping[str, BackendWeight], closed_before: frozenset[tuple[str, str]],
                    params: WeightParams, stale: bool) -> tuple[dict[str, dict[str, str]], frozenset[tuple[str, str]]]:
    """Per class and backend: ``drain`` when the backend is drained or down, or when the class has an
    ``admit_kv_ratio`` and the backend's KV usage reached it, or an ``admit_batch_ratio`` and the
    backend's :func:`batch_occupancy` reached it (the ``readmit_`` ratios once closed); else
    ``ready``. Also returns the closed (class, backend) pairs for the next update.

    A class may be closed on every backend at once: load shedding by priority, not an outage.
    Stale inputs open every class on every backend that is not drained, like the equal-weights fallback.
    """
    states: dict[str, dict[str, str]] = {}
    closed: set[tuple[str, str]] = set()
    occupancy = {name: batch_occupancy(bw.inputs, params.backends[name].max_num_seqs if name in params.backends else 0)
                 for name, bw in backends.items()}
    for cname, cls in params.classes.items():
        per: dict[str, str] = {}
        for name, bw in backends.items():
            was_closed = (cname, name) in closed_before
            shut = (bw.state == READY and not stale and cls.has_admission_limit
                    and (over_limit(bw.inputs.kv_cache_usage_ratio, cls.admit_kv_ratio, cls.readmit_kv_ratio,
                                    was_closed)
                         or over_limit(occupancy[name], cls.admit_batch_ratio, cls.readmit_batch_ratio, was_closed)))
            if shut:
                closed.add((cname, name))
            per[name] = DRAIN if shut or bw.state != READY else READY
        states[cname] = per
    return states, frozenset(closed)
