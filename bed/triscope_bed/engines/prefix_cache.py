"""The simulated engine's prefix cache, with vLLM's block semantics (``vllm/v1/core/kv_cache_manager.py``,
``block_pool.py``).

A full KV block of a prompt is keyed by everything before and in it (vLLM hashes the parent block's hash
with the block's tokens; here the request's prefix block ids stand for its tokens). A new request looks
up its prompt's keys from the first on and reuses the leading run it finds: those tokens need no prefill.
A block in use by running requests is shared and counted once; when its last user ends (or is preempted)
it stays cached but free, at the tail of an LRU queue, and is evicted from the head when the pool needs a
block. So the cache follows the pool: under KV pressure the oldest unused prefixes go first.

Counters in tokens, as vLLM's ``vllm:prefix_cache_queries`` / ``vllm:prefix_cache_hits``: a request's prompt
is queried once, at its first admission.
"""

from __future__ import annotations

from collections import OrderedDict

Key = tuple[int, int]
"""(hash of the prefix block ids up to this KV block, the KV block's index in the prompt)."""
MAX_PREFIX_BLOCKS = 100_000


def block_keys(prefix: tuple[int, ...], prefix_block_tokens: int, prompt: int, kv_block_tokens: int) -> tuple[Key, ...]:
    """Keys of the prompt's full KV blocks that its prefix ids describe (a partial last block is never cached)."""
    if not prefix or prefix_block_tokens < 1:
        return ()
    covered = min(prompt, len(prefix) * prefix_block_tokens)
    keys = []
    for j in range(covered // kv_block_tokens):
        upto = -(-((j + 1) * kv_block_tokens) // prefix_block_tokens)  # prefix blocks this KV block reaches into
        keys.append((hash(prefix[:upto]), j))
    return tuple(keys)


class PrefixCache:
    """Cached KV blocks: the shared ones in use (reference counts) and the free ones in LRU order."""

    def __init__(self) -> None:
        self.refs: dict[Key, int] = {}
        self.free_lru: OrderedDict[Key, None] = OrderedDict()
        self.queried_tokens = 0
        self.hit_tokens = 0
        self.evicted = 0

    def leading_hits(self, keys: tuple[Key, ...]) -> int:
        """How many of ``keys``, from the first, are cached (in use or free)."""
        n = 0
        for key in keys:
            if key not in self.refs and key not in self.free_lru:
                break
            n += 1
        return n

    def from_free(self, keys: tuple[Key, ...]) -> int:
        """Of ``keys`` (all cached), how many are free now: taking them uses that many pool blocks."""
        return sum(1 for key in keys if key in self.free_lru)

    def take(self, keys: tuple[Key, ...]) -> int:
        """One more user of each of ``keys``; returns how many came off the free queue."""
        revived = 0
        for key in keys:
            if key in self.free_lru:
                del self.free_lru[key]
                revived += 1
            self.refs[key] = self.refs.get(key, 0) + 1
        return revived

    def adopt(self, key: Key) -> bool:
        """A block a request just computed becomes cached, held by it; False when the key is cached already."""
        if key in self.refs or key in self.free_lru:
            return False
        self.refs[key] = 1
        return True

    def release(self, keys: list[Key]) -> int:
        """One user fewer of each of ``keys``; returns how many became free (they stay cached, newest last)."""
        freed = 0
        for key in reversed(keys):  # vLLM frees a request's blocks tail first: its prefix outlives its suffix
            left = self.refs.get(key, 0) - 1
            if left > 0:
                self.refs[key] = left
                continue
            self.refs.pop(key, None)
            self.free_lru[key] = None
            freed += 1
        return freed

    def evict(self, n: int) -> int:
        """Drop up to ``n`` free cached blocks, least recently used first."""
        gone = 0
        while gone < n and self.free_lru:
            self.free_lru.popitem(last=False)
            gone += 1
        self.evicted += gone
        return gone

    def count_query(self, prompt_tokens: int, hit_tokens: int) -> None:
        self.queried_tokens += prompt_tokens
        self.hit_tokens += hit_tokens


__all__ = ["MAX_PREFIX_BLOCKS", "Key", "PrefixCache", "block_keys"]
