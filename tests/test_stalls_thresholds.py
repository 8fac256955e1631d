"""Stall classifier on seeded tables: each rule at and just past its threshold, precedence, shares, filters."""

from __future__ import annotations

import math
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from triscope.analyzers.stalls import busy_ns, classify_window, diagnose_stalls, stall_config
from triscope.config import load_config
from triscope.errors import ConfigError, InputError
from triscope.schema import encode_ts, qualified

MS = 1_000_000
NAN = float("nan")


def _t0() -> int:
    return (time.time_ns() // 10**9 - 600) * 10**9  # aligned to the 100 ms grid, inside "the last 10m"


def _samples(store, t0: int, rows: list[tuple], host: str = "h1", gpu: int = 0, model: str = "H100") -> None:
    """rows: (window index, sm, dram, l2, util) -> one sample in the middle of each 100 ms window."""
    store.insert(qualified(store, "gpu_samples"), {
        "ts": [encode_ts(t0 + i * 100 * MS + 50 * MS) for i, *_ in rows], "host": [host] * len(rows),
        "gpu": [gpu] * len(rows), "gpu_model": [model] * len(rows), "source": ["dcgm"] * len(rows),
        "sm_active_ratio": [r[1] for r in rows], "dram_active_ratio": [r[2] for r in rows],
        "l2_bandwidth_ratio": [r[3] for r in rows], "gpu_util_ratio": [r[4] for r in rows],
    })


def _io(store, t0: int, rows: list[tuple], host: str = "h1") -> None:
    """rows: (window index, device, p99 seconds, queue depth)."""
    store.insert(qualified(store, "io_latency"), {
        "ts": [encode_ts(t0 + r[0] * 100 * MS) for r in rows], "host": [host] * len(rows),
        "device": [r[1] for r in rows], "source": ["bpftrace"] * len(rows), "op": ["read"] * len(rows),
        "window_seconds": [0.1] * len(rows), "ios": [100.0] * len(rows), "p50_seconds": [NAN] * len(rows),
        "p99_seconds": [r[2] for r in rows], "mean_seconds": [NAN] * len(rows),
        "queue_depth": [r[3] for r in rows],
    })


def _trace(store, t0: int, events: list[tuple], host: str = "h1", run: str = "r", rank: int = 0) -> None:
    """events: (kind, kernel_class, name, start ms, dur ms) relative to t0 (the trace's base time)."""
    store.insert(qualified(store, "trace_runs"), {
        "run_id": [run], "rank": [rank], "host": [host], "base_time_ns": [t0], "time_base": ["relative"],
        "status": ["complete"], "ingested_at": [time.time()]})
    n = len(events)
    store.insert(qualified(store, "trace_events"), {
        "run_id": [run] * n, "rank": [rank] * n, "kind": [e[0] for e in events],
        "kernel_class": [e[1] for e in events], "name": [e[2] for e in events],
        "device": [0 if e[0] == "kernel" else -1 for e in events], "stream": [7] * n,
        "ts_ns": [int(round(e[3] * MS)) for e in events], "dur_ns": [int(round(e[4] * MS)) for e in events],
        "category": [e[0] for e in events], "pid": ["1"] * n, "tid": ["1"] * n,
    })


def _run(store, t0: int, windows: int, config: dict | None = None, **kw):
    report = diagnose_stalls(store, t0, t0 + windows * 100 * MS, config or {}, **kw)
    return report, {(w.unit, (w.start_ns - t0) // (100 * MS)): w for w in report.windows}


def test_compute_rule_at_the_default_thresholds(store) -> None:
    t0 = _t0()
    _samples(store, t0, [(0, 0.951, 0.5, 0.5, 1.0), (1, 0.949, 0.5, 0.5, 1.0), (2, 0.99, 0.61, 0.2, 1.0),
                         (3, 0.99, NAN, 0.59, 1.0), (4, 0.99, 0.2, 0.605, 1.0)])
    _, w = _run(store, t0, 5)
    verdicts = [w[("h1/gpu0", i)].verdict for i in range(5)]
    assert verdicts == ["compute", "unclassified", "unclassified", "compute", "unclassified"]
    ev = {e.metric: e for e in w[("h1/gpu0", 0)].evidence["compute"]}
    assert ev["sm_active_ratio"].threshold == 0.95 and ev["sm_active_ratio"].op == ">"
    assert ev["dram_active_ratio"].threshold == 0.6 and ev["dram_active_ratio"].met
    assert ev["sm_active_ratio"].value == pytest.approx(0.951, abs=1e-6)


def test_compute_rule_exactly_at_configured_thresholds(store) -> None:
    """0.75 and 0.5 are exact in Float32: the value equal to the threshold does not count."""
    t0 = _t0()
    up = float(np.nextafter(np.float32(0.75), np.float32(1)))
    down = float(np.nextafter(np.float32(0.5), np.float32(0)))
    _samples(store, t0, [(0, 0.75, 0.25, 0.25, 1.0), (1, up, 0.25, 0.25, 1.0), (2, up, 0.5, 0.25, 1.0),
                         (3, up, down, down, 1.0)])
    cfg = {"stalls": {"compute_sm_active_min": 0.75, "compute_bandwidth_max": 0.5}}
    _, w = _run(store, t0, 4, cfg)
    assert [w[("h1/gpu0", i)].verdict for i in range(4)] == ["unclassified", "compute", "unclassified", "compute"]


def test_io_rule_needs_latency_and_depth_on_one_device(store) -> None:
    t0 = _t0()
    _samples(store, t0, [(i, 0.5, 0.1, 0.1, 0.5) for i in range(5)])
    _io(store, t0, [(0, "nvme0n1", 0.0012, 65.0), (1, "nvme0n1", 0.0012001, 65.0), (2, "nvme0n1", 0.002, 64.0),
                    (3, "nvme0n1", 0.002, 10.0), (3, "nvme1n1", 0.0001, 100.0), (4, "nvme1n1", 0.0015, 64.5)])
    _, w = _run(store, t0, 5)
    assert [w[("h1/gpu0", i)].verdict for i in range(5)] == ["unclassified", "io", "unclassified", "unclassified", "io"]
    io = {e.metric: e for e in w[("h1/gpu0", 1)].evidence["io"]}
    assert io["io_read_p99_seconds"].value == 0.0012001 and io["io_read_p99_seconds"].threshold == 0.0012
    assert io["io_queue_depth"].value == 65.0 and io["io_queue_depth"].threshold == 64
    assert io["io_queue_depth"].source == "io_latency[nvme0n1]"
    assert w[("h1/gpu0", 4)].evidence["io"][0].source == "io_latency[nvme1n1]"


def _gpu_trace(store, t0: int) -> None:
    k = ("kernel", "compute", "gemm")
    c = ("kernel", "comm", "ncclDevKernel_AllReduce_Sum_f32_RING_LL")
    _trace(store, t0, [
        (*c, 0, 85), (*k, 85, 15),  # window 0: comm exactly 85 %
        (*c, 100, 85.000001), (*k, 185.000001, 14.999999),  # window 1: just past
        (*k, 200, 100),  # window 2: compute kernels cover it
        (*k, 300, 40), ("cpu_op", "", "aten::add", 300, 60.000001),  # window 3: GPU 40 %, host 60 %: launch-bound
        (*k, 400, 4), ("cpu_op", "", "aten::add", 404, 0.9), ("cpu_op", "", "aten::add", 499.9, 0.1),  # window 4 idle
    ])


def test_trace_rules_comm_compute_host_idle(store) -> None:
    t0 = _t0()
    _gpu_trace(store, t0)
    report, w = _run(store, t0, 5)
    assert [w[("h1/gpu0", i)].verdict for i in range(5)] == ["unclassified", "comm", "compute", "host", "idle"]
    comm = w[("h1/gpu0", 1)].evidence["comm"][0]
    assert comm.metric == "comm_share" and comm.value == pytest.approx(0.85000001) and comm.threshold == 0.85
    assert w[("h1/gpu0", 0)].metrics["comm_share"] == 0.85
    host = {e.metric: e for e in w[("h1/gpu0", 3)].evidence["host"]}
    assert host["gpu_busy_share"].value == pytest.approx(0.4) and host["host_busy_share"].value > 0.6
    assert report.share_text() == "unclassified 20%, comm 20%, compute 20%, host 20%, idle 20%"


def test_precedence_and_also_matched(store) -> None:
    t0 = _t0()
    _gpu_trace(store, t0)
    _samples(store, t0, [(1, 0.99, 0.1, 0.1, 1.0)])  # the comm window also has SMs > 95 % busy
    _, w = _run(store, t0, 5)
    assert w[("h1/gpu0", 1)].verdict == "comm" and w[("h1/gpu0", 1)].matched == ["comm", "compute"]
    _, w2 = _run(store, t0, 5, {"stalls": {"precedence": ["compute", "comm", "io", "host", "idle"]}})
    assert w2[("h1/gpu0", 1)].verdict == "compute"


def test_host_bound_from_serving_queue(store) -> None:
    t0 = _t0()
    _samples(store, t0, [(0, 0.3, 0.1, 0.1, 0.4), (1, 0.3, 0.1, 0.1, 0.4), (2, 0.01, NAN, NAN, 0.01)])
    store.insert(qualified(store, "serving_metrics"), {
        "ts": [encode_ts(t0 + 20 * MS), encode_ts(t0 + 120 * MS)], "host": ["h1", "h1"], "backend": ["b", "b"],
        "server": ["vllm", "vllm"], "model": ["m", "m"], "queue_length": [1.0, 0.999]})
    _, w = _run(store, t0, 3)
    assert [w[("h1/gpu0", i)].verdict for i in range(3)] == ["host", "unclassified", "idle"]


def test_shares_top_windows_and_breach(store) -> None:
    t0 = _t0()
    _samples(store, t0, [(i, 0.99, 0.1, 0.1, 1.0) for i in range(3)] + [(i, 0.5, 0.1, 0.1, 0.5) for i in range(3, 10)])
    _io(store, t0, [(i, "sda", 0.002 + i * 1e-4, 100.0) for i in range(3, 8)])
    report, _ = _run(store, t0, 10)
    assert report.shares() == pytest.approx({"io": 0.5, "compute": 0.3, "unclassified": 0.2})
    assert report.share_text() == "io 50%, compute 30%, unclassified 20%"
    top = report.top(3)
    assert [w.verdict for w in top] == ["io"] * 3  # furthest past the threshold first
    assert top[0].metrics["io_read_p99_seconds"] == pytest.approx(0.0027)
    assert report.breaches()
    quiet, _ = _run(store, t0, 10, {"stalls": {"alert_share": 0.5}})
    assert quiet.breaches() == []  # io is 50 %, not more
    assert quiet.to_json()["actions"].keys() >= {"io", "compute"}


def test_host_gpu_and_model_filters(store) -> None:
    t0 = _t0()
    _samples(store, t0, [(0, 0.99, 0.1, 0.1, 1.0)], host="h1", gpu=0)
    _samples(store, t0, [(0, 0.01, 0.1, 0.1, 0.0)], host="h1", gpu=1)
    _samples(store, t0, [(0, 0.01, 0.1, 0.1, 0.0)], host="h2", gpu=0, model="A100")
    store.insert(qualified(store, "requests"), {"ts": [encode_ts(t0 + 10 * MS)], "host": ["h1"], "gpu": ["1"],
                                                "model": ["llama-3-8b"], "backend": ["h1:8000"]})
    assert _run(store, t0, 1)[0].units() == ["h1/gpu0", "h1/gpu1", "h2/gpu0"]
    assert _run(store, t0, 1, hosts=["h2"])[0].units() == ["h2/gpu0"]
    assert _run(store, t0, 1, gpus=[1])[0].units() == ["h1/gpu1"]
    assert _run(store, t0, 1, model="llama-3-8b")[0].units() == ["h1/gpu1"]
    assert _run(store, t0, 1, model="A100")[0].units() == ["h2/gpu0"]


def test_config_section_and_env_override() -> None:
    cfg = load_config(environ={"TRISCOPE_STALLS__COMM_SHARE_MIN": "0.5", "TRISCOPE_ANALYSIS__WINDOW_MS": "250"})
    s = stall_config(cfg)
    assert s["comm_share_min"] == 0.5 and s["window_ms"] == 250
    with pytest.raises(ConfigError, match="comm_share_min"):
        stall_config({"stalls": {"comm_share_min": "high"}})
    with pytest.raises(ConfigError, match="precedence"):
        stall_config({"stalls": {"precedence": ["gpu"]}})
    verdict, matched, _, _ = classify_window({"comm_share": 0.6}, s)
    assert verdict == "comm" and matched == ["comm"]


def test_empty_range_is_an_error(store) -> None:
    with pytest.raises(InputError):
        diagnose_stalls(store, 10, 10, {})


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 500), st.integers(0, 80)), max_size=30), st.integers(1, 120))
def test_busy_ns_equals_a_pixel_count(intervals: list[tuple[int, int]], width: int) -> None:
    starts = np.array([s for s, _ in intervals], dtype=np.int64)
    ends = np.array([s + d for s, d in intervals], dtype=np.int64)
    ws = np.arange(0, 600, width, dtype=np.int64)
    we = ws + width
    mask = np.zeros(600 + width, dtype=bool)
    for s, e in zip(starts, ends, strict=True):
        mask[s:e] = True
    expected = [int(mask[a:b].sum()) for a, b in zip(ws, we, strict=True)]
    assert busy_ns(starts, ends, ws, we).tolist() == expected
    assert not math.isnan(float(sum(expected)))
