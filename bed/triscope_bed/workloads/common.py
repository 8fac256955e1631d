"""What every named workload shares: the error, the bounds, and the class a trace row gets under a seed."""

from __future__ import annotations

import hashlib

from triscope_bed.engines.engine import CLASSES

BUCKET_S = 10.0
"""Default time bucket of the non-step workloads."""
MAX_ROWS = 1_000_000
"""Bound on the rows read from a trace file."""


class WorkloadError(ValueError):
    """A workload cannot be built (missing trace file, bad parameter); the message is one line."""


def default_mix() -> dict[str, float]:
    """The simulator's class shares (50 / 35 / 15 %)."""
    return {c.name: c.share for c in CLASSES.values()}


def _unit(seed: int, key: int) -> float:
    """A uniform number in [0, 1) from (seed, key): the same in every process and every call."""
    digest = hashlib.blake2b(f"{seed}:{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2.0**64


def _pick(mix: dict[str, float], u: float) -> str:
    """The class whose cumulative share (classes in name order) covers ``u``."""
    total = sum(mix.values())
    acc = 0.0
    names = sorted(mix)
    for name in names:
        acc += mix[name] / total
        if u < acc:
            return name
    return names[-1]


def assign_class(seed: int, row: int, mix: dict[str, float] | None = None) -> str:
    """The class of trace row ``row`` (its position in the file) under ``seed``: independent of the window."""
    return _pick(mix or default_mix(), _unit(seed, row))
