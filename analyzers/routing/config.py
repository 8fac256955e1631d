"""``[weights]``: every tunable of the routing-weight engine and its feed, defaults written once.

Meanings and the formula: docs/weights.md. ``[weights.classes.NAME]`` tables merge key by key
over :data:`DEFAULT_CLASSES` (a class's SLA survives setting only its limit); ``[weights.feed]``
is the load-balancer adapters' table (:class:`FeedConfig`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Self

from triscope.component import ComponentConfig, non_negative
from triscope.config import deep_merge
from triscope.errors import ConfigError

NAN = float("nan")
READMIT_GAP = 0.05
"""Default ``admit_kv_ratio - readmit_kv_ratio`` of a class admission limit (readmit never below 0)."""

DEFAULT_CLASSES: dict[str, dict[str, float]] = {
    "realtime_speech": {"sla_ms": 200.0, "weight": 8.0, "alpha": 2.5},
    "interactive_image_text": {"sla_ms": 800.0, "weight": 4.0, "alpha": 2.0},
    "offline_video": {"sla_ms": 5000.0, "weight": 1.0, "alpha": 1.0},
}
"""The request classes every config has (``[weights.classes.NAME]`` adds or amends)."""


@dataclass(frozen=True)
class RequestClass:
    """A request class: latency SLA, priority weight and the exponent of its P99 penalty."""

    name: str
    sla_seconds: float
    weight: float
    alpha: float
    admit_kv_ratio: float = NAN
    """KV-cache usage at or above which a backend stops admitting this class (NaN = no class limit:
    the class follows the backend's own ready/drain state); lower-priority classes get lower limits."""
    readmit_kv_ratio: float = NAN
    """Usage below which a backend closed to the class admits it again (hysteresis)."""
    admit_batch_ratio: float = NAN
    """Batch occupancy, ``(running + waiting) / max_num_seqs``, at or above which a backend stops
    admitting this class (NaN = no limit; needs the backend's ``max_num_seqs``)."""
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
    ``maxconn:round(max_inflight * weight)``."""
    max_num_seqs: int = 0
    """The engine's batch size limit (vLLM ``--max-num-seqs``; 0 = unknown), the denominator of a
    class's ``admit_batch_ratio``; vLLM's metrics do not expose it, so it is configured."""


@dataclass(frozen=True)
class FeedConfig(ComponentConfig):
    """``[weights.feed]``: listeners of the feed and the names its LB formats publish."""

    section = "weights.feed"
    bind: str = "127.0.0.1"
    port: int = 9470
    """HTTP port (0 = ephemeral, -1 = off)."""
    agent_port: int = 9471
    """HAProxy agent-check port (0 = ephemeral, -1 = off)."""
    serve_process: bool = False
    """Serve both ports from a process of their own, answering polls from tables sent after each update
    (exporters/feed_process.py): polls never wait on the engine; for large fleets and busy feeds."""
    max_body_bytes: int = 1 << 20  # Envoy 1.40 REST DiscoveryRequests are ~77 KB (node metadata)
    max_connections: int = 512
    max_connections_per_client: int = 0
    """Connections at once from one client address (0 = a quarter of max_connections, at least 16)."""
    header_timeout_s: float = 10.0
    """Total time for a request's headers on the HTTP port, however slowly they arrive."""
    envoy_cluster: str = "triscope"
    traefik_service: str = "triscope"
    traefik_entrypoints: tuple[str, ...] = ("web",)
    traefik_rule: str = "PathPrefix(`/`)"
    traefik_scheme: str = "http"

    def validate(self, where: str) -> None:
        for key in ("port", "agent_port"):
            if not -1 <= getattr(self, key) <= 65535:
                raise ConfigError(f"{where} {key} must be a port 0-65535 or -1 (off), got {getattr(self, key)}")
        non_negative(where, max_body_bytes=self.max_body_bytes,
                     max_connections_per_client=self.max_connections_per_client)
        if not self.header_timeout_s > 0:
            raise ConfigError(f"{where} header_timeout_s must be > 0, got {self.header_timeout_s}")
        if self.max_connections < 1:
            raise ConfigError(f"{where} max_connections must be >= 1, got {self.max_connections}")

    def __getitem__(self, key: str) -> Any:
        """``feed["port"]``: reads as when ``[weights.feed]`` was a plain table."""
        return getattr(self, key)


@dataclass(frozen=True)
class LevelsConfig(ComponentConfig):
    """``[weights.levels]``: per-class admission levels (analyzers/routing/levels.py, docs/weights.md)."""

    section = "weights.levels"
    enabled: bool = False
    """Off by default: levels shed requests, which a deployment opts into (the gateway enforces them)."""
    degrade_at: float = 0.85
    """Fleet pressure at which the lowest class starts shedding."""
    limit_at: float = 0.95
    """Fleet pressure at which every class but the top one is rate-limited."""
    release_margin: float = 0.05
    hold_s: float = 3.0
    max_shed_ratio: float = 0.5
    limit_admit_ratio: float = 0.8
    """Share of a limited class's recent arrival rate the gateway admits."""
    queue_full: float = 1.0
    """Waiting requests per running request that count as full pressure."""
    latency_full: float = 1.0
    """P99 / SLA of a class above the lowest that counts as full pressure."""

    def validate(self, where: str) -> None:
        if not 0 < self.degrade_at <= self.limit_at:
            raise ConfigError(f"{where} needs 0 < degrade_at <= limit_at, got {self.degrade_at} and {self.limit_at}")
        for key in ("max_shed_ratio", "limit_admit_ratio"):
            if not 0 <= getattr(self, key) <= 1:
                raise ConfigError(f"{where} {key} must be in [0, 1], got {getattr(self, key)}")
        non_negative(where, release_margin=self.release_margin, hold_s=self.hold_s)
        if not (self.queue_full > 0 and self.latency_full > 0):
            raise ConfigError(f"{where} queue_full and latency_full must be > 0")


def default_classes() -> dict[str, RequestClass]:
    return parse_classes(DEFAULT_CLASSES)


@dataclass(frozen=True)
class WeightsConfig(ComponentConfig):
    """``[weights]``: every tunable of the engine and the feed (docs/weights.md)."""

    section = "weights"
    aliases = {"history_flush_s": ""}  # the writer batches history rows ([writer] flush_interval_s)
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
    preemption_penalty: float = 2.0
    """Factor of a backend whose preemptions counter rose within ``preemption_lookback_s`` (1 = off)."""
    preemption_lookback_s: float = 60.0
    down_after_errors: int = 5
    """Failed requests in a row (its newest spans) that put a backend down, as Envoy's outlier
    detection ejects after 5 consecutive 5xx (0 = off)."""
    down_silent_requests: float = 20.0
    """A backend whose spans stop while its share of the fleet's spans in ``window_s`` would have been
    at least this many is down (P(0 | Poisson 20) = 2e-9; 0 = off)."""
    forget_after_s: float = 0.0
    """A known backend with no inputs stays published (absent) until forgotten; > 0 forgets it after
    that long while another backend still reports (0 = only an operator removes it)."""
    default_capacity_qps: float = 0.0
    default_class: str = "interactive_image_text"
    lb_scale: int = 100
    scale_up_ratio: float = 0.85
    scale_up_for_s: float = 2.0
    scale_down_ratio: float = 0.40
    scale_down_for_s: float = 5.0
    scale_down_cooldown_s: float = 30.0
    history: bool = True
    classes: Mapping[str, RequestClass] = field(default_factory=default_classes)
    backends: Mapping[str, BackendConfig] = field(default_factory=dict)
    feed: FeedConfig = field(default_factory=FeedConfig)
    levels: LevelsConfig = field(default_factory=LevelsConfig)

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any] | None, where: str | None = None) -> Self:
        """The section in ``data``; classes and backends are tables of tables, parsed here."""
        where = where or f"[{cls.section}]"
        if data is not None and not isinstance(data, Mapping):
            raise ConfigError(f"{where} must be a table, got {data!r}")
        raw = dict(data or {})
        classes = raw.pop("classes", None) or {}
        backends = raw.pop("backends", None) or {}
        for key, value in (("classes", classes), ("backends", backends)):
            if not isinstance(value, Mapping):
                raise ConfigError(f"[weights.{key}] must be a table of tables, got {value!r}")
        raw["classes"] = parse_classes(deep_merge(DEFAULT_CLASSES, classes))
        raw["backends"] = parse_backends(backends)
        if "feed" in raw:  # checked here so a mistake is reported as [weights.feed]
            raw["feed"] = FeedConfig.from_mapping(raw["feed"]).as_dict()
        if "levels" in raw:
            raw["levels"] = LevelsConfig.from_mapping(raw["levels"]).as_dict()
        return super().from_mapping(raw, where)

    def validate(self, where: str) -> None:
        """ConfigError for values that make the formula meaningless."""
        checks = [
            (0 < self.floor <= 1, "floor must be in (0, 1]"),
            (0 < self.ewma_down <= 1 and 0 < self.ewma_up <= 1, "ewma_down/ewma_up must be in (0, 1]"),
            (self.max_step_down > 0 and self.max_step_up > 0, "max_step_down/max_step_up must be > 0"),
            (self.interval_s > 0 and self.window_s > 0, "interval_s and window_s must be > 0"),
            (self.stale_after_s > 0, "stale_after_s must be > 0"),
            (self.lookback_s > 0, "lookback_s must be > 0"),
            (self.release_memory_ratio <= self.drain_memory_ratio, "release_memory_ratio > drain_memory_ratio"),
            (self.release_kv_ratio <= self.drain_kv_ratio, "release_kv_ratio > drain_kv_ratio"),
            (self.lb_scale >= 1, "lb_scale must be >= 1"),
            (0 < self.sharpness <= 4, "sharpness must be in (0, 4]"),
            (self.queue_weight >= 0, "queue_weight must be >= 0"),
            (self.preemption_penalty >= 1, "preemption_penalty must be >= 1"),
            (self.preemption_lookback_s > 0, "preemption_lookback_s must be > 0"),
            (self.forget_after_s >= 0, "forget_after_s must be >= 0"),
            (self.down_after_errors >= 0 and self.down_silent_requests >= 0,
             "down_after_errors and down_silent_requests must be >= 0"),
            (self.default_class in self.classes, f"default_class {self.default_class!r} is not a class"),
        ]
        for ok, message in checks:
            if not ok:
                raise ConfigError(f"{where} {message}")


WeightParams = WeightsConfig
"""The engine's name for its config (``params`` throughout the routing package)."""


def parse_classes(raw: Mapping[str, Any]) -> dict[str, RequestClass]:
    """``{name: {sla_ms, weight, alpha, admit_/readmit_ kv and batch ratios}}`` as request classes."""
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
        unknown = set(spec) - {"sla_ms", "weight", "alpha", "admit_kv_ratio", "readmit_kv_ratio",
                               "admit_batch_ratio", "readmit_batch_ratio"}
        if unknown:
            raise ConfigError(f"[weights.classes.{name}] has unknown keys: {', '.join(sorted(unknown))}")
        _check_class(out[name])
    return out


def _check_class(cls: RequestClass) -> None:
    where = f"[weights.classes.{cls.name}]"
    if cls.sla_seconds <= 0:
        raise ConfigError(f"{where} sla_ms must be > 0")
    for kind, admit, readmit, top in (("kv", cls.admit_kv_ratio, cls.readmit_kv_ratio, 1.0),
                                      ("batch", cls.admit_batch_ratio, cls.readmit_batch_ratio, math.inf)):
        if math.isfinite(admit) and not (0 <= readmit <= admit <= top):
            raise ConfigError(f"{where} needs 0 <= readmit_{kind}_ratio <= admit_{kind}_ratio"
                              f"{' <= 1' if top == 1.0 else ''}, got {readmit:g} and {admit:g}")
        if math.isfinite(readmit) and not math.isfinite(admit):
            raise ConfigError(f"{where} readmit_{kind}_ratio needs admit_{kind}_ratio")


def _limit_pair(spec: Mapping[str, Any], kind: str) -> tuple[float, float]:
    """``admit_<kind>_ratio`` and ``readmit_<kind>_ratio`` (default: admit - READMIT_GAP, >= 0)."""
    admit = float(spec.get(f"admit_{kind}_ratio", NAN))
    default = max(0.0, admit - READMIT_GAP) if math.isfinite(admit) else NAN
    return admit, float(spec.get(f"readmit_{kind}_ratio", default))


_BACKEND_KEYS = {"host", "gpus", "address", "capacity_qps", "max_inflight", "max_num_seqs"}


def parse_backends(raw: Mapping[str, Any]) -> dict[str, BackendConfig]:
    """``{name: {host, gpus, address, capacity_qps, max_inflight, max_num_seqs}}`` as backend configs."""
    out = {}
    for name, spec in raw.items():
        if not isinstance(spec, Mapping):
            raise ConfigError(f"[weights.backends.{name}] must be a table")
        unknown = set(spec) - _BACKEND_KEYS
        if unknown:
            raise ConfigError(f"[weights.backends.{name}] has unknown keys: {', '.join(sorted(unknown))}")
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
