"""The simulated engine's prefix cache (triscope_bed.engines.prefix_cache, in the paged engine): vLLM's block
semantics. A request whose prefix blocks are cached skips their prefill and shares their KV; its own full
blocks are cached when its prefill is done; free cached blocks go least recently used first when the pool
needs room; the counters are vLLM's, in tokens. Checked at every state change: the pool never overflows
and every block is counted once."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import pytest

from triscope.prom_text import parse_exposition
from triscope_bed.engines.backend import SimBackend
from triscope_bed.engines.engine import Engine, EngineSpec, Served
from triscope_bed.engines.prefix_cache import block_keys

BLOCK = 16


def _paged(blocks: int, slots: int = 8, pf: float = 1e-3, dc: float = 1e-3) -> Engine:
    return Engine(EngineSpec("e", blocks * BLOCK, slots=slots, batch_slowdown=0.0, kv_bytes_per_token=1.0,
                             staged_fraction=0.0, paged_kv=True, kv_block_tokens=BLOCK, prefill_s_per_token=pf,
                             decode_s_per_token=dc))


def _watch(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    paged = engine.paged
    assert paged is not None
    original: Callable[[], None] = paged._sync

    def checked() -> None:
        assert 0 <= paged.used <= paged.total, (paged.used, paged.total)
        assert sum(s.blocks for s in paged.running) + len(paged.cache.refs) == paged.used  # each block once
        assert paged.used + len(paged.cache.free_lru) <= paged.total  # cached free blocks are real blocks
        original()

    monkeypatch.setattr(paged, "_sync", checked)


async def _serve(engine: Engine, prompt: int, out: int, prefix: tuple[int, ...] = (), per: int = 64
                 ) -> Served | str:
    return await engine.serve("", 0, (0.0, 0.0), (prompt, out), (prefix, per if prefix else 0))


def test_block_keys_follow_the_prefix_ids() -> None:
    a = block_keys((1, 2, 3), 64, 192, BLOCK)
    b = block_keys((1, 2, 9), 64, 192, BLOCK)
    assert len(a) == 12 and a[:8] == b[:8] and a[8] != b[8]  # equal ids, equal keys; the third id differs
    assert block_keys((1, 2, 3), 64, 100, BLOCK) == a[:6]  # a partial last block is never cached
    assert block_keys((), 64, 192, BLOCK) == ()


def test_a_cached_prefix_skips_its_prefill_and_is_counted(monkeypatch: pytest.MonkeyPatch) -> None:
    engine = _paged(64, pf=2e-3)
    _watch(engine, monkeypatch)

    async def main() -> list[Served | str]:
        first = await _serve(engine, 192, 4, (7, 8, 9))
        again = await _serve(engine, 192, 4, (7, 8, 9))  # all 12 blocks cached: only the last token is computed
        other = await _serve(engine, 192, 4, (7, 8, 1))  # two of three ids shared: 128 tokens cached
        fresh = await _serve(engine, 192, 4)  # no prefix ids: looked up as vLLM does, nothing found
        return [first, again, other, fresh]

    first, again, other, fresh = asyncio.run(main())
    assert isinstance(first, Served) and isinstance(again, Served) and isinstance(other, Served)
    assert again.prefill_s < first.prefill_s / 10 and other.prefill_s < first.prefill_s * 0.5
    cache = engine.paged.cache  # type: ignore[union-attr]
    assert (cache.queried_tokens, cache.hit_tokens) == (4 * 192, 191 + 128)
    series = parse_exposition(engine.metrics_text())
    assert series["vllm:prefix_cache_queries_total"][0][1] == 4 * 192
    assert series["vllm:prefix_cache_hits_total"][0][1] == 191 + 128
    assert engine.paged.used == 0 and len(cache.refs) == 0  # type: ignore[union-attr]


def test_requests_sharing_a_prefix_share_its_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    engine = _paged(64, dc=0.02)
    _watch(engine, monkeypatch)
    used: list[int] = []

    async def main() -> None:
        await _serve(engine, 128, 2, (5, 6))  # caches the 8 blocks of the shared prefix
        tasks = [asyncio.create_task(_serve(engine, 160, 20, (5, 6, 100 + i), per=64)) for i in range(3)]
        await asyncio.sleep(0.1)
        used.append(engine.paged.used)  # type: ignore[union-attr]
        await asyncio.gather(*tasks)

    asyncio.run(main())
    # alone each would hold ceil((160 + generated) / 16) >= 11 blocks, 33 for three; shared: 8 + 3 x (3-4)
    assert used[0] <= 8 + 3 * 4, used


def test_free_cached_blocks_are_evicted_least_recently_used_first(monkeypatch: pytest.MonkeyPatch) -> None:
    engine = _paged(20)
    _watch(engine, monkeypatch)

    async def main() -> list[Served | str]:
        await _serve(engine, 128, 2, (1, 2))   # 8 cached blocks, prefix A
        await _serve(engine, 128, 2, (3, 4))   # 8 more, prefix B: A is now the older
        await _serve(engine, 96, 30)            # needs 8 blocks: only 4 are empty, so 4 of A's go
        b = await _serve(engine, 128, 2, (3, 4))
        a = await _serve(engine, 128, 2, (1, 2))
        return [a, b]

    asyncio.run(main())
    cache = engine.paged.cache  # type: ignore[union-attr]
    # the third request needed 8 blocks with 4 empty: A's 4 tail blocks went (vLLM frees a request's tail
    # first, so its prefix outlives its suffix); B, used more recently, was found whole, A by its head
    assert cache.evicted == 4
    assert cache.hit_tokens == 127 + 4 * BLOCK


def test_the_sim_backend_reads_prefix_blocks_from_the_body() -> None:
    backend = SimBackend(_paged(64).spec)

    async def main() -> list[tuple[int, dict[str, Any]]]:
        body = {"prompt_tokens": 128, "max_tokens": 2, "prefix_blocks": [1, 2], "block_tokens": 64}
        ok = [await backend._completion(json.dumps(body).encode()) for _ in range(2)]
        bad = await backend._completion(json.dumps({**body, "prefix_blocks": ["x"]}).encode())
        return [*ok, bad]

    first, second, bad = asyncio.run(main())
    assert first[0] == second[0] == 200 and bad[0] == 400 and "prefix_blocks" in bad[1]["error"]
    assert second[1]["timings"]["prefill_s"] < first[1]["timings"]["prefill_s"]


def test_the_large_kv_profile_keeps_a_conversation_s_history_between_its_turns() -> None:
    """``vllm-cpu-large-kv``: vLLM-CPU's fitted costs with a 256 Ki-token KV in 16-token blocks. Two turns of
    one Mooncake conversation at full size (the second's first 12 block ids are the first's), a dozen
    unrelated prompts in between: the second turn finds its 6,144-token history cached and skips its
    prefill."""
    from triscope_bed.engines.calibration import PROFILES, VLLM_CPU, idle_latency, token_sizes

    large = PROFILES["vllm-cpu-large-kv"]
    engine = Engine(large.engine_spec("e"))
    assert engine.spec.kv_capacity_bytes // engine.spec.kv_bytes_per_token == 262_144 and large.kv_block_tokens == 16
    for cls, (prompt, out) in token_sizes().items():  # the shared cost model: within 12 % of the measured idle
        assert abs(idle_latency(VLLM_CPU, prompt, out) / VLLM_CPU.idle_latency_s[cls] - 1) < 0.12
    assert set(large.sla_s.values()) == {round(4 * idle_latency(VLLM_CPU, 6909, 350), 0)}
    history = tuple(range(100, 112))  # 12 blocks of 512 tokens
    fast = _faster(engine)

    async def main() -> list[Served | str]:
        first = await _serve(fast, 12 * 512, 8, history, per=512)
        others = [await _serve(fast, 4096, 8, (9000 + k,), per=512) for k in range(12)]
        second = await _serve(fast, 14 * 512, 8, (*history, 200, 201), per=512)
        return [first, *others, second]

    done = asyncio.run(main())
    first, second = done[0], done[-1]
    assert isinstance(first, Served) and isinstance(second, Served)
    cache = fast.paged.cache  # type: ignore[union-attr]
    assert cache.hit_tokens == 12 * 512  # the whole history, the new turn's 1,024 tokens computed
    assert second.prefill_s < first.prefill_s / 3


def _faster(engine: Engine) -> Engine:
    """The same engine with per-token costs a thousand times smaller, so the test takes milliseconds."""
    import dataclasses

    spec = dataclasses.replace(engine.spec, prefill_s_per_token=engine.spec.prefill_s_per_token / 1000,
                               decode_s_per_token=engine.spec.decode_s_per_token / 1000, overhead_s=0.0)
    return Engine(spec)
