"""NCCL sources: Inspector (JSONL + Prometheus), Flight Recorder (pickle/JSON), nccl-tests, bus factors."""

from __future__ import annotations

import json
import math
import os
import pickle
from pathlib import Path

import pytest
from conftest import shared_data

from triscope.collectors.nccl import flight_recorder as nccl_flight_recorder
from triscope.collectors.nccl import inspector as nccl_inspector
from triscope.collectors.nccl import tests_output as nccl_tests
from triscope.collectors.nccl.common import bus_factor, canonical_collective, dtype_bytes
from triscope.collectors.nccl.ingest import detect_format, ingest_path
from triscope.errors import InputError
from triscope.schema import encode_ts, qualified


def test_bus_factors_follow_nccl_tests() -> None:
    assert bus_factor("AllReduce", 8) == pytest.approx(2 * 7 / 8)
    for coll in ("ReduceScatter", "AllGather", "AllToAll"):
        assert bus_factor(coll, 16) == pytest.approx(15 / 16)
    for coll in ("Broadcast", "Reduce", "SendRecv"):
        assert bus_factor(coll, 4) == 1.0
    assert math.isnan(bus_factor("AllReduce", -1))


def test_collective_names_of_every_spelling() -> None:
    assert canonical_collective(
        "ncclKernel_AllReduce_RING_LL_Sum_float(ncclDevComm*, unsigned long, ncclWork*)") == "AllReduce"
    assert canonical_collective("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)") == "AllGather"
    assert canonical_collective("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL") == "ReduceScatter"
    assert canonical_collective("nccl:_all_gather_base") == "AllGather"
    assert canonical_collective("gloo:all_reduce") == "AllReduce"
    assert canonical_collective("allreduce") == "AllReduce"
    assert canonical_collective("nccl:all_to_all") == "AllToAll"
    assert canonical_collective("reduce_scatter_tensor_coalesced") == "ReduceScatter"
    assert canonical_collective("aten::mm") == ""
    assert dtype_bytes("BFloat16") == 2 and dtype_bytes("Float") == 4 and math.isnan(dtype_bytes("weird"))


def test_nccl_tests_table_is_consistent_with_the_bus_factor() -> None:
    path = shared_data("nccl", "nccl_tests_all_reduce_16xH100.txt")
    parsed = nccl_tests.parse_file(path, "nt")
    assert parsed.errors == []
    rows = parsed.rows
    assert len(rows) == 62 and {r["variant"] for r in rows} == {"out_of_place", "in_place"}
    assert all(r["collective"] == "AllReduce" and r["nranks"] == 16 for r in rows)
    big = [r for r in rows if r["msg_bytes"] >= 2**28]
    for r in rows:
        assert r["msg_bytes"] == r["count"] * 4  # float
    for r in big:  # the tool's own busbw/algbw equals the nccl-tests factor we use for Kineto ops
        assert r["busbw_bytes_per_second"] / r["algbw_bytes_per_second"] == pytest.approx(
            bus_factor("AllReduce", 16), rel=2e-3)
        assert r["algbw_bytes_per_second"] == pytest.approx(r["msg_bytes"] / r["duration_seconds"], rel=5e-3)
    last = rows[-1]
    assert last["variant"] == "in_place" and last["duration_seconds"] == pytest.approx(47743e-6)
    assert json.loads(last["detail_json"])["hosts"] == ["ztan-mig-235z", "ztan-mig-gq73"]


def test_nccl_tests_bad_row_reported_others_kept(tmp_path: Path) -> None:
    text = shared_data("nccl", "nccl_tests_all_reduce_16xH100.txt").read_text().splitlines()
    idx = next(i for i, ln in enumerate(text) if ln.strip().startswith("1024 "))
    text[idx] = "        1024           256     float"
    bad = tmp_path / "broken.txt"
    bad.write_text("\n".join(text))
    parsed = nccl_tests.parse_file(bad, "nt")
    assert len(parsed.rows) == 60 and len(parsed.errors) == 1 and f":{idx + 1}:" in parsed.errors[0]


def test_inspector_jsonl_bandwidth_matches_bus_factor() -> None:
    parsed = nccl_inspector.parse_file(shared_data("nccl", "inspector_examples.jsonl"), "insp")
    assert parsed.errors == []
    ar, rs = parsed.rows
    assert (ar["collective"], ar["rank"], ar["nranks"], ar["seq"]) == ("AllReduce", 2, 8, 1407)
    assert rs["collective"] == "ReduceScatter" and rs["host"] == "example-hostname"
    for r in (ar, rs):
        assert r["busbw_bytes_per_second"] / r["algbw_bytes_per_second"] == pytest.approx(
            bus_factor(r["collective"], 8), rel=1e-5)
        assert r["algbw_bytes_per_second"] == pytest.approx(r["msg_bytes"] / r["duration_seconds"], rel=1e-4)
    assert rs["ts"] == encode_ts(1752867229_235059000)  # coll_start_ts when the event trace is present


def test_inspector_jsonl_bad_line_keeps_the_others(tmp_path: Path) -> None:
    lines = shared_data("nccl", "inspector_examples.jsonl").read_text().splitlines()
    path = tmp_path / "mixed.jsonl"
    path.write_text("\n".join([lines[0], '{"header": {"id": ', lines[1]]) + "\n")
    parsed = nccl_inspector.parse_file(path, "insp")
    assert len(parsed.rows) == 2
    assert len(parsed.errors) == 1 and parsed.errors[0].startswith(f"{path}:2:")


def test_inspector_prometheus_series_are_joined() -> None:
    parsed = nccl_inspector.parse_file(shared_data("nccl", "inspector_example.prom"), "prom")
    assert parsed.errors == []
    by = {r["collective"]: r for r in parsed.rows}
    assert set(by) == {"AllReduce", "Send"}
    ar = by["AllReduce"]
    assert ar["busbw_bytes_per_second"] == pytest.approx(678.263e9)
    assert ar["duration_seconds"] == pytest.approx(9498.47e-6)
    assert (ar["comm_id"], ar["host"], ar["device"], ar["nranks"]) == ("DP Group 0", "nvl72004-T01", 0, 4)
    assert by["Send"]["is_p2p"] == 1 and json.loads(by["Send"]["detail_json"])["message_size_bucket"] == "512-513MB"


def test_flight_recorder_pickle_and_json_agree() -> None:
    pick = nccl_flight_recorder.parse_file(shared_data("flight_recorder", "fr_trace_rank_0"), "fr")
    js = nccl_flight_recorder.parse_file(shared_data("flight_recorder", "fr_trace_rank_0.json"), "fr")
    assert len(pick) == len(js) == 12
    keys = ("ts", "rank", "comm_id", "pg_desc", "collective", "seq", "msg_bytes", "state", "backend")
    assert [tuple(r[k] for k in keys) for r in pick] == [tuple(r[k] for k in keys) for r in js]
    gather = next(r for r in pick if r["collective"] == "AllGather")
    assert gather["msg_bytes"] == 2 * 64 * 4 and gather["state"] == "scheduled"
    assert not json.loads(gather["detail_json"])["pending"]  # pg_status says it completed


class _Evil:
    def __reduce__(self):
        return (os.system, ("touch /tmp/triscope-should-not-exist",))


def test_flight_recorder_unpickler_refuses_code(tmp_path: Path) -> None:
    marker = Path("/tmp/triscope-should-not-exist")
    marker.unlink(missing_ok=True)
    path = tmp_path / "fr_trace_rank_0"
    path.write_bytes(pickle.dumps({"version": "2.10", "entries": [_Evil()]}))
    with pytest.raises(InputError, match="not allowed"):
        nccl_flight_recorder.parse_file(path, "fr")
    assert not marker.exists()
    assert nccl_flight_recorder.safe_loads(pickle.dumps({"a": (1, 2.5, "x"), "s": {1, 2}})) == {"a": (1, 2.5, "x"),
                                                                                              "s": {1, 2}}


def test_detect_and_ingest_every_sample(store) -> None:
    data = shared_data("nccl")
    assert detect_format(data / "inspector_examples.jsonl") == "inspector"
    assert detect_format(data / "inspector_example.prom") == "inspector"
    assert detect_format(data / "nccl_tests_all_reduce_16xH100.txt") == "nccl-tests"
    fr_dir = shared_data("flight_recorder")
    assert detect_format(fr_dir / "fr_trace_rank_1") == "flight-recorder"
    assert detect_format(fr_dir / "fr_trace_rank_1.json") == "flight-recorder"
    counts = {p.name: ingest_path(store, p).rows for p in sorted(data.iterdir())
              if p.suffix in (".jsonl", ".prom", ".txt")}
    fr = ingest_path(store, fr_dir, run_id="fr")
    assert fr.rows == 24 and fr.errors == []
    again = ingest_path(store, fr_dir, run_id="fr")  # re-ingest replaces
    assert again.rows == 24
    res = store.query(f"SELECT source, count() FROM {qualified(store, 'nccl_ops')} GROUP BY source ORDER BY source")
    assert dict(res.rows) == {"flight_recorder": 24, "inspector": 4, "nccl_tests": 62}
    assert counts["nccl_tests_all_reduce_16xH100.txt"] == 62
    exact = store.query(f"SELECT toUnixTimestamp64Nano(ts) FROM {qualified(store, 'nccl_ops')} "
                        "WHERE source = 'flight_recorder' AND rank = 1 AND seq = 1 AND comm_id = '0'").scalar()
    assert exact == 1796206941940984103  # nanosecond-exact creation time of rank 1's first all_reduce


def test_unrecognised_file_is_a_one_line_error(tmp_path: Path, store) -> None:
    path = tmp_path / "x.txt"
    path.write_text("hello\nworld\n")
    with pytest.raises(InputError, match="not a recognised"):
        ingest_path(store, path)
