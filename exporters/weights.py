"""Routing-weight engine: backend inputs (memory, KV cache, load, tail latency) -> LB weights.

The core, :func:`compute_weights`, is a pure function of the inputs, the previous
:class:`EngineState`, the :class:`WeightParams` and ``now``. :func:`read_inputs` assembles
:class:`BackendInputs` from the store tables. The formula is documented in docs/weights.md.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from triscope.config import deep_merge
from triscope.errors import ConfigError

NAN = float("nan")
READY = "ready"
DRAIN = "drain"
READMIT_GAP = 0.05
"""Default ``admit_kv_ratio - readmit_kv_ratio`` of a class admission limit (readmit never below 0)."""

DEFAULT_CLASSES: dict[str, dict[str, float]] = {
    "realtime_speech": {"sla_ms": 200.0, "weight": 8.0, "alpha": 2.5},
    "interactive_image_text": {"sla_ms": 800.0, "weight": 4.0, "alpha": 2.0},
    "offline_video": {"sla_ms": 5000.0, "weight": 1.0, "alpha": 1.0},
}

DEFAULTS: dict[str, Any] = {
    "interval_s": 1.0,
    "window_s": 10.0,
    "lookback_s": 300.0,
    "stale_after_s": 15.0,
    "discover": True,
    "floor": 0.05,
    "ewma_down": 0.7,
    "ewma_up": 0.2,
    "max_step_down": 0.5,
    "max_step_up": 0.1,
    "slow_start": True,
    "drain_memory_ratio": 0.97,
    "release_memory_ratio": 0.92,
    "drain_kv_ratio": 0.98,
    "release_kv_ratio": 0.90,
    "latency_penalty_cap": 100.0,
    "sharpness": 1.0,
    "queue_weight": 0.0,
    "default_capacity_qps": 0.0,
    "default_class": "interactive_image_text",
    "lb_scale": 100,
    "scale_up_ratio": 0.85,
    "scale_up_for_s": 2.0,
    "scale_down_ratio": 0.40,
    "scale_down_for_s": 5.0,
    "scale_down_cooldown_s": 30.0,
    "history": True,
    "history_flush_s": 10.0,
    "classes": DEFAULT_CLASSES,
    "backends": {},
    "feed": {
        "bind": "127.0.0.1",
        "port": 9470,
        "agent_port": 9471,
        "max_body_bytes": 1 << 20,  # Envoy 1.40 REST DiscoveryRequests are ~77 KB (node metadata)
        "max_connections": 512,
        "envoy_cluster": "triscope",
        "traefik_service": "triscope",
        "traefik_entrypoints": ["web"],
        "traefik_rule": "PathPrefix(`/`)",
    },
}


@dataclass(frozen=True)
class RequestClass:
    """A request class: latency SLA, priority weight and the exponent of its P99 penalty."""

    name: str
    sla_seconds: float
    weight: float
    alpha: float
    admit_kv_ratio: float = NAN
    """KV-cache usage at or above which a backend stops admitting this class (NaN = no class limit:
    the class follows the backend's own ready/drain state). Lower-priority classes get lower limits,
    so a filling backend sheds them first and keeps room for the urgent ones."""
    readmit_kv_ratio: float = NAN
    """Usage below which a backend closed to the class admits it again (hysteresis)."""
    admit_batch_ratio: float = NAN
    """Batch occupancy, ``(running + waiting) / max_num_seqs``, at or above which a backend stops
    admitting this class (NaN = no limit; needs the backend's ``max_num_seqs``). A request's
    decode steps slow down with the batch it shares: this keeps long requests off crowded batches."""
    readmit_batch_ratio: float = NAN
    """Occupancy below which a backend closed to the class admits it again (hysteresis)."""

    @property
    def has_kv_limit(self) -> bool:
        return math.isfinite(self.admit_kv_ratio)

    @property
    def has_batch_limit(self) -> bool:
        return math.isfinite(self.admit_batch_ratio)

    @property
    def has_admission_limit(self) -> bool:
        return self.has_kv_limit or self.has_batch_limit


@dataclass(frozen=True)
class BackendConfig:
    """Static facts about one backend from ``[weights.backends.NAME]``."""

    name: str
    host: str = ""
    gpus: tuple[int, ...] = ()
    address: str = ""
    capacity_qps: float = 0.0
    max_inflight: int = 0
    """Concurrency the backend takes at full weight (0 = unset); the HAProxy agent sends
    ``maxconn:round(max_inflight * weight)`` (admission control, see docs/weights.md)."""
    max_num_seqs: int = 0
    """The engine's batch size limit (vLLM ``--max-num-seqs``; 0 = unknown): the denominator of a
    class's ``admit_batch_ratio``. vLLM's metrics do not expose it, so it is configured."""


@dataclass(frozen=True)
class WeightParams:
    """Every tunable of the engine and the feed (see docs/weights.md for meanings and defaults)."""

    interval_s: float = 1.0
    window_s: float = 10.0
    lookback_s: float = 300.0
    stale_after_s: float = 15.0
    discover: bool = True
    floor: float = 0.05
    ewma_down: float = 0.7
    ewma_up: float = 0.2
    max_step_down: float = 0.5
    max_step_up: float = 0.1
    slow_start: bool = True
    drain_memory_ratio: float = 0.97
    release_memory_ratio: float = 0.92
    drain_kv_ratio: float = 0.98
    release_kv_ratio: float = 0.90
    latency_penalty_cap: float = 100.0
    sharpness: float = 1.0
    queue_weight: float = 0.0
    default_capacity_qps: float = 0.0
    default_class: str = "interactive_image_text"
    lb_scale: int = 100
    scale_up_ratio: float = 0.85
    scale_up_for_s: float = 2.0
    scale_down_ratio: float = 0.40
    scale_down_for_s: float = 5.0
    scale_down_cooldown_s: float = 30.0
    history: bool = True
    history_flush_s: float = 10.0
    classes: Mapping[str, RequestClass] = field(default_factory=lambda: _classes(DEFAULT_CLASSES))
    backends: Mapping[str, BackendConfig] = field(default_factory=dict)
    feed: Mapping[str, Any] = field(default_factory=lambda: dict(DEFAULTS["feed"]))

    @classmethod
    def from_config(cls, config: Mapping[str, Any] | None = None) -> WeightParams:
        """Parameters from the ``[weights]`` section of a loaded config (defaults for missing keys)."""
        section = deep_merge(DEFAULTS, (config or {}).get("weights", {}) or {})
        unknown = set(section) - set(DEFAULTS)
        if unknown:
            raise ConfigError(f"[weights]: unknown key(s) {', '.join(sorted(unknown))}")
        kwargs: dict[str, Any] = {}
        for name, default in DEFAULTS.items():
            if name in ("classes", "backends", "feed"):
                continue
            value = section[name]
            try:
                kwargs[name] = type(default)(value)
            except (TypeError, ValueError):
                raise ConfigError(f"[weights] {name} = {value!r} is not a {type(default).__name__}") from None
        kwargs["classes"] = _classes(section["classes"])
        kwargs["backends"] = _backends(section["backends"])
        kwargs["feed"] = section["feed"]
        params = cls(**kwargs)
        params.validate()
        return params

    def validate(self) -> None:
        """Raise ConfigError for values that make the formula meaningless."""
        checks = [
            (0 < self.floor <= 1, "floor must be in (0, 1]"),
            (0 < self.ewma_down <= 1 and 0 < self.ewma_up <= 1, "ewma_down/ewma_up must be in (0, 1]"),
            (self.max_step_down > 0 and self.max_step_up > 0, "max_step_down/max_step_up must be > 0"),
            (self.interval_s > 0 and self.window_s > 0, "interval_s and window_s must be > 0"),
            (self.stale_after_s > 0, "stale_after_s must be > 0"),
            (self.release_memory_ratio <= self.drain_memory_ratio, "release_memory_ratio > drain_memory_ratio"),
            (self.release_kv_ratio <= self.drain_kv_ratio, "release_kv_ratio > drain_kv_ratio"),
            (self.lb_scale >= 1, "lb_scale must be >= 1"),
            (0 < self.sharpness <= 4, "sharpness must be in (0, 4]"),
            (self.queue_weight >= 0, "queue_weight must be >= 0"),
            (self.default_class in self.classes, f"default_class {self.default_class!r} is not a class"),
        ]
        for ok, message in checks:
            if not ok:
                raise ConfigError(f"[weights] {message}")


def _classes(raw: Mapping[str, Any]) -> dict[str, RequestClass]:
    out = {}
    for name, spec in raw.items():
        if not isinstance(spec, Mapping):
            raise ConfigError(f"[weights.classes.{name}] must be a table")
        try:
            admit, readmit = _limit_pair(spec, "kv")
            admit_batch, readmit_batch = _limit_pair(spec, "batch")
            out[name] = RequestClass(name, float(spec["sla_ms"]) / 1000.0, float(spec["weight"]),
                                     float(spec["alpha"]), admit, readmit, admit_batch, readmit_batch)
        except (KeyError, TypeError, ValueError):
            raise ConfigError(f"[weights.classes.{name}] needs numeric sla_ms, weight and alpha "
                              "(and numeric admit_/readmit_ kv and batch ratios when given)") from None
        cls = out[name]
        if cls.sla_seconds <= 0:
            raise ConfigError(f"[weights.classes.{name}] sla_ms must be > 0")
        for kind, admit, readmit, top in (("kv", cls.admit_kv_ratio, cls.readmit_kv_ratio, 1.0),
                                          ("batch", cls.admit_batch_ratio, cls.readmit_batch_ratio, math.inf)):
            if math.isfinite(admit) and not (0 <= readmit <= admit <= top):
                raise ConfigError(f"[weights.classes.{name}] needs 0 <= readmit_{kind}_ratio <= admit_{kind}_ratio"
                                  f"{' <= 1' if top == 1.0 else ''}, got {readmit:g} and {admit:g}")
            if math.isfinite(readmit) and not math.isfinite(admit):
                raise ConfigError(f"[weights.classes.{name}] readmit_{kind}_ratio needs admit_{kind}_ratio")
    return out


def _limit_pair(spec: Mapping[str, Any], kind: str) -> tuple[float, float]:
    """``admit_<kind>_ratio`` and ``readmit_<kind>_ratio`` (default: admit - READMIT_GAP, >= 0)."""
    admit = float(spec.get(f"admit_{kind}_ratio", NAN))
    default = max(0.0, admit - READMIT_GAP) if math.isfinite(admit) else NAN
    return admit, float(spec.get(f"readmit_{kind}_ratio", default))


def _backends(raw: Mapping[str, Any]) -> dict[str, BackendConfig]:
    out = {}
    for name, spec in raw.items():
        if not isinstance(spec, Mapping):
            raise ConfigError(f"[weights.backends.{name}] must be a table")
        try:
            out[name] = BackendConfig(name, str(spec.get("host", "")),
                                      tuple(int(g) for g in spec.get("gpus", ())),
                                      str(spec.get("address", "")), float(spec.get("capacity_qps", 0.0)),
                                      int(spec.get("max_inflight", 0)), int(spec.get("max_num_seqs", 0)))
        except (TypeError, ValueError):
            raise ConfigError(f"[weights.backends.{name}]: gpus, max_inflight and max_num_seqs must be integers, "
                              "capacity_qps a number") from None
        if out[name].max_inflight < 0 or out[name].max_num_seqs < 0:
            raise ConfigError(f"[weights.backends.{name}] max_inflight and max_num_seqs must be >= 0")
    return out


@dataclass(frozen=True)
class BackendInputs:
    """What the engine knows about one backend; NaN means not measured.

    ``ages`` maps a source (``gpu``, ``serving``, ``requests``) to the epoch seconds of its newest sample.
    """

    backend: str
    memory_used_bytes: float = NAN
    memory_total_bytes: float = NAN
    kv_cache_usage_ratio: float = NAN
    qps: float = NAN
    capacity_qps: float = NAN
    p99_seconds: Mapping[str, float] = field(default_factory=dict)
    healthy: bool = True
    sources: Mapping[str, float] = field(default_factory=dict)
    address: str = ""
    queue_length: float = NAN
    """Requests waiting in the engine's scheduler (``vllm:num_requests_waiting``)."""
    running_requests: float = NAN
    """Requests in the running batch (``vllm:num_requests_running``)."""

    @property
    def memory_used_ratio(self) -> float:
        used, total = self.memory_used_bytes, self.memory_total_bytes
        if not (math.isfinite(used) and math.isfinite(total)) or total <= 0:
            return NAN
        return min(1.0, max(0.0, used / total))

    def updated_at(self) -> float:
        """Oldest of the latest GPU / serving samples (newest requests row when neither); NaN if none."""
        primary = [self.sources[s] for s in ("gpu", "serving") if math.isfinite(self.sources.get(s, NAN))]
        if primary:
            return min(primary)
        return self.sources.get("requests", NAN)


@dataclass(frozen=True)
class BackendState:
    """Engine memory of one backend between updates."""

    weight: float
    drained: bool = False
    first_seen: float = NAN


@dataclass(frozen=True)
class EngineState:
    """Everything :func:`compute_weights` carries from one update to the next."""

    backends: Mapping[str, BackendState] = field(default_factory=dict)
    version: int = 0
    published: tuple = ()
    kv_above_since: float = NAN
    kv_below_since: float = NAN
    newest_instance_at: float = NAN
    stale: bool = False
    class_closed: frozenset[tuple[str, str]] = frozenset()
    """(class, backend) pairs closed by the class's admission limit at the last update."""


@dataclass(frozen=True)
class BackendWeight:
    """The engine's verdict for one backend."""

    backend: str
    weight: float
    target: float
    lb_weight: int
    state: str
    reasons: tuple[str, ...]
    factors: Mapping[str, float]
    inputs: BackendInputs
    age_seconds: float
    drain_suppressed: bool = False

    def to_dict(self) -> dict[str, Any]:
        i = self.inputs
        return {
            "weight": _num(self.weight), "target": _num(self.target), "lb_weight": self.lb_weight,
            "state": self.state, "drained": self.state == DRAIN, "reasons": list(self.reasons),
            "address": i.address,
            "age_seconds": _num(self.age_seconds), "drain_suppressed": self.drain_suppressed,
            "factors": {k: _num(v) for k, v in self.factors.items()},
            "inputs": {
                "memory_used_ratio": _num(i.memory_used_ratio),
                "memory_used_bytes": _num(i.memory_used_bytes),
                "memory_total_bytes": _num(i.memory_total_bytes),
                "kv_cache_usage_ratio": _num(i.kv_cache_usage_ratio),
                "qps": _num(i.qps), "capacity_qps": _num(i.capacity_qps),
                "p99_seconds": {k: _num(v) for k, v in i.p99_seconds.items()},
                "healthy": i.healthy,
                "sources": {k: _num(v) for k, v in i.sources.items()},
            },
        }


@dataclass(frozen=True)
class ScaleDecision:
    """KV-cache scaling recommendation."""

    action: str  # up, down, hold
    fleet_kv_cache_usage_ratio: float
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return {"action": self.action, "fleet_kv_cache_usage_ratio": _num(self.fleet_kv_cache_usage_ratio),
                "reason": self.reason}


@dataclass(frozen=True)
class WeightsResult:
    """One engine update: per-backend weights plus fleet-level flags."""

    backends: Mapping[str, BackendWeight]
    version: int
    computed_at: float
    stale: bool
    stale_backends: tuple[str, ...]
    drain_suppressed: bool
    classes: Mapping[str, Mapping[str, float]]
    scale: ScaleDecision
    interval_s: float = 1.0
    class_admission: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    """Per class, per backend: ``ready`` or ``drain`` for requests of that class (see
    :func:`class_admission`); HAProxy per-class pools read it with ``agent-send "NAME CLASS"``."""

    def class_state(self, backend: str, request_class: str) -> str | None:
        """``ready``/``drain`` of ``backend`` for ``request_class``; None when either is unknown."""
        return self.class_admission.get(request_class, {}).get(backend)

    def to_dict(self) -> dict[str, Any]:
        """The ``/v1/weights`` document."""
        return {
            "version": self.version, "computed_at": self.computed_at, "stale": self.stale,
            "stale_backends": list(self.stale_backends), "drain_suppressed": self.drain_suppressed,
            "interval_s": self.interval_s,
            "backends": {name: b.to_dict() for name, b in sorted(self.backends.items())},
            "classes": {name: {k: _num(v) for k, v in c.items()} for name, c in self.classes.items()},
            "scale": self.scale.to_dict(),
            "class_admission": {
                name: {"backends": dict(sorted(states.items())),
                       "open_backends": sum(1 for s in states.values() if s == READY),
                       "shedding": bool(states) and all(s == DRAIN for s in states.values())}
                for name, states in sorted(self.class_admission.items())},
        }


def _num(x: float) -> float | None:
    """JSON has no NaN: not-measured values become null."""
    return float(x) if isinstance(x, int | float) and math.isfinite(x) else None


# --------------------------------------------------------------------------- formula


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

    Waiting requests that outnumber the running batch mean the scheduler is blocked (KV cache full,
    head-of-line): new requests would queue there however few connections it holds.
    """
    if params.queue_weight <= 0 or not math.isfinite(queue_length) or queue_length <= 0:
        return 1.0
    run = running if math.isfinite(running) else 0.0
    return min(1.0 / params.floor, 1.0 + params.queue_weight * queue_length / max(1.0, run))


def factors(inputs: BackendInputs, params: WeightParams) -> dict[str, float]:
    """The multiplicative penalties of a backend (each >= 1); ``queue`` only when ``queue_weight`` > 0."""
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
    return out


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
    return tuple(reasons)


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


def batch_occupancy(inputs: BackendInputs, max_num_seqs: int) -> float:
    """``(running + waiting) / max_num_seqs``: how full the engine's batch is, and past 1 how
    many requests queue behind it; NaN when unknown (no ``max_num_seqs`` or no running gauge)."""
    if max_num_seqs <= 0 or not math.isfinite(inputs.running_requests):
        return NAN
    waiting = inputs.queue_length if math.isfinite(inputs.queue_length) else 0.0
    return max(0.0, inputs.running_requests + waiting) / max_num_seqs


def class_admission(backends: Mapping[str, BackendWeight], closed_before: frozenset[tuple[str, str]],
                    params: WeightParams, stale: bool) -> tuple[dict[str, dict[str, str]], frozenset[tuple[str, str]]]:
    """Per class and backend: ``drain`` when the backend is drained, or when the class has an
    ``admit_kv_ratio`` and the backend's KV usage reached it, or an ``admit_batch_ratio`` and the
    backend's :func:`batch_occupancy` reached it (the ``readmit_`` ratios once closed); else
    ``ready``. Also returns the closed (class, backend) pairs for the next update.

    Unlike a backend drain, a class may be closed on every backend at once: that is load shedding
    by priority (the LB answers that class 503 at once), not a fleet outage. Stale inputs open
    every class on every backend that is not drained, like the equal-weights fallback.
    """
    states: dict[str, dict[str, str]] = {}
    closed: set[tuple[str, str]] = set()
    occupancy = {name: batch_occupancy(bw.inputs, params.backends[name].max_num_seqs if name in params.backends else 0)
                 for name, bw in backends.items()}
    for cname, cls in params.classes.items():
        per: dict[str, str] = {}
        for name, bw in backends.items():
            was_closed = (cname, name) in closed_before
            shut = (bw.state != DRAIN and not stale and cls.has_admission_limit
                    and (over_limit(bw.inputs.kv_cache_usage_ratio, cls.admit_kv_ratio, cls.readmit_kv_ratio,
                                    was_closed)
                         or over_limit(occupancy[name], cls.admit_batch_ratio, cls.readmit_batch_ratio, was_closed)))
            if shut:
                closed.add((cname, name))
            per[name] = DRAIN if shut or bw.state == DRAIN else READY
        states[cname] = per
    return states, frozenset(closed)


def compute_weights(inputs: Sequence[BackendInputs], previous: EngineState | None,
                    params: WeightParams, now: float) -> tuple[WeightsResult, EngineState]:
    """Weights for ``inputs`` given the previous state; pure (no clock, no I/O)."""
    first_update = previous is None
    prev = previous or EngineState()
    by_name = {i.backend: i for i in inputs}
    names = sorted(by_name)
    ages = {n: now - by_name[n].updated_at() for n in names}
    stale_backends = tuple(n for n in names if not (ages[n] <= params.stale_after_s))
    stale = bool(stale_backends) or not names

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

    fac = {n: factors(by_name[n], params) for n in names}
    results: dict[str, BackendWeight] = {}
    states: dict[str, BackendState] = {}
    suppressed = False
    if stale:
        for n in names:
            results[n] = BackendWeight(n, 1.0, 1.0, lb_weight(1.0, False, params), READY,
                                       ("stale",) if n in stale_backends else (), fac[n], by_name[n],
                                       ages[n])
            states[n] = BackendState(1.0, False, first_seen[n])
    else:
        reasons = {n: drain_reasons(by_name[n], _was_drained(prev, n), params) for n in names}
        drained = {n for n in names if reasons[n]}
        if drained and len(drained) == len(names):
            suppressed = True
            drained = set()
        raw = {n: 1.0 / math.prod(fac[n].values()) for n in names if n not in drained}
        best = max(raw.values())
        for n in names:
            if n in drained:
                results[n] = BackendWeight(n, 0.0, 0.0, 0, DRAIN, reasons[n], fac[n], by_name[n], ages[n])
                states[n] = BackendState(0.0, True, first_seen[n])
                continue
            target = (raw[n] / best) ** params.sharpness
            old = prev.backends.get(n)
            if suppressed and reasons[n]:
                weight = params.floor
            elif first_update:
                weight = max(params.floor, target)
            elif old is None or old.drained:
                weight = params.floor if params.slow_start else max(params.floor, target)
            else:
                weight = damp(old.weight, target, params)
            results[n] = BackendWeight(n, weight, target, lb_weight(weight, False, params), READY,
                                       reasons[n] if suppressed else (), fac[n], by_name[n], ages[n],
                                       drain_suppressed=suppressed and bool(reasons[n]))
            states[n] = BackendState(weight, False, first_seen[n])

    if stale:  # a sustained condition cannot be verified on stale numbers: hold and restart the timers
        scale, above, below = ScaleDecision("hold", NAN, "inputs are stale"), NAN, NAN
    else:
        # the instance that appeared in this very update already starts the cooldown
        scale, above, below = scale_decision(inputs, replace(prev, newest_instance_at=newest), params, now)
    admission, closed = class_admission(results, prev.class_closed, params, stale)
    published = (tuple((n, results[n].lb_weight, results[n].state) for n in names) + (("stale", stale),)
                 + tuple(sorted(closed)))
    version = prev.version + 1 if published != prev.published else prev.version
    result = WeightsResult(results, version, now, stale, stale_backends, suppressed,
                           class_priorities(inputs, params), scale, params.interval_s, admission)
    state = EngineState(states, version, published, above, below, newest, stale, closed)
    return result, state


def _was_drained(state: EngineState, name: str) -> bool:
    old = state.backends.get(name)
    return bool(old and old.drained)


def with_address(inputs: BackendInputs, params: WeightParams) -> BackendInputs:
    """Fill ``address`` (config, else the name when it is host:port) and ``capacity_qps`` from the config."""
    cfg = params.backends.get(inputs.backend)
    address = inputs.address or (cfg.address if cfg else "") or (inputs.backend if _is_host_port(inputs.backend)
                                                                 else "")
    capacity = inputs.capacity_qps
    if not math.isfinite(capacity) and cfg and cfg.capacity_qps > 0:
        capacity = cfg.capacity_qps
    return replace(inputs, address=address, capacity_qps=capacity)


def _is_host_port(text: str) -> bool:
    host, sep, port = text.rpartition(":")
    return bool(sep and host and port.isdigit() and 0 < int(port) < 65536)


def split_address(address: str) -> tuple[str, int]:
    """``host:port`` -> (host, port); raises ValueError when malformed."""
    if not _is_host_port(address):
        raise ValueError(f"not host:port: {address!r}")
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def read_inputs(store: Any, params: WeightParams, now: float) -> list[BackendInputs]:
    """Assemble :class:`BackendInputs` from the store (see :mod:`triscope.exporters.weights_store`)."""
    from triscope.exporters.weights_store import read_inputs as _read

    return _read(store, params, now)

__all__ = ["BackendConfig", "BackendInputs", "BackendState", "BackendWeight", "EngineState", "READY", "DRAIN",
           "RequestClass", "ScaleDecision", "WeightParams", "WeightsResult", "class_admission", "class_priorities",
           "compute_weights", "damp", "drain_reasons", "factors", "headroom_penalty", "latency_penalty",
           "queue_penalty",
           "lb_weight", "read_inputs", "scale_decision", "split_address", "with_address"]
