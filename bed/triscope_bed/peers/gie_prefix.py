"""The GIE endpoint picker's approximate prefix index (:mod:`triscope_bed.peers.gie_epp`): the bytes GIE
hashes for a request, its chained xxhash64 blocks, and the per-pod LRU of blocks served."""

from __future__ import annotations

import json
from collections import OrderedDict

import xxhash


def _go_json(value: object) -> bytes:
    """Compact JSON as Go's ``json.Marshal`` writes it (no spaces, HTML-safe escapes; map key order aside)."""
    text = json.dumps(value, separators=(",", ":"), ensure_ascii=False)
    for char, escaped in _GO_ESCAPES:  # these only occur inside strings, so replacing them is safe
        text = text.replace(char, escaped)
    return text.encode()


_GO_ESCAPES = (("<", "\\u003c"), (">", "\\u003e"), ("&", "\\u0026"), ("\u2028", "\\u2028"), ("\u2029", "\\u2029"))


def user_input(body: dict) -> tuple[bytes, str] | None:
    """The bytes GIE hashes for prefix affinity, and the cache salt: a completion's prompt (a list of
    strings joined by spaces), a chat's messages as JSON; None for any other body."""
    salt = str(body.get("cache_salt") or "")
    if "messages" in body:
        return _go_json(body["messages"]), salt
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return prompt.encode(), salt
    if isinstance(prompt, list) and all(isinstance(p, str) for p in prompt):
        return " ".join(prompt).encode(), salt
    return None


def hash_prompt(model: str, salt: str, data: bytes, block_chars: int, max_blocks: int) -> list[int]:
    """Chained xxhash64 of ``data`` in ``block_chars``-byte blocks (a trailing partial block too);
    nothing under one full block; at most ``max_blocks`` blocks' worth of input."""
    if block_chars <= 0 or len(data) < block_chars:
        return []
    data = data[:block_chars * max_blocks]
    prev = xxhash.xxh64_intdigest(model.encode() + salt.encode())  # different models, different chains
    out = []
    for i in range(0, len(data), block_chars):
        prev = xxhash.xxh64_intdigest(data[i:i + block_chars] + prev.to_bytes(8, "little"))
        out.append(prev)
    return out


class PrefixIndexer:
    """Block hash -> pods that served it, bounded by one LRU per pod (evicting drops the pod)."""

    def __init__(self, default_capacity: int) -> None:
        self.default_capacity = default_capacity
        self.hash_to_pods: dict[int, set[str]] = {}
        self.lru: dict[str, OrderedDict[int, None]] = {}
        self.capacity: dict[str, int] = {}

    def add(self, hashes: list[int], pod: str, capacity: int = 0) -> None:
        """Record that ``pod`` now holds ``hashes``; the LRU's size is fixed when it is created."""
        lru = self.lru.get(pod)
        if lru is None:
            lru = self.lru[pod] = OrderedDict()
            self.capacity[pod] = capacity if capacity > 0 else self.default_capacity
        cap = self.capacity[pod]
        for h in hashes:
            if h in lru:
                lru.move_to_end(h)
                continue
            lru[h] = None
            if len(lru) > cap:
                old, _ = lru.popitem(last=False)
                holders = self.hash_to_pods.get(old)
                if holders is not None:
                    holders.discard(pod)
                    if not holders:
                        del self.hash_to_pods[old]
        for h in hashes:
            self.hash_to_pods.setdefault(h, set()).add(pod)

    def match(self, hashes: list[int]) -> dict[str, int]:
        """Pod -> blocks matched, walking the blocks in order and stopping at the first no pod has.

        As in GIE a pod is credited for every block it holds up to that point, not only for an
        unbroken run of its own."""
        res: dict[str, int] = {}
        for h in hashes:
            pods = self.hash_to_pods.get(h)
            if not pods:
                break
            for p in pods:
                res[p] = res.get(p, 0) + 1
        return res
