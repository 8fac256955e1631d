"""A real 2-process gloo job (torch.distributed on 127.0.0.1) with rank 1 delayed before every all_reduce.

Kineto traces -> ingest_trace -> host-side collective extraction -> straggler = rank 1 and comm
verdicts on rank 0, which waits; the job's own Flight Recorder dumps tell the same story.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import free_port

from triscope.analyzers.nccl_crossrank import flight_recorder_check, stragglers
from triscope.analyzers.stalls import diagnose_stalls
from triscope.collectors.kineto.ingest import ingest_trace
from triscope.collectors.nccl.ingest import ingest_path
from triscope.collectors.nccl.kineto import extract_kineto, ingest_kineto_run

WORKER = Path(__file__).with_name("nccl_gloo_worker.py")
DELAY_S = 0.15
ITERS = 4
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def gloo_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("gloo")
    port = free_port()
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(out), str(port), str(r), "2", "1", str(DELAY_S),
                               str(ITERS)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for r in (0, 1)]
    for p in procs:
        output, _ = p.communicate(timeout=120)
        assert p.returncode == 0, output.decode(errors="replace")[-3000:]
    return out


def _ingest(store, out: Path) -> str:
    for r in (0, 1):
        ingest_trace(store, out / f"rank{r}.json", run_id="gloo-live")
    return "gloo-live"


def test_host_side_collectives_extracted(store, gloo_run: Path) -> None:
    run = _ingest(store, gloo_run)
    rows = extract_kineto(store, run)
    for rank in (0, 1):
        mine = [r for r in rows if r["rank"] == rank]
        assert [r["collective"] for r in mine].count("AllReduce") == ITERS
        assert [r["collective"] for r in mine].count("AllGather") == ITERS
        assert all(r["backend"] == "gloo" and r["device"] == -1 and r["nranks"] == 2 for r in mine)
    waits = [r["duration_seconds"] for r in rows if r["rank"] == 0 and r["collective"] == "AllReduce"]
    assert min(waits) > DELAY_S * 0.6  # rank 0 sat in every all_reduce until rank 1 arrived


def test_straggler_is_the_delayed_rank(store, gloo_run: Path) -> None:
    run = _ingest(store, gloo_run)
    ingest_kineto_run(store, run)
    report = stragglers(store, run_ids=[run], sources=("kineto",))
    reduces = [c for c in report.collectives if c.collective == "AllReduce"]
    assert len(reduces) == ITERS
    for c in reduces:
        assert c.straggler_rank == 1 and c.longest_wait_rank == 0
        assert c.lateness_seconds > DELAY_S * 0.6
    assert report.by_rank()[0]["rank"] == 1


def test_flight_recorder_of_the_same_job(store, gloo_run: Path) -> None:
    for r in (0, 1):
        res = ingest_path(store, gloo_run / f"fr_rank{r}", run_id="fr-live")
        assert res.errors == [] and res.rows >= 2 * ITERS
        js = ingest_path(store, gloo_run / f"fr_rank{r}.json", run_id=f"fr-json-{r}")
        assert js.rows == res.rows
    report = stragglers(store, run_ids=["fr-live"], sources=("flight_recorder",))
    reduces = [c for c in report.collectives if c.collective == "AllReduce"]
    assert len(reduces) >= ITERS
    delayed = [c for c in reduces if c.lateness_seconds > DELAY_S * 0.6]
    assert len(delayed) == ITERS and all(c.straggler_rank == 1 for c in delayed)
    checks = flight_recorder_check(store, ["fr-live"])
    assert checks and all(c["ok"] for c in checks), json.dumps(checks)
    size = store.query("SELECT any(msg_bytes) FROM " + store.database + ".nccl_ops WHERE run_id = 'fr-live' "
                       "AND collective = 'AllReduce'").scalar()
    assert size == 256 * 1024 * 4


def test_comm_verdict_on_the_waiting_rank(store, gloo_run: Path) -> None:
    run = _ingest(store, gloo_run)
    ingest_kineto_run(store, run)
    from triscope.analyzers.stalls import trace_span

    start, end = trace_span(store, [run])
    report = diagnose_stalls(store, start, end, {}, run_ids=[run])
    units = report.units()
    waiting = next(u for u in units if u.endswith("cpu-rank0"))
    sleeper = next(u for u in units if u.endswith("cpu-rank1"))
    comm = [w for w in report.windows if w.unit == waiting and w.verdict == "comm"]
    assert comm, [(w.verdict, w.metrics) for w in report.windows if w.unit == waiting]
    for w in comm:
        ev = {e.metric: e for e in w.evidence["comm"]}
        assert ev["comm_share"].met and ev["comm_share"].value > 0.85 and ev["comm_share"].threshold == 0.85
    assert report.shares(waiting)["comm"] > report.shares(sleeper).get("comm", 0.0)
    assert "idle" in report.shares(sleeper)  # rank 1 sleeps, neither computing nor communicating
    assert report.stragglers["by_rank"][0]["rank"] == 1
    assert any("straggler rank 1" in b for b in report.breaches())
    steps = diagnose_stalls(store, start, end, {}, run_ids=[run], by="step")
    assert {w.kind for w in steps.windows} == {"step"} and len(steps.windows) == 2 * ITERS
