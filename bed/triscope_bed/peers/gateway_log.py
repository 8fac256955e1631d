"""What the gateway's access log says about a run: where each request went and where its time went.

Envoy writes one JSON line per request (``triscope.exporters.extproc.ACCESS_LOG_FORMAT``). The summary
splits each request's time between the picker (its answer to the buffered body, ``pick_ms``), the
engine (to its response headers, ``upstream_ms``) and the picker again (its answer to those headers,
``answer_ms``), so a cluster of client timeouts can be put on the gateway, the picker or an engine.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from triscope_bed.stats import percentile

STAGES = ("pick_ms", "upstream_ms", "answer_ms", "duration_ms")
SLOW_PICK_MS = 100.0
"""A picker answer slower than this is counted (a pick itself takes well under a millisecond)."""


def read_access_log(path: Path) -> list[dict[str, Any]]:
    """The log's records in order (a line Envoy was still writing at the stop is skipped)."""
    records = []
    try:
        lines = path.read_text(errors="replace").splitlines()
    except FileNotFoundError:
        return []
    for line in lines:
        try:
            doc = json.loads(line)
        except ValueError:
            continue
        if isinstance(doc, dict):
            records.append(doc)
    return records


def _number(value: Any) -> float:
    """A field as a number; NaN where Envoy wrote ``null`` or ``-`` (a point the request never reached)."""
    if isinstance(value, bool):
        return math.nan
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


def quantiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p99": None, "max": None}
    return {"p50": round(percentile(values, 50), 1), "p99": round(percentile(values, 99), 1),
            "max": round(max(values), 1)}


def summarize(records: Iterable[Mapping[str, Any]], names: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Per run: requests routed to each backend (``names``: ``host:port`` -> backend name), response codes
    with Envoy's flags, each stage's P50 / P99 / max in ms, and how many picker answers took over
    :data:`SLOW_PICK_MS`, with the slowest few (``t_s`` after the first request's start)."""
    records = list(records)
    names = names or {}
    routed: Counter[str] = Counter()
    outcomes: Counter[str] = Counter()
    stages: dict[str, list[float]] = {k: [] for k in STAGES}
    slow: list[tuple[float, Mapping[str, Any]]] = []
    for r in records:
        upstream = r.get("upstream")
        if isinstance(upstream, str) and upstream not in ("", "-"):
            routed[names.get(upstream, upstream)] += 1
        flags = r.get("flags")
        outcome = str(r.get("code"))
        if isinstance(flags, str) and flags not in ("", "-"):
            outcome += f" {flags}"
        outcomes[outcome] += 1
        for key in STAGES:
            v = _number(r.get(key))
            if math.isfinite(v):
                stages[key].append(v)
        pick = _number(r.get("pick_ms"))
        if pick > SLOW_PICK_MS:
            slow.append((pick, r))
    t0 = min((t for t in (_number(r.get("start")) for r in records) if math.isfinite(t)), default=0.0)
    slow.sort(key=lambda item: -item[0])
    slowest = [{"t_s": round(_number(r.get("start")) - t0, 3), "pick_ms": pick,
                "upstream": names.get(str(r.get("upstream")), r.get("upstream")), "code": r.get("code")}
               for pick, r in slow[:5]]
    return {"requests": sum(outcomes.values()), "routed": dict(sorted(routed.items())),
            "outcomes": dict(sorted(outcomes.items())), "slow_picks": len(slow), "slowest_picks": slowest,
            "stages_ms": {k: quantiles(v) for k, v in stages.items()}}
