"""What ``diagnose`` reports of a serving incident."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

UNKNOWN = "unknown"
CAUSES = ("backend_down", "load_beyond_capacity", "kv_pressure", "io", "routing_imbalance", "host_cpu",
          "host_memory")
"""Every cause ``diagnose`` can name (docs/diagnose.md says the rule and data behind each); a
:class:`Cause` by any other name is a ValueError."""


@dataclass(frozen=True)
class Cause:
    """One candidate cause: how strongly the data says it, and the figures that say so."""

    name: str
    score: float
    evidence: tuple[str, ...]

    def __post_init__(self) -> None:
        if self.name not in CAUSES and self.name != UNKNOWN:
            raise ValueError(f"cause {self.name!r} is not in CAUSES ({', '.join(CAUSES)})")

    def to_dict(self) -> dict[str, Any]:
        return {"cause": self.name, "score": round(self.score, 3), "evidence": list(self.evidence)}


@dataclass
class Incident:
    """A stretch in which request classes broke their SLO on some backends."""

    start_s: float
    end_s: float
    backends: list[str]
    classes: list[str]
    worst_p99_ratio: float
    failed_requests: int
    requests: int
    completed_drop_ratio: float
    """1 - the fleet's completed rate during / before (NaN when not measured)."""
    open: bool
    cause: Cause
    runners_up: list[Cause] = field(default_factory=list)
    lead_times_s: dict[str, float] = field(default_factory=dict)
    """Per indicator: seconds from its first move to the breach (positive: it moved before)."""
    missing: list[str] = field(default_factory=list)
    """Signals a cause needs that the store does not have for this stretch."""
    kv_at_breach: float = math.nan
    """The highest KV usage of the backends hit in the first breached window."""
    p99_growth: float = math.nan
    """Worst P99 during / the backends' P99 over the baseline, less 1 (4.17 = the seed's 417 %)."""

    def to_dict(self) -> dict[str, Any]:
        def num(x: float) -> float | None:
            return round(x, 4) if math.isfinite(x) else None

        return {"start_s": self.start_s, "end_s": self.end_s, "duration_s": self.end_s - self.start_s,
                "open": self.open, "backends": self.backends, "classes": self.classes,
                "worst_p99_over_sla": num(self.worst_p99_ratio), "failed_requests": self.failed_requests,
                "requests": self.requests, "completed_drop_ratio": num(self.completed_drop_ratio),
                "cause": self.cause.to_dict(), "runners_up": [c.to_dict() for c in self.runners_up],
                "lead_times_s": {k: round(v, 1) for k, v in self.lead_times_s.items()}, "missing": self.missing,
                "kv_at_breach": num(self.kv_at_breach), "p99_growth": num(self.p99_growth)}
