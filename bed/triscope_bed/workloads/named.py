"""Named workloads for the closed-loop bench: a real trace replay and synthetic shapes.

``WORKLOADS[name](seed, backends, **params) -> list[Arrival]``; every builder is deterministic in
its arguments, so every policy replays the same requests. ``Arrival.step`` is the index of the
``bucket_s``-long window the arrival falls in (the load step for ``step``), which is what
:func:`triscope_bed.reports.judge.judge` groups by. docs/workloads.md describes each one.

The real workload replays the Azure LLM inference trace 2023 (code service; TIMESTAMP,
ContextTokens, GeneratedTokens; CC-BY-4.0), from Azure/AzurePublicDataset, published with Patel
et al., "Splitwise: Efficient generative LLM inference using phase splitting", ISCA 2024.
"""

from __future__ import annotations

import csv
import inspect
import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from triscope_bed.paths import REPO
from triscope_bed.workloads.arrivals import Arrival, LoadShape
from triscope_bed.workloads.common import (
    BUCKET_S,
    MAX_ROWS,
    WorkloadError,
    assign_class,
    default_mix,
)
from triscope_bed.workloads.mooncake import mooncake

DEFAULT_TRACE = REPO.parent / "shared" / "data" / "workloads" / "azure_llm_2023_code.csv"
"""``<repo>/../shared/data/workloads/azure_llm_2023_code.csv`` (not in the repository: 8,819 rows)."""
QPS_PER_BACKEND = 6.0
"""Default mean offered load per backend (4 backends: 24 QPS, the bench's first step)."""
STEP_S = 45.0
"""Default step length of the ``step`` workload: covers the 8-42 s after a +30 % step in which
production services are observed to fail (tests may use shorter steps)."""


@dataclass(frozen=True)
class TraceRow:
    """One request of a trace: seconds since the trace's first request, and its token counts."""

    t: float
    context_tokens: int
    generated_tokens: int


def _parse_time(text: str) -> float:
    """``2023-11-16 18:17:03.9799600`` (7 fractional digits, which ``fromisoformat`` may refuse) in seconds."""
    base, _, frac = text.strip().partition(".")
    whole = datetime.strptime(base, "%Y-%m-%d %H:%M:%S").timestamp()
    return whole + (float("0." + frac) if frac else 0.0)


def load_trace(path: str | Path | None = None) -> list[TraceRow]:
    """The Azure LLM trace rows in file order, times relative to the first row."""
    p = Path(path) if path is not None else DEFAULT_TRACE
    if not p.is_file():
        raise WorkloadError(f"trace file not found: {p} (the Azure LLM 2023 code trace; pass its path)")
    rows: list[TraceRow] = []
    t0: float | None = None
    with p.open(newline="") as fh:
        reader = csv.DictReader(fh)
        need = {"TIMESTAMP", "ContextTokens", "GeneratedTokens"}
        if not need <= set(reader.fieldnames or ()):
            raise WorkloadError(f"{p}: expected columns {', '.join(sorted(need))}, got {reader.fieldnames}")
        for n, rec in enumerate(reader):
            if n >= MAX_ROWS:
                break
            try:
                t = _parse_time(rec["TIMESTAMP"])
                row = (int(rec["ContextTokens"]), int(rec["GeneratedTokens"]))
            except (ValueError, TypeError) as exc:
                raise WorkloadError(f"{p}: row {n + 2}: {exc}") from None
            t0 = t if t0 is None else t0
            rows.append(TraceRow(t - t0, *row))
    if not rows:
        raise WorkloadError(f"{p}: no rows")
    return rows


def replay(rows: list[TraceRow], seed: int, *, start_s: float = 0.0, duration_s: float | None = None,
           compress: float = 1.0, target_qps: float | None = None, token_scale: float = 1.0,
           max_total_tokens: int | None = None, bucket_s: float = BUCKET_S,
           mix: dict[str, float] | None = None) -> list[Arrival]:
    """Arrivals from trace rows: the window from ``start_s`` (trace seconds), time divided by ``compress``.

    ``duration_s`` is the bench run length (None: to the trace's end). With ``target_qps`` the
    compression is chosen so that exactly ``round(target_qps x duration_s)`` consecutive requests from
    ``start_s`` fill ``duration_s``. Tokens are multiplied by ``token_scale`` (at least 1 each) and the
    prompt cut so prompt + max_tokens <= ``max_total_tokens`` (an engine's ``--max-model-len``).
    """
    if compress <= 0 or token_scale <= 0 or bucket_s <= 0:
        raise WorkloadError("compress, token_scale and bucket_s must be > 0")
    first = next((i for i, r in enumerate(rows) if r.t >= start_s), len(rows))
    if first >= len(rows):
        raise WorkloadError(f"start_s {start_s} is past the trace's end ({rows[-1].t:.0f} s)")
    if target_qps is not None:
        if target_qps <= 0 or duration_s is None or duration_s <= 0:
            raise WorkloadError("target_qps needs a positive target_qps and duration_s")
        want = max(1, round(target_qps * duration_s))
        if first + want > len(rows):
            raise WorkloadError(f"the trace has {len(rows) - first} requests after {start_s} s, "
                                f"{want} needed for {target_qps} QPS x {duration_s} s")
        span = rows[first + want - 1].t - rows[first].t if want > 1 else 0.0
        # the window's own mean gap is added so `want` requests at that rate cover exactly duration_s
        compress = (span * want / (want - 1) if want > 1 else duration_s) / duration_s
        window = rows[first:first + want]
    else:
        end = math.inf if duration_s is None else start_s + duration_s * compress
        window = [r for r in rows[first:] if r.t < end]
    t0 = start_s if target_qps is None else rows[first].t
    out = []
    for k, r in enumerate(window):
        t = (r.t - t0) / compress
        prompt = max(1, round(r.context_tokens * token_scale))
        gen = max(1, round(r.generated_tokens * token_scale))
        if max_total_tokens is not None:
            gen = min(gen, max(1, max_total_tokens // 2))
            prompt = max(1, min(prompt, max_total_tokens - gen))
        out.append(Arrival(t, assign_class(seed, first + k, mix), int(t // bucket_s), prompt, gen))
    return out


def poisson(rate: Callable[[float, str], float], rate_max: float, duration_s: float, mix: dict[str, float],
            seed: int, bucket_s: float) -> list[Arrival]:
    """Per-class non-homogeneous Poisson arrivals by thinning; ``rate(t, cls)`` <= ``rate_max`` QPS."""
    rng = random.Random(seed)
    out = []
    for name in sorted(mix):
        t = 0.0
        while rate_max > 0:
            t += rng.expovariate(rate_max)
            if t >= duration_s:
                break
            if rng.random() * rate_max <= rate(t, name):
                out.append(Arrival(t, name, int(t // bucket_s)))
    out.sort(key=lambda a: a.t)
    return out


def step_load(seed: int, backends: int, *, qps_per_backend: float = QPS_PER_BACKEND, steps: int = 5,
              step_s: float = STEP_S, step_factor: float = 1.3, burst_factor: float = 3.0,
              duration_s: float | None = None, mix: dict[str, float] | None = None) -> list[Arrival]:
    """``step``: the bench's LoadShape (+30 % per step, bursts x3 for 1 s every 4 s), base = backends x QPS."""
    shape = LoadShape(base_qps=qps_per_backend * backends, step_factor=step_factor, steps=steps, step_s=step_s,
                      burst_factor=burst_factor, mix=mix or default_mix())
    if duration_s is not None:  # a run length instead of a step count
        shape.steps = max(1, round(duration_s / step_s))
    return shape.schedule(seed)


def azure(seed: int, backends: int, *, qps_per_backend: float | None = QPS_PER_BACKEND, duration_s: float = 300.0,
          start_s: float = 0.0, compress: float = 1.0, token_scale: float = 1.0, max_total_tokens: int | None = None,
          trace: str | Path | None = None, bucket_s: float = BUCKET_S,
          mix: dict[str, float] | None = None) -> list[Arrival]:
    """``azure``: the code trace replayed at ``qps_per_backend x backends`` mean QPS (None: ``compress``)."""
    rows = load_trace(trace)
    target = None if qps_per_backend is None else qps_per_backend * backends
    return replay(rows, seed, start_s=start_s, duration_s=duration_s, compress=compress, target_qps=target,
                  token_scale=token_scale, max_total_tokens=max_total_tokens, bucket_s=bucket_s, mix=mix)


def flash_crowd(seed: int, backends: int, *, qps_per_backend: float = QPS_PER_BACKEND, duration_s: float = 90.0,
                crowd_at_s: float = 30.0, crowd_s: float = 20.0, factor: float = 3.0, bucket_s: float = BUCKET_S,
                mix: dict[str, float] | None = None) -> list[Arrival]:
    """``flash-crowd``: Poisson base load, x ``factor`` from ``crowd_at_s`` for ``crowd_s``, then base again."""
    m = mix or default_mix()
    base, total = qps_per_backend * backends, sum(m.values())

    def rate(t: float, cls: str) -> float:
        return base * m[cls] / total * (factor if crowd_at_s <= t < crowd_at_s + crowd_s else 1.0)

    return poisson(rate, base * max(1.0, factor), duration_s, m, seed, bucket_s)


def mix_shift_video(seed: int, backends: int, *, qps_per_backend: float = QPS_PER_BACKEND, duration_s: float = 90.0,
                    video_share_end: float = 0.45, bucket_s: float = BUCKET_S,
                    mix: dict[str, float] | None = None) -> list[Arrival]:
    """``mix-shift-video``: constant total QPS; offline_video's share moves linearly from the mix's to
    ``video_share_end`` over the run, the other classes keeping their relative shares."""
    start = mix_at(0.0, mix, video_share_end)
    qps = qps_per_backend * backends

    def rate(t: float, cls: str) -> float:
        return qps * mix_at(t / duration_s, mix, video_share_end)[cls]

    return poisson(rate, qps, duration_s, start, seed, bucket_s)


def mix_at(frac: float, mix: dict[str, float] | None = None, video_share_end: float = 0.45) -> dict[str, float]:
    """The class shares (summing to 1) a fraction ``frac`` of the way through ``mix-shift-video``."""
    m = mix or default_mix()
    total = sum(m.values())
    v0 = m.get("offline_video", 0.0) / total
    video = v0 + (video_share_end - v0) * min(1.0, max(0.0, frac))
    rest = total - m.get("offline_video", 0.0)
    out = {c: (1.0 - video) * s / rest for c, s in m.items() if c != "offline_video"} if rest > 0 else {}
    out["offline_video"] = video
    return out


Builder = Callable[..., list[Arrival]]
"""``builder(seed, backends, **params) -> list[Arrival]`` (keyword params, each with a default)."""

WORKLOADS: dict[str, Builder] = {
    "step": step_load,
    "azure": azure,
    "flash-crowd": flash_crowd,
    "mix-shift-video": mix_shift_video,
    "mooncake": mooncake,
}


def bucket_seconds(name: str, **params: Any) -> float:
    """The bucket length ``Arrival.step`` counts in for workload ``name`` with these params (for judge())."""
    if name not in WORKLOADS:
        raise WorkloadError(f"unknown workload {name!r} (known: {', '.join(WORKLOADS)})")
    return float(params.get("step_s", STEP_S)) if name == "step" else float(params.get("bucket_s", BUCKET_S))


def build(name: str, seed: int, backends: int, **params: Any) -> list[Arrival]:
    """``WORKLOADS[name](seed, backends, **params)``: a param only other workloads take is left out (one
    CLI can pass them all); a name no workload takes, or an unknown workload, is a :class:`WorkloadError`."""
    if name not in WORKLOADS:
        raise WorkloadError(f"unknown workload {name!r} (known: {', '.join(WORKLOADS)})")
    if backends < 1:
        raise WorkloadError("backends must be >= 1")
    known = {k: set(inspect.signature(b).parameters) - {"seed", "backends"} for k, b in WORKLOADS.items()}
    stray = set(params) - set().union(*known.values())
    if stray:
        raise WorkloadError(f"unknown workload parameter(s): {', '.join(sorted(stray))}")
    return WORKLOADS[name](seed, backends, **{k: v for k, v in params.items() if k in known[name]})
