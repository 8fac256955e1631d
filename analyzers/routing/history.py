"""``weights_history`` rows of an engine result: one per backend per update."""

from __future__ import annotations

from typing import Any

from triscope.analyzers.routing.model import WeightsResult
from triscope.schema import WEIGHTS_HISTORY, encode_ts


def history_columns(result: WeightsResult) -> dict[str, list[Any]]:
    """The ``weights_history`` batch (column-oriented) of one engine result."""
    ts = encode_ts(round(result.computed_at * 1e9))
    rows = []
    for name, b in sorted(result.backends.items()):
        f = b.factors
        rows.append({"ts": ts, "backend": name, "weight": float(b.weight), "target": float(b.target),
                     "lb_weight": int(b.lb_weight), "state": b.state, "reasons": ",".join(b.reasons),
                     "factor_memory": float(f.get("memory", 1.0)), "factor_kv_cache": float(f.get("kv_cache", 1.0)),
                     "factor_load": float(f.get("load", 1.0)), "factor_latency": float(f.get("latency", 1.0)),
                     "memory_used_ratio": float(b.inputs.memory_used_ratio),
                     "kv_cache_usage_ratio": float(b.inputs.kv_cache_usage_ratio), "qps": float(b.inputs.qps),
                     "input_age_seconds": float(b.age_seconds), "stale": int(result.stale),
                     "version": int(result.version)})
    return WEIGHTS_HISTORY.columns_of(rows)
