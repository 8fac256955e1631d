"""What the per-request picker (:mod:`.picker`) is set with, takes and answers: its settings
(:class:`PickerParams`, written flat in ``[epp]``), a backend's scrape (:class:`LiveSignals`), the
weight engine's decisions (:class:`EngineView`), a request's need (:class:`RequestNeed`) and a
choice (:class:`Pick`)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from triscope.analyzers.routing.model import DOWN, DRAIN, ClassLevel, WeightsResult
from triscope.component import ComponentConfig, interval, non_negative
from triscope.errors import ConfigError

NAN = float("nan")
KV_ONLY = ("kv_cache",)
"""The weight engine's drain reasons of a drain for KV cache usage alone (``admission.drain_reasons``)."""


@dataclass(frozen=True)
class PickerParams(ComponentConfig):
    """Knobs of :class:`~.picker.HeadroomPicker` (defaults written once); ``[epp]`` holds them
    (:data:`PICKER_KEYS`, written flat in that section)."""

    unready_after_s: float = 3.0
    """A backend with neither a good scrape nor an answer to one of the picker's requests for this long leaves
    the candidates: an engine too busy to render ``/metrics`` in time but still answering is slow, not gone."""
    stale_after_s: float = 1.0
    """Older scrapes still count for health, but their KV and queue figures are not trusted (at least two
    scrape periods: a backend scraped less often under a scrape budget keeps its figures until the next)."""
    visible_after_s: float = 0.2
    """A request picked this long before a scrape is assumed to be in that scrape's KV and counts."""
    kv_reserve_ratio: float = 0.05
    """Share of each backend's KV kept free by the fit test (decode growth of running requests)."""
    default_request_tokens: float = 256.0
    """Size assumed for requests of unknown size until the picker has seen some."""
    work_unit: str = "requests"
    """What outstanding work counts: ``requests`` (in flight, as leastconn; the better of the two on the
    vLLM-CPU test bed, docs/epp.md) or ``tokens`` (their KV need, which overweights long requests near
    their end)."""
    engine_weights: bool = False
    """Divide each backend's work by the weight engine's relative weight. Off by default: those weights
    come from the same load the ledger counts (queue, latency, KV), so dividing by them counts it twice,
    a second later, and held the picker on the wrong engine under a pinned tenant (docs/epp.md); the
    engine's drains and class admission apply either way."""
    engine_kv_drains: bool = False
    """Honour a drain the weight engine set for KV cache usage alone. Off by default: the fit test weighs each
    request against fresher KV figures, and a drain held for an engine period sent a whole burst to the other
    engine on the real test bed (docs/epp.md); drains for health, memory or sleep always hold."""
    early_signals: bool = True
    """A preemption since the previous scrape, or requests waiting for capacity (a queue), make a backend full."""
    misfit_penalty: float = 1.0
    """Work added to a backend the request does not fit by its KV gauge, in requests (or mean request sizes
    with ``tokens``): the fit counts the whole expected output, which the engine allocates only as it
    decodes, so a much shorter line wins over it (on the real test bed a strict fit queued the large
    backend, docs/epp.md); ``inf``: never send to such a backend while another fits. A backend short of
    KV by an early signal, or running requests this picker did not send (whose KV may not free soon: a
    pinned tenant), takes ``short_penalty`` instead."""
    short_penalty: float = 1.0
    """Work added, in requests, to a backend the request does not fit that is also short of KV by an early
    signal or running requests this picker did not send (their KV may not free soon); ``inf``: it takes
    nothing that fits elsewhere, however long the line there (which queued the other engine under a
    pinned tenant on the real test bed, docs/epp.md)."""
    external_weight: float = 1.0
    """Work counted per request the engine runs or queues that this picker did not send (0: such requests
    only slow the backend's own requests down, which the ledger sees as they last longer)."""
    prefix_weight: float = 0.0
    """Work, in requests, taken off a backend that holds a request's whole prompt in its prefix cache (by the
    picker's index of what it sent where), in proportion to the share of the prompt's blocks it holds; only
    backends the request fits get it, so affinity never overrides the KV fit. 0 (the default until the test
    bed has measured it against the peers on shared-prefix traffic) leaves the prefix term off; 2 is a start."""
    prefix_block_chars: int = 256
    """Prompt characters per hashed block (about 64 tokens: a match is counted in whole blocks)."""
    prefix_max_blocks: int = 512
    """Blocks of a prompt hashed and matched at most (its first 128k characters at the default block)."""
    seed: int | None = None

    def validate(self, where: str) -> None:
        interval(where, unready_after_s=self.unready_after_s, stale_after_s=self.stale_after_s)
        non_negative(where, visible_after_s=self.visible_after_s, misfit_penalty=self.misfit_penalty,
                     short_penalty=self.short_penalty, external_weight=self.external_weight,
                     default_request_tokens=self.default_request_tokens, prefix_weight=self.prefix_weight)
        if self.prefix_block_chars < 1 or self.prefix_max_blocks < 0:
            raise ConfigError(f"{where} prefix_block_chars must be >= 1 and prefix_max_blocks >= 0, got "
                              f"{self.prefix_block_chars} and {self.prefix_max_blocks}")
        if not 0 <= self.kv_reserve_ratio < 1:
            raise ConfigError(f"{where} kv_reserve_ratio must be in [0, 1), got {self.kv_reserve_ratio}")
        if self.work_unit not in ("requests", "tokens"):
            raise ConfigError(f"{where} work_unit must be 'requests' or 'tokens', got {self.work_unit!r}")


PICKER_KEYS = ("unready_after_s", "stale_after_s", "visible_after_s", "kv_reserve_ratio", "work_unit",
               "engine_weights", "engine_kv_drains", "early_signals", "misfit_penalty", "short_penalty",
               "external_weight", "prefix_weight", "prefix_block_chars", "prefix_max_blocks")
"""The :class:`PickerParams` a user sets in ``[epp]`` (the request size and seed are the picker's own)."""


@dataclass(frozen=True)
class LiveSignals:
    """One scrape of a backend (vLLM's ``/metrics``); NaN where not exported."""

    waiting: float = NAN
    running: float = NAN
    kv_usage: float = NAN
    kv_capacity_tokens: float = NAN
    updated: float = -math.inf
    """When the scrape's answer arrived (monotonic)."""
    requested: float = NAN
    """When the scrape was sent: the engine took its figures between this and ``updated`` (NaN: at ``updated``)."""
    preemptions_total: float = NAN
    """The engine's preemptions counter (``vllm:num_preemptions_total``)."""
    waiting_for_capacity: float = NAN
    """Requests waiting for scheduling capacity: a batch slot, the step's token budget or KV blocks; vLLM V1's
    ``vllm:num_requests_waiting_by_reason{reason="capacity"}`` counts every waiting request it does not defer."""
    period_s: float = 0.0
    """The scraper's period when it took this scrape (its figures stay fresh for two)."""


@dataclass(frozen=True)
class EngineView:
    """What the picker takes from the weight engine: weights, drains and class admission per backend."""

    weights: Mapping[str, float] = field(default_factory=dict)
    drained: frozenset[str] = frozenset()
    class_admission: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    """Per class, per backend: ``ready`` or ``drain``."""
    version: int = 0
    class_levels: Mapping[str, ClassLevel] = field(default_factory=dict)
    """Per class: the admission level the gateway enforces (:class:`~.gate.ClassGate`)."""
    kv_drained: frozenset[str] = frozenset()
    """The drained backends whose only reason is KV cache usage (their class admission is ``drain`` for it too)."""

    @classmethod
    def of(cls, result: WeightsResult) -> EngineView:
        drained = {n: v.reasons for n, v in result.backends.items() if v.state in (DRAIN, DOWN)}
        return cls({n: v.weight for n, v in result.backends.items()}, frozenset(drained),
                   result.class_admission, result.version, result.class_levels,
                   frozenset(n for n, why in drained.items() if tuple(why) == KV_ONLY))

    @classmethod
    def from_document(cls, doc: Mapping[str, Any]) -> EngineView:
        """The feed's ``/v1/weights`` JSON (``WeightsResult.to_dict``); ValueError when it is not one."""
        backends = doc.get("backends")
        if not isinstance(backends, Mapping):
            raise ValueError("not a /v1/weights document: no backends table")
        weights, drained, kv_drained = {}, set(), set()
        for name, b in backends.items():
            if not isinstance(b, Mapping):
                raise ValueError(f"not a /v1/weights document: backend {name!r} is not a table")
            w = b.get("weight")
            weights[str(name)] = float(w) if isinstance(w, int | float) and not isinstance(w, bool) else NAN
            if b.get("state") in (DRAIN, DOWN):
                drained.add(str(name))
                if isinstance(b.get("reasons"), list) and tuple(b["reasons"]) == KV_ONLY:
                    kv_drained.add(str(name))
        admission = {}
        for cls_name, entry in (doc.get("class_admission") or {}).items():
            states = entry.get("backends") if isinstance(entry, Mapping) else None
            if isinstance(states, Mapping):
                admission[str(cls_name)] = {str(k): str(v) for k, v in states.items()}
        levels = {str(c): ClassLevel.from_dict(v) for c, v in (doc.get("class_levels") or {}).items()
                  if isinstance(v, Mapping)}
        version = doc.get("version")
        return cls(weights, frozenset(drained), admission, version if isinstance(version, int) else 0, levels,
                   frozenset(kv_drained))

    def class_state(self, backend: str, request_class: str) -> str | None:
        return self.class_admission.get(request_class, {}).get(backend)


@dataclass(frozen=True)
class RequestNeed:
    """What a request will hold: its class and KV tokens (prompt + expected output)."""

    request_class: str = ""
    kv_tokens: float = NAN
    prompt_tokens: float = NAN
    """Its prompt alone: held once prefilled, a floor under what a scrape saw it hold."""
    prefix_blocks: tuple[int, ...] = ()
    """Chained hashes of its prompt's blocks (:func:`~.prefix_index.block_hashes`); empty: no prefix term."""


@dataclass(frozen=True)
class Pick:
    """A choice (``address`` set) or a refusal (``status`` and ``message``)."""

    backend: str = ""
    address: str = ""
    ticket: int = -1
    status: int = 200
    message: str = ""
    factors: Mapping[str, Any] = field(default_factory=dict)
