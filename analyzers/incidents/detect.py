"""Breaches and incidents: where request classes broke their SLO, merged over windows and backends.

A backend breaches in a window when a class's P99 from its request spans (at least ``min_requests``)
is over the class's SLA, or, without spans, the engine's own P99 is over the default class's SLA;
when at least ``error_ratio`` of its requests failed; or when its scrape failed (it is down). Breached
windows closer than ``merge_gap_s`` on any backends are one incident.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from triscope.analyzers.incidents.causes import explain
from triscope.analyzers.incidents.config import IncidentsConfig
from triscope.analyzers.incidents.model import Incident
from triscope.analyzers.incidents.series import Window, read_host, read_windows
from triscope.analyzers.routing.config import WeightParams
from triscope.store.base import Store


@dataclass(frozen=True)
class Breach:
    backend: str
    start_s: float
    classes: tuple[str, ...]
    p99_ratio: float
    failed: int
    requests: int
    down: bool


def breach_of(w: Window, params: WeightParams, cfg: IncidentsConfig) -> Breach | None:
    """The window's breach, or None."""
    classes: list[str] = []
    ratio = math.nan
    for name, c in w.classes.items():
        cls = params.classes.get(name) or params.classes[params.default_class]
        if c.requests >= cfg.min_requests and math.isfinite(c.p99_seconds):
            r = c.p99_seconds / cls.sla_seconds
            ratio = r if not math.isfinite(ratio) else max(ratio, r)
            if r > 1:
                classes.append(name)
    if not w.classes and math.isfinite(w.engine_p99_seconds):
        ratio = w.engine_p99_seconds / params.classes[params.default_class].sla_seconds
        if ratio > 1:
            classes.append(params.default_class)
    failing = (w.requests >= cfg.min_requests and w.failed >= cfg.min_requests
               and w.failed / w.requests >= cfg.error_ratio)
    down = w.scrape_up == 0
    if not (classes or failing or down):
        return None
    if failing and not classes:
        classes = sorted(name for name, c in w.classes.items() if c.failed)
    return Breach(w.backend, w.start_s, tuple(sorted(set(classes))), ratio, w.failed, w.requests, down)


def merge(breaches: list[Breach], gap_s: float, window_s: float) -> list[list[Breach]]:
    """Breaches grouped into incidents: a new group starts after ``gap_s`` without any breach."""
    groups: list[list[Breach]] = []
    for b in sorted(breaches, key=lambda b: (b.start_s, b.backend)):
        # sorted by start: the group's latest start is its last breach's (a max over the group was quadratic)
        if groups and b.start_s - groups[-1][-1].start_s - window_s <= gap_s:
            groups[-1].append(b)
        else:
            groups.append([b])
    return groups


@dataclass
class IncidentReport:
    start_ns: int
    end_ns: int
    window_s: float
    backends: list[str]
    incidents: list[Incident]
    config: IncidentsConfig
    windows: Mapping[str, Mapping[float, Window]] = field(default_factory=dict)
    """The signals the incidents were judged by (for their timelines; not in :meth:`to_dict`)."""
    sla_s: Mapping[str, float] = field(default_factory=dict)

    def alerts(self) -> list[str]:
        """Why ``diagnose`` exits 3 (empty: it does not)."""
        out = []
        for i in self.incidents:
            if self.config.alert_open and i.open:
                out.append(f"incident open since {i.start_s:.0f}: {i.cause.name} on {', '.join(i.backends)}")
            elif self.config.alert_min_p99_ratio and i.worst_p99_ratio >= self.config.alert_min_p99_ratio:
                out.append(f"incident with P99 {i.worst_p99_ratio:.1f}x its SLA: {i.cause.name}")
        return out

    def summary(self) -> dict[str, Any]:
        """The design's headline over this range: of the incidents, those after a sustained QPS jump of
        ``qps_jump``; the time from the jump to the breach, KV usage at the breach, P99 growth (medians and
        ranges)."""
        after = [i for i in self.incidents if "qps_jump" in i.lead_times_s and i.lead_times_s["qps_jump"] >= 0]

        def spread(values: list[float]) -> dict[str, float] | None:
            vals = sorted(v for v in values if math.isfinite(v))
            if not vals:
                return None
            return {"median": round(vals[len(vals) // 2], 3), "min": round(vals[0], 3), "max": round(vals[-1], 3)}

        return {"incidents": len(self.incidents), "after_qps_jump": len(after),
                "share_after_qps_jump": round(len(after) / len(self.incidents), 3) if self.incidents else None,
                "qps_jump": self.config.qps_jump,
                "seconds_from_jump_to_breach": spread([i.lead_times_s["qps_jump"] for i in after]),
                "kv_usage_at_breach": spread([i.kv_at_breach for i in after]),
                "p99_growth": spread([i.p99_growth for i in after]),
                "causes": {c: sum(1 for i in self.incidents if i.cause.name == c)
                           for c in sorted({i.cause.name for i in self.incidents})}}

    def to_dict(self) -> dict[str, Any]:
        return {"start_ns": self.start_ns, "end_ns": self.end_ns, "window_s": self.window_s,
                "backends": self.backends, "incidents": [i.to_dict() for i in self.incidents],
                "alerts": self.alerts(), "summary": self.summary()}


def find_incidents(store: Store, start_ns: int, end_ns: int, config: Mapping[str, Any]) -> IncidentReport:
    """The serving incidents of [start, end): breaches merged, each judged (cause, evidence, lead times)."""
    cfg = IncidentsConfig.from_config(config)
    params = WeightParams.from_config(config)
    look_from = start_ns - int(cfg.baseline_s * 1e9)
    windows, io = read_windows(store, look_from, end_ns, cfg.window_s, params.default_class, list(params.classes))
    host = read_host(store, look_from, end_ns, cfg.window_s)
    breaches = [b for series in windows.values() for w in series.values()
                if w.start_s * 1e9 >= start_ns and (b := breach_of(w, params, cfg)) is not None]
    incidents = []
    last_window = (end_ns / 1e9) - 2 * cfg.window_s
    for group in merge(breaches, cfg.merge_gap_s, cfg.window_s):
        start_s = min(b.start_s for b in group)
        end_s = max(b.start_s for b in group) + cfg.window_s
        ratios = [b.p99_ratio for b in group if math.isfinite(b.p99_ratio)]
        why = explain(group, windows, io, cfg, host)
        incidents.append(Incident(
            start_s, end_s, sorted({b.backend for b in group}), sorted({c for b in group for c in b.classes}),
            max(ratios) if ratios else math.nan, sum(b.failed for b in group), sum(b.requests for b in group),
            why.completed_drop_ratio, end_s - cfg.window_s >= last_window, why.cause, why.runners_up,
            why.lead_times_s, why.missing, why.kv_at_breach, why.p99_growth))
    return IncidentReport(start_ns, end_ns, cfg.window_s, sorted(windows), incidents, cfg, windows,
                          {name: c.sla_seconds for name, c in params.classes.items()})


__all__ = ["Breach", "IncidentReport", "breach_of", "find_incidents", "merge"]
