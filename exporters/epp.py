"""triscope as a Gateway API Inference Extension Endpoint Picker: per-request picks over ext_proc.

:class:`HeadroomChooser` reads each buffered OpenAI request (``/v1/completions`` or
``/v1/chat/completions``), estimates the KV it will hold and asks
:class:`~triscope.analyzers.routing.picker.HeadroomPicker`; Envoy (or any GIE-conformant gateway)
routes to the ``x-gateway-destination-endpoint`` it answers. The end of the request's ext_proc
stream closes the picker's ledger entry. Live scrapes reach the picker through its ``observe``;
the weight engine's results through ``set_weights``, so drains and class admission of the HAProxy,
EDS, Traefik and JSON feeds hold for per-request picks too.
"""

from __future__ import annotations

import json
import math
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from triscope.analyzers.routing.gate import ClassGate
from triscope.analyzers.routing.picker import EngineView, HeadroomPicker, Pick, RequestNeed
from triscope.analyzers.routing.prefix_index import block_hashes, prompt_text
from triscope.exporters.extproc import Choice

CLASS_HEADER = "x-triscope-class"
"""The request's class (``speech``, ``image-text``, ...); a JSON field ``request_class`` also counts."""


@dataclass(frozen=True)
class NeedParams:
    """How a request's KV need is estimated from its body."""

    chars_per_token: float = 4.0
    """Prompt characters per token (a text prompt is not tokenized here: a tokenizer per model costs more
    than the estimate's error, which the KV reserve absorbs)."""
    default_output_tokens: float = 256.0
    """Expected output when the request sets no ``max_tokens``."""


def request_need(doc: Mapping[str, Any], headers: Mapping[str, str], params: NeedParams) -> RequestNeed:
    """The class, KV tokens (prompt + expected output) and prompt tokens of one OpenAI-style request body."""
    prompt = _prompt_tokens(doc.get("prompt"), params) + _chat_tokens(doc.get("messages"), params)
    out = doc.get("max_tokens", doc.get("max_completion_tokens"))
    output = float(out) if isinstance(out, int | float) and not isinstance(out, bool) and out > 0 else (
        params.default_output_tokens)
    cls = headers.get(CLASS_HEADER) or doc.get("request_class") or ""
    return RequestNeed(str(cls)[:64], prompt + output if prompt > 0 else math.nan, prompt if prompt > 0 else math.nan)


def _prompt_tokens(prompt: Any, params: NeedParams) -> float:
    if isinstance(prompt, str):
        return len(prompt) / params.chars_per_token
    if isinstance(prompt, list) and prompt:
        if all(isinstance(t, int) for t in prompt):  # token ids
            return float(len(prompt))
        return sum(_prompt_tokens(p, params) for p in prompt)
    return 0.0


def _chat_tokens(messages: Any, params: NeedParams) -> float:
    if not isinstance(messages, list):
        return 0.0
    chars = 0
    for m in messages:
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, str):
            chars += len(content)
        elif isinstance(content, list):  # parts: text counts by length; images by what the caller says
            chars += sum(len(p.get("text", "")) for p in content if isinstance(p, dict))
    return chars / params.chars_per_token


@dataclass(frozen=True)
class Fallback:
    """The answer to a request the admission levels refuse (the request reaches no backend)."""

    status: int = 503
    body: str = '{"error": {"message": "overloaded: request class shed by triscope, retry later", ' \
                '"type": "triscope_admission"}}'


class HeadroomChooser:
    """The ext_proc :class:`~triscope.exporters.extproc.Chooser` of :class:`HeadroomPicker`, with the
    admission levels' :class:`~triscope.analyzers.routing.gate.ClassGate` in front of it."""

    def __init__(self, picker: HeadroomPicker, need: NeedParams | None = None, gate: ClassGate | None = None,
                 fallback: Fallback | None = None) -> None:
        self.picker = picker
        self.need = need or NeedParams()
        self.gate = gate or ClassGate()
        self.fallback = fallback or Fallback()
        self.refused: Counter[tuple[str, str]] = Counter()
        """(class, level) -> requests refused by the admission levels."""

    def set_engine(self, view: EngineView | None) -> None:
        """The weight engine's decisions: drains, class admission and weights for the picker, levels for the gate."""
        self.picker.set_weights(view)
        self.gate.set_levels(view.class_levels if view is not None else {})

    def choose(self, body: bytes | None, headers: Mapping[str, str]) -> Choice:
        need = RequestNeed(headers.get(CLASS_HEADER, "")[:64])
        if body is not None:
            try:
                doc = json.loads(body)
            except ValueError:
                doc = None
            if not isinstance(doc, dict):
                return Choice(status=400, message="request body is not a JSON object")
            need = request_need(doc, headers, self.need)
            params = self.picker.params
            if params.prefix_weight > 0:  # the model (and a cache salt) start the chain: no match across them
                seed = f"{doc.get('model', '')}\x00{doc.get('cache_salt', '')}"
                need = replace(need, prefix_blocks=block_hashes(prompt_text(doc), params.prefix_block_chars,
                                                                params.prefix_max_blocks, seed))
        now = time.monotonic()
        refusal = self.gate.admit(need.request_class, now)
        if refusal is not None:
            self.refused[(need.request_class, refusal)] += 1
            return Choice(status=self.fallback.status, message=self.fallback.body, detail=refusal)
        pick = self.picker.pick(need, now)
        return Choice(pick.backend, pick.address, detail=pick)

    def answered(self, choice: Choice, status: int) -> None:
        if isinstance(choice.detail, Pick):
            self.picker.answered(choice.detail.backend, status, time.monotonic())

    def done(self, choice: Choice) -> None:
        if isinstance(choice.detail, Pick):
            self.picker.finish(choice.detail)
