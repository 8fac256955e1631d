"""Fold one exposition's series into per-model figures of one serving instance.

Deployment shapes: data-parallel shards (vLLM's ``engine`` label, SGLang's ``dp_rank``, Triton's
``version``) are summed (counts, counters, histogram buckets) or averaged (KV-cache usage). Ranks
that mirror one scheduler (SGLang's ``tp_rank`` / ``pp_rank`` / ``moe_ep_rank`` with
``--enable-metrics-for-all-schedulers``) count once: gauges take the highest rank value (they agree
but for timing), counters and histograms take the lowest rank's series, so deltas stay on one series.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from triscope.collectors.serving_metrics.engines import (
    COUNTER,
    ENGINES,
    GAUGE_MAX,
    GAUGE_MEAN,
    HISTOGRAM,
    REPLICA_LABELS,
    SLEEP,
    Engine,
    Field,
    first_present,
)
from triscope.errors import InputError
from triscope.prom_text import Series, le_bound

HISTOGRAMS = ("latency", "ttft", "queue_time", "itl")
_SKIP = frozenset(REPLICA_LABELS) | {"le", "quantile"}


@dataclass
class InstanceSnapshot:
    """Figures of one (instance, model) at one scrape: ``values`` by field key, cumulative ``buckets`` by histogram."""

    model: str
    values: dict[str, float] = field(default_factory=dict)
    buckets: dict[str, dict[float, float]] = field(default_factory=dict)

    def get(self, key: str) -> float:
        """A figure, NaN when the engine does not expose it."""
        return self.values.get(key, math.nan)

    @property
    def queue_length(self) -> float:
        return self.get("queue_length")

    @property
    def running_requests(self) -> float:
        return self.get("running_requests")

    @property
    def kv_cache_usage_ratio(self) -> float:
        return self.get("kv_cache_usage_ratio")

    @property
    def requests_total(self) -> float:
        return self.get("requests_total")

    @property
    def latency_buckets(self) -> dict[float, float]:
        return self.buckets.get("latency", {})

    @property
    def ttft_buckets(self) -> dict[float, float]:
        return self.buckets.get("ttft", {})


def _rank(replica: tuple[str, ...]) -> tuple[tuple[int, str], ...]:
    return tuple((int(r), "") if r.isdigit() else (1 << 30, r) for r in replica)


def _sleep_level(states: dict[str, float]) -> float:
    if states.get("awake") == 1:
        return 0.0
    if states.get("discard_all") == 1:
        return 2.0
    if states.get("weights_offloaded") == 1 or states.get("awake") == 0:
        return 1.0
    return math.nan


def _finite_max(values: list[float]) -> float:
    finite = [v for v in values if not math.isnan(v)]
    return max(finite) if finite else math.nan


class _Folder:
    """Reduces the samples of one field: per (model, shard) one replica, then over shards."""

    def __init__(self, fld: Field, model_of: Callable[[dict[str, str]], str], skip: frozenset[str],
                 source: str) -> None:
        self.fld, self.model_of, self.skip, self.source = fld, model_of, skip, source

    def fold(self, samples: list[tuple[dict[str, str], float]], name: str) -> dict[str, Any]:
        groups: dict[tuple[str, tuple[tuple[str, str], ...]], dict[tuple[str, ...], Any]] = defaultdict(dict)
        kind = self.fld.kind
        for labels, value in samples:
            shard = tuple(sorted((k, v) for k, v in labels.items() if k not in self.skip))
            replica = tuple(labels.get(k, "") for k in REPLICA_LABELS)
            slot = groups[(self.model_of(labels), shard)]
            if kind == HISTOGRAM:
                le = labels.get("le", "+Inf")
                try:
                    bound = le_bound(le) * self.fld.scale
                except ValueError:
                    raise InputError(f"{self.source}: {name}: bucket le={le!r} is not a number") from None
                slot.setdefault(replica, {})[bound] = value
            elif kind == SLEEP:
                slot.setdefault(replica, {})[labels.get("sleep_state", "")] = value
            else:
                slot[replica] = value * self.fld.scale
        per_model: dict[str, list[Any]] = defaultdict(list)
        for (model, _shard), replicas in groups.items():
            if kind in (HISTOGRAM, COUNTER):
                per_model[model].append(replicas[min(replicas, key=_rank)])
            elif kind == SLEEP:
                per_model[model].append(_finite_max([_sleep_level(s) for s in replicas.values()]))
            else:
                per_model[model].append(_finite_max(list(replicas.values())))
        return {model: self._across_shards(parts) for model, parts in per_model.items()}

    def _across_shards(self, parts: list[Any]) -> Any:
        kind = self.fld.kind
        if kind == HISTOGRAM:
            total: dict[float, float] = {}
            for buckets in parts:
                for le, count in buckets.items():
                    total[le] = total.get(le, 0.0) + count
            return total
        finite = [p for p in parts if not math.isnan(p)]
        if not finite:
            return math.nan
        if kind == GAUGE_MEAN:
            return sum(finite) / len(finite)
        if kind in (GAUGE_MAX, SLEEP):
            return max(finite)
        return sum(finite)


def _sample_names(fld: Field) -> list[str]:
    """Sample names to look for: a histogram's buckets; a counter also with ``_total``, which the parser
    appends to counters exposed without it (Triton's ``nv_inference_request_success``)."""
    if fld.kind == HISTOGRAM:
        return [n + "_bucket" for n in fld.names]
    if fld.kind == COUNTER:
        return [m for n in fld.names for m in (n, n + "_total") if not m.endswith("_total_total")]
    return list(fld.names)


def _model_namer(engine: Engine, default_model: str) -> Callable[[dict[str, str]], str]:
    def model_of(labels: dict[str, str]) -> str:
        if engine.target_model_wins and default_model:
            return default_model
        for key in engine.model_labels:
            if labels.get(key):
                return labels[key]
        return default_model
    return model_of


def _llm_models(series: Series, engine: Engine) -> set[str]:
    """Raw model label values seen in the engine's LLM-only families (empty: keep every model)."""
    if not engine.llm_prefix:
        return set()
    return {labels.get(key, "") for name, samples in series.items() if name.startswith(engine.llm_prefix)
            for labels, _ in samples for key in engine.model_labels[:1]}


def aggregate(series: Series, server: str, default_model: str = "", source: str = "metrics") -> dict[
        str, InstanceSnapshot]:
    """Per-model snapshot of one instance (engine ``server``); InputError (one line) on a malformed bucket."""
    engine = ENGINES[server]
    model_of = _model_namer(engine, default_model)
    llm = _llm_models(series, engine)
    label = engine.model_labels[0] if engine.model_labels else ""
    snaps: dict[str, InstanceSnapshot] = {}
    for key, fld in engine.fields.items():
        names = _sample_names(fld)
        samples = [(labels, value) for labels, value in first_present(series, names)
                   if all(labels.get(k) == want for k, want in fld.where)
                   and (not llm or labels.get(label, "") in llm)]
        if not samples:
            continue
        skip = _SKIP | set(engine.model_labels) | {k for k, _ in fld.where} | ({"sleep_state"} if fld.kind == SLEEP
                                                                              else set())
        folded = _Folder(fld, model_of, frozenset(skip), source).fold(samples, fld.names[0])
        for model, value in folded.items():
            snap = snaps.setdefault(model, InstanceSnapshot(model))
            if fld.kind == HISTOGRAM:
                snap.buckets[key] = value
            else:
                snap.values[key] = value
    for snap in snaps.values():
        _derive(snap)
    return dict(sorted(snaps.items()))


def _derive(snap: InstanceSnapshot) -> None:
    """Fallbacks between families of one engine (older TensorRT-LLM backends, Triton without TRT-LLM)."""
    v = snap.values
    used, most = v.pop("kv_used_blocks", math.nan), v.pop("kv_max_blocks", math.nan)
    if math.isnan(v.get("kv_cache_usage_ratio", math.nan)) and most > 0:
        v["kv_cache_usage_ratio"] = used / most
    pending = v.pop("pending", math.nan)
    if "queue_length" not in v and not math.isnan(pending):
        v["queue_length"] = pending


__all__ = ["HISTOGRAMS", "InstanceSnapshot", "aggregate"]
