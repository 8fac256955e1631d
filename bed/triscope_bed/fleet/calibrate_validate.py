"""Validate a simulator profile against a real vLLM-CPU server: the ``step`` workload (Poisson steps with
bursts, :mod:`triscope_bed.workloads.named`) with the test bed's token sizes, sent open-loop to the real
server and then to a sim backend of the profile, both ``/metrics`` sampled every ``sample_s``;
:mod:`triscope_bed.fleet.calibrate_report` compares the two runs. docs/calibration.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import random
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from triscope_bed.engines.calibration import SimProfile, token_sizes
from triscope_bed.engines.vllm_cpu import ServerOptions, VllmInstall, VllmServer, make_tiny_model, serve
from triscope_bed.fleet.calibrate import body, timed
from triscope_bed.ports import free_port
from triscope_bed.workloads.arrivals import Arrival
from triscope_bed.workloads.http_pool import HttpPool
from triscope_bed.workloads.named import build

GAUGES = {"waiting": "vllm:num_requests_waiting", "running": "vllm:num_requests_running",
          "kv": "vllm:kv_cache_usage_perc", "preemptions": "vllm:num_preemptions_total"}


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
            [sys.executable, "-m", "triscope_bed.fleet.calibrate_validate",
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
    """``python -m triscope_bed.fleet.calibrate_validate PROFILE_JSON name:port:kv_gib:slots:speed``: a sim
    backend of a profile that is not (yet) one of the named ones (:func:`sim_server`)."""
    from triscope_bed.engines.backend import BackendSpec
    from triscope_bed.engines.backend import serve as serve_backends

    doc = json.loads(argv[0])
    spec = BackendSpec.parse(argv[1])
    spec.profile = SimProfile(**doc)
    asyncio.run(serve_backends([spec]))
    return 0


if __name__ == "__main__":
    sys.exit(_serve_json(sys.argv[1:]))
