"""Grafana boards (triscope.dashboards): every query runs on the real engine, the JSON is valid.

Each panel's and each variable's SQL goes through triscope.dashboards.macros (the ClickHouse
plugin's macros and Grafana's variable interpolation) and then runs in chDB (the ``store``
fixture) on data seeded into every table the boards read. Grafana itself cannot be installed
here, so ``dashboards push`` is checked against a small local HTTP server that records the
Grafana API calls it receives (a stand-in for the Grafana HTTP API, the network boundary).
"""

from __future__ import annotations

import math
from datetime import UTC, datetime
from typing import Any

import numpy as np
import pytest

from tests.conftest import REPO
from triscope.collectors.nccl_common import ns_text
from triscope.dashboards.boards import all_boards
from triscope.dashboards.macros import ALL, Context, Var, expand
from triscope.schema import qualified

T0_S = 1_767_225_600  # 2026-01-01T00:00:00Z
T0 = T0_S * 1_000_000_000
WNS = 100_000_000
START = datetime.fromtimestamp(T0_S - 1, UTC)
END = datetime.fromtimestamp(T0_S + 10, UTC)
PROVISIONING = REPO / "dashboards" / "provisioning"

BACKENDS = {"h1:8000": ("h1", "0"), "h1:8001": ("h1", "GPU-h1-1"), "h2:8000": ("h2", ""), "h3:8000": ("h3", "0")}
GPUS = [("h1", 0, "GPU-h1-0"), ("h1", 1, "GPU-h1-1"), ("h2", 0, "GPU-h2-0")]
CLASSES = ["realtime_speech", "interactive_image_text", "offline_video"]
MODALITIES = {"realtime_speech": "speech", "interactive_image_text": "image", "offline_video": "video"}


def _ins(store, table: str, rows: list[dict[str, Any]]) -> None:  # noqa: ANN001
    cols = {k: [r[k] for r in rows] for k in rows[0]}
    if "ts" in cols:
        cols["ts"] = [ns_text(v) for v in cols["ts"]]
    store.insert(qualified(store, table), cols)


def seed(store, seed: int = 3) -> dict[str, list[dict[str, Any]]]:  # noqa: ANN001
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
            if rng.random() < 0.1:
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
                "ttft_p99_seconds": 0.05} for b, (h, _) in BACKENDS.items() for k in range(8)]
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
    return {"requests": reqs, "gpu_samples": gpus, "nccl_ops": ops}


# ---------------------------------------------------------------- running a board's queries

def _ctx(variables: dict[str, Var]) -> Context:
    return Context(START, END, interval_s=1.0, variables=variables)


def resolve_variables(store, board: dict[str, Any], selected: dict[str, list[str]] | None = None  # noqa: ANN001
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


def run_panels(store, board: dict[str, Any], variables: dict[str, Var]) -> dict[str, Any]:  # noqa: ANN001
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
def test_every_query_returns_rows(store, name: str) -> None:  # noqa: ANN001
    seed(store)
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
def test_queries_with_a_selection(store, name: str) -> None:  # noqa: ANN001
    """Specific values (the ``IN (...)`` branch of every filter) still run and narrow the result."""
    seed(store)
    board = BOARDS[name]
    everything = run_panels(store, board, resolve_variables(store, board))
    chosen = resolve_variables(store, board, {k: v for k, v in SELECTION.items()})
    for key, (panel, _target, res) in run_panels(store, board, chosen).items():
        assert len(res.rows) <= len(everything[key][2].rows) or panel["type"] in ("stat", "bargauge"), key
    fleet_qps = [v for k, v in run_panels(store, BOARDS["fleet"], resolve_variables(
        store, BOARDS["fleet"], {"backend": ["h2:8000"]})).items() if k.startswith("Fleet QPS")][0][2]
    assert fleet_qps.rows[0][0] == pytest.approx(
        sum(1 for r in store_requests(store) if r == "h2:8000") / 11)


def store_requests(store) -> list[str]:  # noqa: ANN001
    return [r[0] for r in store.query(f"SELECT backend FROM {qualified(store, 'requests')}").rows]
