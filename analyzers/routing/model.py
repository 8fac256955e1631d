"""What the weight engine reads and returns: backend inputs, per-backend verdicts, fleet results, state."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from triscope.analyzers.routing.config import NAN, WeightParams

READY = "ready"
DRAIN = "drain"
DOWN = "down"
"""A backend that does not answer (scrape refused, requests failing, spans stopped): no traffic until it answers."""
QPS_COUNTS = "completed"
"""What a backend's ``qps`` counts: requests that finished (spans are written when a request ends; the
engine's success counter rises then), not requests offered; a backend refusing work shows a low rate."""
SOURCE_GPU, SOURCE_SERVING, SOURCE_REQUESTS = "gpu", "serving", "requests"
"""Keys of :attr:`BackendInputs.sources`: GPU samples, serving-metrics scrapes, request spans."""


@dataclass(frozen=True)
class BackendInputs:
    """What the engine knows about one backend; NaN means not measured.

    ``sources`` maps a source (``gpu``, ``serving``, ``requests``) to the epoch seconds of its newest sample.
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
    preemptions: float = NAN
    """Rise of the engine's preemptions counter over ``preemption_lookback_s`` (``vllm:num_preemptions``)."""
    sleep_state: float = NAN
    """``vllm:engine_sleep_state``: 0 awake, > 0 sleeping (its level)."""
    scrape_up: float = NAN
    """The latest scrape of its metrics: 1 answered, 0 failed (refused, timed out, garbage); NaN when not scraped."""
    scrape_error: str = ""
    """The latest failed scrape's one-line error (empty when ``scrape_up`` is not 0)."""
    scrape_failing_s: float = NAN
    """How long its scrapes have failed in a row (since the last one that answered); NaN while they answer."""
    span_count: float = NAN
    """Request spans of the backend within ``window_s``; NaN when the backend has no spans at all."""
    trailing_errors: float = NAN
    """Failed requests in a row at the end of ``window_s`` (0 when the newest succeeded); NaN without spans."""

    @property
    def memory_used_ratio(self) -> float:
        used, total = self.memory_used_bytes, self.memory_total_bytes
        if not (math.isfinite(used) and math.isfinite(total)) or total <= 0:
            return NAN
        return min(1.0, max(0.0, used / total))

    def updated_at(self) -> float:
        """Oldest of the latest GPU / serving samples (newest requests row when neither); NaN if none."""
        primary = [self.sources[s] for s in (SOURCE_GPU, SOURCE_SERVING) if math.isfinite(self.sources.get(s, NAN))]
        if primary:
            return min(primary)
        return self.sources.get(SOURCE_REQUESTS, NAN)


@dataclass(frozen=True)
class BackendState:
    """Engine memory of one backend between updates; ``address`` and ``sources`` keep a backend
    published (as absent) once its inputs are gone."""

    weight: float
    drained: bool = False
    first_seen: float = NAN
    address: str = ""
    sources: Mapping[str, float] = field(default_factory=dict)
    down: bool = False
    ready_since: float = NAN
    """When it last became ready (new, or back from drain or down): the silence rule waits a window."""


@dataclass(frozen=True)
class EngineState:
    """Everything :func:`~triscope.analyzers.routing.scoring.compute_weights` carries from one update to the next."""

    backends: Mapping[str, BackendState] = field(default_factory=dict)
    version: int = 0
    published: tuple = ()
    kv_above_since: float = NAN
    kv_below_since: float = NAN
    newest_instance_at: float = NAN
    stale: bool = False
    class_closed: frozenset[tuple[str, str]] = frozenset()
    """(class, backend) pairs closed by the class's admission limit at the last update."""
    absent: frozenset[str] = frozenset()
    """Backends published without inputs at the last update (what :func:`forget` removes by default)."""
    class_levels: Mapping[str, ClassLevel] = field(default_factory=dict)
    """Each class's admission level at the last update (hysteresis)."""


def forget(state: EngineState, names: Iterable[str] | None = None) -> tuple[EngineState, tuple[str, ...]]:
    """``state`` without the named backends (default: every absent one), and the names removed.
    A forgotten backend that reports again comes back as new (slow start)."""
    drop = set(state.absent if names is None else names) & set(state.backends)
    kept = {n: b for n, b in state.backends.items() if n not in drop}
    return replace(state, backends=kept, absent=state.absent - drop), tuple(sorted(drop))


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
    missing: tuple[str, ...] = ()
    """Factors whose input this backend does not report: each took the fleet's median penalty."""

    def to_dict(self) -> dict[str, Any]:
        i = self.inputs
        return {
            "weight": _num(self.weight), "target": _num(self.target), "lb_weight": self.lb_weight,
            "state": self.state, "drained": self.state == DRAIN, "down": self.state == DOWN,
            "reasons": list(self.reasons), "missing": list(self.missing),
            "address": i.address,
            "age_seconds": _num(self.age_seconds), "drain_suppressed": self.drain_suppressed,
            "factors": {k: _num(v) for k, v in self.factors.items()},
            "inputs": {
                "memory_used_ratio": _num(i.memory_used_ratio),
                "memory_used_bytes": _num(i.memory_used_bytes),
                "memory_total_bytes": _num(i.memory_total_bytes),
                "kv_cache_usage_ratio": _num(i.kv_cache_usage_ratio),
                "qps": _num(i.qps), "capacity_qps": _num(i.capacity_qps),
                "preemptions": _num(i.preemptions), "sleep_state": _num(i.sleep_state),
                "p99_seconds": {k: _num(v) for k, v in i.p99_seconds.items()},
                "healthy": i.healthy,
                "scrape_up": _num(i.scrape_up), "scrape_error": i.scrape_error,
                "scrape_failing_s": _num(i.scrape_failing_s),
                "span_count": _num(i.span_count), "trailing_errors": _num(i.trailing_errors),
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


NORMAL, DEGRADE, LIMIT, BREAK = "normal", "degrade", "limit", "break"
LEVELS = (NORMAL, DEGRADE, LIMIT, BREAK)
"""In order of severity; ``triscope_class_admission_level`` exports the index."""


@dataclass(frozen=True)
class ClassLevel:
    """One class's admission level and what the gateway does about it."""

    level: str = NORMAL
    shed_ratio: float = 0.0
    """Share of the class's requests to shed (``degrade``; the lowest class also at ``limit``)."""
    admit_ratio: float = 1.0
    """Share of the class's recent arrival rate to admit (``limit``)."""
    since: float = -math.inf
    reason: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"level": self.level, "shed_ratio": self.shed_ratio, "admit_ratio": self.admit_ratio,
                "since": self.since if math.isfinite(self.since) else None, "reason": self.reason}

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any]) -> ClassLevel:
        level = doc.get("level")
        if level not in LEVELS:
            raise ValueError(f"unknown admission level {level!r}")
        return cls(str(level), _ratio(doc.get("shed_ratio"), 0.0), _ratio(doc.get("admit_ratio"), 1.0),
                   reason=str(doc.get("reason") or ""))


def _ratio(value: Any, default: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return default
    return min(1.0, max(0.0, float(value)))


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
    """Per class, per backend: ``ready`` or ``drain`` for requests of that class; HAProxy per-class
    pools read it with ``agent-send "NAME CLASS"``."""
    absent_backends: tuple[str, ...] = ()
    """Known backends with no inputs within ``lookback_s``: still published (docs/weights.md)."""
    unknown_backends: tuple[str, ...] = ()
    """Backends no load balancer can know (no address, no scrape, not configured): left out."""
    class_levels: Mapping[str, ClassLevel] = field(default_factory=dict)
    """Per class: its admission level (analyzers/routing/levels.py); all ``normal`` while levels are off."""
    pressure: float = NAN
    """The fleet pressure the levels were set from (NaN when nothing is measured); 1.0 = full, above = past full."""
    pressure_source: str = ""
    """What set the pressure: ``kv``, ``queue`` or ``latency``."""
    down_backends: tuple[str, ...] = ()
    """Backends that do not answer: published with state ``down`` and no traffic."""

    def class_state(self, backend: str, request_class: str) -> str | None:
        """``ready``/``drain`` of ``backend`` for ``request_class``; None when either is unknown."""
        return self.class_admission.get(request_class, {}).get(backend)

    def to_dict(self) -> dict[str, Any]:
        """The ``/v1/weights`` document."""
        return {
            "version": self.version, "computed_at": self.computed_at, "stale": self.stale,
            "stale_backends": list(self.stale_backends), "down_backends": list(self.down_backends),
            "drain_suppressed": self.drain_suppressed,
            "absent_backends": list(self.absent_backends), "unknown_backends": list(self.unknown_backends),
            "interval_s": self.interval_s,
            "qps_counts": QPS_COUNTS,
            "backends": {name: b.to_dict() for name, b in sorted(self.backends.items())},
            "classes": {name: {k: _num(v) for k, v in c.items()} for name, c in self.classes.items()},
            "scale": self.scale.to_dict(),
            "class_admission": {
                name: {"backends": dict(sorted(states.items())),
                       "open_backends": sum(1 for s in states.values() if s == READY),
                       "shedding": bool(states) and all(s == DRAIN for s in states.values())}
                for name, states in sorted(self.class_admission.items())},
            "class_levels": {name: level.to_dict() for name, level in sorted(self.class_levels.items())},
            "pressure": _num(self.pressure), "pressure_source": self.pressure_source,
        }


def _num(x: float) -> float | None:
    """JSON has no NaN: not-measured values become null."""
    return float(x) if isinstance(x, int | float) and math.isfinite(x) else None


def with_address(inputs: BackendInputs, params: WeightParams) -> BackendInputs:
    """Fill ``address`` (config, else the name when it is host:port) and ``capacity_qps`` from the config."""
    cfg = params.backends.get(inputs.backend)
    address = inputs.address or (cfg.address if cfg else "") or (inputs.backend if _is_host_port(inputs.backend)
                                                                 else "")
    capacity = inputs.capacity_qps
    if not math.isfinite(capacity) and cfg and cfg.capacity_qps > 0:
        capacity = cfg.capacity_qps
    return replace(inputs, address=address, capacity_qps=capacity)


def lb_knows(inputs: BackendInputs, params: WeightParams) -> bool:
    """Whether the backend is one of the fleet's: configured in ``[weights.backends]``, or with
    telemetry of its own (a scrape, answered or failed, or GPU samples). A name seen only in request
    spans (a gateway's ``server.address``, an SDK's random ``service.instance.id``) is not: nothing
    vouches that it exists or is the fleet's, and it has no numbers to weigh."""
    return bool(inputs.backend in params.backends or SOURCE_SERVING in inputs.sources
                or SOURCE_GPU in inputs.sources or math.isfinite(inputs.scrape_up))


def _is_host_port(text: str) -> bool:
    host, sep, port = text.rpartition(":")
    return bool(sep and host and port.isdigit() and 0 < int(port) < 65536)


def split_address(address: str) -> tuple[str, int]:
    """``host:port`` -> (host, port); raises ValueError when malformed."""
    if not _is_host_port(address):
        raise ValueError(f"not host:port: {address!r}")
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)
