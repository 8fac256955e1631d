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
    # Per GPU (union over streams): the [30, 40) gap of stream 7 is covered by the NCCL kernel, so the only
    # GPU idle time is [50, 150), a host wait; the split adds up to idle, the per-stream sum does not.
    assert (w.host_wait_ns, w.kernel_wait_ns, w.other_idle_ns) == (100_000, 0, 0)
    assert w.idle_split.total_ns == w.idle_ns and w.stream_sum.total_ns == 110_000
    # launch delay = GPU start - end of the launch call: 8, 37, 21, 28 us
    assert w.launch_delay.count == 4 and w.launch_delay.max_ns == 37_000 and w.launch_delay.p50_ns == 21_000
    steps = {s.step: s.breakdown for s in rank.steps}
    assert steps[1].span_ns == 40_000 and steps[1].gpu_events == 3
    # Step 2's GPU window starts where step 1's work ended (50) and holds the 100 us the GPU waited for its
    # launch: [50, 160). Step windows tile the run, so their spans add up to it (was 10 us: 40 + 10 != 150).
    assert (rank.steps[1].gpu_start_ns, rank.steps[1].gpu_end_ns) == (50_000, 160_000)
    assert steps[2].span_ns == 110_000 and steps[2].host_wait_ns == 100_000 and steps[2].gpu_events == 1
    assert sum(b.span_ns for b in steps.values()) == w.span_ns
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


EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "traces"
_ADDED = ("span_ns", "busy_ns", "compute_ns", "non_compute_ns", "idle_ns", "comm_ns", "memory_ns",
          "comm_compute_overlap_ns", "gpu_events", "host_wait_ns", "kernel_wait_ns", "other_idle_ns")


def _sample(name: str) -> Path:
    return EXAMPLES / name if (EXAMPLES / name).exists() else shared_data("kineto", name)


@pytest.mark.parametrize("name", ["a100_ddp_2024_rank0.json.gz", "v100_resnet_ns_resolution_rank0.json.gz",
                                  "sampled_128rank_job_rank0.json.gz", "amd_mi250_rocm62_toy.json.gz"])
def test_figures_add_up_on_real_traces(store, name: str) -> None:
    """The per-GPU idle split adds up to idle time, and the step figures add up to the run's."""
    ingest_trace(store, _sample(name), run_id="sum")
    for include_last in (False, True):
        (rank,) = analyze_run(store, "sum", include_last_step=include_last)
        w = rank.whole
        assert w.gpu_events > 0 and w.idle_split.total_ns == w.idle_ns <= w.span_ns
        steps = rank.steps[:-1] if rank.last_step_dropped else rank.steps
        assert steps, "the sample has ProfilerSteps"
        for field_name in _ADDED:  # exact: each nanosecond (and each item) belongs to one step
            assert sum(getattr(s.breakdown, field_name) for s in steps) == getattr(w, field_name), field_name
        for s in rank.steps:
            assert s.breakdown.idle_split.total_ns == s.breakdown.idle_ns
            assert s.breakdown.span_ns == s.gpu_end_ns - s.gpu_start_ns
        assert all(a.gpu_end_ns == b.gpu_start_ns for a, b in zip(rank.steps, rank.steps[1:], strict=False))


def test_a100_per_stream_sum_exceeds_the_span_but_the_headline_does_not(store) -> None:
    """The A100 DDP sample: compute and NCCL streams wait for the host at the same time, so the per-stream
    host wait summed (HTA's idle time breakdown, 737 ms) exceeds the 436 ms span; per GPU it is 335 ms."""
    ingest_trace(store, _sample("a100_ddp_2024_rank0.json.gz"), run_id="a100")
    (rank,) = analyze_run(store, "a100")
    w = rank.whole
    assert w.stream_sum.host_wait_ns > w.span_ns > w.idle_ns >= w.host_wait_ns
    assert round(w.span_ns / 1e6) == 436 and round(w.stream_sum.host_wait_ns / 1e6) == 737
    assert round(w.host_wait_ns / 1e6) == 335
    # Every step reads the run's idle share (was 73-77 % per step with overlapping step spans).
    steps = rank.steps[:-1]
    assert all(abs(s.breakdown.pct(s.breakdown.idle_ns) - w.pct(w.idle_ns)) < 1.0 for s in steps)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 300), st.integers(1, 40), st.sampled_from([1, 2, 3]),
                          st.sampled_from(["compute", "comm", "memory"]), st.integers(-1, 300)),
                min_size=1, max_size=25),
       st.lists(st.integers(0, 340), max_size=6))
def test_windows_match_brute_force(items, cuts) -> None:
    """window_breakdowns on generated timelines: every figure per window equals a per-nanosecond count, the
    GPU idle split adds up to idle time, and windows that tile the span add up to breakdown_of."""
    from triscope.analyzers.gpu_timeline import breakdown_of, window_breakdowns

    cols = {"ts_ns": np.array([i[0] for i in items], dtype=np.int64),
            "dur_ns": np.array([i[1] for i in items], dtype=np.int64),
            "stream": np.array([i[2] for i in items], dtype=np.int64),
            "kernel_class": np.array([i[3] for i in items], dtype=object),
            "launch_ts": np.array([min(i[4], i[0]) for i in items], dtype=np.int64)}
    cols["launch_end"] = np.where(cols["launch_ts"] >= 0, cols["launch_ts"] + 1, -1)
    lo, hi = int(cols["ts_ns"].min()), int((cols["ts_ns"] + cols["dur_ns"]).max())
    edges = sorted({lo, hi, *(c for c in cuts if lo < c < hi)})
    windows = window_breakdowns(cols, np.array(edges[:-1]), np.array(edges[1:]), kernel_wait_ns=10)
    for b, a, z in zip(windows, edges[:-1], edges[1:], strict=True):
        def covered(kind: str | None, t: int) -> bool:
            return any(s <= t < s + d and (kind is None or k == kind) for s, d, _, k, _ in items)
        assert b.busy_ns == sum(covered(None, t) for t in range(a, z))
        assert b.compute_ns == sum(covered("compute", t) for t in range(a, z))
        assert b.comm_compute_overlap_ns == sum(covered("compute", t) and covered("comm", t) for t in range(a, z))
        assert b.idle_split.total_ns == b.idle_ns == (z - a) - b.busy_ns
    whole = breakdown_of(cols, kernel_wait_ns=10)
    for field_name in _ADDED:
        assert sum(getattr(b, field_name) for b in windows) == getattr(whole, field_name), field_name
