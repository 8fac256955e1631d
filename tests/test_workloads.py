"""Workloads for the closed-loop bench (trace replay, synthetic shapes), the completions request shape
against a real simulated backend process, and the judging metrics on hand-made results."""

from __future__ import annotations

import asyncio
import json
import math
import subprocess
import sys
import urllib.request
from collections import Counter
from pathlib import Path

import pytest
from conftest import free_port

from triscope_bed.engines.engine import CLASSES
from triscope_bed.fleet.bench_fleet import read_ready
from triscope_bed.reports.judge import error_kind, judge, plot_judgements
from triscope_bed.workloads.arrivals import Arrival
from triscope_bed.workloads.driver import Result, drive
from triscope_bed.workloads.named import (
    WORKLOADS,
    WorkloadError,
    assign_class,
    bucket_seconds,
    build,
    load_trace,
    mix_at,
    replay,
)
from triscope_bed.workloads.prompts import MAX_PROMPT_CHARS, completion_body, synthetic_prompt

EXCERPT = Path(__file__).parent / "data" / "azure_llm_2023_code_excerpt.csv"


def test_replay_keeps_order_count_tokens_and_compresses_time() -> None:
    rows = load_trace(EXCERPT)
    assert len(rows) == 600 and rows[0].t == 0.0
    assert all(a.t <= b.t for a, b in zip(rows, rows[1:], strict=False))
    arr = replay(rows, seed=1, compress=10.0)
    assert len(arr) == 600
    assert [a.t for a in arr] == pytest.approx([r.t / 10 for r in rows])
    assert [(a.prompt_tokens, a.max_tokens) for a in arr] == [(r.context_tokens, r.generated_tokens) for r in rows]
    assert (arr[0].prompt_tokens, arr[0].max_tokens) == (4808, 10)  # the file's first row
    # a window of the trace: trace seconds [180, 240) played 2x faster
    win = replay(rows, seed=1, start_s=180.0, duration_s=30.0, compress=2.0, bucket_s=10.0)
    inside = [r for r in rows if 180.0 <= r.t < 240.0]
    assert len(win) == len(inside) > 400
    assert [a.t for a in win] == pytest.approx([(r.t - 180.0) / 2 for r in inside])
    assert all(0 <= a.t < 30.0 and a.step == int(a.t // 10) for a in win)
    # a target mean QPS: exactly qps x duration requests spread over the run
    fast = replay(rows, seed=1, duration_s=20.0, target_qps=10.0)
    assert len(fast) == 200 and 19.0 < fast[-1].t < 20.0
    assert [a.prompt_tokens for a in fast] == [r.context_tokens for r in rows[:200]]
    with pytest.raises(WorkloadError, match="needed"):
        replay(rows, seed=1, duration_s=100.0, target_qps=10.0)


def test_tokens_scaled_and_bounded() -> None:
    rows = load_trace(EXCERPT)
    arr = replay(rows, seed=1, token_scale=1 / 16, max_total_tokens=512)
    assert all(a.prompt_tokens is not None and a.max_tokens is not None for a in arr)
    assert all(1 <= a.prompt_tokens + a.max_tokens <= 512 for a in arr)  # type: ignore[operator]
    assert arr[0].prompt_tokens == round(4808 / 16)
    # an arrival without counts uses its class's defaults
    assert Arrival(0.0, "offline_video", 0).tokens() == (8000, 200)
    big = completion_body(Arrival(0.0, "offline_video", 0, 10**9, 10**9), 7)
    assert len(big) < 64 * 1024 and len(json.loads(big)["prompt"]) == MAX_PROMPT_CHARS


def test_completion_body_prompt_salt_and_extra() -> None:
    a = Arrival(0.0, "realtime_speech", 0, 300, 20)
    doc = json.loads(completion_body(a, 5, "m"))
    assert {k: v for k, v in doc.items() if k != "prompt"} == {
        "model": "m", "prompt_tokens": 300, "max_tokens": 20, "request_class": "realtime_speech"}
    assert len(doc["prompt"]) == 1200 and doc["prompt"].startswith("request 5 realtime_speech: ")
    assert doc["prompt"] == synthetic_prompt(5, "realtime_speech", 300)  # deterministic
    assert synthetic_prompt(6, "realtime_speech", 300)[:40] != doc["prompt"][:40]  # no shared prefix
    salted = json.loads(completion_body(a, 5, "m", salt="leastconn-s3", chars_per_token=4.8,
                                        extra={"ignore_eos": True, "min_tokens": 20}))
    assert salted["prompt"].startswith("leastconn-s3 request 5 ") and len(salted["prompt"]) == 1440
    assert salted["ignore_eos"] is True and salted["min_tokens"] == 20
    with pytest.raises(ValueError, match="max_tokens"):
        completion_body(a, 5, extra={"max_tokens": 1})
    with pytest.raises(ValueError, match="salt"):
        completion_body(a, 5, salt="x" * 65)


def test_class_assignment_stable_and_seeded() -> None:
    rows = load_trace(EXCERPT)
    one = [a.cls for a in replay(rows, seed=1)]
    assert one == [a.cls for a in replay(rows, seed=1)]
    two = [a.cls for a in replay(rows, seed=2)]
    assert sum(x != y for x, y in zip(one, two, strict=True)) > 0.3 * len(one)
    # the class belongs to the trace row, whatever the window
    win = replay(rows, seed=1, start_s=180.0, duration_s=30.0)
    first = next(i for i, r in enumerate(rows) if r.t >= 180.0)
    assert len(win) > 150
    assert [a.cls for a in win] == one[first:first + len(win)]
    assert assign_class(1, first) == one[first]
    shares = Counter(one)  # default shares 50/35/15 %; 600 draws: 5 sigma is about 0.1
    for name, cls in CLASSES.items():
        assert abs(shares[name] / len(one) - cls.share) < 0.1, shares


def test_step_flash_and_mix_rates_as_stated() -> None:
    arr = WORKLOADS["step"](3, 2, qps_per_backend=10.0, steps=3, step_s=20.0)
    counts = Counter(a.step for a in arr)
    for k in range(3):
        want = 20.0 * 1.3**k * 20.0  # Poisson count: 5 sigma = 5 sqrt(want)
        assert abs(counts[k] - want) < 5 * math.sqrt(want), (k, counts[k], want)
    assert build("step", 3, 2, qps_per_backend=10.0, steps=3, step_s=20.0) == arr  # same seed, same schedule

    crowd = build("flash-crowd", 4, 2, qps_per_backend=10.0, duration_s=90.0, crowd_at_s=30.0, crowd_s=20.0)
    before = sum(a.t < 30.0 for a in crowd) / 30.0
    during = sum(30.0 <= a.t < 50.0 for a in crowd) / 20.0
    after = sum(a.t >= 50.0 for a in crowd) / 40.0
    assert abs(before - 20.0) < 5 * math.sqrt(600) / 30 and abs(after - 20.0) < 5 * math.sqrt(800) / 40
    assert abs(during - 60.0) < 5 * math.sqrt(1200) / 20
    assert max(a.t for a in crowd) < 90.0

    shift = build("mix-shift-video", 5, 4, qps_per_backend=10.0, duration_s=90.0)
    assert abs(len(shift) / 90.0 - 40.0) < 5 * math.sqrt(3600) / 90  # total QPS constant at 40
    first = [a for a in shift if a.t < 30.0]
    last = [a for a in shift if a.t >= 60.0]
    share = [sum(a.cls == "offline_video" for a in part) / len(part) for part in (first, last)]
    assert abs(share[0] - 0.20) < 0.06 and abs(share[1] - 0.40) < 0.06, share  # 0.15 -> 0.45 linearly
    assert mix_at(0.0)["offline_video"] == pytest.approx(0.15) and mix_at(1.0)["offline_video"] == pytest.approx(0.45)
    assert sum(mix_at(0.5).values()) == pytest.approx(1.0)
    assert bucket_seconds("step", step_s=20.0) == 20.0 and bucket_seconds("azure") == 10.0


def test_registry_errors_are_one_line() -> None:
    assert set(WORKLOADS) == {"step", "azure", "flash-crowd", "mix-shift-video", "mooncake"}
    with pytest.raises(WorkloadError, match="trace file not found: /nonexistent"):
        build("azure", 1, 4, trace="/nonexistent/azure.csv")
    with pytest.raises(WorkloadError, match="unknown workload 'nope'"):
        build("nope", 1, 4)
    with pytest.raises(WorkloadError, match="qps_per_backnd"):
        build("step", 1, 4, qps_per_backnd=3)
    # a param of another workload is left out, so one CLI can pass them all
    arr = build("azure", 1, 2, trace=str(EXCERPT), duration_s=10.0, qps_per_backend=5.0, step_s=45.0)
    assert len(arr) == 100


def _r(step: int, cls: str, status: int, latency: float, backend: str = "b0", reason: str = "") -> Result:
    return Result(step * 10.0 + 1.0, cls, step, status, latency, backend, reason=reason)


def test_judge_goodput_error_split_and_peak_exact(tmp_path: Path) -> None:
    speech, image = "realtime_speech", "interactive_image_text"
    results = [_r(0, speech, 200, 0.05) for _ in range(10)] + [_r(0, image, 200, 0.5)]
    results += [_r(1, speech, 200, 0.05) for _ in range(8)] + [
        _r(1, speech, 200, 0.3),  # late: a success, not goodput
        _r(1, speech, 503, 0.01, reason="out of memory: KV cache full"),
        _r(1, image, 503, 0.01, backend=""),  # HAProxy's own 503
        _r(1, image, 503, 0.01, reason="queue full"),
        _r(1, image, 0, 4.8, backend=""),
        _r(1, image, -1, 0.0, backend=""),
        _r(1, image, 500, 0.01)]
    results += [_r(2, speech, 200, 0.05) for _ in range(5)]  # the least load, and held
    doc = judge(results, 10.0)
    json.dumps(doc, allow_nan=False)  # JSON-able as it is
    b0, b1, b2 = doc["buckets"]
    assert (b0["offered_qps"], b0["goodput_qps"], b0["held"]) == (1.1, 1.1, True)
    assert (b1["offered_qps"], b1["goodput_qps"], b1["held"]) == (1.5, 0.8, False)
    assert b1["errors"] == {"oom": 1, "lb_reject": 1, "backend_503": 1, "timeout": 1, "connection": 1,
                            "http_other": 1}
    assert b1["classes"][speech]["p99_all_s"] == "inf" and b1["classes"][speech]["goodput_qps"] == 0.8
    assert b1["classes"][image]["errors"]["oom"] == 0 and b1["classes"][image]["offered"] == 5
    assert b2["held"] and b2["offered_qps"] == 0.5
    assert doc["peak_qps_held"] == 1.1  # every window offered <= 1.1 QPS was held; 1.5 was not
    assert doc["goodput_qps"] == pytest.approx(24 / 30) and doc["errors"]["oom"] == 1
    assert doc["classes"][speech]["p99_all_s"] == "inf"  # nearest-rank P99 of 25 requests is the worst: the OOM
    assert doc["classes"]["offline_video"]["offered"] == 0 and doc["classes"]["offline_video"]["p99_all_s"] is None
    pooled = judge(results, 10.0, duration_s=25.0, repetitions=2, offered_qps=[2.0, 3.0, 1.0])
    assert pooled["buckets"][2]["goodput_qps"] == pytest.approx(5 / (5.0 * 2))  # last window cut at 25 s
    assert pooled["peak_qps_held"] == 2.0 and pooled["buckets"][1]["offered_qps"] == 3.0
    # a held window above an unheld one does not count
    assert judge(results + [_r(3, speech, 200, 0.05) for _ in range(30)], 10.0)["peak_qps_held"] == 1.1
    assert error_kind(_r(0, speech, 503, 0.0)) == "oom"  # a reason-less backend 503 (older results)

    # X of *held*: 100 speech requests, 95 within SLA and 5 OOM (P99 of successes 50 ms)
    shed = [_r(0, speech, 200, 0.05) for _ in range(95)] + [_r(0, speech, 503, 0.0) for _ in range(5)]
    assert judge(shed, 10.0)["buckets"][0]["held"] is False  # default X = 99 %
    assert judge(shed, 10.0, min_goodput=0.95)["buckets"][0]["held"] is True
    assert judge(shed, 10.0, min_goodput=0.96)["buckets"][0]["held"] is False
    assert judge(shed, 10.0, min_goodput=0.95)["classes"][speech]["p99_ok_s"] == 0.05
    slow = [_r(0, speech, 200, 0.05) for _ in range(99)] + [_r(0, speech, 200, 0.25)]  # 99 % good, P99 ok 50 ms
    assert judge(slow, 10.0)["buckets"][0]["held"] is True
    assert judge(slow[1:], 10.0)["buckets"][0]["held"] is False  # 98/99 good: under 99 %, P99 of 99 = the worst
    # generated tokens of goodput requests per second (from the answers' usage)
    toks = [Result(1.0, speech, 0, 200, 0.05, "b0", completion_tokens=20) for _ in range(3)]
    toks.append(Result(1.0, speech, 0, 200, 0.5, "b0", completion_tokens=40))  # late: not goodput
    assert judge(toks, 10.0)["buckets"][0]["goodput_tokens_per_s"] == 6.0
    assert b0["goodput_tokens_per_s"] is None  # no usage recorded (GET /v1/infer)

    png = tmp_path / "judge.png"
    plot_judgements({"leastconn": doc, "triscope": judge(results[:11], 10.0)}, str(png), title="hand-made")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def _metric(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


@pytest.mark.integration
def test_drive_completions_against_sim_backend() -> None:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "triscope_bed.engines.backend", "--backend", f"b0:{port}:40:16"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        read_ready(proc, "simulated backend")
        arr = replay(load_trace(EXCERPT), seed=7, duration_s=2.0, target_qps=15.0, token_scale=0.25)
        arr.append(Arrival(2.0, "realtime_speech", 0))  # no token counts: the class's 200 / 20
        results, lag = asyncio.run(drive("127.0.0.1", port, arr, api="completions", prompt_salt="t1",
                                         extra_body={"temperature": 0.0}))
        assert len(results) == len(arr) == 31
        assert Counter(r.status for r in results) == {200: 31}, [r.reason for r in results if r.status != 200]
        assert all(r.backend == "b0" and 0 <= r.engine_queue_s <= r.latency_s for r in results)
        assert sorted(r.idx for r in results) == list(range(31))
        # the usage the backend echoed is each arrival's token counts
        assert all((r.prompt_tokens, r.completion_tokens) == arr[r.idx].tokens() for r in results)
        assert arr[0].tokens() == (round(4808 / 4), round(10 / 4)) and arr[-1].tokens() == (200, 20)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
            text = resp.read().decode()
        assert _metric(text, "vllm:prompt_tokens_total") == sum(a.tokens()[0] for a in arr)
        assert _metric(text, "vllm:generation_tokens_total") == sum(a.tokens()[1] for a in arr)
        infer, _ = asyncio.run(drive("127.0.0.1", port, arr[:3]))  # the default request shape is unchanged
        assert [r.status for r in infer] == [200, 200, 200]
        assert all(r.prompt_tokens == r.completion_tokens == -1 for r in infer)  # /v1/infer echoes no usage
        with pytest.raises(ValueError, match="api"):
            asyncio.run(drive("127.0.0.1", port, arr[:1], api="chat"))
    finally:
        proc.terminate()
        proc.wait(timeout=10)
