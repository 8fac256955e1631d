"""What each backend's prefix cache is likely to hold, for the picker's prefix term.

An engine with automatic prefix caching (vLLM, SGLang) skips the prefill of a prompt's leading
blocks it still holds from an earlier request. The picker cannot see inside the engines' caches, so
it keeps its own estimate, as the GIE Endpoint Picker and sglang-router's ``cache_aware`` policy do:
each prompt is cut into fixed-size blocks of text, each block's hash chained to the one before it (a
block matches only when everything before it matches too, as in the engine's cache), and every
backend keeps a least-recently-used set of the blocks it was sent, bounded by its KV capacity. A
backend's match for a new prompt is the number of leading blocks it holds.

The estimate errs where the engine's cache and the index part ways: the engine evicted earlier (its
KV filled with other work), or restarted. The picker forgets a backend's blocks when it is refused
(the process is gone) and bounds each backend by its KV capacity, so the index can only lag the
engine by its eviction order, never by blocks a dead process held.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

DEFAULT_CAPACITY_BLOCKS = 65_536
"""Blocks held per backend before its KV capacity is known (about 1M tokens of 16-token blocks)."""


def prompt_text(doc: Mapping[str, Any]) -> str:
    """The text of an OpenAI-style request that its prefix is made of: a completion's prompt (a list of
    strings joined), or a chat's messages (role and text of each, in order: equal conversations, equal text)."""
    prompt = doc.get("prompt")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and all(isinstance(p, str) for p in prompt):
        return "\n".join(prompt)
    messages = doc.get("messages")
    if not isinstance(messages, list):
        return ""
    parts = []
    for m in messages:
        if not isinstance(m, dict):
            continue
        content = m.get("content")
        if isinstance(content, list):  # parts: the text ones; an image part by its URL (same image, same text)
            content = "".join(str(p.get("text") or json.dumps(p.get("image_url"), sort_keys=True))
                              for p in content if isinstance(p, dict))
        parts.append(f"<{m.get('role', '')}>{content if isinstance(content, str) else ''}")
    return "".join(parts)


def block_hashes(text: str, block_chars: int, max_blocks: int, seed: str = "") -> tuple[int, ...]:
    """Chained hashes of ``text``'s whole ``block_chars``-character blocks (at most ``max_blocks``), each
    over its block and the previous hash; ``seed`` (the model) starts the chain, so the same text sent to
    two models never matches. A trailing partial block is left out, as an engine caches whole blocks.

    Python's own (SipHash) hash: about 0.2 us a block against 2 us for hashlib's blake2b, and the index
    lives in the one process that hashes, so its per-process salt does no harm."""
    if block_chars <= 0 or max_blocks <= 0:
        return ()
    n = min(len(text) // block_chars, max_blocks)
    prev = hash(seed)
    out = []
    for i in range(n):
        prev = hash((prev, text[i * block_chars:(i + 1) * block_chars]))
        out.append(prev)
    return tuple(out)


class PrefixIndex:
    """Block hash -> backends holding it, bounded by one LRU per backend. Not thread-safe: the picker
    calls it under its own lock."""

    def __init__(self, default_capacity: int = DEFAULT_CAPACITY_BLOCKS) -> None:
        self.default_capacity = max(1, default_capacity)
        self._holders: dict[int, set[str]] = {}
        self._lru: dict[str, OrderedDict[int, None]] = {}
        self._capacity: dict[str, int] = {}

    def set_capacity(self, backend: str, blocks: int) -> None:
        """Bound ``backend``'s set to ``blocks`` (its KV capacity in blocks), evicting its oldest beyond it."""
        self._capacity[backend] = max(1, int(blocks))
        self._trim(backend)

    def match(self, blocks: Sequence[int], candidates: Iterable[str]) -> dict[str, int]:
        """Leading blocks of ``blocks`` each candidate holds (0 for none)."""
        alive = set(candidates)
        counts = dict.fromkeys(alive, 0)
        for h in blocks:
            alive &= self._holders.get(h, set())
            if not alive:
                break
            for b in alive:
                counts[b] += 1
        return counts

    def record(self, backend: str, blocks: Sequence[int]) -> None:
        """``backend`` was sent a prompt of ``blocks``: it holds them now, the most recently used. The head
        is marked the most recent, so a prompt's tail is evicted first, as vLLM frees a request's blocks
        tail first: what stays is still a prefix."""
        lru = self._lru.setdefault(backend, OrderedDict())
        for h in reversed(blocks):
            if h in lru:
                lru.move_to_end(h)
            else:
                lru[h] = None
                self._holders.setdefault(h, set()).add(backend)
        self._trim(backend)

    def forget(self, backend: str) -> None:
        """``backend``'s cache is gone (its process was refused, or restarted): drop all it held."""
        for h in self._lru.pop(backend, OrderedDict()):
            self._drop(h, backend)

    def blocks(self, backend: str) -> int:
        """Blocks the index believes ``backend`` holds."""
        return len(self._lru.get(backend, ()))

    def _trim(self, backend: str) -> None:
        lru = self._lru.get(backend)
        if lru is None:
            return
        cap = self._capacity.get(backend, self.default_capacity)
        while len(lru) > cap:
            old, _ = lru.popitem(last=False)
            self._drop(old, backend)

    def _drop(self, h: int, backend: str) -> None:
        holders = self._holders.get(h)
        if holders is not None:
            holders.discard(backend)
            if not holders:
                del self._holders[h]


__all__: Sequence[str] = ["DEFAULT_CAPACITY_BLOCKS", "PrefixIndex", "block_hashes", "prompt_text"]
