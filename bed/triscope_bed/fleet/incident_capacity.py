"""The capacity probe of ``bench/incidents.py``: the open-loop rate at which the fleet stops meeting its SLAs
on this machine, so the base load is a known fraction of it rather than a figure tuned by hand.

The probe ramps the load generator's rate geometrically (``start`` requests/s per backend, times ``ratio``
after each calm step of ``step_s``), with the collector running, and judges each step as the client saw it: per
request class the P99 of the latency from the arrival (an open-loop client's wait, workers' queueing included),
requests still unanswered ``settle_s`` after the step counted as over every SLA, and the share of failed
requests. The **capacity** is the first rate whose P99 of some class is over its SLA (or ``error_ratio`` of its
requests failed) in its step and in a repeat of it: the rate at which the client's P99 reaches the SLA. The
bench's base load is ``--load-fraction`` of it (docs/diagnose.md, "How it is judged").
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from triscope_bed.fleet.incident_fleet import Fleet
from triscope_bed.fleet.incident_load import LoadGen
from triscope_bed.reports.incident_score import Sent

MIN_CLASS_REQUESTS = 5
"""A class's P99 is judged in a step only with at least this many arrivals of it."""


@dataclass
class Step:
    """One step of the ramp as the client saw it."""

    rate_per_backend: float
    requests: int
    failed: int
    unanswered: int
    p99_over_sla: dict[str, float]
    """Per class judged: P99 / SLA (inf where more than 1 % were unanswered)."""
    breached: bool


@dataclass
class Capacity:
    """The probe's answer: the rate at which the client's P99 reached the SLA (``capped``: no step breached,
    the capacity is at least the last rate tried)."""

    rate_per_backend: float
    capped: bool
    steps: list[Step] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"rate_per_backend": round(self.rate_per_backend, 3), "capped": self.capped,
                "steps": [{"rate_per_backend": round(s.rate_per_backend, 3), "requests": s.requests,
                           "failed": s.failed, "unanswered": s.unanswered, "breached": s.breached,
                           "p99_over_sla": {c: round(v, 2) if math.isfinite(v) else "inf"
                                            for c, v in s.p99_over_sla.items()}} for s in self.steps]}


def judge_step(rate: float, arrivals: Iterable[tuple[float, str]], sent: Iterable[Sent], lo: float, hi: float,
               sla_s: Mapping[str, float], error_ratio: float = 0.05) -> Step:
    """The step [lo, hi) from its arrivals and the requests answered so far (matched by arrival time): a class's
    P99 over its SLA, or ``error_ratio`` of the requests failed, breaches it. Arrivals not answered yet count
    as slower than any SLA (the caller judges a step only once every SLA has passed since its end)."""
    issued: dict[str, int] = {}
    for t, cls in arrivals:
        if lo <= t < hi:
            issued[cls] = issued.get(cls, 0) + 1
    lat: dict[str, list[float]] = {}
    failed = 0
    for s in sent:
        if lo <= s.arrival_s < hi:
            if s.ok:
                lat.setdefault(s.request_class, []).append(s.start_s + s.latency_s - s.arrival_s)
            else:
                failed += 1
    answered = sum(len(v) for v in lat.values()) + failed
    ratios: dict[str, float] = {}
    for cls, n in issued.items():
        sla = sla_s.get(cls)
        if sla is None or n < MIN_CLASS_REQUESTS:
            continue
        done = sorted(lat.get(cls, []))
        rank = min(n - 1, int(0.99 * n))  # ClickHouse's quantileExact, as diagnose takes it
        ratios[cls] = done[rank] / sla if rank < len(done) else math.inf
    total = sum(issued.values())
    breached = any(r > 1 for r in ratios.values()) or (total > 0 and failed / total >= error_ratio)
    return Step(rate, total, failed, max(0, total - answered), ratios, breached)


def probe_capacity(fleet: Fleet, sla_s: Mapping[str, float], seed: int, *, start: float = 0.25,
                   ratio: float = 1.25, step_s: float = 10.0, max_steps: int = 24, confirm: int = 1,
                   say: Callable[[str], None] = print) -> Capacity:
    """Ramp an open-loop load over ``fleet`` until a step breaches (see the module's doc). A breached step is
    held at the same rate ``confirm`` more times, and the capacity is that rate only if every repeat breaches
    too: one unlucky step (a burst of long requests, a busy neighbour) moves a single-step answer by a whole
    ``ratio``. The load generator is the bench's own, sending no client spans, and is stopped before
    returning."""
    n = len(fleet.engines)
    settle = max(sla_s.values())
    if settle > step_s:
        raise ValueError(f"a step of {step_s} s is shorter than the longest SLA ({settle} s)")
    load = LoadGen(fleet, start * n, seed).start()
    steps: list[Step] = []

    def run_step(factor: float) -> Step:
        """One step at ``factor`` from now, judged once its slowest arrival is past every SLA (the load stays at
        ``factor`` meanwhile: the next rate depends on the judgement)."""
        load.factor = factor
        lo = time.time()
        _sleep_until(lo + step_s + settle)
        with load.lock:
            arrivals, sent = list(load.arrivals), list(load.sent)
        step = judge_step(start * factor, arrivals, sent, lo, lo + step_s, sla_s)
        say(f"  probe {step.rate_per_backend:.2f} req/s per backend: " + ", ".join(
            f"{c} P99 {v:.2f}x SLA" for c, v in sorted(step.p99_over_sla.items()))
            + (f", {step.failed} failed" if step.failed else "") + (" - breached" if step.breached else ""))
        return step

    try:
        factor, repeats = 1.0, 0
        while len(steps) < max_steps:
            steps.append(run_step(factor))
            if steps[-1].breached:
                if repeats >= confirm:
                    return Capacity(steps[-1].rate_per_backend, False, steps)
                repeats += 1  # the same rate once more
                continue
            repeats = 0
            factor *= ratio
    finally:
        load.stop()
    return Capacity(steps[-1].rate_per_backend, True, steps)


def _sleep_until(t: float) -> None:
    time.sleep(max(0.0, t - time.time()))


__all__ = ["MIN_CLASS_REQUESTS", "Capacity", "Step", "judge_step", "probe_capacity"]
