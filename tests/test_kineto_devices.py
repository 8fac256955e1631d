"""Device work of accelerators other than CUDA: recognised by what the trace says, per device type."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from conftest import require, shared_data
from kineto_helpers import cpu, kernel, write_trace

from triscope.analyzers.trace_breakdown import analyze_run
from triscope.collectors.kineto import ingest_trace
from triscope.collectors.kineto.classify import device_type, event_kind, pid_device
from triscope.schema import qualified

# HolisticTraceAnalysis 0.5 get_temporal_breakdown on this file (HTA_DISABLE_NS_ROUNDING=1): idle, compute,
# non-compute and span in microseconds (4.30 / 94.68 / 1.02 %).
HTA_MTIA = {"idle": 19045.764695, "compute": 419693.063315, "non_compute": 4536.876066, "span": 443275.704077}


def test_mtia_device_work_is_recognised_and_the_breakdown_matches_hta(store) -> None:
    result = ingest_trace(store, shared_data("kineto", "mtia_inference_rank0.json.gz"), run_id="mtia")
    assert result.gpu_events == 1313 and result.device_type == "MTIA"
    devices = store.query(f"SELECT DISTINCT device FROM {qualified(store, 'trace_events')} "
                          "WHERE kind = 'kernel'").rows
    assert devices == [(17,)]  # no device argument: the pid Kineto gives device 17 ("MTIA 17")
    kinds = dict(store.query(f"SELECT category, any(kind) FROM {qualified(store, 'trace_events')} "
                             "GROUP BY category").rows)
    assert kinds["mtia_ccp_events"] == "kernel" and kinds["mtia_runtime"] == "runtime"
    (rank,) = analyze_run(store, "mtia")
    w = rank.whole
    ours = {"idle": w.idle_ns, "compute": w.compute_ns, "non_compute": w.non_compute_ns, "span": w.span_ns}
    for key, us in HTA_MTIA.items():
        assert ours[key] / 1000 == pytest.approx(us, rel=1e-6), key
    assert [round(w.pct(v), 2) for v in (w.idle_ns, w.compute_ns, w.non_compute_ns)] == [4.30, 94.68, 1.02]


@pytest.mark.slow
def test_mtia_agrees_with_hta_run_here(store, tmp_path: Path) -> None:
    try:
        from hta.trace_analysis import TraceAnalysis
    except ImportError:
        require(False, "holistictraceanalysis is not installed (pip install '.[bench]')")
    trace = shared_data("kineto", "mtia_inference_rank0.json.gz")
    (tmp_path / "hta").mkdir()
    shutil.copy(trace, tmp_path / "hta" / trace.name)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HTA_DISABLE_NS_ROUNDING", "1")
        row = TraceAnalysis(trace_dir=str(tmp_path / "hta")).get_temporal_breakdown(visualize=False).iloc[0]
    hta = {"idle": row["idle_time(us)"], "compute": row["compute_time(us)"],
           "non_compute": row["non_compute_time(us)"], "span": row["kernel_time(us)"]}
    assert hta == pytest.approx(HTA_MTIA, rel=1e-9)
    ingest_trace(store, trace, run_id="m")
    (rank,) = analyze_run(store, "m")
    assert rank.whole.compute_ns / 1000 == pytest.approx(hta["compute"], rel=1e-6)


def test_categories_and_device_types() -> None:
    assert [event_kind(c) for c in ("mtia_ccp_events", "mtia_runtime", "xpu_runtime", "privateuse1_driver",
                                    "Kernel", "cuda_profiler_range")] == \
        ["kernel", "runtime", "runtime", "runtime", "kernel", "profiler_range"]
    assert [device_type(c) for c in ("kernel", "gpu_memcpy", "Memset", "mtia_ccp_events", "npu_events",
                                     "cuda_profiler_range")] == ["GPU", "GPU", "GPU", "MTIA", "NPU", "GPU"]
    assert [pid_device(p) for p in (17, "17", "+3", " 1", "Spans", 1 << 40, "1.0")] == [17, 17, 3, -1, -1, -1, -1]


@pytest.mark.parametrize("clickhouse", [True, False], ids=["clickhouse", "python"])
def test_device_work_of_an_unknown_category_on_a_device_pid(store, tmp_path: Path, clickhouse: bool) -> None:
    """A category triscope does not know, with a stream, on a pid no host event uses: device work, on the
    device its pid names; the same category on the host's pid stays what it was."""
    dev = {"ph": "X", "cat": "npu_events", "pid": 3, "tid": 9, "args": {"stream": 2}}
    events = [cpu("aten::mm", 0, 50), {**cpu("launch", 1, 2, cat="npu_runtime"), "args": {"correlation": 1}},
              {**dev, "name": "MatMul", "ts": 5, "dur": 20}, {**dev, "name": "dma_copy", "ts": 30, "dur": 5},
              {"ph": "X", "cat": "npu_events", "name": "host_side", "pid": 100, "tid": 100, "ts": 40, "dur": 1,
               "args": {"stream": 2}}]
    path = write_trace(tmp_path / "npu.json", events)
    result = ingest_trace(store, path, run_id="npu", use_clickhouse_json=clickhouse)
    assert result.gpu_events == 2 and result.device_type == "NPU"
    rows = store.query(f"SELECT name, kind, kernel_class, device FROM {qualified(store, 'trace_events')} "
                       "ORDER BY ts_ns").rows
    assert rows == [("aten::mm", "cpu_op", "", -1), ("launch", "runtime", "", -1), ("MatMul", "kernel", "compute", 3),
                    ("dma_copy", "kernel", "memory", 3), ("host_side", "other", "", -1)]
    runs = store.query(f"SELECT gpu_event_count FROM {qualified(store, 'trace_runs')} FINAL").rows
    assert runs == [(2,)]


def test_cuda_and_rocm_keep_their_device_argument(store, tmp_path: Path) -> None:
    path = write_trace(tmp_path / "k.json", [{**kernel("k", 1, 1), "pid": 5}])  # device arg 0, pid 5
    ingest_trace(store, path, run_id="k")
    assert store.query(f"SELECT device FROM {qualified(store, 'trace_events')}").rows == [(0,)]
    rocm = ingest_trace(store, shared_data("kineto", "amd_mi250_rocm62_toy.json.gz"), run_id="rocm")
    assert rocm.device_type == "GPU" and rocm.gpu_events == 16
