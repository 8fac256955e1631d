"""The weight formula: penalties, damping, scaling advice and :func:`compute_weights` (docs/weights.md).

:func:`compute_weights` is a pure function of the inputs, the previous :class:`EngineState`, the
params and ``now``: no clock, no I/O.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import replace

from triscope.analyzers.routing.admission import class_admission, down_reasons, drain_reasons
from triscope.analyzers.routing.config import NAN, RequestClass, WeightParams
from triscope.analyzers.routing.levels import class_levels, fleet_pressure
from triscope.analyzers.routing.model import (
    DOWN,
    DRAIN,
    READY,
    BackendInputs,
    BackendState,
    BackendWeight,
    EngineState,
    ScaleDecision,
    WeightsResult,
    lb_knows,
)


def headroom_penalty(ratio: float) -> float:
    """``1 / max(0.05, 1 - ratio)`` with the ratio clamped to [0, 1]; 1 when it is not measured."""
    if not math.isfinite(ratio):
        return 1.0
    return 1.0 / max(0.05, 1.0 - min(1.0, max(0.0, ratio)))


def latency_penalty(p99_seconds: float, cls: RequestClass) -> float:
    """``max(1, p99/sla)^alpha``; 1 when the P99 is not measured."""
    if not math.isfinite(p99_seconds) or p99_seconds <= 0:
        return 1.0
    return max(1.0, p99_seconds / cls.sla_seconds) ** cls.alpha


def class_of(name: str, params: WeightParams) -> RequestClass:
    """The request class called ``name``, or the default class for unknown names."""
    return params.classes.get(name) or params.classes[params.default_class]


def queue_penalty(queue_length: float, running: float, params: WeightParams) -> float:
    """``1 + queue_weight * waiting / max(1, running)``, at most ``1 / floor``; 1 when not measured.

    More waiting than running means the scheduler is blocked (KV cache full, head-of-line).
    """
    if params.queue_weight <= 0 or not math.isfinite(queue_length) or queue_length <= 0:
        return 1.0
    run = running if math.isfinite(running) else 0.0
    return min(1.0 / params.floor, 1.0 + params.queue_weight * queue_length / max(1.0, run))


def factors(inputs: BackendInputs, params: WeightParams) -> dict[str, float]:
    """The multiplicative penalties of a backend (each >= 1); ``queue`` only when ``queue_weight`` > 0,
    ``preemption`` only when the preemptions counter is measured."""
    capacity = inputs.capacity_qps if math.isfinite(inputs.capacity_qps) else params.default_capacity_qps
    load = 1.0
    if capacity > 0 and math.isfinite(inputs.qps):
        load = headroom_penalty(min(1.0, max(0.0, inputs.qps / capacity)))
    latency = 1.0
    for name, p99 in inputs.p99_seconds.items():
        latency = max(latency, latency_penalty(p99, class_of(name, params)))
    out = {
        "memory": headroom_penalty(inputs.memory_used_ratio),
        "kv_cache": headroom_penalty(inputs.kv_cache_usage_ratio),
        "load": load,
        "latency": min(latency, params.latency_penalty_cap),
    }
    if params.queue_weight > 0:
        out["queue"] = queue_penalty(inputs.queue_length, inputs.running_requests, params)
    if math.isfinite(inputs.preemptions):  # preempting: in trouble before KV usage reads 100 %
        out["preemption"] = params.preemption_penalty if inputs.preemptions > 0 else 1.0
    return out


def damp(previous: float, target: float, params: WeightParams) -> float:
    """EWMA (cut fast, raise slowly), bounded step, then the floor."""
    alpha = params.ewma_down if target < previous else params.ewma_up
    step = alpha * (target - previous)
    step = min(params.max_step_up, max(-params.max_step_down, step))
    return min(1.0, max(params.floor, previous + step))


def lb_weight(weight: float, drained: bool, params: WeightParams) -> int:
    """Integer weight for load balancers: 0 when drained, else 1..lb_scale."""
    if drained:
        return 0
    return max(1, min(params.lb_scale, round(weight * params.lb_scale)))


def class_priorities(inputs: Sequence[BackendInputs], params: WeightParams) -> dict[str, dict[str, float]]:
    """Per class: SLA, weight, alpha, fleet P99 (worst backend) and ``weight * max(1, p99/sla)^alpha``."""
    out = {}
    for name, cls in params.classes.items():
        p99s = [i.p99_seconds[name] for i in inputs
                if math.isfinite(i.p99_seconds.get(name, NAN))]
        p99 = max(p99s) if p99s else NAN
        out[name] = {"sla_seconds": cls.sla_seconds, "weight": cls.weight, "alpha": cls.alpha,
                     "p99_seconds": p99, "priority_weight": cls.weight * latency_penalty(p99, cls)}
    return out


def scale_decision(inputs: Sequence[BackendInputs], state: EngineState, params: WeightParams,
                   now: float) -> tuple[ScaleDecision, float, float]:
    """KV-cache scaling recommendation; also returns the updated above/below-since timestamps."""
    kvs = [i.kv_cache_usage_ratio for i in inputs if math.isfinite(i.kv_cache_usage_ratio)]
    if not kvs:
        return ScaleDecision("hold", NAN, "no backend reports KV-cache usage"), NAN, NAN
    fleet = sum(kvs) / len(kvs)
    above = state.kv_above_since if fleet >= params.scale_up_ratio else NAN
    below = state.kv_below_since if fleet <= params.scale_down_ratio else NAN
    if fleet >= params.scale_up_ratio and not math.isfinite(above):
        above = now
    if fleet <= params.scale_down_ratio and not math.isfinite(below):
        below = now
    if math.isfinite(above) and now - above >= params.scale_up_for_s:
        return ScaleDecision("up", fleet, f"KV usage >= {params.scale_up_ratio:.0%} for "
                             f"{now - above:.1f}s"), above, below
    if math.isfinite(below) and now - below >= params.scale_down_for_s:
        newest = state.newest_instance_at
        if math.isfinite(newest) and now - newest < params.scale_down_cooldown_s:
            return ScaleDecision("hold", fleet, f"KV usage low but an instance appeared {now - newest:.1f}s ago "
                                 f"(cooldown {params.scale_down_cooldown_s:g}s)"), above, below
        return ScaleDecision("down", fleet, f"KV usage <= {params.scale_down_ratio:.0%} for "
                             f"{now - below:.1f}s"), above, below
    return ScaleDecision("hold", fleet, "KV usage within bounds or not sustained"), above, below


def _first_seen(names: list[str], prev: EngineState, first_update: bool, now: float) -> tuple[dict[str, float], float]:
    """When each backend was first seen, and the newest appearance (a new instance starts the cooldown)."""
    newest = prev.newest_instance_at
    first_seen: dict[str, float] = {}
    for n in names:
        old = prev.backends.get(n)
        if old is None or not math.isfinite(old.first_seen):
            first_seen[n] = now
            if not first_update and old is None:
                newest = now if not math.isfinite(newest) else max(newest, now)
        else:
            first_seen[n] = old.first_seen
    return first_seen, newest


def _absent(prev: EngineState, present: Mapping[str, BackendInputs], params: WeightParams,
            now: float) -> dict[str, BackendInputs]:
    """Backends published before whose inputs are gone, as inputs holding only their address and
    last sample times. ``forget_after_s`` > 0 drops those silent that long, but only while another
    backend reports: silence of the whole fleet is lost telemetry, not a fleet gone."""
    out = {}
    for name, old in prev.backends.items():
        if name in present:
            continue
        last = BackendInputs(name, address=old.address, sources=dict(old.sources))
        seen = last.updated_at()
        if params.forget_after_s > 0 and present and not (now - seen <= params.forget_after_s):
            continue
        out[name] = last
    return out


def _state(inputs: BackendInputs, weight: float, state: str, first_seen: float, prev: BackendState | None,
           now: float) -> BackendState:
    back = prev is None or prev.drained or prev.down or not math.isfinite(prev.ready_since)
    ready_since = (now if back else prev.ready_since) if state == READY else NAN  # type: ignore[union-attr]
    return BackendState(weight, state == DRAIN, first_seen, inputs.address, dict(inputs.sources), state == DOWN,
                        ready_since)


def missing_factors(inputs: BackendInputs, params: WeightParams) -> set[str]:
    """The factors of :func:`factors` whose input the backend does not report."""
    out = set()
    if not math.isfinite(inputs.memory_used_ratio):
        out.add("memory")
    if not math.isfinite(inputs.kv_cache_usage_ratio):
        out.add("kv_cache")
    capacity = inputs.capacity_qps if math.isfinite(inputs.capacity_qps) else params.default_capacity_qps
    if not (capacity > 0 and math.isfinite(inputs.qps)):
        out.add("load")
    if not any(math.isfinite(v) and v > 0 for v in inputs.p99_seconds.values()):
        out.add("latency")
    if params.queue_weight > 0 and not math.isfinite(inputs.queue_length):
        out.add("queue")
    return out


def impute_missing(fac: Mapping[str, dict[str, float]], missing: Mapping[str, set[str]], measured_by: Sequence[str],
                   targets: Sequence[str]) -> dict[str, tuple[str, ...]]:
    """A factor a backend of ``targets`` does not report takes the median of that factor over the
    backends of ``measured_by`` that report it (in place): not measuring a signal must not win
    traffic. Returns, per backend, the factors filled in."""
    filled: dict[str, list[str]] = {n: [] for n in targets}
    for key in sorted({k for n in targets for k in missing[n]}):
        values = [fac[n][key] for n in measured_by if key not in missing[n] and key in fac[n]]
        if not values:
            continue  # nobody measures it: 1 for all, as the formula says
        median = statistics.median(values)
        for n in targets:
            if key in missing[n] and key in fac[n]:
                fac[n][key] = median
                filled[n].append(key)
    return {n: tuple(keys) for n, keys in filled.items()}


def _expected_spans(present: Mapping[str, BackendInputs], prev: EngineState, params: WeightParams,
                    now: float) -> dict[str, float]:
    """Spans each backend's share of the fleet's traffic (its published weight over the ready ones')
    would have made within ``window_s``, counted from when it became ready."""
    fleet = sum(i.span_count for i in present.values() if math.isfinite(i.span_count))
    ready = {n: b for n, b in prev.backends.items() if not (b.drained or b.down) and b.weight > 0}
    total = sum(b.weight for b in ready.values())
    if fleet <= 0 or total <= 0:
        return {}
    out = {}
    for n in present:
        b = ready.get(n)
        if b is not None and math.isfinite(b.ready_since):
            out[n] = fleet * b.weight / total * min(1.0, max(0.0, (now - b.ready_since) / params.window_s))
    return out


def compute_weights(inputs: Sequence[BackendInputs], previous: EngineState | None,
                    params: WeightParams, now: float) -> tuple[WeightsResult, EngineState]:
    """Weights for ``inputs`` given the previous state; pure (no clock, no I/O).

    Backends no LB can know (:func:`lb_knows`) are left out; backends of ``previous`` missing from
    ``inputs`` stay published as absent; a backend that does not answer is ``down``; one whose
    inputs are late eases to the fleet's median weight on its own (docs/weights.md, "Stale inputs").
    """
    first_update = previous is None
    prev = previous or EngineState()
    given = {i.backend: i for i in inputs}
    unknown = tuple(sorted(n for n, i in given.items() if not lb_knows(i, params) and n not in prev.backends))
    present = {n: i for n, i in given.items() if n not in unknown}
    absent = _absent(prev, present, params, now)
    by_name = {**present, **absent}
    names = sorted(by_name)
    ages = {n: now - by_name[n].updated_at() for n in names}
    expected = _expected_spans(present, prev, params, now)
    down = {n: why for n in sorted(present) if (why := down_reasons(present[n], expected.get(n, 0.0), params))}
    kept_up: dict[str, tuple[str, ...]] = {}
    if down and len(down) == len(present):  # every one down: more likely our view of the fleet broke than the fleet
        kept_up, down = down, {}
    stale_backends = tuple(n for n in sorted(present) if n not in down and not (ages[n] <= params.stale_after_s))
    live = [n for n in sorted(present) if n not in down and n not in stale_backends]
    stale = not live
    first_seen, newest = _first_seen(names, prev, first_update, now)

    fac = {n: factors(by_name[n], params) for n in names}
    missing = {n: missing_factors(by_name[n], params) for n in names}
    filled = impute_missing(fac, missing, live, [*live, *stale_backends])
    results: dict[str, BackendWeight] = {}
    states: dict[str, BackendState] = {}
    suppressed = False

    def publish(n: str, weight: float, target: float, state: str, reasons: tuple[str, ...],
                drain_suppressed: bool = False) -> None:
        results[n] = BackendWeight(n, weight, target, lb_weight(weight, state != READY, params), state, reasons,
                                   fac[n], by_name[n], ages[n], drain_suppressed, filled.get(n, ()))
        states[n] = _state(by_name[n], weight, state, first_seen[n], prev.backends.get(n), now)

    for n, why in down.items():
        publish(n, 0.0, 0.0, DOWN, why)
    if stale:  # nothing fresh to compare: equal weights for every backend that answers
        for n in names:
            if n not in down:
                why = ("absent",) if n in absent else ("stale",) if n in stale_backends else ()
                publish(n, 1.0, 1.0, READY, why + kept_up.get(n, ()), drain_suppressed=n in kept_up)
    else:
        reasons = {n: drain_reasons(by_name[n], _was_drained(prev, n), params) for n in live}
        drained = {n for n in live if reasons[n]}
        if drained and len(drained) == len(live):  # never drain the whole fleet: hold it at the floor
            suppressed = True
            drained = set()
        raw = {n: 1.0 / math.prod(fac[n].values()) for n in live if n not in drained}
        best = max(raw.values())
        targets: dict[str, float] = {}
        for n in live:
            if n in drained:
                publish(n, 0.0, 0.0, DRAIN, reasons[n])
                continue
            target = targets[n] = (raw[n] / best) ** params.sharpness
            old = prev.backends.get(n)
            if suppressed and reasons[n]:
                weight = params.floor
            elif first_update:
                weight = max(params.floor, target)
            elif old is None or old.drained or old.down:
                weight = params.floor if params.slow_start else max(params.floor, target)
            else:
                weight = damp(old.weight, target, params)
            publish(n, weight, target, READY, (reasons[n] if suppressed else ()) + kept_up.get(n, ()),
                    drain_suppressed=(suppressed and bool(reasons[n])) or n in kept_up)
        neutral = statistics.median(targets.values()) if targets else 1.0
        for n in stale_backends:  # late numbers: neither favoured nor starved, eased towards the median
            old = prev.backends.get(n)
            start = params.floor if old is None or old.drained or old.down else old.weight
            publish(n, damp(start, neutral, params) if not first_update else neutral, neutral, READY,
                    ("stale",) + kept_up.get(n, ()), drain_suppressed=n in kept_up)
        for n in sorted(absent):  # no numbers: kept in the LB's list, eased down to the floor
            publish(n, damp(prev.backends[n].weight, params.floor, params), params.floor, READY, ("absent",))

    fresh_inputs = [present[n] for n in live]
    if stale:  # a sustained condition cannot be verified on stale numbers: hold and restart the timers
        scale, above, below = ScaleDecision("hold", NAN, "inputs are stale"), NAN, NAN
    else:
        # the instance that appeared in this very update already starts the cooldown
        scale, above, below = scale_decision(fresh_inputs, replace(prev, newest_instance_at=newest), params, now)
    admission, closed = class_admission(results, prev.class_closed, params, stale)
    pressure, source = (NAN, "") if stale else fleet_pressure({n: results[n] for n in live}, params)
    levels = class_levels(pressure, source, admission, prev.class_levels, params, now, stale)
    published = (tuple((n, results[n].lb_weight, results[n].state) for n in names) + (("stale", stale),)
                 + tuple(sorted(closed))
                 + tuple((c, lv.level, round(lv.shed_ratio, 2)) for c, lv in sorted(levels.items())))
    version = prev.version + 1 if published != prev.published else prev.version
    result = WeightsResult(results, version, now, stale, stale_backends, suppressed or bool(kept_up),
                           class_priorities(fresh_inputs, params), scale, params.interval_s, admission,
                           tuple(sorted(absent)), unknown, levels, pressure, source, tuple(sorted(down)))
    state = EngineState(states, version, published, above, below, newest, stale, closed, frozenset(absent), levels)
    return result, state


def _was_drained(state: EngineState, name: str) -> bool:
    old = state.backends.get(name)
    return bool(old and old.drained)
