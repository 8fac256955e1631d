"""The store queries behind the Prometheus exporter's derived families, each over a recent window.

Every query is parameterized SQL over ``[now - window_s, now]`` and returns
``{sample key: [(label values, value), ...]}``; the collector (:mod:`.collector`) turns sample keys
into metric families.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from triscope.schema import GPU_SAMPLES, REQUESTS, SERVING_METRICS, qualified

Samples = dict[str, Sequence[tuple[tuple[str, ...], float]]]
"""Sample key -> [(label values, value)]."""

STALLS = "stalls"
"""The query name of the stall-class shares (computed by the analyzer, not a table)."""


@dataclass
class Derived:
    """One refresh of the store-derived values; ``samples[family] = [(labels, value), ...]``."""

    at: float = 0.0
    duration_s: float = 0.0
    samples: Samples = field(default_factory=dict)
    ok: bool = False  # the store answered at least one query


def _range(now_ns: int, window_s: float) -> dict[str, int]:
    return {"start": now_ns - int(window_s * 1e9), "end": now_ns}


_IN_RANGE = "ts >= fromUnixTimestamp64Nano({start:Int64}) AND ts <= fromUnixTimestamp64Nano({end:Int64})"


def query_requests(store: Any, now_ns: int, window_s: float) -> Samples:
    """Request rate and P99 latency per backend from request spans in the window."""
    rows = store.query(
        f"SELECT backend, count(), quantileIf(0.99)(latency_seconds, isFinite(latency_seconds)), "
        f"countIf(isFinite(latency_seconds)) FROM {qualified(store, REQUESTS)} WHERE {_IN_RANGE} "
        "GROUP BY backend ORDER BY backend", _range(now_ns, window_s)).rows
    rate = [((str(b),), int(n) / window_s) for b, n, _p99, _k in rows]
    p99 = [((str(b), REQUESTS.name), float(p)) for b, _n, p, k in rows if int(k) > 0]
    return {"requests_per_second": rate, "latency_p99": p99}


def query_serving(store: Any, now_ns: int, window_s: float) -> Samples:
    """Latest KV-cache usage and engine-reported P99 per backend and model from serving metrics."""
    rows = store.query(
        "SELECT backend, model, "
        "argMaxIf(kv_cache_usage_ratio, ts, isFinite(kv_cache_usage_ratio)), countIf(isFinite(kv_cache_usage_ratio)), "
        "argMaxIf(latency_p99_seconds, ts, isFinite(latency_p99_seconds)), countIf(isFinite(latency_p99_seconds)) "
        f"FROM {qualified(store, SERVING_METRICS)} WHERE {_IN_RANGE} GROUP BY backend, model "
        "ORDER BY backend, model", _range(now_ns, window_s)).rows
    kv = [((str(b), str(m)), float(v)) for b, m, v, n, _p, _k in rows if int(n) > 0]
    p99: dict[str, float] = {}
    for b, _m, _v, _n, p, k in rows:  # one engine-reported P99 per backend: the worst model's
        if int(k) > 0:
            p99[str(b)] = max(p99.get(str(b), -math.inf), float(p))
    return {"kv_cache": kv, "serving_p99": [((b, SERVING_METRICS.name), v) for b, v in sorted(p99.items())]}


def query_gpu(store: Any, now_ns: int, window_s: float) -> Samples:
    """Latest GPU memory used / total per host and GPU in the window."""
    rows = store.query(
        "SELECT host, gpu, argMaxIf(memory_used_bytes, ts, isFinite(memory_used_bytes)), "
        "argMaxIf(memory_total_bytes, ts, isFinite(memory_total_bytes) AND memory_total_bytes > 0), "
        "countIf(isFinite(memory_used_bytes)), countIf(isFinite(memory_total_bytes) AND memory_total_bytes > 0) "
        f"FROM {qualified(store, GPU_SAMPLES)} WHERE {_IN_RANGE} GROUP BY host, gpu ORDER BY host, gpu",
        _range(now_ns, window_s)).rows
    used, total, ratio = [], [], []
    for host, gpu, u, t, nu, nt in rows:
        labels = (str(host), str(gpu))
        if int(nu) > 0:
            used.append((labels, float(u)))
        if int(nt) > 0:
            total.append((labels, float(t)))
        if int(nu) > 0 and int(nt) > 0:
            ratio.append((labels, float(u) / float(t)))
    return {"gpu_used": used, "gpu_total": total, "gpu_ratio": ratio}


def query_stalls(store: Any, now_ns: int, window_s: float,
                 config: Mapping[str, Any]) -> Samples:
    """Share of time per stall class over the window (the classifier of ``triscope diagnose``)."""
    from triscope.analyzers.stalls import diagnose_stalls

    report = diagnose_stalls(store, now_ns - int(window_s * 1e9), now_ns, dict(config))
    return {"stalls": [((cls,), float(share)) for cls, share in sorted(report.shares().items())]}


QUERIES: dict[str, Callable[..., Samples]] = {
    REQUESTS.name: query_requests,
    SERVING_METRICS.name: query_serving,
    GPU_SAMPLES.name: query_gpu,
    STALLS: query_stalls,
}
"""Query name (the ``query`` label of ``triscope_exporter_store_query_errors_total``) -> query."""
