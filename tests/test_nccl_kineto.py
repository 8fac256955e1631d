"""Collectives from Kineto traces in the store: NCCL kernels joined to record_param_comms."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
from conftest import shared_data

from triscope.collectors.kineto.ingest import ingest_trace
from triscope.collectors.nccl.kineto import extract_kineto, ingest_kineto_run
from triscope.errors import InputError
from triscope.schema import encode_ts, qualified

A100 = ("kineto", "a100_ddp_2024_rank0.json.gz")
_PARAM_KEYS = ("Collective name", "In msg nelems", "Out msg nelems", "Group size", "dtype", "In split size",
               "Out split size", "Process Group Name", "Process Group Description", "Process Group Ranks")


def _strip(src: Path, dst: Path, drop_external: bool) -> None:
    """Copy of a trace whose NCCL kernels lost their collective args (2023-era traces look like this)."""
    with gzip.open(src) as fh:
        data = json.load(fh)
    for e in data["traceEvents"]:
        if e.get("cat") == "kernel" and e.get("name", "").startswith("nccl"):
            for k in _PARAM_KEYS:
                e["args"].pop(k, None)
            if drop_external:
                e["args"].pop("External id", None)
    dst.write_text(json.dumps(data))


def _key(rows: list[dict]) -> list[tuple]:
    return [(r["ts"], r["collective"], r["msg_bytes"], r["nranks"], r["dtype"], r["comm_id"], r["seq"]) for r in rows]


def test_a100_kernels_with_args(store) -> None:
    ingest_trace(store, shared_data(*A100), run_id="a100")
    rows = extract_kineto(store, "a100")
    assert [r["collective"] for r in rows].count("AllReduce") == 15
    assert [r["collective"] for r in rows].count("Broadcast") == 6
    for r in rows:
        assert r["backend"] == "nccl" and r["device"] == 0 and r["nranks"] == 2 and r["comm_id"] == "0"
        assert r["msg_bytes"] == r["count"] * {"Float": 4, "Long": 8}[r["dtype"]]
        assert r["busbw_bytes_per_second"] == pytest.approx(r["algbw_bytes_per_second"])  # 2(n-1)/n = 1 at n = 2
        assert r["algbw_bytes_per_second"] == pytest.approx(r["msg_bytes"] / r["duration_seconds"])
    big = next(r for r in rows if r["ts"] == encode_ts(1716423323_009853422))  # ts 4458677009853.422 us + base
    assert big["duration_seconds"] == pytest.approx(2636.669e-6) and big["msg_bytes"] == 6637568 * 4
    assert sorted(r["seq"] for r in rows if r["collective"] == "AllReduce") == list(range(15))


@pytest.mark.parametrize("drop_external", [False, True], ids=["external-id", "correlation"])
def test_params_joined_from_record_param_comms(store, tmp_path: Path, drop_external: bool) -> None:
    ingest_trace(store, shared_data(*A100), run_id="full")
    stripped = tmp_path / "stripped_rank0.json"
    _strip(shared_data(*A100), stripped, drop_external)
    ingest_trace(store, stripped, run_id="stripped")
    kernel_args = store.query(f"SELECT countIf(collective != '') FROM {qualified(store, 'trace_events')} "
                              "WHERE run_id = 'stripped' AND kernel_class = 'comm'").scalar()
    assert kernel_args == 0
    assert _key(extract_kineto(store, "stripped")) == _key(extract_kineto(store, "full"))


def test_stored_and_replaced(store) -> None:
    ingest_trace(store, shared_data(*A100), run_id="a100")
    assert ingest_kineto_run(store, "a100") == 21
    assert ingest_kineto_run(store, "a100") == 21
    n = store.query(f"SELECT count() FROM {qualified(store, 'nccl_ops')} WHERE source = 'kineto'").scalar()
    assert n == 21


def test_unknown_run_is_an_input_error(store) -> None:
    with pytest.raises(InputError, match="not in the store"):
        extract_kineto(store, "nope")


def test_pre_2024_trace_keeps_kernels_without_sizes(store) -> None:
    ingest_trace(store, shared_data("kineto", "sampled_128rank_job_rank0.json.gz"), run_id="s128")
    rows = extract_kineto(store, "s128")
    assert len(rows) == 10 and {r["collective"] for r in rows} == {"SendRecv"}
    assert all(r["is_p2p"] == 1 and r["duration_seconds"] > 0 for r in rows)


def test_summary_says_when_bus_bandwidth_is_unknown_and_why(store) -> None:
    """`nccl kineto` tells a reader why bus bandwidth is missing: a 2023 trace's NCCL kernels carry no sizes,
    gloo's host-side collectives have none stored; a 2024 A100 trace has them all."""
    from triscope.collectors.nccl.kineto import ingest_kineto_summary

    ingest_trace(store, shared_data(*A100), run_id="a100")
    ingest_trace(store, shared_data("kineto", "sampled_128rank_job_rank0.json.gz"), run_id="s128")
    ingest_trace(store, shared_data("kineto", "local_cpu_gloo_2rank_rank0.json"), run_id="gloo")
    a100 = ingest_kineto_summary(store, "a100")
    assert (a100.rows, a100.busbw_known, a100.no_size, a100.notes) == (21, 21, 0, [])
    assert a100.median_busbw_bytes_per_second is not None and a100.median_busbw_bytes_per_second > 1e9
    s128 = ingest_kineto_summary(store, "s128")
    assert s128.rows == s128.no_size == 10 and s128.busbw_known == 0 and s128.median_busbw_bytes_per_second is None
    (note,) = s128.notes
    assert note.startswith("bus bandwidth unknown for 10 of 10 collectives")
    assert "the trace has no message sizes" in note
    gloo = ingest_kineto_summary(store, "gloo")
    assert gloo.rows == gloo.host_side == gloo.no_size_host_side == 15
    assert "host-side (gloo)" in gloo.notes[0] and "Flight Recorder" in gloo.notes[0]


def test_stragglers_say_when_there_is_nothing_cross_rank_to_compare(store) -> None:
    from triscope.analyzers.nccl_crossrank import nothing_to_compare, stragglers

    def notes(runs: list[str] | None, min_lateness: float = 0.001) -> list[str]:
        return nothing_to_compare(store, stragglers(store, runs, min_lateness_seconds=min_lateness), runs)

    (empty,) = notes(None)
    assert empty.startswith("nothing to compare: no collectives in the store")
    ingest_trace(store, shared_data(*A100), run_id="a100")
    ingest_kineto_run(store, "a100")
    (one_rank,) = notes(["a100"])
    assert "nothing cross-rank to compare in run a100" in one_rank and "rank 0 only" in one_rank
    for r in (0, 1):
        ingest_trace(store, shared_data("kineto", f"sampled_128rank_job_rank{r}.json.gz"), run_id="s128")
        ingest_trace(store, shared_data("kineto", f"local_cpu_gloo_2rank_rank{r}.json"), run_id="gloo")
    ingest_kineto_run(store, "s128")
    ingest_kineto_run(store, "gloo")
    (p2p,) = notes(["s128"])
    assert "only point-to-point ops (20)" in p2p
    assert notes(["gloo"]) == []  # rank 1 was ~96 ms late: there are stragglers, nothing to explain
    (on_time,) = notes(["gloo"], min_lateness=10.0)
    assert on_time == "12 collectives compared across ranks: no rank was 10000 ms or more late"
