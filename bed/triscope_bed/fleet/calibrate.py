"""Fit the simulated engine to a real vLLM-CPU server, then run one open-loop workload on both and compare.

**fit**: idle single-request client latencies for a grid of (prompt, output) sizes, least squares
``latency = overhead + a * prompt + b * output``; then ``n`` decode-heavy requests at once for a few
``n`` and the batch slowdown ``s`` that makes the sim's step model (:func:`fit_slowdown`) match the
measured latency ratios (least squares, closed form). The idle decode slope is divided by ``1 + s / slots``
because the sim's decode step applies the slowdown to a lone request too; prefill costs per token.

**validate**: the ``step`` workload (Poisson steps with bursts, :mod:`triscope_bed.workloads.named`) with
the test bed's token sizes, sent open-loop to the real server and then to a sim backend of the
profile; both ``/metrics`` sampled every ``sample_s``; :mod:`triscope_bed.fleet.calibrate_report` compares.

CLI: ``bench/calibrate_sim.py`` (``fit``, ``validate``, ``all``); docs/calibration.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from triscope_bed.engines.calibration import SimProfile, sla_from_idle, token_sizes
from triscope_bed.engines.vllm_classes import TOKEN_ID_RANGE
from triscope_bed.engines.vllm_cpu import SERVED_MODEL, ServerOptions, VllmInstall, VllmServer, make_tiny_model, serve
from triscope_bed.ports import free_port
from triscope_bed.workloads.arrivals import Arrival
from triscope_bed.workloads.http_pool import HttpPool
from triscope_bed.workloads.named import build

FIT_SIZES: tuple[tuple[int, int], ...] = (
    (16, 1), (48, 1), (256, 1), (480, 1), (16, 16), (16, 64), (16, 128), (16, 256), (48, 16), (176, 96), (272, 128))
"""(prompt, output) grid of the idle fit: prompt-only, output-only and the three classes (all <= 512 tokens)."""
BATCH_SIZE = (16, 96)
"""The decode-heavy request of the slowdown fit: 111 tokens, one 128-token block, so 7 fit in the test bed's KV."""
GAUGES = {"waiting": "vllm:num_requests_waiting", "running": "vllm:num_requests_running",
          "kv": "vllm:kv_cache_usage_perc", "preemptions": "vllm:num_preemptions_total"}
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


# ---- validate ------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Workload:
    """The validation load: ``step`` workload, one backend, the test bed's token sizes."""

    seed: int = 1
    base_qps: float = 2.0
    step_factor: float = 1.5
    steps: int = 4
    step_s: float = 20.0
    burst_factor: float = 3.0

    def schedule(self) -> list[Arrival]:
        sizes = token_sizes()
        arrivals = build("step", self.seed, 1, qps_per_backend=self.base_qps, steps=self.steps, step_s=self.step_s,
                         step_factor=self.step_factor, burst_factor=self.burst_factor)
        return [dataclasses.replace(a, prompt_tokens=sizes[a.cls][0], max_tokens=sizes[a.cls][1]) for a in arrivals]

    def level_qps(self) -> list[float]:
        return [self.base_qps * self.step_factor**k for k in range(self.steps)]


@dataclass
class Run:
    """One engine's answers to the workload and its sampled gauges."""

    engine: str
    results: list[dict[str, Any]] = field(default_factory=list)
    """t (send, s from start), cls, step, latency_s, status."""
    samples: list[dict[str, float]] = field(default_factory=list)
    """t, waiting, running, kv, preemptions."""
    worst_lag_s: float = 0.0


def parse_gauges(text: str) -> dict[str, float]:
    """The four :data:`GAUGES` of a vLLM-style /metrics text (sum over label sets; NaN when absent)."""
    out = {}
    for key, name in GAUGES.items():
        vals = [float(m.group(1)) for m in re.finditer(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? (\S+)$", text, re.M)]
        out[key] = sum(vals) if vals else float("nan")
    return out


async def _sampler(port: int, every_s: float, t0: float, out: list[dict[str, float]], stop: asyncio.Event) -> None:
    pool = HttpPool("127.0.0.1", port)
    try:
        while not stop.is_set():
            with contextlib.suppress(OSError, ValueError, asyncio.IncompleteReadError, TimeoutError):
                _s, _h, text = await asyncio.wait_for(pool.get("/metrics"), 5.0)
                out.append({"t": time.monotonic() - t0, **parse_gauges(text.decode())})
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), every_s)
    finally:
        pool.close()


async def run_load(engine: str, port: int, arrivals: list[Arrival], sample_s: float = 0.25, seed: int = 1) -> Run:
    """Send ``arrivals`` open-loop to ``127.0.0.1:port`` while sampling its /metrics; waits for every answer."""
    run = Run(engine)
    rng = random.Random(seed)
    payloads = [body(a.prompt_tokens or 1, a.max_tokens or 1, rng, a.cls) for a in arrivals]
    stop = asyncio.Event()
    t0 = time.monotonic()
    sampler = asyncio.create_task(_sampler(port, sample_s, t0, run.samples, stop))

    async def one(a: Arrival, payload: bytes) -> None:
        sent, error = time.monotonic(), ""
        try:
            lat, status = await timed(port, payload), 200
        except (RuntimeError, OSError, TimeoutError, asyncio.IncompleteReadError, ValueError) as exc:
            lat, status, error = time.monotonic() - sent, 0, f"{type(exc).__name__}: {exc}"[:200]
        run.results.append({"t": sent - t0, "cls": a.cls, "step": a.step, "latency_s": lat, "status": status,
                            "error": error})

    tasks = []
    for a, payload in zip(arrivals, payloads, strict=True):
        delay = a.t - (time.monotonic() - t0)
        if delay > 0:
            await asyncio.sleep(delay)
        run.worst_lag_s = max(run.worst_lag_s, -delay)
        tasks.append(asyncio.create_task(one(a, payload)))
    await asyncio.gather(*tasks)
    await asyncio.sleep(sample_s * 2)  # the drained state's gauges
    stop.set()
    await sampler
    return run


@contextlib.contextmanager
def sim_server(profile: SimProfile, named: bool = False) -> Iterator[int]:
    """A sim backend subprocess of ``profile`` on a free port: ``--profile NAME`` when ``named``, else its JSON."""
    port = free_port()
    spec = f"sim0:{port}:{profile.kv_gib}:{profile.slots}:1.0"
    argv = ([sys.executable, "-m", "triscope_bed.engines.backend", "--profile", profile.name, "--backend", spec]
            if named else
            [sys.executable, "-m", "triscope_bed.fleet.calibrate", "serve-json",
             json.dumps(dataclasses.asdict(profile)), spec])
    with tempfile.TemporaryFile() as err:  # a file, not a pipe nobody reads while the load runs
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=err, stdin=subprocess.DEVNULL)
        try:
            line = proc.stdout.readline() if proc.stdout else b""
            if b"ready" not in line:
                proc.wait(10)
                err.seek(0)
                lines = err.read().decode(errors="replace").strip().splitlines() or ["no output"]
                raise RuntimeError(f"sim backend did not start: {lines[-1]}")
            yield port
        finally:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
            if proc.stdout is not None:
                proc.stdout.close()


async def warm(port: int, n: int = 3) -> None:
    rng = random.Random(0)
    for _ in range(n):
        await timed(port, body(32, 16, rng))


def validate(vllm_port: int, profile: SimProfile, workload: Workload, sample_s: float = 0.25,
             named: bool = True) -> tuple[Run, Run]:
    """The workload on the real server, then on a sim backend of ``profile`` (one after the other: 2 cores)."""
    arrivals = workload.schedule()
    asyncio.run(warm(vllm_port))
    real = asyncio.run(run_load("vllm", vllm_port, arrivals, sample_s, workload.seed))
    with sim_server(profile, named) as port:
        sim = asyncio.run(run_load("sim", port, arrivals, sample_s, workload.seed))
    return real, sim


@contextlib.contextmanager
def vllm_server(workdir: Path, options: ServerOptions | None = None) -> Iterator[VllmServer]:
    """One real test-bed server (worker pinned to core 0 as :func:`serve` does); RuntimeError when not installed."""
    install = VllmInstall.default()
    missing = install.missing()
    if missing is not None:
        raise RuntimeError(missing)
    model = make_tiny_model(install, install.model_dir)
    with serve(install, model, workdir, count=1, options=options) as (server,):
        yield server


def _serve_json(argv: list[str]) -> int:
    """``python -m triscope_bed.fleet.calibrate serve-json PROFILE_JSON name:port:kv_gib:slots:speed``
    (used by validate)."""
    from triscope_bed.engines.backend import BackendSpec
    from triscope_bed.engines.backend import serve as serve_backends

    doc = json.loads(argv[0])
    spec = BackendSpec.parse(argv[1])
    spec.profile = SimProfile(**doc)
    asyncio.run(serve_backends([spec]))
    return 0


def main(argv: list[str] | None = None) -> int:
    """``bench/calibrate_sim.py``: see :func:`triscope_bed.fleet.calibrate_report.main`."""
    from triscope_bed.fleet.calibrate_report import main as report_main

    return report_main(argv)


if __name__ == "__main__":
    if len(sys.argv) >= 4 and sys.argv[1] == "serve-json":
        sys.exit(_serve_json(sys.argv[2:]))
    sys.exit(main())
