"""The offered load of the closed-loop bench, computed up front from a seed.

Every policy sees exactly the same offered load: per-class Poisson arrivals whose rate steps up by
``step_factor`` (+30%) every ``step_s`` seconds and is modulated by bursts (``burst_factor`` x for
``burst_s`` every ``burst_period_s``, phase-shifted per class, mean-preserving). Named workloads (real
trace replay, flash crowd, ...) are built by :mod:`triscope_bed.workloads.named`; the schedule is
sent by :mod:`triscope_bed.workloads.driver`; docs/workloads.md describes both.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

from triscope_bed.engines.engine import CLASSES

MAX_TOKENS = 1_000_000
"""Bound of ``prompt_tokens`` / ``max_tokens`` in a request (what the simulated backend accepts)."""


@dataclass(frozen=True)
class Arrival:
    t: float
    cls: str
    step: int
    """Index of the load step, or of the ``bucket_s``-long time bucket of a replay (see workloads)."""
    prompt_tokens: int | None = None
    """Prompt length (None: the class's default, :data:`~triscope_bed.engines.engine.CLASSES`)."""
    max_tokens: int | None = None
    """Tokens to generate (None: the class's default)."""
    blocks: tuple[int, ...] = ()
    """Ids of the prompt's blocks of ``block_tokens`` tokens (a trace with prefix structure): equal ids, equal
    text; empty: a prompt that shares nothing."""
    block_tokens: int = 0

    def tokens(self) -> tuple[int, int]:
        """(prompt, max) tokens of the request, the class's defaults filling what the arrival lacks."""
        cls = CLASSES[self.cls]
        prompt = self.prompt_tokens if self.prompt_tokens is not None else cls.prompt_tokens
        out = self.max_tokens if self.max_tokens is not None else cls.completion_tokens
        return max(1, min(MAX_TOKENS, prompt)), max(1, min(MAX_TOKENS, out))


@dataclass
class LoadShape:
    """The offered load: QPS steps, class mix and bursts."""

    base_qps: float = 20.0
    step_factor: float = 1.3
    steps: int = 6
    step_s: float = 8.0
    burst_period_s: float = 4.0
    burst_s: float = 1.0
    burst_factor: float = 3.0
    mix: dict[str, float] = field(default_factory=lambda: {c.name: c.share for c in CLASSES.values()})

    def step_qps(self, step: int) -> float:
        return self.base_qps * self.step_factor**step

    @property
    def duration_s(self) -> float:
        return self.steps * self.step_s

    def _modulation(self, t: float, phase: float) -> float:
        """Mean-1 burst multiplier: ``burst_factor`` inside a burst, a lower floor outside."""
        duty = self.burst_s / self.burst_period_s
        if duty >= 1.0 or self.burst_factor <= 1.0:
            return 1.0
        low = max(0.0, (1.0 - duty * self.burst_factor) / (1.0 - duty))
        inside = ((t + phase) % self.burst_period_s) < self.burst_s
        return self.burst_factor if inside else low

    def schedule(self, seed: int = 1) -> list[Arrival]:
        """All arrivals, sorted by time (thinning of a non-homogeneous Poisson process)."""
        rng = random.Random(seed)
        out: list[Arrival] = []
        total_share = sum(self.mix.values())
        for k, (name, share) in enumerate(sorted(self.mix.items())):
            phase = k * self.burst_period_s / max(1, len(self.mix))
            for step in range(self.steps):
                lam = self.step_qps(step) * share / total_share
                lam_max = lam * max(1.0, self.burst_factor)
                t = step * self.step_s
                end = t + self.step_s
                while True:
                    t += rng.expovariate(lam_max) if lam_max > 0 else math.inf
                    if t >= end:
                        break
                    if rng.random() * lam_max <= lam * self._modulation(t, phase):
                        out.append(Arrival(t, name, step))
        out.sort(key=lambda a: a.t)
        return out
