"""Trace breakdown: interval arithmetic, a hand-built trace with known figures, and HTA agreement."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from conftest import require, shared_data
from hypothesis import given, settings
from hypothesis import strategies as st
from kineto_helpers import cpu, kernel, runtime, write_trace

from triscope.analyzers.trace_breakdown import analyze_run, union_length
from triscope.collectors.kineto import ingest_trace


def _brute_union(intervals: list[tuple[int, int]]) -> int:
    covered: set[int] = set()
    for s, e in intervals:
        covered.update(range(s, e))
    return len(covered)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 200), st.integers(0, 40)), max_size=30))
def test_union_length_matches_brute_force(pairs):
    intervals = [(s, s + d) for s, d in pairs]
    start = np.array([s for s, _ in intervals], dtype=np.int64)
    end = np.array([e for _, e in intervals], dtype=np.int64)
    assert union_length(start, end) == _brute_union(intervals)


def _known_trace(path: Path) -> Path:
    """Two steps; stream 7 compute, stream 9 NCCL. Times in us (ns after ingest)."""
    events = [
        cpu("ProfilerStep#1", 0, 100, cat="user_annotation"),
        cpu("ProfilerStep#2", 100, 100, cat="user_annotation"),
        # step 1: launches at 1, 2 and 3
        runtime("cudaLaunchKernel", 1, 1, correlation=1),
        runtime("cudaLaunchKernel", 2, 1, correlation=2),
        runtime("cudaLaunchKernel", 3, 1, correlation=3),
        kernel("gemm", 10, 20, stream=7, correlation=1),        # [10, 30) compute
        kernel("gemm2", 40, 10, stream=7, correlation=2),       # [40, 50) compute, gap 10 -> kernel wait
        kernel("ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevComm*)", 25, 20, stream=9,
               correlation=3),                                  # [25, 45) comm, overlaps compute 25-30, 40-45
        # step 2: launch at 120 happens after the previous stream-7 kernel ended (50) -> host wait
        runtime("cudaLaunchKernel", 120, 2, correlation=4),
        kernel("gemm3", 150, 10, stream=7, correlation=4),      # [150, 160)
    ]
    return write_trace(path, events)


def test_known_trace_figures_are_exact(store, tmp_path: Path):
    ingest_trace(store, _known_trace(tmp_path / "known.json"), run_id="k")
    (rank,) = analyze_run(store, "k", include_last_step=True)
    w = rank.whole
    assert (w.span_ns, w.busy_ns, w.compute_ns) == (150_000, 50_000, 40_000)
    assert (w.non_compute_ns, w.idle_ns, w.comm_ns) == (10_000, 100_000, 20_000)
    assert w.comm_compute_overlap_ns == 10_000 and w.overlap_ratio == 0.5
    by_stream = {s.stream: s for s in w.idle_by_stream}
    assert (by_stream[7].kernel_wait_ns, by_stream[7].host_wait_ns, by_stream[7].other_ns) == (10_000, 100_000, 0)
    assert by_stream[9].total_ns == 0
    # launch delay = GPU start - end of the launch call: 8, 37, 21, 28 us
    assert w.launch_delay.count == 4 and w.launch_delay.max_ns == 37_000 and w.launch_delay.p50_ns == 21_000
    steps = {s.step: s.breakdown for s in rank.steps}
    assert steps[1].span_ns == 40_000 and steps[1].gpu_events == 3 and steps[2].span_ns == 10_000
    (dropped,) = analyze_run(store, "k")  # HTA default: drop work launched from the last step on
    assert dropped.last_step_dropped and dropped.whole.span_ns == 40_000


def test_cpu_only_trace_reports_no_gpu_work(store):
    ingest_trace(store, shared_data("kineto", "cpu_only_gloo_rank34.json.gz"), run_id="cpu")
    (rank,) = analyze_run(store, "cpu")
    assert rank.rank == 34 and rank.whole.gpu_events == 0 and rank.whole.span_ns == 0


def _hta_breakdown(trace: Path, tmp_path: Path) -> dict:
    """HolisticTraceAnalysis on the same file, with its ns rounding off (see docs/trace-breakdown.md)."""
    try:
        from hta.trace_analysis import TraceAnalysis
    except ImportError:
        require(False, "holistictraceanalysis is not installed (pip install '.[bench]')")
    folder = tmp_path / "hta"
    folder.mkdir()
    shutil.copy(trace, folder / trace.name)
    os.environ["HTA_DISABLE_NS_ROUNDING"] = "1"
    try:
        analysis = TraceAnalysis(trace_dir=str(folder))
        temporal = analysis.get_temporal_breakdown(visualize=False).iloc[0]
    finally:
        os.environ.pop("HTA_DISABLE_NS_ROUNDING", None)
    return {"idle": temporal["idle_time(us)"], "compute": temporal["compute_time(us)"],
            "non_compute": temporal["non_compute_time(us)"], "span": temporal["kernel_time(us)"]}


@pytest.mark.slow
@pytest.mark.parametrize("name", ["a100_ddp_2024_rank0.json.gz", "v100_resnet_ns_resolution_rank0.json.gz"])
def test_agrees_with_hta_within_half_a_percent(store, tmp_path: Path, name: str):
    trace = shared_data("kineto", name)
    hta = _hta_breakdown(trace, tmp_path)
    ingest_trace(store, trace, run_id="x")
    (rank,) = analyze_run(store, "x")
    ours = {"idle": rank.whole.idle_ns, "compute": rank.whole.compute_ns,
            "non_compute": rank.whole.non_compute_ns, "span": rank.whole.span_ns}
    for key, value in ours.items():
        assert value / 1000 == pytest.approx(hta[key], rel=0.005), key


def test_ranks_loaded_together_give_the_per_rank_figures(store, monkeypatch: pytest.MonkeyPatch) -> None:
    """analyze_run loads ranks in groups (two queries per group): the figures of every rank are
    those of loading it alone, whatever the group size, and a rank selection keeps working."""
    import triscope.analyzers.trace_breakdown as tb

    for k in (0, 1):
        ingest_trace(store, shared_data("kineto", f"sampled_128rank_job_rank{k}.json.gz"), run_id="groups")
    alone = [tb.analyze_rank(store, "groups", r) for r in (0, 1)]
    assert all(r.whole.gpu_events > 0 for r in alone)
    assert tb.analyze_run(store, "groups") == alone  # one group
    monkeypatch.setattr(tb, "ANALYZE_GROUP_GPU_EVENTS", 1)
    assert tb.analyze_run(store, "groups") == alone  # a group per rank
    assert tb.analyze_run(store, "groups", ranks=[1]) == alone[1:]
    with pytest.raises(tb.InputError, match="no rank"):
        tb.analyze_run(store, "groups", ranks=[7])


def test_rank_groups_bound_the_gpu_events_loaded_at_once() -> None:
    from triscope.analyzers.trace_breakdown import rank_groups

    assert rank_groups({0: 5, 1: 5, 2: 5}, limit=10) == [[0, 1], [2]]
    assert rank_groups({0: 50, 1: 1, 2: 1}, limit=10) == [[0], [1, 2]]
    assert rank_groups({0: 0, 1: 0}, limit=10) == [[0, 1]]
    assert rank_groups({}, limit=10) == []
