"""``triscope diagnose TRACE`` on trace shapes the samples did not have, each built from the project's own
sample data: a one-kernel trace, GPU activity recorded as CUPTI profiler ranges without kernels, an MTIA trace
with DMA transfers on no stream, a file named by rank, and files refused with ``--json``."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from conftest import REPO, TEST_DATA, shared_data
from kineto_helpers import complete_events, load_json, write_trace

from triscope.analyzers.trace_breakdown import analyze_run
from triscope.collectors.kineto import ingest_trace
from triscope.collectors.kineto.runs import default_run_id
from triscope.schema import qualified

EXAMPLES = REPO / "examples" / "traces"
GPU_WORDS = ("GPU events", "per GPU", "idle split per GPU")


def _diagnose(store: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "TRISCOPE_STORE__PATH": str(store), "COLUMNS": "200"}
    env.pop("TRISCOPE_CONFIG", None)
    return subprocess.run([sys.executable, "-m", "triscope", "diagnose", *args], capture_output=True, text=True,
                          env=env, cwd=REPO, timeout=300)


def _top(doc: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in doc.items() if k != "traceEvents"}


def one_kernel_trace(path: Path) -> Path:
    """One profiler step of the A100 sample with a few short CPU ops, one kernel and its launch (the shape of a
    trace that recorded a single kernel)."""
    doc = load_json(EXAMPLES / "a100_ddp_2024_rank0.json.gz")
    xs = complete_events(doc)
    step = next(e for e in xs if e["name"] == "ProfilerStep#4")
    inside = [e for e in xs if step["ts"] <= e["ts"] < step["ts"] + step["dur"] and e["pid"] == step["pid"]]
    launches = {e["args"]["correlation"]: e for e in inside if e["name"] == "cudaLaunchKernel"}
    kern = next(e for e in xs if e["cat"] == "kernel" and e["args"].get("correlation") in launches)
    ops = [e for e in inside if e["cat"] == "cpu_op" and e["dur"] < 20]
    events = [step, ops[0], ops[-1], launches[kern["args"]["correlation"]], kern]
    return write_trace(path, events, **_top(doc))


def test_a_one_kernel_trace_is_too_short_to_judge(tmp_path: Path) -> None:
    """Its breakdown (compute 100 %, idle 0 %) is that of one kernel; no verdict contradicts it ("idle 100%")."""
    trace = one_kernel_trace(tmp_path / "one_kernel.json")
    res = _diagnose(tmp_path / "db", "--json", str(trace))
    assert res.returncode == 0, res.stderr
    (run,) = json.loads(res.stdout)["runs"]
    (rank,) = run["ranks"]
    assert rank["whole"]["gpu_events"] == 1 and rank["whole"]["compute_pct"] == 100.0
    assert rank["no_verdict"].startswith("too short to judge") and run["stalls"] is None
    text = _diagnose(tmp_path / "db", str(trace))
    assert text.returncode == 0, text.stderr
    assert "too short to judge" in text.stdout and "rank 0: no stall verdict" in text.stdout
    assert "idle 100%" not in text.stdout and " -> " not in text.stdout, text.stdout


def profiler_range_trace(path: Path) -> Path:
    """The AlexNet sample as the CUPTI range profiler records it: each kernel a ``cuda_profiler_range`` on the
    GPU's pid with counters and no stream, and no kernel, memcpy, memset or sync events."""
    doc = load_json(EXAMPLES / "alexnet_single_gpu_sync.json.gz")
    events = []
    for e in complete_events(doc):
        if e["cat"] == "kernel":
            events.append({"ph": "X", "cat": "cuda_profiler_range", "name": e["name"], "pid": e["pid"], "tid": 0,
                           "ts": e["ts"], "dur": e["dur"],
                           "args": {"smsp__sass_thread_inst_executed_op_ffma_pred_on.sum": 4096}})
        elif e["cat"] not in ("gpu_memcpy", "gpu_memset", "cuda_sync"):
            events.append(e)
    return write_trace(path, events, **_top(doc))


def test_profiler_ranges_are_gpu_activity_without_kernels_not_a_cpu_trace(tmp_path: Path, store) -> None:
    trace = profiler_range_trace(tmp_path / "ranges.json.gz")
    result = ingest_trace(store, trace, run_id="ranges")
    assert (result.gpu_events, result.profiler_ranges, result.device_type) == (0, 79, "GPU")
    (rank,) = analyze_run(store, "ranges")
    assert rank.ranges_only and rank.facts.device == 0 and rank.facts.runtime_calls > 0
    assert "kernels not captured" in rank.no_verdict()

    res = _diagnose(tmp_path / "db", str(trace))
    assert res.returncode == 0, res.stderr
    out = res.stdout
    for needle in ("79 profiler ranges", "cuda_profiler_range", "kernels were not captured", "profiler_metrics",
                   "ProfilerActivity.CUDA", "rank 0: no stall verdict"):
        assert needle in out, (needle, out)
    for wrong in ("CPU only", "CPU-only", "set_num_threads", "CPU-bound"):
        assert wrong not in out, (wrong, out)
    assert "no GPU kernels: 79 GPU profiler ranges" in res.stderr
    doc = json.loads(_diagnose(tmp_path / "db", "--json", str(trace)).stdout)
    assert doc["runs"][0]["stalls"] is None and doc["runs"][0]["ranks"][0]["profiler_ranges"] == 79


def _ns(us: Decimal) -> int:
    return int((us * 1000).to_integral_value())


def mtia_trace(path: Path) -> tuple[Path, int]:
    """The MTIA sample as one profiler step, with device-to-host DMA transfers on no stream (no runtime call
    launched them) before its first and after its last device work; and the span of the work on streams (ns)."""
    doc = load_json(shared_data("kineto", "mtia_inference_rank0.json.gz"), exact=True)
    xs = complete_events(doc)
    device = [e for e in xs if e["cat"] == "mtia_ccp_events"]
    host = [e for e in xs if e["cat"] in ("cpu_op", "user_annotation", "mtia_runtime")]
    lo, hi = min(e["ts"] for e in device), max(e["ts"] + e["dur"] for e in device)
    cpu_lo, cpu_hi = min(e["ts"] for e in host), max(e["ts"] + e["dur"] for e in host)
    step = {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#1", "pid": host[0]["pid"],
            "tid": host[0]["tid"], "ts": cpu_lo - 5, "dur": cpu_hi - cpu_lo + 10, "args": {}}

    def dma(ts: Decimal, size: int) -> dict[str, Any]:
        return {"ph": "X", "cat": "mtia_ccp_events", "name": "dma_request", "pid": device[0]["pid"], "tid": 801,
                "ts": ts, "dur": Decimal("8.136"), "args": {"direction": "DEVICE_TO_HOST", "size": size, "sqid": 0}}

    events = [step, dma(lo - 3000, 16), *doc["traceEvents"], dma(hi + 300, 8)]
    doc["traceEvents"] = events
    text = json.dumps(doc, default=lambda d: float(d) if d % 1 else int(d))
    path.write_text(text)
    return path, _ns(hi) - _ns(lo)


def test_an_mtia_trace_speaks_of_mtia_and_its_steps_add_up(tmp_path: Path) -> None:
    trace, span_ns = mtia_trace(tmp_path / "mtia.json")
    res = _diagnose(tmp_path / "db", "--json", str(trace))
    assert res.returncode in (0, 3), res.stderr
    (rank,) = json.loads(res.stdout)["runs"][0]["ranks"]
    assert rank["device_type"] == "MTIA" and rank["device"] == 17 and rank["off_stream_events"] == 2
    whole, (step,) = rank["whole"], rank["steps"]
    assert whole["span_ns"] == span_ns  # the stream-less transfers, 3 ms before, are not work
    assert whole["gpu_events"] == 1313 and {s["stream"] for s in whole["idle_by_stream"]} >= {104} \
        and -1 not in {s["stream"] for s in whole["idle_by_stream"]}
    for key in ("span_ns", "busy_ns", "compute_ns", "idle_ns", "gpu_events"):
        assert step[key] == whole[key], key
    assert rank["steps_add_up"] is True
    text = _diagnose(tmp_path / "db", str(trace)).stdout
    assert "MTIA events" in text and "idle split per MTIA" in text and "per MTIA / rank" in text
    assert "they add up to the whole run" in text and "2 MTIA events on no stream" in text
    assert not any(word in text for word in GPU_WORDS), text


@pytest.mark.parametrize("clickhouse", [True, False], ids=["clickhouse", "python"])
def test_device_work_on_no_stream_is_stored_apart(store, tmp_path: Path, clickhouse: bool) -> None:
    """Both ingest paths store the stream-less, unlaunched DMA transfers as ``device_other`` on the device
    their pid names, and nothing else differently from the sample."""
    trace, _ = mtia_trace(tmp_path / "mtia.json")
    result = ingest_trace(store, trace, run_id="m", use_clickhouse_json=clickhouse)
    assert result.gpu_events == 1313 and result.device_type == "MTIA"
    rows = store.query(f"SELECT kind, device, count() FROM {qualified(store, 'trace_events')} "
                       "WHERE category = 'mtia_ccp_events' GROUP BY kind, device ORDER BY kind").rows
    assert rows == [("device_other", 17, 2), ("kernel", 17, 1313)]


def test_profiler_ranges_and_off_stream_kinds_read_the_same_on_both_paths(store, tmp_path: Path) -> None:
    trace = profiler_range_trace(tmp_path / "ranges.json")
    query = f"SELECT kind, device, stream, count() FROM {qualified(store, 'trace_events')} " \
            "WHERE run_id = {r:String} GROUP BY kind, device, stream ORDER BY kind, device, stream"
    got = []
    for run, clickhouse in (("a", True), ("b", False)):
        ingest_trace(store, trace, run_id=run, use_clickhouse_json=clickhouse)
        got.append(store.query(query, {"r": run}).rows)
    assert got[0] == got[1] and ("profiler_range", 0, -1, 79) in got[0]


def test_a_file_keeps_its_rank_in_its_run_id(tmp_path: Path) -> None:
    assert default_run_id(Path("mtia_rank_0.json.gz")) == "mtia_rank_0"
    assert default_run_id(Path("rank-34.Jul_15.1074.pt.trace.json.gz")) == "rank-34.Jul_15.1074"
    assert default_run_id(Path("rank0.json")) == "rank0"
    trace = tmp_path / "x_rank_0.json.gz"
    shutil.copy(EXAMPLES / "a100_ddp_2024_rank0.json.gz", trace)
    res = _diagnose(tmp_path / "db", str(trace))
    assert res.returncode in (0, 3), res.stderr
    assert "run x_rank_0 rank 0" in res.stderr and "`triscope diagnose --trace-run x_rank_0`" in res.stdout
    again = _diagnose(tmp_path / "db", "--trace-run", "x_rank_0", "--json")
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["run_id"] == "x_rank_0"
    doc = json.loads(_diagnose(tmp_path / "db", "--json", str(trace)).stdout)
    assert doc["ingested"][0]["run_id"] == "x_rank_0"
    assert doc["runs"][0]["report_again"] == "triscope diagnose --trace-run x_rank_0"


def test_errors_with_json_are_a_json_document(tmp_path: Path) -> None:
    refused = _diagnose(tmp_path / "db", "--json", str(TEST_DATA / "not_kineto" / "execution_trace.json"))
    assert refused.returncode == 2, refused.stderr
    doc = json.loads(refused.stdout)
    assert doc["ingested"] == [] and doc["runs"] == [] and len(doc["errors"]) == 1
    assert "not a Kineto trace" in doc["errors"][0] and "error:" in refused.stderr
    missing = _diagnose(tmp_path / "db", "--json", str(tmp_path / "nope.json"))
    assert missing.returncode == 2 and "nope.json" in json.loads(missing.stdout)["errors"][0]


def test_a_directory_with_a_refused_file_is_exit_1_as_documented(tmp_path: Path) -> None:
    """One rank went in, one was refused (the same rank twice): "some could not" is exit 1, and the rank that
    went in is reported."""
    job = tmp_path / "job"
    job.mkdir()
    for name in ("a.json.gz", "b.json.gz"):
        shutil.copy(EXAMPLES / "triton_single_kernel.json.gz", job / name)
    res = _diagnose(tmp_path / "db", "--json", str(job))
    assert res.returncode == 1, res.stderr
    doc = json.loads(res.stdout)
    assert len(doc["ingested"]) == 1 and len(doc["errors"]) == 1 and "already ingested" in doc["errors"][0]
    assert [r["run_id"] for r in doc["runs"]] == ["job"]
    assert _diagnose(tmp_path / "db2", str(job)).returncode == 1
