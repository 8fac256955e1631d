"""Request classes for spans that carry none: ``[otlp] class_rules`` and ``default_class`` (docs/run.md).

vLLM's ``llm_request`` span, like most engines' and gateways', names no request class, so without a
mapping every request would count as the weight engine's default class. A span's class is, in order:
its own ``triscope.request_class`` (or ``request.class``) attribute; the first rule that matches it;
``default_class``. A rule matches when every condition it sets holds (conditions left out match all):

- ``model``: glob on the row's model (``whisper*``);
- ``route``: glob on ``http.route``, else ``url.path`` (span, its parent, resource): ``/v1/audio/*``;
- ``attribute`` + ``value``: the attribute (span, parent, resource; a header as the OTel convention
  names it, ``http.request.header.x-priority``) has a value matching the glob (``value`` left out:
  present);
- ``modality``: the row's modality (``text``, ``image``, ``audio``, ...);
- ``min_prompt_tokens`` / ``max_prompt_tokens``: prompt tokens within the bounds (0 = no bound).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

from triscope.errors import ConfigError

ROUTE_ATTRS = ("http.route", "url.path")


@dataclass(frozen=True)
class ClassRule:
    """One ``[[otlp.class_rules]]`` entry: ``request_class`` for the spans matching every condition set."""

    request_class: str
    model: str = ""
    route: str = ""
    attribute: str = ""
    value: str = ""
    modality: str = ""
    min_prompt_tokens: int = 0
    max_prompt_tokens: int = 0

    def matches(self, row: Mapping[str, Any], lookup: Any) -> bool:
        """Whether a ``requests`` row (and ``lookup(names)``, the span's first attribute present) matches."""
        if self.model and not fnmatch.fnmatchcase(str(row.get("model", "")), self.model):
            return False
        if self.modality and str(row.get("modality", "")) != self.modality:
            return False
        tokens = int(row.get("prompt_tokens") or 0)
        if tokens < self.min_prompt_tokens or (self.max_prompt_tokens and tokens > self.max_prompt_tokens):
            return False
        if self.route:
            route = lookup(ROUTE_ATTRS)
            if route is None or not fnmatch.fnmatchcase(str(route), self.route):
                return False
        if self.attribute:
            found = lookup((self.attribute,))
            if found is None or (self.value and not fnmatch.fnmatchcase(str(found), self.value)):
                return False
        return True


_KEYS = {f.name for f in fields(ClassRule)} - {"request_class"} | {"class"}


def parse_class_rules(raw: Sequence[Any], where: str = "[otlp] class_rules") -> tuple[ClassRule, ...]:
    """Tables ``{class = NAME, model = ..., ...}`` as rules; ConfigError (one line) naming a bad one."""
    out = []
    for k, spec in enumerate(raw):
        here = f"{where}[{k}]"
        if not isinstance(spec, Mapping):
            raise ConfigError(f"{here} must be a table, got {spec!r}")
        unknown = set(spec) - _KEYS
        if unknown:
            raise ConfigError(f"{here} has unknown keys: {', '.join(sorted(unknown))} "
                              f"(known: {', '.join(sorted(_KEYS))})")
        name = spec.get("class")
        if not isinstance(name, str) or not name:
            raise ConfigError(f"{here} needs class = \"NAME\"")
        texts = {key: spec.get(key, "") for key in ("model", "route", "attribute", "value", "modality")}
        bounds = {key: spec.get(key, 0) for key in ("min_prompt_tokens", "max_prompt_tokens")}
        if any(not isinstance(v, str) for v in texts.values()):
            raise ConfigError(f"{here}: model, route, attribute, value and modality must be strings")
        if any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in bounds.values()):
            raise ConfigError(f"{here}: min_prompt_tokens and max_prompt_tokens must be integers >= 0")
        if texts["value"] and not texts["attribute"]:
            raise ConfigError(f"{here}: value needs attribute")
        if not any(texts.values()) and not any(bounds.values()):
            raise ConfigError(f"{here} sets no condition: use default_class for a class of every span")
        out.append(ClassRule(name, **texts, **bounds))
    return tuple(out)


def rule_attributes(rules: Sequence[ClassRule]) -> frozenset[str]:
    """The span attributes the rules read (decoders keep them; parents pass them to their children)."""
    names = {r.attribute for r in rules if r.attribute}
    if any(r.route for r in rules):
        names.update(ROUTE_ATTRS)
    return frozenset(names)


def classify(row: Mapping[str, Any], lookup: Any, rules: Sequence[ClassRule], default: str) -> str:
    """The class of a row whose span names none: the first matching rule's, else ``default``."""
    for rule in rules:
        if rule.matches(row, lookup):
            return rule.request_class
    return default


__all__ = ["ClassRule", "classify", "parse_class_rules", "rule_attributes"]
