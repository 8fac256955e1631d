"""The gateway's side of the admission levels (:mod:`.levels`): per request, admit or refuse by class.

- ``degrade``: refuse ``shed_ratio`` of the class's requests, at random (seeded);
- ``limit``: a token bucket per class whose rate is ``admit_ratio`` x the class's offered arrival rate
  over the last ``window_s`` (refused requests count: it is what clients send, not what got through),
  holding ``burst_s`` of that rate;
- ``break``: refuse every request (the gateway answers with its fallback);
- ``normal`` or an unknown class: admit.

A refused request is a failure in the test bed's goodput and in its P99 over all offered requests:
levels pay only when shedding the lowest class keeps the others within their SLA.
"""

from __future__ import annotations

import random
import threading
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass

from triscope.analyzers.routing.model import BREAK, DEGRADE, LIMIT, ClassLevel

MAX_TRACKED_CLASSES = 256
"""Classes whose arrivals are counted at once: the class comes from a client's header or body, so a client
inventing names must not grow the gate without bound (the engine's classes are a configured few)."""


@dataclass
class _Bucket:
    rate: float
    capacity: float
    tokens: float
    at: float

    def take(self, now: float) -> bool:
        self.tokens = min(self.capacity, self.tokens + (now - self.at) * self.rate)
        self.at = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return True
        return False


class ClassGate:
    """Thread-safe per-class admission at the gateway, from the engine's latest class levels."""

    def __init__(self, window_s: float = 10.0, burst_s: float = 1.0, seed: int | None = None) -> None:
        self.window_s = window_s
        self.burst_s = burst_s
        self._levels: dict[str, ClassLevel] = {}
        self._arrivals: dict[str, deque[float]] = {}
        self._buckets: dict[str, _Bucket] = {}
        self._rng = random.Random(seed)
        self._lock = threading.Lock()

    def set_levels(self, levels: Mapping[str, ClassLevel]) -> None:
        with self._lock:
            self._levels = dict(levels)
            for cname in [c for c in self._buckets if self._levels.get(c, ClassLevel()).level != LIMIT]:
                del self._buckets[cname]

    def levels(self) -> dict[str, ClassLevel]:
        with self._lock:
            return dict(self._levels)

    def admit(self, request_class: str, now: float) -> str | None:
        """None when the request may go on; else the level that refuses it (``degrade``, ``limit``, ``break``)."""
        with self._lock:
            arrivals = self._arrivals.get(request_class)
            if arrivals is None:
                arrivals = deque(maxlen=100_000)
                if len(self._arrivals) >= MAX_TRACKED_CLASSES:
                    self._forget_idle(now)
                if len(self._arrivals) < MAX_TRACKED_CLASSES or request_class in self._levels:
                    self._arrivals[request_class] = arrivals
            while arrivals and arrivals[0] < now - self.window_s:
                arrivals.popleft()
            level = self._levels.get(request_class)
            refusal = self._refusal(request_class, level, arrivals, now) if level is not None else None
            arrivals.append(now)
            return refusal

    def _forget_idle(self, now: float) -> None:
        """Drop the classes without an arrival in the window and without a level."""
        for cname in [c for c, q in self._arrivals.items()
                      if c not in self._levels and (not q or q[-1] < now - self.window_s)]:
            del self._arrivals[cname]

    def _refusal(self, cname: str, level: ClassLevel, arrivals: deque[float], now: float) -> str | None:
        if level.level == BREAK:
            return BREAK
        if level.level in (DEGRADE, LIMIT) and level.shed_ratio > 0 and self._rng.random() < level.shed_ratio:
            return DEGRADE
        if level.level != LIMIT:
            return None
        rate = level.admit_ratio * (len(arrivals) + 1) / self.window_s
        capacity = max(1.0, rate * self.burst_s)
        bucket = self._buckets.get(cname)
        if bucket is None:  # the limit starts with a full bucket
            bucket = self._buckets[cname] = _Bucket(rate, capacity, capacity, now)
        bucket.rate, bucket.capacity = rate, capacity
        return None if bucket.take(now) else LIMIT
