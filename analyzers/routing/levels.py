"""Admission levels per request class: ``normal``, ``degrade``, ``limit``, ``break`` (docs/weights.md).

One fleet **pressure** figure (1.0 = full), the most pressing of:

- ``kv``: mean KV-cache usage of the backends that serve (not drained);
- ``queue``: requests waiting per running request, mean over those backends, over ``queue_full``;
- ``latency``: the worst P99 / SLA of a class above the lowest, over ``latency_full`` (a class above
  the lowest missing its SLA is what shedding the lowest is for).

Per class, classes ordered by their weight (DESIGN.md: video 1 < image-text 4 < speech 8):

- ``break``: no backend is open to the class (every one drained or closed to it by its admission
  limit): the gateway answers with its fallback instead of queueing the request nowhere.
- ``limit`` (every class but the top one): pressure >= ``limit_at``: the gateway admits
  ``admit_ratio`` of the class's recent arrival rate (a token bucket per class, at the picker).
- ``degrade`` (the lowest class, also while others are at ``limit``): pressure >= ``degrade_at``: the
  gateway sheds ``shed_ratio`` of its requests, rising from 0 at ``degrade_at`` to ``max_shed_ratio``
  at ``limit_at``.
- ``normal`` otherwise.

Hysteresis: a class goes up a level at once; it comes down only once pressure is ``release_margin``
below the threshold that raised it and it has held the level ``hold_s``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from triscope.analyzers.routing.config import WeightParams
from triscope.analyzers.routing.model import (
    BREAK,
    DEGRADE,
    DRAIN,
    LEVELS,
    LIMIT,
    NORMAL,
    READY,
    BackendWeight,
    ClassLevel,
)


def fleet_pressure(backends: Mapping[str, BackendWeight], params: WeightParams) -> tuple[float, str]:
    """(pressure, what set it) over the backends that serve; (NaN, "") when nothing is measured."""
    serving = [b.inputs for b in backends.values() if b.state == READY]
    parts: dict[str, float] = {}
    kvs = [i.kv_cache_usage_ratio for i in serving if math.isfinite(i.kv_cache_usage_ratio)]
    if kvs:
        parts["kv"] = sum(kvs) / len(kvs)
    queues = [i.queue_length / max(1.0, i.running_requests) for i in serving
              if math.isfinite(i.queue_length) and math.isfinite(i.running_requests)]
    if queues:
        parts["queue"] = sum(queues) / len(queues) / params.levels.queue_full
    lowest = _by_weight(params)[0] if params.classes else ""
    ratios = [p99 / params.classes[c].sla_seconds for i in serving for c, p99 in i.p99_seconds.items()
              if c in params.classes and c != lowest and math.isfinite(p99) and params.classes[c].sla_seconds > 0]
    if ratios:
        parts["latency"] = max(ratios) / params.levels.latency_full
    if not parts:
        return math.nan, ""
    name = max(parts, key=lambda k: parts[k])
    return parts[name], name


def _by_weight(params: WeightParams) -> list[str]:
    """Class names from the lowest weight up (name breaks ties, so the order is stable)."""
    return sorted(params.classes, key=lambda c: (params.classes[c].weight, c))


def class_levels(pressure: float, source: str, admission: Mapping[str, Mapping[str, str]],
                 previous: Mapping[str, ClassLevel], params: WeightParams, now: float,
                 stale: bool) -> dict[str, ClassLevel]:
    """Every class's level for this update from :func:`fleet_pressure`'s ``(pressure, source)`` and the
    class admission per backend (all ``normal`` while levels are off, inputs are stale or no backend reports)."""
    cfg = params.levels
    if not cfg.enabled or stale or not any(admission.values()):
        return {c: ClassLevel(since=now) for c in params.classes}
    order = _by_weight(params)
    out: dict[str, ClassLevel] = {}
    for rank, cname in enumerate(order):
        lowest, top = rank == 0, rank == len(order) - 1
        before = previous.get(cname, ClassLevel())
        states = admission.get(cname, {})
        if states and all(s == DRAIN for s in states.values()):
            wanted, why = BREAK, "no backend open to the class"
        elif math.isfinite(pressure) and pressure >= cfg.limit_at and not top:
            wanted, why = LIMIT, f"{source} pressure {pressure:.2f} >= limit_at {cfg.limit_at:g}"
        elif math.isfinite(pressure) and pressure >= cfg.degrade_at and lowest:
            wanted, why = DEGRADE, f"{source} pressure {pressure:.2f} >= degrade_at {cfg.degrade_at:g}"
        else:
            wanted, why = NORMAL, ""
        level = _with_hysteresis(before, wanted, pressure, now, params)
        if level != wanted:
            why = f"held: {before.reason}" if before.reason else "held"
        out[cname] = _level(level, lowest, pressure, why, before.since if level == before.level else now, params)
    return out


def _with_hysteresis(before: ClassLevel, wanted: str, pressure: float, now: float, params: WeightParams) -> str:
    """``wanted`` when it is as severe or more; else the previous level until it may be released."""
    cfg = params.levels
    if LEVELS.index(wanted) >= LEVELS.index(before.level) or before.level == BREAK:
        return wanted  # a class that has a backend again leaves break at once: it has somewhere to go
    threshold = cfg.limit_at if before.level == LIMIT else cfg.degrade_at
    released = not math.isfinite(pressure) or pressure < threshold - cfg.release_margin
    return wanted if released and now - before.since >= cfg.hold_s else before.level


def _level(level: str, lowest: bool, pressure: float, reason: str, since: float,
           params: WeightParams) -> ClassLevel:
    cfg = params.levels
    if level in (NORMAL, BREAK):
        return ClassLevel(level, since=since, reason=reason)
    shed = 0.0
    if lowest:
        span = max(1e-9, cfg.limit_at - cfg.degrade_at)
        share = (pressure - cfg.degrade_at) / span if math.isfinite(pressure) else 1.0
        shed = cfg.max_shed_ratio * min(1.0, max(0.0, share))
    admit = cfg.limit_admit_ratio if level == LIMIT else 1.0
    return ClassLevel(level, shed, admit, since, reason)
