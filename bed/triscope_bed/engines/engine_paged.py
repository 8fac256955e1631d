"""Paged KV for the simulated engine: vLLM's step loop, KV growing block by block, preemption by recompute.

What vLLM's v1 scheduler does (``vllm/v1/core/sched/scheduler.py``, ``kv_cache_manager.py``), in the
simulator's cost model. The engine runs steps; each step every running request computes its next
token. Before a step, running requests (in the order they were scheduled) take the KV block their
next token needs (generating output token ``k`` needs slots for ``prompt + k - 1`` tokens); when none
is free, the most recently scheduled running request (the end of the list, possibly the one asking)
is preempted: its blocks are freed, it goes back to the head of the waiting queue and, once admitted
again, recomputes the prefill of its prompt plus the tokens it had generated. Then, if nothing was
preempted, waiting requests are admitted FCFS (head-of-line) while a slot and the blocks of their
prompt (plus the watermark while something runs) are free; their prefill is part of the step.

A step lasts ``(prefill_s_per_token * prefill_tokens + decode_s_per_token * (1 + batch_slowdown * n /
slots)) / speed`` for ``n`` requests in it: prefill costs per token, decoding per step and per sequence
in the batch (fitted to vLLM-CPU: a step costs 2.8 ms plus 0.64 ms per sequence, a prompt token 0.33 ms);
a lone request takes ``prompt * prefill + output * decode * (1 + batch_slowdown / slots)``, and a
step's prefill delays every decode in it, as on the real engine. ``vllm:num_preemptions_total``
counts preemptions.

A request that names its prompt's prefix blocks (a trace with prefix structure) goes through the prefix
cache (:mod:`triscope_bed.engines.prefix_cache`): its leading cached blocks are shared, not prefilled, and
its own full blocks are cached when its prefill is done; free cached blocks are evicted LRU when the pool
needs a block. Without prefix blocks nothing is cached, as before.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from triscope_bed.engines.prefix_cache import Key, PrefixCache, block_keys

if TYPE_CHECKING:
    from triscope_bed.engines.engine import Engine, Served

MAX_CATCH_UP_S = 0.05
"""A step loop that fell behind (a busy host) runs its late steps back to back, at most this far back."""


@dataclass(eq=False)
class _Seq:
    """One request in the paged scheduler."""

    prompt: int
    out: int
    t0: float
    finished: asyncio.Future[None]
    done: int = 0
    """Output tokens generated (kept across a preemption)."""
    blocks: int = 0
    """Blocks it holds alone (its cached, possibly shared, blocks are in ``held``)."""
    prefilling: bool = False
    started: float = -1.0
    ttft: float = -1.0
    prefill_s: float = 0.0
    keys: tuple[Key, ...] = ()
    """Prefix-cache keys of the prompt's full blocks (empty: nothing cached)."""
    held: list[Key] = field(default_factory=list)
    cached_tokens: int = 0
    """Prompt tokens the current admission found cached (no prefill for them)."""
    queried: bool = False


@dataclass
class PagedKV:
    """The paged KV pool and step loop of one :class:`~triscope_bed.engines.engine.Engine` (``spec.paged_kv``)."""

    engine: Engine
    running: list[_Seq] = field(default_factory=list)
    waiting: deque[_Seq] = field(default_factory=deque)
    used: int = 0
    preemptions: int = 0
    steps: int = 0
    cache: PrefixCache = field(default_factory=PrefixCache)
    _wake: asyncio.Event | None = None
    _task: asyncio.Task[None] | None = None

    def __post_init__(self) -> None:
        spec = self.engine.spec
        if spec.kv_block_tokens < 1 or spec.kv_reserved_blocks < 0 or spec.watermark_blocks < 0:
            raise ValueError(f"{spec.name}: kv_block_tokens >= 1, kv_reserved_blocks >= 0, watermark_blocks >= 0")
        if spec.staged_fraction:
            raise ValueError(f"{spec.name}: paged KV stages nothing (staged_fraction must be 0)")
        self.block_tokens = spec.kv_block_tokens
        self.block_bytes = spec.kv_block_tokens * spec.kv_bytes_per_token
        self.total = int(spec.kv_capacity_bytes // self.block_bytes) - spec.kv_reserved_blocks
        if self.total < 1:
            raise ValueError(f"{spec.name}: the KV pool holds no block of {spec.kv_block_tokens} tokens")
        self.engine.capacity = self.total * self.block_bytes  # usage is of the usable blocks, as vLLM's gauge

    def blocks_for(self, tokens: int) -> int:
        return max(1, math.ceil(tokens / self.block_tokens))

    def free(self) -> int:
        """Blocks a request may take: never used, or cached but free (evicted when taken)."""
        return self.total - self.used - math.ceil(self.engine.pressure / self.block_bytes)

    def _allocate(self, n: int) -> None:
        """Take ``n`` blocks for new KV, evicting the least recently used free cached blocks to make room."""
        empty = self.free() - len(self.cache.free_lru)
        if n > empty:
            self.cache.evict(n - empty)
        self.used += n

    def _sync(self) -> None:
        e = self.engine
        e.kv_used = self.used * self.block_bytes
        e.running, e.waiting = len(self.running), len(self.waiting)
        e.peak_kv_ratio = max(e.peak_kv_ratio, e.kv_ratio())

    def kick(self) -> None:
        """Wake the step loop (an arrival, released pressure); starts it on the running event loop."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        if self._task is None or self._task.done() or self._task.get_loop() is not loop:
            self._wake = asyncio.Event()
            self._task = loop.create_task(self._loop(), name=f"sim-engine-{self.engine.spec.name}")
        assert self._wake is not None
        self._wake.set()

    def _release(self, seq: _Seq) -> None:
        """Its own blocks back to the pool; its cached ones one user fewer (free but cached when none is left)."""
        self.used -= seq.blocks + self.cache.release(seq.held)
        seq.blocks, seq.held = 0, []

    def _preempt(self, victim: _Seq) -> None:
        self.running.remove(victim)
        self._release(victim)
        victim.prefilling = False
        self.waiting.appendleft(victim)
        self.preemptions += 1

    def _plan(self) -> list[_Seq]:
        """The next step's batch: KV for every running request (preempting), then admissions."""
        spec, batch, preempted = self.engine.spec, [], False
        for seq in list(self.running):
            if seq not in self.running:  # preempted for a request ahead of it in this pass
                continue
            need = self.blocks_for(seq.prompt + seq.done)
            while seq.blocks + len(seq.held) < need:
                if self.free() >= 1 or self.running == [seq]:  # alone, it runs (pinned pressure)
                    seq.blocks += 1
                    self._allocate(1)
                    continue
                victim = self.running[-1]
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            if seq in self.running:
                batch.append(seq)
        while not preempted and self.waiting and len(self.running) < spec.slots:
            seq = self.waiting[0]
            need = self.blocks_for(seq.prompt + seq.done)
            hits = self.cache.leading_hits(seq.keys)
            revive = self.cache.from_free(seq.keys[:hits])
            watermark = spec.watermark_blocks if self.running else 0
            if need - hits + revive + watermark > self.free() and self.running:
                break
            self.waiting.popleft()
            # vLLM recomputes at least the prompt's last token, so a fully cached prompt still prefills one
            seq.cached_tokens = min(hits * self.block_tokens, seq.prompt - 1)
            if not seq.queried:
                seq.queried = True
                self.cache.count_query(seq.prompt, seq.cached_tokens)
            self.used += self.cache.take(seq.keys[:hits])
            seq.held = list(seq.keys[:hits])
            seq.blocks, seq.prefilling = need - hits, True
            self._allocate(need - hits)
            self.running.append(seq)
            seq.started = time.monotonic() if seq.started < 0 else seq.started
            batch.append(seq)
        self._sync()
        return batch

    def step_seconds(self, batch: list[_Seq]) -> float:
        spec = self.engine.spec
        # a recompute redoes the output too; cached prompt tokens are not computed again
        prefill = sum(s.prompt + s.done - s.cached_tokens for s in batch if s.prefilling)
        load = 1.0 + spec.batch_slowdown * len(batch) / spec.slots
        return (prefill * spec.prefill_s_per_token + spec.decode_s_per_token * load) / spec.speed

    def _advance(self, batch: list[_Seq], seconds: float) -> None:
        """The step is over: every request of the batch has one more token; finished ones leave."""
        now = time.monotonic()
        for seq in batch:
            if seq not in self.running:  # cancelled during the step
                continue
            if seq.prefilling:
                seq.prefilling = False
                seq.prefill_s += seconds
                self._cache_own_blocks(seq)
                if seq.ttft < 0:
                    seq.ttft = now - seq.t0
                    self.engine.c.ttft.observe(seq.ttft)
            seq.done += 1
            if seq.done >= seq.out:
                self._remove(seq)
                if not seq.finished.done():
                    seq.finished.set_result(None)
        self.steps += 1
        self._sync()

    async def _loop(self) -> None:
        deadline = time.monotonic()
        while True:
            batch = self._plan()
            if not batch:
                assert self._wake is not None
                self._wake.clear()
                await self._wake.wait()
                deadline = time.monotonic()
                continue
            seconds = self.step_seconds(batch)
            deadline = max(deadline, time.monotonic() - MAX_CATCH_UP_S) + seconds
            await asyncio.sleep(max(0.0, deadline - time.monotonic()))
            self._advance(batch, seconds)

    def _cache_own_blocks(self, seq: _Seq) -> None:
        """Its prompt's full blocks it just computed are cached (held by it until it ends)."""
        for key in seq.keys[len(seq.held):]:
            if seq.blocks < 1 or not self.cache.adopt(key):
                break  # computed twice at once: the other copy is the cached one, this one stays its own
            seq.blocks -= 1
            seq.held.append(key)

    def _remove(self, seq: _Seq) -> None:
        if seq in self.running:
            self.running.remove(seq)
            self._release(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)

    def refusal(self, prompt: int, out: int) -> str | None:
        if self.blocks_for(prompt + out - 1) > self.total:
            return "request exceeds the KV pool"
        limit = self.engine.spec.max_waiting
        if limit is not None and len(self.waiting) >= limit:
            return "queue full"
        return None

    async def serve(self, cls: str, t0: float, tokens: tuple[int, int],
                    prefix: tuple[tuple[int, ...], int] = ((), 0)) -> Served | str:
        """Queue, run (with preemptions) and finish one request of ``tokens`` = (prompt, output); ``prefix``:
        the prompt's prefix block ids and the tokens each stands for (a prefix-cache lookup), or none."""
        from triscope_bed.engines.engine import Served

        e = self.engine
        prompt, out = max(1, tokens[0]), max(1, tokens[1])
        reason = self.refusal(prompt, out)
        if reason is not None:
            e.c.refused[cls] = e.c.refused.get(cls, 0) + 1
            return reason
        seq = _Seq(prompt, out, t0, asyncio.get_running_loop().create_future(),
                   keys=block_keys(prefix[0], prefix[1], prompt, self.block_tokens))
        self.waiting.append(seq)
        self._sync()
        self.kick()
        completed = False
        try:
            await seq.finished
            completed = True
        finally:
            if not completed:  # cancelled (which cancels the future too): free its blocks now
                self._remove(seq)
                self._sync()
                with contextlib.suppress(RuntimeError):
                    self.kick()
        done = time.monotonic()
        e.record(cls, t0, seq.started, done, (prompt, out))
        return Served(seq.started - t0, seq.ttft, done - t0, seq.prefill_s, done - t0 - seq.ttft)
