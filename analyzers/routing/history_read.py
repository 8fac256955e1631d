"""What the load balancers were told at a past time, from ``weights_history`` (``weights show --at``)."""

from __future__ import annotations

import math
from typing import Any

from triscope.schema import WEIGHTS_HISTORY, qualified
from triscope.store.base import Store


def _num(x: Any) -> float | None:
    try:
        v = float(x)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None


def weights_at(store: Store, at_ns: int, lookback_s: float) -> dict[str, Any]:
    """The ``/v1/weights``-shaped document of the last engine update at or before ``at_ns`` per backend
    (within ``lookback_s``), as recorded; empty ``backends`` when the feed recorded none then."""
    rows = store.query(f"""
SELECT backend, toUnixTimestamp64Nano(max(ts)) AS at_ns, argMax(weight, ts) AS w, argMax(target, ts) AS tg,
       argMax(lb_weight, ts) AS lb, argMax(state, ts) AS st, argMax(reasons, ts) AS why,
       argMax(factor_memory, ts) AS fm, argMax(factor_kv_cache, ts) AS fk, argMax(factor_load, ts) AS fl,
       argMax(factor_latency, ts) AS fla, argMax(memory_used_ratio, ts) AS mem, argMax(kv_cache_usage_ratio, ts) AS kv,
       argMax(qps, ts) AS q, argMax(input_age_seconds, ts) AS age, argMax(stale, ts) AS stl,
       argMax(version, ts) AS v
FROM {qualified(store, WEIGHTS_HISTORY)}
WHERE ts <= fromUnixTimestamp64Nano({{at:Int64}}) AND ts >= fromUnixTimestamp64Nano({{since:Int64}})
GROUP BY backend ORDER BY backend""", {"at": at_ns, "since": at_ns - int(lookback_s * 1e9)}).dicts()
    backends = {}
    for r in rows:
        state = str(r["st"])
        backends[str(r["backend"])] = {
            "weight": _num(r["w"]), "target": _num(r["tg"]), "lb_weight": int(r["lb"]), "state": state,
            "drained": state == "drain", "down": state == "down",
            "reasons": [x for x in str(r["why"]).split(",") if x], "recorded_at_ns": int(r["at_ns"]),
            "age_seconds": _num(r["age"]),
            "factors": {"memory": _num(r["fm"]), "kv_cache": _num(r["fk"]), "load": _num(r["fl"]),
                        "latency": _num(r["fla"])},
            "inputs": {"memory_used_ratio": _num(r["mem"]), "kv_cache_usage_ratio": _num(r["kv"]),
                       "qps": _num(r["q"])}}
    return {"at_ns": at_ns, "version": max((int(r["v"]) for r in rows), default=0),
            "stale": any(int(r["stl"]) for r in rows), "backends": backends,
            "down_backends": sorted(n for n, b in backends.items() if b["down"]), "source": "weights_history"}


__all__ = ["weights_at"]
