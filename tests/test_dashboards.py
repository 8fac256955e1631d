"""Grafana boards (triscope.dashboards): every query runs on the real engine, the JSON is valid.

Each panel's and each variable's SQL goes through triscope.dashboards.macros (the ClickHouse
plugin's macros and Grafana's variable interpolation) and then runs in chDB (the ``store``
fixture) on data seeded into every table the boards read. Grafana itself cannot be installed
here, so ``dashboards push`` is checked against a small local HTTP server that records the
Grafana API calls it receives (a stand-in for the Grafana HTTP API, the network boundary).
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
import threading
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from conftest import REPO, free_port, fresh_database, require_binary

from triscope.dashboards import macros
from triscope.dashboards.boards import all_boards
from triscope.dashboards.generate import DEFAULT_OUT, expected_files, stale_files, write
from triscope.dashboards.macros import ALL, Context, MacroError, Var, expand
from triscope.dashboards.model import CLICKHOUSE_PLUGIN_VERSION
from triscope.schema import encode_ts, qualified

T0_S = 1_767_225_600  # 2026-01-01T00:00:00Z
T0 = T0_S * 1_000_000_000
WNS = 100_000_000
START = datetime.fromtimestamp(T0_S - 1, UTC)
END = datetime.fromtimestamp(T0_S + 10, UTC)
PROVISIONING = REPO / "dashboards" / "provisioning"

BACKENDS = {"h1:8000": ("h1", "0"), "h1:8001": ("h1", "GPU-h1-1"), "h2:8000": ("h2", ""), "h3:8000": ("h3", "0")}
GPUS = [("h1", 0, "GPU-h1-0"), ("h1", 1, "GPU-h1-1"), ("h2", 0, "GPU-h2-0"), ("h2", 1, "GPU-h2-1")]
H2_GPU1_GAPS = 3  # GPU 1 of h2 (a whole-host backend) misses every third window
CLASSES = ["realtime_speech", "interactive_image_text", "offline_video"]
MODALITIES = {"realtime_speech": "speech", "interactive_image_text": "image", "offline_video": "video"}


def _ins(store, table: str, rows: list[dict[str, Any]]) -> None:
    cols = {k: [r[k] for r in rows] for k in rows[0]}
    if "ts" in cols:
        cols["ts"] = [encode_ts(v) for v in cols["ts"]]
    store.insert(qualified(store, table), cols)


def seed(store, seed: int = 3) -> dict[str, list[dict[str, Any]]]:
    """Rows in every table the boards read, over [T0, T0 + 4 s)."""
    rng = np.random.default_rng(seed)
    nan = float("nan")
    reqs = []
    for b, (host, gpu) in BACKENDS.items():
        for w in range(40):
            for _ in range(int(rng.integers(0, 22))):
                cls = CLASSES[int(rng.integers(0, 3))]
                lat = float(rng.exponential(0.2)) if rng.random() > 0.03 else nan
                reqs.append({"ts": T0 + w * WNS + int(rng.integers(0, WNS)), "host": host, "backend": b, "gpu": gpu,
                             "model": "m-a" if rng.random() < 0.6 else "m-b",
                             "model_version": "v1" if rng.random() < 0.5 else "v2",
                             "modality": MODALITIES[cls], "request_class": cls,
                             "input_resolution": "1024x768" if cls != "realtime_speech" else "",
                             "latency_seconds": lat, "status": "error" if rng.random() < 0.05 else "ok",
                             "prompt_tokens": int(rng.integers(1, 500)), "image_pixels": 1024 * 768})
    _ins(store, "requests", reqs)
    gpus = []
    for host, idx, uuid in GPUS:
        for w in range(-2, 40):
            if rng.random() < 0.1 or (host == "h2" and idx == 1 and w % H2_GPU1_GAPS == 1):
                continue
            busy = host == "h1" and idx == 0 and w < 20
            gpus.append({"ts": T0 + w * WNS + int(rng.integers(0, WNS)), "host": host, "gpu": idx, "gpu_uuid": uuid,
                         "memory_used_bytes": float(rng.uniform(0, 15e9)), "memory_total_bytes": 16e9,
                         "sm_active_ratio": 0.98 if busy else float(rng.uniform(0, 0.9)),
                         "dram_active_ratio": 0.3 if busy else float(rng.uniform(0, 1)),
                         "l2_bandwidth_ratio": nan, "gpu_util_ratio": 0.9})
    _ins(store, "gpu_samples", gpus)
    serving = [{"ts": T0 + k * 500_000_000, "host": h, "backend": b, "server": "vllm", "model": "m-a",
                "queue_length": float(k % 4), "running_requests": 2.0, "kv_cache_usage_ratio": 0.1 * k,
                "requests_total": 10.0 * k, "latency_p50_seconds": 0.1, "latency_p99_seconds": 0.4,
                "ttft_p99_seconds": 0.05, "preemptions_total": float(k),
                "prefix_cache_queries_total": 100.0 * k, "prefix_cache_hits_total": 40.0 * k}
               for b, (h, _) in BACKENDS.items() for k in range(8)]
    _ins(store, "serving_metrics", serving)
    io = []
    for s in range(4):
        for op in ("read", "write"):
            io.append({"ts": T0 + s * 1_000_000_000, "host": "h1", "device": "nvme0n1", "source": "bpftrace", "op": op,
                       "window_seconds": 1.0, "ios": 500.0, "p50_seconds": 0.0002,
                       "p99_seconds": 0.002 if s < 2 else 0.0004, "mean_seconds": 0.0003,
                       "queue_depth": 100.0 if s < 2 else 4.0})
        io.append({"ts": T0 + s * 1_000_000_000, "host": "h2", "device": "sda", "source": "diskstats", "op": "all",
                   "window_seconds": 1.0, "ios": 50.0, "p50_seconds": 0.001, "p99_seconds": 0.003,
                   "mean_seconds": 0.001, "queue_depth": 2.0})
    _ins(store, "io_latency", io)
    runs = [{"run_id": "r1", "rank": r, "source_path": f"rank{r}.json", "source_bytes": 1, "host": "h1",
             "base_time_ns": T0, "time_base": "relative", "event_count": 20, "gpu_event_count": 20,
             "status": "complete", "error": "", "metadata_json": "{}"} for r in (0, 1)]
    _ins(store, "trace_runs", runs)
    events = []
    for r in (0, 1):
        for w in range(20):  # rank 0: 90% comm in the first 10 windows; rank 1 mostly compute
            comm = 90_000_000 if (r == 0 and w < 10) else 20_000_000
            events.append({"run_id": "r1", "rank": r, "kind": "kernel", "kernel_class": "comm",
                           "name": "ncclKernel_AllReduce", "device": r, "ts_ns": w * WNS, "dur_ns": comm})
            events.append({"run_id": "r1", "rank": r, "kind": "kernel", "kernel_class": "compute", "name": "gemm",
                           "device": r, "ts_ns": w * WNS + comm, "dur_ns": WNS - comm - 1_000_000})
    _ins(store, "trace_events", events)
    ops = []
    for seq in range(10):
        for r in (0, 1):
            late = 5_000_000 * (seq % 3 + 1) if r == (seq % 2) else 0
            ops.append({"ts": T0 + seq * 200_000_000 + late, "host": "h1", "run_id": "r1", "rank": r,
                        "source": "kineto", "backend": "nccl", "comm_id": "pg0", "pg_desc": "default_pg",
                        "collective": "AllReduce", "seq": seq, "is_p2p": 0, "nranks": 2, "msg_bytes": 4e6,
                        "device": r, "duration_seconds": 0.002 + 0.001 * r, "algbw_bytes_per_second": 2e9,
                        "busbw_bytes_per_second": 2e9, "state": "completed"})
    for size in (1e6, 4e6, 16e6):
        ops.append({"ts": T0 + 3_000_000_000, "host": "h1", "run_id": "nccl-tests", "rank": -1, "source": "nccl_tests",
                    "backend": "nccl", "comm_id": "", "pg_desc": "", "collective": "AllReduce", "seq": -1, "is_p2p": 0,
                    "nranks": 8, "msg_bytes": size, "device": -1, "duration_seconds": size / 1e10,
                    "algbw_bytes_per_second": 1e10, "busbw_bytes_per_second": 1.75e10, "state": ""})
    for r, state in ((0, "completed"), (1, "scheduled")):
        ops.append({"ts": T0 + 3_500_000_000, "host": "h1", "run_id": "fr1", "rank": r, "source": "flight_recorder",
                    "backend": "nccl", "comm_id": "0", "pg_desc": "default_pg", "collective": "AllReduce", "seq": 7,
                    "is_p2p": 0, "nranks": 2, "msg_bytes": 4e6, "device": r, "duration_seconds": nan,
                    "algbw_bytes_per_second": nan, "busbw_bytes_per_second": nan, "state": state})
    _ins(store, "nccl_ops", ops)
    history = []
    for k in range(20):
        for b in BACKENDS:
            drained = b == "h2:8000" and 5 <= k < 10
            history.append({"ts": T0 + k * 200_000_000, "backend": b, "weight": 0.0 if drained else 0.5 + 0.02 * k,
                            "target": 0.0 if drained else 0.6, "lb_weight": 0 if drained else 50 + 2 * k,
                            "state": "drain" if drained else "ready", "reasons": "memory" if drained else "",
                            "factor_memory": 20.0 if drained else 1.5, "factor_kv_cache": 1.1, "factor_load": 1.0,
                            "factor_latency": 2.0, "memory_used_ratio": 0.98 if drained else 0.4,
                            "kv_cache_usage_ratio": 0.3, "qps": 40.0, "input_age_seconds": 0.5, "stale": 0,
                            "version": k + 1})
    _ins(store, "weights_history", history)
    health = [{"ts": T0 + k * 500_000_000, "host": h, "backend": b, "target": f"http://{b}/metrics",
               "up": 0 if (b == "h2:8000" and k >= 6) else 1, "duration_seconds": 0.01}
              for b, (h, _) in BACKENDS.items() for k in range(8)]
    _ins(store, "scrape_health", health)
    host = [{"ts": T0 + k * 1_000_000_000, "host": h, "backend": b, "processes": 2, "window_seconds": 1.0,
             "cpu_seconds": 0.8, "wait_seconds": 0.05 * k, "rss_bytes": 2e9, "psi_cpu_some": 0.1,
             "psi_memory_some": 0.0, "psi_io_some": 0.02, "oom_kills": 0.0}
            for b, (h, _) in list(BACKENDS.items()) + [("", ("h1", 0))] for k in range(4)]
    _ins(store, "host_samples", host)
    return {"requests": reqs, "gpu_samples": gpus, "nccl_ops": ops}


@pytest.fixture(scope="module")
def seeded(store_path: Path):
    """One seeded database for the read-only tests of this module (in the session's chDB directory,
    like the ``store`` fixture; seeding once keeps the file fast)."""
    import os

    with fresh_database(store_path, f"dash{os.getpid()}") as s:
        seed(s)
        yield s


# ---------------------------------------------------------------- running a board's queries

def _ctx(variables: dict[str, Var]) -> Context:
    return Context(START, END, interval_s=1.0, variables=variables)


def resolve_variables(store, board: dict[str, Any], selected: dict[str, list[str]] | None = None
                      ) -> dict[str, Var]:
    """Run every variable's own query in order (as Grafana does) and select All or ``selected``."""
    state: dict[str, Var] = {}
    for v in board["templating"]["list"]:
        if v["type"] == "textbox":
            state[v["name"]] = Var(store.database, [store.database], multi=False)
            continue
        sql = expand(v["query"]["rawSql"], _ctx(state))
        options = [str(r[0]) for r in store.query(sql).rows]
        assert options, f"variable {v['name']} of {board['uid']} found no values: {sql}"
        pick = (selected or {}).get(v["name"])
        state[v["name"]] = Var(pick if pick else [ALL], options, multi=v["multi"])
    return state


def sql_targets(board: dict[str, Any]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    return [(p, tg) for p in board["panels"] for tg in p.get("targets", []) if "rawSql" in tg]


def run_panels(store, board: dict[str, Any], variables: dict[str, Var]) -> dict[str, Any]:
    out = {}
    for panel, target in sql_targets(board):
        sql = expand(target["rawSql"], _ctx(variables))
        out[f"{panel['title']}/{target['refId']}"] = (panel, target, store.query(sql))
    return out


def _has_value(rows: list[tuple[Any, ...]]) -> bool:
    return any(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x != 0
               for r in rows for x in r)


BOARDS = all_boards()


@pytest.mark.parametrize("name", sorted(BOARDS))
def test_every_query_returns_rows(seeded, name: str) -> None:
    store = seeded
    board = BOARDS[name]
    variables = resolve_variables(store, board)
    results = run_panels(store, board, variables)
    assert results, f"{name} has no ClickHouse panels"
    for key, (_panel, target, res) in results.items():
        assert res.rows, f"{name} / {key} returned no rows"
        assert _has_value(res.rows), f"{name} / {key}: no finite non-zero value in {res.rows[:3]}"
        if target["format"] == 0:  # time series: a time column first, ascending
            assert res.columns[0] == "time", f"{name} / {key}: first column {res.columns[0]}"
            times = [r[0] for r in res.rows]
            assert times == sorted(times), f"{name} / {key}: not ordered by time"


SELECTION = {"host": ["h1"], "gpu": ["0"], "backend": ["h1:8000", "h1:8001"], "model": ["m-a"],
             "model_version": ["v1"], "modality": ["speech", "image"], "request_class": ["realtime_speech",
                                                                                          "interactive_image_text"],
             "input_resolution": ["1024x768"], "run_id": ["r1"], "collective": ["AllReduce"], "device": ["nvme0n1"]}


@pytest.mark.parametrize("name", sorted(BOARDS))
def test_queries_with_a_selection(seeded, name: str) -> None:
    """Specific values (the ``IN (...)`` branch of every filter) still run and narrow the result."""
    store = seeded
    board = BOARDS[name]
    everything = run_panels(store, board, resolve_variables(store, board))
    chosen = resolve_variables(store, board, {k: v for k, v in SELECTION.items()})
    names = {v["name"] for v in board["templating"]["list"]}
    checked = 0
    for key, (panel, _target, res) in run_panels(store, board, chosen).items():
        assert len(res.rows) <= len(everything[key][2].rows) or panel["type"] in ("stat", "bargauge"), key
        for col, values in SELECTION.items():  # a column named like a variable holds only selected values
            if col in names and col in res.columns:
                i = res.columns.index(col)
                seen = {str(r[i]) for r in res.rows}
                assert seen <= set(values), f"{name} / {key}: {col} {seen - set(values)} not selected"
                checked += bool(seen)
    assert checked >= 2, f"{name}: no panel shows a filtered column"
    fleet_qps = [v for k, v in run_panels(store, BOARDS["fleet"], resolve_variables(
        store, BOARDS["fleet"], {"backend": ["h2:8000"]})).items() if k.startswith("Fleet QPS")][0][2]
    assert fleet_qps.rows[0][0] == pytest.approx(
        sum(1 for r in store_requests(store) if r == "h2:8000") / 11)
    # GPU 1 of h1 is named by uuid in its requests (backend h1:8001): the index selects them too
    by_gpu = [v for k, v in run_panels(store, BOARDS["fleet"], resolve_variables(
        store, BOARDS["fleet"], {"host": ["h1"], "gpu": ["1"]})).items() if k.startswith("Backends")][0][2]
    assert [r[0] for r in by_gpu.rows] == ["h1:8001"]


def test_fleet_gpu_memory_adds_up_mig_instances(store_path: Path) -> None:
    """dcgm keeps MIG instances as rows of their parent GPU: the fleet's memory panels add them up
    (an average of the instances would halve a two-instance GPU). SYNTHETIC rows."""
    from triscope.schema import GPU_SAMPLES

    gib = float(1 << 30)
    rows = [{"ts": encode_ts(T0 + k * 200_000_000), "host": "mig-node", "gpu": 0, "mig_instance": inst,
             "mig_profile": "3g.40gb", "source": "dcgm", "memory_used_bytes": used * gib,
             "memory_total_bytes": 40 * gib} for k in range(5) for inst, used in (("1", 10.0), ("2", 20.0))]
    rows += [{"ts": encode_ts(T0 + k * 200_000_000), "host": "mig-node", "gpu": 1, "source": "dcgm",
              "memory_used_bytes": 8 * gib, "memory_total_bytes": 80 * gib} for k in range(5)]
    with fresh_database(store_path, "dashmig") as store:
        store.insert(qualified(store, GPU_SAMPLES), GPU_SAMPLES.columns_of(rows))
        variables = {v["name"]: (Var(store.database, [store.database], multi=False) if v["type"] == "textbox"
                                 else Var([ALL], ["__none__"])) for v in BOARDS["fleet"]["templating"]["list"]}
        variables["host"], variables["gpu"] = Var([ALL], ["mig-node"]), Var([ALL], ["0", "1"])
        got = {}
        for panel, target in sql_targets(BOARDS["fleet"]):
            if panel["title"] in ("GPU memory used", "GPU memory used / total"):
                res = store.query(expand(target["rawSql"], _ctx(variables)))
                got[panel["title"]] = {(r[1], r[2]): r[3] for r in res.rows}
    assert got["GPU memory used"] == {("mig-node", "0"): 30 * gib, ("mig-node", "1"): 8 * gib}
    assert got["GPU memory used / total"] == {("mig-node", "0"): pytest.approx(30 / 80),
                                              ("mig-node", "1"): pytest.approx(0.1)}


def test_prefix_cache_hit_rate_is_hits_over_lookups_per_interval(seeded) -> None:
    """The seeded engines find 40 of every 100 looked-up tokens cached: 0.4 in every interval, per backend."""
    variables = resolve_variables(seeded, BOARDS["fleet"])
    (key,) = [k for k in run_panels(seeded, BOARDS["fleet"], variables) if k.startswith("Prefix-cache hit rate")]
    res = run_panels(seeded, BOARDS["fleet"], variables)[key][2]
    assert res.rows and all(r[2] == pytest.approx(0.4) for r in res.rows), res.rows[:5]

def store_requests(store) -> list[str]:
    return [r[0] for r in store.query(f"SELECT backend FROM {qualified(store, 'requests')}").rows]


# ---------------------------------------------------------------- agreement with the analyzers

def test_heatmap_panels_match_the_analyzer(seeded) -> None:
    """The heatmap board's slices equal triscope.analyzers.heatmap's tensor over the same range."""
    from triscope.analyzers.heatmap import HeatmapSpec, compute_heatmap
    from triscope.dashboards.heatmap import slice_sql

    store = seeded
    spec = HeatmapSpec()
    board = BOARDS["heatmap"]
    variables = resolve_variables(store, board)
    result = compute_heatmap(store, spec, int(START.timestamp()) * 10**9, int(END.timestamp()) * 10**9 + 1)
    assert result.requests > 100 and result.unmatched > 0
    assert _whole_host_rules_differ(store, spec) > 0
    widths = {"qps": spec.qps_bin, "memory": spec.memory_bin_bytes, "latency": spec.latency_bin_s}
    for x, y in (("qps", "latency"), ("memory", "latency"), ("qps", "memory")):
        rows = store.query(expand(slice_sql(x, y), _ctx(variables))).rows
        got = np.zeros(result.slice((x, y)).shape, dtype=np.uint64)
        for xv, yv, n in rows:
            got[int(round(xv / widths[x])), int(round(yv / widths[y]))] += n
        np.testing.assert_array_equal(got, result.slice((x, y)), err_msg=f"{x} x {y}")
    unmatched = [v for k, v in run_panels(store, board, variables).items() if k.startswith("Requests without")][0]
    assert unmatched[2].rows[0][0] == result.unmatched
    # the model variable picks the requests counted, not the backend's load (the analyzer's --model)
    only_a = resolve_variables(store, board, {"model": ["m-a"]})
    rows = store.query(expand(slice_sql("qps", "latency"), _ctx(only_a))).rows
    ref = compute_heatmap(store, spec, result.start_ns, result.end_ns, models=["m-a"]).slice(("qps", "latency"))
    got = np.zeros(ref.shape, dtype=np.uint64)
    for xv, yv, n in rows:
        got[int(round(xv / spec.qps_bin)), int(round(yv / spec.latency_bin_s))] += n
    np.testing.assert_array_equal(got, ref)


def _whole_host_rules_differ(store, spec) -> int:
    """Windows of h2:8000 (empty ``gpu``: the whole host) whose memory bin under the analyzer's rule
    (each GPU's latest window mean within ``memory_max_age_s``) differs from the old rule (the sum
    over the GPUs that reported in that window): the seed must tell the two apart."""
    means: dict[int, dict[int, float]] = {}
    for gpu, w, used in store.query(
            f"SELECT gpu, intDiv(toUnixTimestamp64Nano(ts), {WNS}) AS w, avg(memory_used_bytes) "
            f"FROM {qualified(store, 'gpu_samples')} WHERE host = 'h2' GROUP BY gpu, w").rows:
        means.setdefault(int(gpu), {})[int(w)] = float(used)
    windows = {int(r[0]) for r in store.query(
        f"SELECT DISTINCT intDiv(toUnixTimestamp64Nano(ts), {WNS}) FROM {qualified(store, 'requests')} "
        "WHERE backend = 'h2:8000'").rows}
    max_age_w = int(spec.memory_max_age_s * 1e9) // WNS
    mbin = lambda used: min(int(used // spec.memory_bin_bytes), spec.memory_bins - 1)  # noqa: E731
    differ = 0
    for w in windows:
        if not any(w in by_w for by_w in means.values()):
            continue  # no window of its own: both rules take an earlier one
        old = sum(by_w[w] for by_w in means.values() if w in by_w)
        new = sum(by_w[max(k for k in by_w if k <= w)] for by_w in means.values()
                  if any(w - max_age_w <= k <= w for k in by_w))
        differ += mbin(old) != mbin(new)
    return differ


def test_stragglers_match_the_analyzer(seeded) -> None:
    from triscope.analyzers.nccl_crossrank import stragglers
    from triscope.dashboards.nccl import stragglers_sql

    store = seeded
    variables = resolve_variables(store, BOARDS["nccl"])
    res = store.query(expand(stragglers_sql(), _ctx(variables)))
    got = {(r["run_id"], r["rank"]): r for r in res.dicts()}
    want = stragglers(store, start_ns=int(START.timestamp()) * 10**9,
                      end_ns=int(END.timestamp()) * 10**9 + 1).by_rank()
    assert want and len(got) == len(want)
    for w in want:
        g = got[(w["run_id"], w["rank"])]
        assert g["times_last"] == w["times_last"]
        assert g["total_lateness_seconds"] == pytest.approx(w["total_lateness_seconds"])
        assert g["max_lateness_seconds"] == pytest.approx(w["max_lateness_seconds"])


def test_stall_shares_follow_the_rules(seeded) -> None:
    """Seeded: h1 GPU 0 compute-bound in its first 20 windows; nvme0n1 IO-bound for 2 s; rank 0 90% comm
    in 10 of its 20 traced windows."""
    store = seeded
    board = BOARDS["stalls"]
    res = [v for k, v in run_panels(store, board, resolve_variables(store, board)).items()
           if k.startswith("Ranks by comm")][0][2].dicts()
    by_rank = {r["rank"]: r for r in res}
    assert by_rank[0]["comm_bound_share"] == pytest.approx(0.5)
    assert by_rank[1]["comm_bound_share"] == 0
    assert by_rank[0]["mean_comm_share"] == pytest.approx((10 * 0.9 + 10 * 0.2) / 20)
    gpus = [v for k, v in run_panels(store, board, resolve_variables(store, board, {"host": ["h1"], "gpu": ["0"]})
                                     ).items() if k.startswith("GPUs by")][0][2].dicts()
    assert [(g["host"], g["gpu"]) for g in gpus] == [("h1", "0")]
    windows = store.query(f"SELECT uniqExact(intDiv(toUnixTimestamp64Nano(ts), {WNS})) FROM "
                          f"{qualified(store, 'gpu_samples')} WHERE host = 'h1' AND gpu = 0").scalar()
    busy = store.query(f"SELECT uniqExact(intDiv(toUnixTimestamp64Nano(ts), {WNS})) FROM "
                       f"{qualified(store, 'gpu_samples')} WHERE host = 'h1' AND gpu = 0 AND sm_active_ratio > 0.95"
                       ).scalar()
    assert gpus[0]["compute_bound_share"] == pytest.approx(busy / windows)
    # IO: h1's GPU windows in [T0, T0 + 2 s) are IO-bound, later ones are not
    io = [v for k, v in run_panels(store, board, resolve_variables(store, board, {"host": ["h1"]})).items()
          if k.startswith("IO-bound share")][0][2].rows
    assert [r[2] for r in io if r[1] == "h1"][:4] == [1, 1, 0, 0]


# ---------------------------------------------------------------- the macro expander

def test_macros_expand_like_the_plugin() -> None:
    start, end = datetime(2026, 1, 1, 0, 0, 0, tzinfo=UTC), datetime(2026, 1, 1, 1, 0, 0, 500000, tzinfo=UTC)
    ctx = Context(start, end, interval_s=0.2, variables={
        "host": Var(["a", "o'b"], ["a", "o'b", "c"]), "gpu": Var([ALL], ["0", "1"]),
        "one": Var("x", ["x"], multi=False), "database": Var("db", ["db"], multi=False)})
    assert expand("$__timeFilter(ts)", ctx) == "ts >= toDateTime(1767225600) AND ts <= toDateTime(1767229200)"
    assert expand("$__timeFilter_ms(ts)", ctx) == ("ts >= fromUnixTimestamp64Milli(1767225600000) AND "
                                                   "ts <= fromUnixTimestamp64Milli(1767229200500)")
    assert expand("$__fromTime|$__toTime|$__interval_s", ctx) == "toDateTime(1767225600)|toDateTime(1767229200)|1"
    assert expand("$__timeInterval(ts)", ctx) == "toStartOfInterval(toDateTime(ts), INTERVAL 1 second)"
    assert expand("$__timeInterval_ms(ts)", ctx) == "toStartOfInterval(toDateTime64(ts, 3), INTERVAL 200 millisecond)"
    assert expand("$__dateFilter(d)", ctx) == "d >= toDate('2026-01-01') AND d <= toDate('2026-01-01')"
    assert expand("${host:singlequote}|$host|${host:sqlstring}|$one|${database}.t", ctx) == \
        "'a','o\\'b'|'a','o'b'|'a','o''b'|x|db.t"
    # All without a custom all-value stands for every option; conditionalAll drops the condition
    assert expand("${gpu:singlequote}", ctx) == "'0','1'"
    assert expand("$__conditionalAll(gpu IN (${gpu:singlequote}), $gpu) AND "
                  "$__conditionalAll(host IN (${host:singlequote}), $host)", ctx) == "1=1 AND host IN ('a','o\\'b')"
    assert expand("$__conditionalAll(f(a, g(b, c)), ${gpu})", ctx) == "1=1"
    assert expand("${host:regex}", ctx) == "(a|o'b)"
    assert expand("$__from $__to $unknown_var", ctx) == "1767225600000 1767229200500 $unknown_var"
    assert expand("$__interval|$__interval_ms", ctx) == "200ms|200"
    assert expand("$__interval", Context(start, end, interval_s=120)) == "2m"
    assert macros.referenced_variables("$__timeFilter(ts) AND ${host:singlequote} $gpu [[one]]") == {
        "host", "gpu", "one"}
    for bad in ("$__timeFilter()", "$__timeFilter(a, b)", "$__nosuchmacro(ts)", "$__conditionalAll(x)",
                "$__timeInterval(ts"):
        with pytest.raises(MacroError):
            expand(bad, ctx)


def test_macro_output_runs_in_clickhouse(store) -> None:
    """Time filters of the plugin's forms select exactly the rows in [from, to] (second resolution)."""
    seed(store)
    ctx = Context(datetime.fromtimestamp(T0_S, UTC), datetime.fromtimestamp(T0_S + 2, UTC), interval_s=1.0,
                  variables={"database": Var(store.database, multi=False)})
    n = store.query(expand("SELECT count() FROM ${database}.io_latency WHERE $__timeFilter(ts)", ctx)).scalar()
    assert n == 9  # rows at T0, T0 + 1 s and T0 + 2 s (3 per second)
    n_ms = store.query(expand("SELECT count() FROM ${database}.io_latency WHERE $__timeFilter_ms(ts)", ctx)).scalar()
    assert n_ms == n
    buckets = store.query(expand("SELECT $__timeInterval(ts) AS t, count() FROM ${database}.io_latency "
                                 "WHERE $__timeFilter(ts) GROUP BY t ORDER BY t", ctx)).rows
    assert [c for _, c in buckets] == [3, 3, 3]


# ---------------------------------------------------------------- dashboard JSON

def _provisioned() -> dict[str, str]:
    doc = yaml.safe_load((PROVISIONING / "datasources" / "triscope.yaml").read_text())
    return {d["uid"]: d["type"] for d in doc["datasources"]}


def _datasource_refs(node: Any) -> list[dict[str, Any]]:
    out = []
    if isinstance(node, dict):
        ds = node.get("datasource")
        if isinstance(ds, dict):
            out.append(ds)
        for v in node.values():
            out += _datasource_refs(v)
    elif isinstance(node, list):
        for v in node:
            out += _datasource_refs(v)
    return out


def _queries(board: dict[str, Any]) -> list[str]:
    out = [tg.get("rawSql") or tg.get("expr", "") for p in board["panels"] for tg in p.get("targets", [])]
    return out + [v["query"]["rawSql"] for v in board["templating"]["list"] if v["type"] == "query"]


@pytest.mark.parametrize("name", sorted(BOARDS))
def test_board_json_is_valid(name: str) -> None:
    board = BOARDS[name]
    assert board["schemaVersion"] >= 36 and board["uid"].startswith("triscope-") and len(board["uid"]) <= 40
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids)) and all(isinstance(i, int) for i in ids)
    cells: set[tuple[int, int]] = set()
    for p in board["panels"]:
        g = p["gridPos"]
        assert set(g) == {"h", "w", "x", "y"} and g["w"] > 0 and g["h"] > 0 and g["x"] + g["w"] <= 24, p["title"]
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not (cells & mine), f"{p['title']} overlaps another panel"
        cells |= mine
        if p["type"] not in ("row", "text"):
            assert p["targets"] and p.get("description"), p["title"]
            assert {t["refId"] for t in p["targets"]} == {chr(65 + i) for i in range(len(p["targets"]))}
    provisioned = _provisioned()
    for ds in _datasource_refs(board):
        if ds.get("type") == "grafana":
            continue
        assert provisioned.get(ds["uid"]) == ds["type"], f"datasource {ds} is not provisioned"
    names = {v["name"] for v in board["templating"]["list"]}
    multi = {v["name"] for v in board["templating"]["list"] if v.get("multi")}
    order = [v["name"] for v in board["templating"]["list"]]
    for q in _queries(board):
        used = macros.referenced_variables(q)
        assert used <= names, f"undefined variables {used - names} in {q[:80]}"
        for m in re.finditer(r"\$\{?(\w+)(?::(\w+))?\}?", q):
            if m.group(1) in multi and not q[max(0, m.start() - 2):m.start()].endswith(", "):
                assert m.group(2) in ("singlequote", "regex"), f"${m.group(1)} unquoted in {q[:100]}"
    for i, v in enumerate(board["templating"]["list"]):  # a variable only depends on earlier ones
        if v["type"] == "query":
            assert macros.referenced_variables(v["query"]["rawSql"]) <= set(order[:i]), v["name"]
    for target in sql_targets(board):
        assert target[1]["editorType"] == "sql" and target[1]["format"] in (0, 1)


def _plugin_reads_as_v3(target: dict[str, Any]) -> bool:
    """grafana/clickhouse-datasource v4.20.0 src/data/migration.ts ``isV3CHQuery``, in Python: such a
    target is migrated when the board opens (a changed query: Grafana marks the board modified)."""
    version = tuple(int(x) for x in str(target.get("pluginVersion") or "0").split("-")[0].split(".")[:3])
    return version < (4, 0, 0) or target.get("queryType") in ("sql", "builder")


def test_targets_are_v4_queries_of_the_provisioned_plugin() -> None:
    """Targets carry the pluginVersion compose installs; variables use the v4 variable model."""
    compose = yaml.safe_load((REPO / "compose" / "compose.yaml").read_text())
    plugin, version = compose["services"]["grafana"]["environment"]["GF_INSTALL_PLUGINS"].split()
    assert (plugin, version) == ("grafana-clickhouse-datasource", CLICKHOUSE_PLUGIN_VERSION)
    checked = 0
    for board in BOARDS.values():
        for panel, target in sql_targets(board):
            assert target["pluginVersion"] == version and not _plugin_reads_as_v3(target), panel["title"]
            assert target["queryType"] == ("table" if target["format"] == 1 else "timeseries"), panel["title"]
            checked += 1
        for v in board["templating"]["list"]:
            if v["type"] == "query":
                assert v["query"] == {"queryType": "sql", "rawSql": v["definition"], "refId": "var"}, v["name"]
    assert checked > 30
    assert _plugin_reads_as_v3({"editorType": "sql", "rawSql": "SELECT 1", "queryType": "table"})  # the old shape


def test_links_point_at_existing_boards_and_variables() -> None:
    by_uid = {b["uid"]: b for b in BOARDS.values()}
    found = 0
    for board in BOARDS.values():
        for link in _links(board):
            m = re.fullmatch(r"/d/([\w-]+)\?(.*)", link["url"])
            assert m, link
            target = by_uid[m.group(1)]
            names = {v["name"] for v in target["templating"]["list"]}
            for var in re.findall(r"var-(\w+)=", m.group(2)) + re.findall(r"\$\{(\w+):queryparam\}", m.group(2)):
                assert var in names, f"{board['uid']} links to {target['uid']} with unknown variable {var}"
            assert "${__url_time_range}" in link["url"]
            found += 1
    assert found >= 20
    wanted = {"host", "gpu", "model_version", "modality", "input_resolution", "request_class"}
    linked = {v for b in BOARDS.values() for lk in _links(b) for v in re.findall(r"var-(\w+)=", lk["url"])}
    assert wanted <= linked


def _links(node: Any) -> list[dict[str, Any]]:
    out = []
    if isinstance(node, dict):
        for key, v in node.items():
            if key == "links" and isinstance(v, list):
                out += [lk for lk in v if isinstance(lk, dict) and "url" in lk]
            elif key == "value" and isinstance(v, list) and v and isinstance(v[0], dict) and "url" in v[0]:
                out += v
            else:
                out += _links(v)
    elif isinstance(node, list):
        for v in node:
            out += _links(v)
    return out


def test_boards_cover_the_issue() -> None:
    kinds = {name: {p["type"] for p in b["panels"]} for name, b in BOARDS.items()}
    assert "heatmap" in kinds["heatmap"] and "bargauge" in kinds["stalls"]
    titles = {p["title"] for b in BOARDS.values() for p in b["panels"]}
    for t in ("QPS per backend", "GPU memory used", "P99 latency per backend", "QPS x latency",
              "Stall shares over the range", "Bus bandwidth by collective", "Straggler ranks", "Read p99",
              "Write p99", "Queue depth",
              "Weight per backend", "P99 priority weight per request class"):
        assert t in titles
    prom = [tg for b in BOARDS.values() for p in b["panels"] for tg in p.get("targets", []) if "expr" in tg]
    assert len(prom) >= 6


def test_prometheus_expressions_parse(tmp_path: Path) -> None:
    """Every PromQL target, with Grafana's variables filled in, passes ``promtool check rules``."""
    promtool = require_binary("promtool")
    ctx = Context(START, END, variables={"backend": Var([ALL], ["h1:8000", "h2:8000"])})
    exprs = [tg["expr"] for b in BOARDS.values() for p in b["panels"] for tg in p.get("targets", []) if "expr" in tg]
    rules = {"groups": [{"name": "dashboards", "rules": [
        {"record": f"triscope:dashboard_expr_{i}", "expr": macros.interpolate(e, ctx).replace("$__rate_interval", "1m")}
        for i, e in enumerate(exprs)]}]}
    path = tmp_path / "rules.yml"
    path.write_text(yaml.safe_dump(rules))
    proc = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


# ---------------------------------------------------------------- generated files and provisioning

def test_generated_json_is_up_to_date() -> None:
    """dashboards/json is what the generator writes (run `triscope dashboards build` after a change)."""
    assert stale_files(DEFAULT_OUT) == []
    assert sorted(p.name for p in DEFAULT_OUT.glob("*.json")) == sorted(expected_files())
    for name, text in expected_files().items():
        assert json.loads(text)["uid"] == "triscope-" + name.removesuffix(".json")


def test_build_command_writes_and_checks(tmp_path: Path) -> None:
    out = tmp_path / "boards"
    cmd = [sys.executable, "-m", "triscope", "dashboards", "build", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in out.glob("*.json")) == sorted(expected_files())
    assert subprocess.run(cmd + ["--check"], capture_output=True, timeout=120).returncode == 0
    (out / "io.json").write_text("{}")
    (out / "old.json").write_text("{}")
    proc = subprocess.run(cmd + ["--check", "--json"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and json.loads(proc.stdout)["stale"] == ["io.json", "old.json"]
    write(out)
    assert stale_files(out) == [] and not (out / "old.json").exists()


def _same(value: Any) -> Any:
    """A cell as both stores can agree on: floats to 7 significant digits, times as epoch seconds, the rest as text."""
    import datetime as dt

    if isinstance(value, (list, tuple)):
        return [_same(v) for v in value]
    if value is None or (isinstance(value, float) and value != value):  # JSON writes NaN as null
        return "nan"
    if isinstance(value, dt.datetime):
        return round(value.replace(tzinfo=value.tzinfo or dt.UTC).timestamp(), 6)
    if isinstance(value, bool | int | float):  # Float32 columns read back as their exact binary value over Native
        return float(f"{float(value):.7g}")
    text = str(value)
    try:
        return round(float(text), 9)
    except ValueError:
        pass
    if re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d(\.\d+)?", text):
        head, _, frac = text.partition(".")
        return round(dt.datetime.fromisoformat(head).replace(tzinfo=dt.UTC).timestamp() + float(f"0.{frac or 0}"), 6)
    return text


def test_every_board_answers_through_the_daemon_s_query_endpoint(seeded) -> None:
    """Grafana on one machine: every panel's SQL through the daemon's endpoint (clickhouse-connect, as the
    CLI uses it) gives the rows the store opened directly gives."""
    from triscope.query_endpoint import QueryConfig, QueryEndpoint
    from triscope.store.server import ServerStore

    ep = QueryEndpoint(seeded, QueryConfig.from_config({"query": {"port": 0}})).start()
    remote = ServerStore(ep.url, database=seeded.database, username=ep.username, password=ep.token,
                         create_database=False)
    try:
        compared = 0
        for name, board in BOARDS.items():
            variables = resolve_variables(seeded, board)
            direct, served = run_panels(seeded, board, variables), run_panels(remote, board, variables)
            for key, (_, _, result) in direct.items():
                got = served[key][2]
                assert got.columns == result.columns, (name, key)
                assert [_same(r) for r in got.rows] == [_same(r) for r in result.rows], (name, key)
                compared += 1
        assert compared > 30
    finally:
        remote.close()
        ep.close()


def test_provisioning_yaml() -> None:
    embedded_file = PROVISIONING.parent / "provisioning-embedded" / "datasources" / "triscope.yaml"
    embedded = yaml.safe_load(embedded_file.read_text())
    (ch,) = [d for d in embedded["datasources"] if d["type"] == "grafana-clickhouse-datasource"]
    assert ch["uid"] == "triscope-clickhouse" and ch["jsonData"]["protocol"] == "http"
    assert ch["secureJsonData"]["password"] == "${TRISCOPE_QUERY_PASSWORD}"
    ds = yaml.safe_load((PROVISIONING / "datasources" / "triscope.yaml").read_text())
    assert ds["apiVersion"] == 1
    types = {d["type"] for d in ds["datasources"]}
    assert types == {"grafana-clickhouse-datasource", "prometheus"}
    for d in ds["datasources"]:
        for key, value in (d.get("secureJsonData") or {}).items():
            assert re.fullmatch(r"\$\{[A-Z_]+\}", str(value)), f"{d['name']}.{key} must come from the environment"
        assert "password" not in d and "basicAuthPassword" not in d
    prov = yaml.safe_load((PROVISIONING / "dashboards" / "triscope.yaml").read_text())
    (provider,) = prov["providers"]
    assert provider["type"] == "file" and provider["folder"] == "triscope" and provider["folderUid"] == "triscope"
    # compose mounts dashboards/json at this path
    assert provider["options"]["path"] == "/var/lib/grafana/dashboards"
    assert DEFAULT_OUT == REPO / "dashboards" / "json"
    # and the compose stack mounts the generated folder and the provisioning folder there
    compose = yaml.safe_load((REPO / "compose" / "compose.yaml").read_text())
    mounts = {}
    for vol in compose["services"]["grafana"]["volumes"]:
        src, _, rest = vol.partition(":")
        mounts[rest.split(":")[0]] = (REPO / "compose" / src).resolve()
    assert mounts["/var/lib/grafana/dashboards"] == DEFAULT_OUT
    assert mounts["/etc/grafana/provisioning"] == PROVISIONING


# ---------------------------------------------------------------- push

class _Grafana(BaseHTTPRequestHandler):
    """Records Grafana HTTP API calls; knows folders it was asked to create (not a Grafana)."""

    calls: list[dict[str, Any]] = []
    folders: set[str] = set()
    status = 200

    def _reply(self, code: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _record(self) -> dict[str, Any]:
        length = min(int(self.headers.get("Content-Length") or 0), 8 << 20)
        body = json.loads(self.rfile.read(length)) if length else None
        call = {"method": self.command, "path": self.path, "auth": self.headers.get("Authorization"), "body": body}
        self.calls.append(call)
        return call

    def do_GET(self) -> None:
        self._record()
        if self.status != 200:
            return self._reply(self.status, {"message": "invalid API key"})
        uid = self.path.rsplit("/", 1)[-1]
        if self.path.startswith("/api/folders/") and uid in self.folders:
            return self._reply(200, {"uid": uid, "title": "triscope", "id": 7})
        return self._reply(404, {"message": "folder not found"})

    def do_POST(self) -> None:
        call = self._record()
        if self.status != 200:
            return self._reply(self.status, {"message": "invalid API key"})
        if self.path == "/api/folders":
            self.folders.add(call["body"]["uid"])
            return self._reply(200, {"uid": call["body"]["uid"], "title": call["body"]["title"], "id": 7})
        if self.path == "/api/dashboards/db":
            uid = call["body"]["dashboard"]["uid"]
            return self._reply(200, {"uid": uid, "url": f"/d/{uid}/x", "version": 1, "status": "success", "id": 1})
        return self._reply(404, {"message": "not found"})

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture()
def grafana():
    _Grafana.calls, _Grafana.folders, _Grafana.status = [], set(), 200
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Grafana)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_push_creates_the_folder_and_saves_every_board(grafana: str) -> None:
    from triscope.dashboards.push import push

    pushed = push(grafana, "tok-123")
    calls = _Grafana.calls
    assert [(c["method"], c["path"]) for c in calls[:2]] == [("GET", "/api/folders/triscope"), ("POST", "/api/folders")]
    assert calls[1]["body"] == {"title": "triscope", "uid": "triscope"}
    saves = [c for c in calls if c["path"] == "/api/dashboards/db"]
    assert len(saves) == len(BOARDS) == len(pushed)
    for c in saves:
        assert c["method"] == "POST" and c["auth"] == "Bearer tok-123"
        body = c["body"]
        assert body["overwrite"] is True and body["folderUid"] == "triscope" and body["dashboard"]["id"] is None
        want = BOARDS[body["dashboard"]["uid"].removeprefix("triscope-")]
        assert body["dashboard"] == want
    assert {p.uid for p in pushed} == {b["uid"] for b in BOARDS.values()} and all(p.version == 1 for p in pushed)
    # second push: the folder exists, nothing is created again
    _Grafana.calls.clear()
    push(grafana, ("admin", "s3cret"), boards={"io": BOARDS["io"]})
    assert [(c["method"], c["path"]) for c in _Grafana.calls] == [("GET", "/api/folders/triscope"),
                                                                   ("POST", "/api/dashboards/db")]
    assert _Grafana.calls[0]["auth"].startswith("Basic ")


def test_push_cli_errors_are_one_line(grafana: str, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    from triscope.cli import main

    monkeypatch.delenv("GRAFANA_TOKEN", raising=False)
    monkeypatch.delenv("GRAFANA_BASIC_AUTH", raising=False)
    assert main(["dashboards", "push", "--url", grafana]) == 2
    assert "no Grafana credentials" in capsys.readouterr().err and not _Grafana.calls
    monkeypatch.setenv("GRAFANA_TOKEN", "bad")
    _Grafana.status = 401
    assert main(["dashboards", "push", "--url", grafana]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("triscope: error: Grafana at") and "Unauthorized" in err and "\n" not in err
    port = free_port()
    assert main(["dashboards", "push", "--url", f"http://127.0.0.1:{port}", "--timeout", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"triscope: error: Grafana at http://127.0.0.1:{port} is unreachable") and "\n" not in err
    assert main(["dashboards", "push", "--url", "http://u:p@127.0.0.1:1"]) == 2
    assert "must not carry credentials" in capsys.readouterr().err
    _Grafana.status = 200
    assert main(["dashboards", "push", "--url", grafana, "--folder", "GPU fleet", "--folder-uid", "gpu-fleet",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["folder_uid"] == "gpu-fleet" and len(out["dashboards"]) == len(BOARDS)
    assert _Grafana.calls[-1]["body"]["folderUid"] == "gpu-fleet"


def test_weights_history_panels(seeded) -> None:
    store = seeded
    board = BOARDS["weights"]
    results = run_panels(store, board, resolve_variables(store, board))
    drains = [v for k, v in results.items() if k.startswith("Down, drained")][0][2].dicts()
    assert [(d["backend"], d["state"], d["reasons"], d["updates"], d["last_version"]) for d in drains] == [
        ("h2:8000", "drain", "memory", 5, 10)]
    weights = [v for k, v in results.items() if k.startswith("Weight and target")][0][2].dicts()
    h2 = {str(r["time"]): r["weight"] for r in weights if r["backend"] == "h2:8000"}
    assert h2["2026-01-01 00:00:01"] == 0.0  # updates 5..9 (T0 + 1.0 s .. 1.8 s): drained
    assert h2["2026-01-01 00:00:02"] == pytest.approx(0.5 + 0.02 * 12, abs=1e-9)


def _grouping_to_matrix(rows: list[tuple[Any, ...]]) -> tuple[list[Any], list[Any], dict[tuple[Any, Any], Any]]:
    """Grafana's 'grouping to matrix' (row field xMin, column field yMin): both in first-appearance order."""
    xs, ys, cells = list(dict.fromkeys(r[0] for r in rows)), list(dict.fromkeys(r[1] for r in rows)), {}
    for x, y, n in rows:
        cells[(x, y)] = n
    return xs, ys, cells


def test_heatmap_panels_give_grafana_a_rows_frame(seeded) -> None:
    """What the heatmap panel needs after the pivot: x ascending; with a numeric x the y fields already in
    ascending order (Grafana sorts them only when x is time); bucket names without float noise."""
    store = seeded
    board = BOARDS["heatmap"]
    variables = resolve_variables(store, board)
    panels = [p for p in board["panels"] if p["type"] == "heatmap"]
    assert len(panels) == 6
    for p in panels:
        assert p["transformations"] == [{"id": "groupingToMatrix", "options": {
            "columnField": "yMin", "rowField": "xMin", "valueField": "count", "emptyValue": "zero"}}]
        assert p["options"]["calculate"] is False and p["options"]["rowsFrame"]["layout"] == "ge"
        res = store.query(expand(p["targets"][0]["rawSql"], _ctx(variables)))
        assert res.columns == ["xMin", "yMin", "count"], p["title"]
        xs, ys, cells = _grouping_to_matrix(res.rows)
        assert xs == sorted(xs) and len(xs) > 1, p["title"]
        assert all(len(str(float(y))) <= 14 for y in ys), f"{p['title']}: noisy bucket names {ys[:5]}"
        if isinstance(xs[0], (int, float)):
            assert ys == sorted(ys), f"{p['title']}: y buckets out of order"
            assert len(cells) == len(xs) * len(ys), f"{p['title']}: not a complete grid"
            assert len(ys) in (SPEC_BINS["latency"], SPEC_BINS["memory"]), p["title"]
        assert sum(n for n in cells.values()) > 0


SPEC_BINS = {"latency": 128, "memory": 64, "qps": 32}
