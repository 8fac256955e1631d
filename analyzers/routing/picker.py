"""Per-request endpoint picking by KV headroom and outstanding work (the EPP exporter's brain).

The weight engine publishes every 100-250 ms; a burst lands between two updates. The picker keeps
what the engine cannot: its own ledger of requests in flight per backend (opened at the pick, closed
when the proxied request ends), so a burst never herds onto the backend that looked emptiest at the
last scrape. Per request it estimates the KV the request will hold (prompt + expected output) and:

1. keeps the backends the engine allows (not drained, class admission ``ready``, healthy: scraped
   within ``unready_after_s`` and not refusing connections since);
2. picks the least outstanding work per unit of weight; work is the ledger's requests (or their
   tokens) plus the requests the backend runs or queues that did not come through this picker
   (another LB, a pinned tenant), and the fit: whether the backend's free KV (capacity x (1 - usage)
   at the last scrape, minus what the ledger sent there since, plus the prompts it saw that ended) holds it;
3. a backend the request does not fit counts ``misfit_penalty`` more work (``short_penalty`` if it is
   short of KV by an early signal or runs others' requests). When none fits, work alone decides;
4. a backend the request fits that holds the leading blocks of its prompt (the picker's
   :class:`~.prefix_index.PrefixIndex` of what it sent where) counts up to ``prefix_weight`` less work,
   in proportion to the share of the prompt it holds: its prefill is skipped there.

Pure logic: scrapes come in through :meth:`HeadroomPicker.observe`, engine results through
:meth:`HeadroomPicker.set_weights`; times are ``time.monotonic()`` seconds. docs/epp.md.
"""

from __future__ import annotations

import math
import random
import threading
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from triscope.analyzers.routing.model import DRAIN, WeightsResult
from triscope.analyzers.routing.picker_model import (
    NAN,
    EngineView,
    LiveSignals,
    Pick,
    PickerParams,
    RequestNeed,
)
from triscope.analyzers.routing.prefix_index import PrefixIndex

__all__ = ["EngineView", "HeadroomPicker", "LiveSignals", "Pick", "PickerParams", "RequestNeed"]


@dataclass
class _Backend:
    name: str
    address: str
    signals: LiveSignals = field(default_factory=LiveSignals)
    in_flight: dict[int, tuple[float, float, float]] = field(default_factory=dict)
    """ticket -> (picked at, tokens, prompt tokens or 0)."""
    preempting: bool = False
    """The engine preempted between its last two scrapes: it is out of KV now, whatever the usage gauge says."""
    ended: deque[tuple[float, float, float]] = field(default_factory=lambda: deque(maxlen=4096))
    """(picked at, ended at, prompt tokens) of requests ended after the last scrape was sent: it may count them."""
    refused: bool = False
    """Its last scrape found nothing listening: the process is gone, not slow; unready until a scrape answers."""
    answered_at: float = -math.inf
    """When it last answered one of the picker's requests (a response status below 500: the engine serves)."""


class HeadroomPicker:
    """Thread-safe per-request picker over a fixed set of backends (name -> ``host:port``)."""

    def __init__(self, backends: Mapping[str, str], params: PickerParams | None = None,
                 chars_per_token: float = 4.0) -> None:
        """``chars_per_token``: how the prefix index turns a backend's KV capacity in tokens into the prompt
        characters its cache can hold (the EPP's own ``chars_per_token``, which sizes requests the same way)."""
        if not backends:
            raise ValueError("the picker needs at least one backend")
        self.params = params or PickerParams()
        if not chars_per_token > 0:
            raise ValueError(f"chars_per_token must be positive, not {chars_per_token!r}")
        self.chars_per_token = chars_per_token
        if self.params.work_unit not in ("requests", "tokens"):
            raise ValueError(f"work_unit must be requests or tokens, not {self.params.work_unit!r}")
        self._backends = {name: _Backend(name, address) for name, address in backends.items()}
        self._engine: EngineView | None = None
        self._lock = threading.Lock()
        self._rng = random.Random(self.params.seed)
        self._next_ticket = 0
        self._recent_sizes: deque[float] = deque(maxlen=256)
        self.prefixes = PrefixIndex()
        """What each backend's prefix cache is believed to hold (blocks of the prompts sent to it)."""

    @property
    def backends(self) -> tuple[str, ...]:
        return tuple(self._backends)

    def observe(self, backend: str, signals: LiveSignals) -> None:
        """Record a successful scrape of ``backend``."""
        with self._lock:
            b = self._backends[backend]
            before = b.signals.preemptions_total
            b.preempting = math.isfinite(before) and signals.preemptions_total > before
            b.signals = signals
            b.refused = False
            if math.isfinite(signals.kv_capacity_tokens) and signals.kv_capacity_tokens > 0:
                # the cache cannot hold more than the KV
                blocks = signals.kv_capacity_tokens * self.chars_per_token / self.params.prefix_block_chars
                self.prefixes.set_capacity(backend, int(blocks))
            while b.ended and b.ended[0][1] < _sent(signals):  # ended before this scrape was sent: not in it
                b.ended.popleft()

    def refused(self, backend: str) -> None:
        """A scrape of ``backend`` was refused (nothing listens): it leaves the candidates now rather than
        ``unready_after_s`` after its last answer, until a scrape answers again."""
        with self._lock:
            self._backends[backend].refused = True
            self.prefixes.forget(backend)  # a process that is gone took its cache with it

    def answered(self, backend: str, status: int, now: float) -> None:
        """``backend`` answered a request routed to it with HTTP ``status`` at ``now``: below 500 it is alive
        (the engine itself answered; the gateway's own 503 for a failed connection proves nothing), whatever
        its scrapes say."""
        if status >= 500 or status < 100:
            return
        with self._lock:
            b = self._backends.get(backend)
            if b is not None:
                b.answered_at = max(b.answered_at, now)  # a refused scrape still rules until one answers

    def set_weights(self, result: WeightsResult | EngineView | None) -> None:
        """The weight engine's latest result (in process, or read from the feed's ``/v1/weights``):
        drains, class admission and relative weights; None: neutral."""
        view = EngineView.of(result) if isinstance(result, WeightsResult) else result
        with self._lock:
            self._engine = view

    @property
    def engine(self) -> EngineView | None:
        """The weight engine's last result (None: neutral)."""
        return self._engine

    def in_flight(self) -> dict[str, int]:
        with self._lock:
            return {name: len(b.in_flight) for name, b in self._backends.items()}

    def pick(self, need: RequestNeed, now: float) -> Pick:
        """Choose a backend for one request and open its ledger entry (close it with :meth:`finish`)."""
        with self._lock:
            tokens = need.kv_tokens if math.isfinite(need.kv_tokens) and need.kv_tokens > 0 else self._mean_size()
            rows = {name: self._factors(b, need.request_class, now) for name, b in self._backends.items()}
            candidates = [n for n, f in rows.items() if f["eligible"]]
            if not candidates:  # every backend unready or drained: the least bad one, never a refusal by default
                candidates = [n for n, f in rows.items() if f["healthy"]] or list(rows)
            fitting = {n for n in candidates if rows[n]["free_kv_tokens"] - rows[n]["reserve_tokens"] >= tokens}
            unit = self._mean_size() if self.params.work_unit == "tokens" else 1.0
            penalty, short_penalty = self.params.misfit_penalty * unit, self.params.short_penalty * unit
            scores = {}
            for n in candidates:
                row = rows[n]
                if n in fitting or not fitting:  # when nothing fits, work alone decides
                    scores[n] = row["work_per_weight"]
                else:  # the KV of requests this picker did not send (a tenant, another gateway) may never
                    # free in time, nor may KV already short by an early signal
                    strict = row["kv_short"] or row["external_requests"] > 0
                    extra = short_penalty if strict else penalty
                    scores[n] = (row["work_tokens"] + extra) / row["weight"]
            matched = self._prefix_term(need, fitting, rows, scores, unit)
            best = min(scores.values())
            chosen = self._rng.choice([n for n, v in scores.items() if v <= best + 1e-9 * max(1.0, abs(best))])
            self._next_ticket += 1
            backend = self._backends[chosen]
            prompt = need.prompt_tokens if math.isfinite(need.prompt_tokens) and need.prompt_tokens > 0 else 0.0
            backend.in_flight[self._next_ticket] = (now, tokens, min(prompt, tokens))
            self._recent_sizes.append(tokens)
            if need.prefix_blocks and self.params.prefix_weight > 0:
                self.prefixes.record(chosen, need.prefix_blocks)
            return Pick(chosen, backend.address, self._next_ticket,
                        factors={"request_tokens": tokens, "fits": bool(fitting), "backends": rows,
                                 "prefix_blocks": len(need.prefix_blocks), "prefix_matched_blocks": matched})

    def finish(self, pick: Pick, now: float | None = None) -> None:
        """The request of ``pick`` ended (answered, failed or cancelled) at ``now`` (monotonic); idempotent."""
        if pick.ticket < 0:
            return
        ended_at = time.monotonic() if now is None else now
        with self._lock:
            b = self._backends.get(pick.backend)
            entry = b.in_flight.pop(pick.ticket, None) if b is not None else None
            if b is not None and entry is not None:
                b.ended.append((entry[0], ended_at, entry[2]))

    def explain(self, now: float, request_class: str = "") -> dict[str, dict[str, Any]]:
        """Every factor the next pick of ``request_class`` would weigh, per backend."""
        with self._lock:
            return {name: self._factors(b, request_class, now) for name, b in self._backends.items()}

    def class_drains(self) -> dict[str, list[str]]:
        """Per backend, the classes whose picks the weight engine's class admission keeps off it (sorted)."""
        with self._lock:
            view = self._engine
            classes = sorted(view.class_admission) if view is not None else []
            return {name: [c for c in classes if self._engine_view(name, c)[2] == DRAIN] for name in self._backends}

    def mean_size(self) -> float:
        """Mean KV need of the last requests picked (the default size before any)."""
        with self._lock:
            return self._mean_size()

    def _mean_size(self) -> float:
        sizes = self._recent_sizes
        return sum(sizes) / len(sizes) if sizes else self.params.default_request_tokens

    def _prefix_term(self, need: RequestNeed, fitting: set[str], rows: dict[str, dict[str, Any]],
                     scores: dict[str, float], unit: float) -> dict[str, int]:
        """Take ``prefix_weight`` (in ``unit``s of work) x the share of the prompt each fitting backend holds off
        its score, in place; return the leading blocks each candidate holds. A backend the request does not
        fit gains nothing."""
        weight = self.params.prefix_weight
        if weight <= 0 or not need.prefix_blocks:
            return {}
        matched = self.prefixes.match(need.prefix_blocks, scores)
        n = len(need.prefix_blocks)
        for name, k in matched.items():
            bonus = weight * unit * k / n if name in fitting else 0.0
            rows[name]["prefix_bonus"] = bonus
            if bonus > 0:
                scores[name] -= bonus / rows[name]["weight"]
        return matched

    def _factors(self, b: _Backend, request_class: str, now: float) -> dict[str, Any]:
        p, s = self.params, b.signals
        age = now - s.updated
        healthy = min(age, now - b.answered_at) <= p.unready_after_s and not b.refused
        fresh = age <= max(p.stale_after_s, 2.0 * s.period_s)
        own_tokens = sum(t for _, t, _ in b.in_flight.values())
        # the engine counts a request as waiting as soon as it arrives: every pick before the scrape is in
        # its running + waiting (or not yet arrived), so none of them may count again as another client's
        visible = sum(1 for at, _, _ in b.in_flight.values() if at <= s.updated)
        # so may be one that ended after the scrape was sent (the engine took its figures at some moment
        # of the scrape's flight, which on a busy engine lasts tens of ms or more): counted as external work
        # it would make a phantom tenant, costing the backend work and its misfit leniency
        sent = _sent(s)
        visible += sum(1 for at, end, _ in b.ended if at <= s.updated and end >= sent)
        unseen_tokens = sum(t for at, t, _ in b.in_flight.values() if at > s.updated - p.visible_after_s)
        # the KV a request the scrape saw held is free once it ended (its prompt's, a floor), else a backend
        # drained since a busy scrape reads full; not while requests waited: they take freed KV first
        freed_tokens = (sum(t for at, end, t in b.ended if at <= s.updated - p.visible_after_s and end > s.updated)
                        if s.waiting == 0 else 0.0)
        engine_load = _sum_finite(s.running, s.waiting)
        external = max(0.0, engine_load - visible) if fresh and math.isfinite(engine_load) else 0.0
        capacity = s.kv_capacity_tokens
        # early signs that the KV is already short, before the usage gauge reads full
        kv_short = p.early_signals and fresh and (b.preempting or s.waiting_for_capacity > 0)
        if fresh and math.isfinite(capacity) and capacity > 0 and math.isfinite(s.kv_usage):
            scraped_free = capacity * (1.0 - min(1.0, max(0.0, s.kv_usage)))
            free = 0.0 if kv_short else min(capacity, scraped_free + freed_tokens) - unseen_tokens
            reserve = capacity * p.kv_reserve_ratio
        elif kv_short:
            free, reserve = 0.0, 1.0
        else:  # nothing trustworthy to fit against: every request fits, work decides
            free, reserve = math.inf, 0.0
        weight, drained, class_state = self._engine_view(b.name, request_class)
        by_tokens = p.work_unit == "tokens"
        counted = external * p.external_weight
        work = own_tokens + counted * self._mean_size() if by_tokens else len(b.in_flight) + counted
        return {
            "healthy": healthy, "refused": b.refused, "fresh": fresh,
            "scrape_age_s": age if math.isfinite(age) else None,
            "answer_age_s": now - b.answered_at if math.isfinite(b.answered_at) else None,
            "scrape_sent_age_s": now - sent if math.isfinite(sent) else None,
            "fresh_for_s": max(p.stale_after_s, 2.0 * s.period_s),
            "engine_requests": engine_load if fresh and math.isfinite(engine_load) else None,
            "engine_waiting": s.waiting if fresh and math.isfinite(s.waiting) else None,
            "in_flight": len(b.in_flight), "in_flight_tokens": own_tokens, "unseen_tokens": unseen_tokens,
            "freed_tokens": freed_tokens, "external_requests": external, "free_kv_tokens": free,
            "reserve_tokens": reserve,
            "preempting": b.preempting and fresh, "waiting_for_capacity": s.waiting_for_capacity, "kv_short": kv_short,
            "weight": weight, "drained": drained, "class_state": class_state,
            "work_tokens": work, "work_per_weight": work / weight if weight > 0 else math.inf,
            "eligible": healthy and not drained and class_state != DRAIN and weight > 0,
            "prefix_index_blocks": self.prefixes.blocks(b.name),
        }

    def _engine_view(self, backend: str, request_class: str) -> tuple[float, bool, str | None]:
        """(relative weight, drained, class admission) from the engine's last result; neutral without one."""
        view = self._engine
        if view is None or backend not in view.weights:
            return 1.0, False, None
        own = view.weights[backend]
        top = max((w for w in view.weights.values() if math.isfinite(w)), default=0.0)
        weight = own / top if top > 0 and math.isfinite(own) and self.params.engine_weights else 1.0
        if backend in view.kv_drained and not self.params.engine_kv_drains:  # the fit test covers KV per request
            return max(weight, 0.05), False, None
        return max(weight, 0.05), backend in view.drained, view.class_state(backend, request_class)


def _sent(s: LiveSignals) -> float:
    """When the scrape behind ``s`` was sent (its arrival when not recorded)."""
    return s.requested if math.isfinite(s.requested) else s.updated


def _sum_finite(*values: float) -> float:
    finite = [v for v in values if math.isfinite(v)]
    return sum(finite) if finite else NAN
