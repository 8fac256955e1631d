"""Stall verdicts that say what the data can say: device work per device type, no GPU advice without
device data, no verdict from a sliver of trace at its edge, no "idle" for a trace whose GPU was busy."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import shared_data

from triscope.analyzers.stalls import diagnose_stalls, trace_span
from triscope.analyzers.trace_breakdown import analyze_run
from triscope.collectors.kineto import ingest_trace

DEVICE_WORDS = ("GPU", "CUDA", "NCCL", "NVLink", "kernel")


def _report(store, run: str, by: str = "window"):
    start, end = trace_span(store, [run])
    return diagnose_stalls(store, start, end + 1, {}, run_ids=[run], by=by)


def test_mtia_windows_are_device_verdicts_named_for_the_device(store) -> None:
    ingest_trace(store, shared_data("kineto", "mtia_inference_rank0.json.gz"), run_id="mtia")
    report = _report(store, "mtia")
    assert [u.rsplit("/", 1)[1] for u in report.units()] == ["mtia17"] and report.device_data
    compute = [w for w in report.windows if w.verdict == "compute"]
    assert compute and all(w.metrics["has_gpu"] == 1.0 for w in report.windows)
    assert "add MTIAs" in report.action("compute") and "GPU" not in report.action("compute")
    assert not report.share_text().startswith("CPU only")


def test_a_short_window_at_the_edge_of_a_trace_is_not_a_verdict_of_its_own(store) -> None:
    """The MTIA trace starts 74 ms into a 100 ms window and ends 34 ms into one: those slivers join their
    neighbours, so every verdict stands on at least half a window of trace."""
    ingest_trace(store, shared_data("kineto", "mtia_inference_rank0.json.gz"), run_id="edges")
    report = _report(store, "edges")
    assert len(report.windows) >= 3
    assert all(w.metrics["traced_seconds"] >= 0.05 for w in report.windows), \
        [round(w.metrics["traced_seconds"], 4) for w in report.windows]
    start, end = trace_span(store, ["edges"])
    assert report.windows[0].start_ns == start and report.windows[-1].end_ns == end + 1  # nothing dropped
    assert sum(w.end_ns - w.start_ns for w in report.windows) == end + 1 - start


def test_a_trace_whose_gpu_work_is_all_compute_is_not_called_idle(store) -> None:
    """The Triton sample: one 1.76 us kernel, whole-run compute 100 %; its ProfilerStep annotation runs
    13 s past the 1.5 ms the profiler recorded, which made it "idle 100%". Over what was recorded the CPU
    was busy launching: host-bound."""
    ingest_trace(store, shared_data("kineto", "triton_single_kernel.json.gz"), run_id="triton")
    (rank,) = analyze_run(store, "triton", include_last_step=True)
    assert rank.whole.pct(rank.whole.compute_ns) == 100.0
    for by in ("window", "step"):
        report = _report(store, "triton", by)
        assert "idle" not in report.shares(), report.share_text()
        assert report.shares() == {"host": 1.0}
        (window,) = report.windows
        assert window.end_ns - window.start_ns < 2_000_000  # the recorded 1.5 ms, not the 13 s annotation


CPU_STEPS = """
import sys
from pathlib import Path
from triscope.commands.demo import capture_cpu_trace
capture_cpu_trace(Path(sys.argv[1]))
"""


@pytest.fixture(scope="module")
def torch_cpu_trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo's capture: a few training steps of a small MLP profiled on the CPU by torch."""
    pytest.importorskip("torch")
    out = tmp_path_factory.mktemp("cpu") / "torch_cpu_mlp.json"
    subprocess.run([sys.executable, "-c", CPU_STEPS, str(out)], check=True, capture_output=True, timeout=300)
    return out


def test_no_gpu_advice_and_no_breach_without_device_data(store, torch_cpu_trace: Path) -> None:
    result = ingest_trace(store, torch_cpu_trace, run_id="cpu")
    assert result.gpu_events == 0 and result.device_type == ""
    for by in ("window", "step"):
        report = _report(store, "cpu", by)
        assert report.windows and not report.device_data
        assert report.share_text().startswith("CPU only (no device data): ")
        assert [u.rsplit("/", 1)[1] for u in report.units()] == ["cpu-rank0"]
        for cls, text in report.to_json()["actions"].items():
            assert "no device data" in text and not any(word in text for word in DEVICE_WORDS), (cls, text)
        assert report.breaches() == []
        assert report.to_json()["device_data"] is False


def test_the_cli_says_so_and_exits_0(tmp_path: Path, torch_cpu_trace: Path) -> None:
    env = {**os.environ, "TRISCOPE_STORE__PATH": str(tmp_path / "db"), "COLUMNS": "200"}
    env.pop("TRISCOPE_CONFIG", None)

    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "triscope", *args], capture_output=True, text=True, env=env,
                              timeout=300)

    ingest = cli("ingest", "trace", "--no-progress", "--run-id", "cpu", str(torch_cpu_trace))
    assert ingest.returncode == 0 and "CPU only: no device events" in ingest.stdout, ingest.stdout + ingest.stderr
    out = cli("diagnose", "--run-id", "cpu", "--by", "step")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "CPU only (no device data)" in out.stdout and "breach" not in out.stdout
    advice = [line for line in out.stdout.splitlines() if " -> " in line]  # printed for alert classes only
    assert not any(word in line for line in advice for word in DEVICE_WORDS), advice
    report = json.loads(cli("diagnose", "--run-id", "cpu", "--by", "step", "--json").stdout)
    assert report["device_data"] is False and report["breaches"] == [] and report["actions"]
    for text in report["actions"].values():
        assert "no device data" in text and not any(word in text for word in DEVICE_WORDS), text


def test_host_collectives_without_device_data_get_no_nccl_advice(store) -> None:
    for rank in (0, 1):
        ingest_trace(store, shared_data("kineto", f"local_cpu_gloo_2rank_rank{rank}.json"), run_id="gloo")
    report = _report(store, "gloo")
    assert "comm" in report.shares() and not report.device_data
    assert report.action("comm").startswith("Communication-bound") and "NCCL" not in report.action("comm")
