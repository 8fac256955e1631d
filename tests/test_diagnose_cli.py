"""``triscope diagnose`` (stalls) and ``triscope nccl`` end to end, each CLI call a subprocess with its own store."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, free_port, shared_data

WORKER = Path(__file__).with_name("nccl_gloo_worker.py")
pytestmark = pytest.mark.slow


def _cli(store_dir: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "TRISCOPE_STORE__PATH": str(store_dir), "COLUMNS": "200", **(env or {})}
    full_env.pop("TRISCOPE_CONFIG", None)
    return subprocess.run([sys.executable, "-m", "triscope", *args], capture_output=True, text=True, env=full_env,
                          cwd=REPO, timeout=300)


def test_sample_gloo_job_report_and_exit_code(tmp_path: Path) -> None:
    db = tmp_path / "db"
    traces = [str(shared_data("kineto", f"local_cpu_gloo_2rank_rank{r}.json")) for r in (0, 1)]
    assert _cli(db, "ingest", "trace", *traces, "--run-id", "job").returncode == 0
    kin = _cli(db, "nccl", "kineto", "job", "--json")
    assert kin.returncode == 0 and json.loads(kin.stdout)["rows"]["job"] == 30
    fr = _cli(db, "nccl", "ingest", str(shared_data("flight_recorder")), "--run-id", "job")
    assert fr.returncode == 0 and "24 rows" in fr.stdout

    out = _cli(db, "diagnose", "--run-id", "job", "--json")
    assert out.returncode == 3, out.stderr
    report = json.loads(out.stdout)
    assert report["window_ms"] == 100 and report["thresholds"]["comm_share_min"] == 0.85
    assert set(report["shares"]) <= {"comm", "compute", "io", "host", "idle", "unclassified"}
    assert report["stragglers"]["by_rank"][0]["rank"] == 1  # rank 1 was ~96 ms late into one all_reduce
    assert all(fr["ok"] for fr in report["flight_recorder"])
    top = report["top_windows"][0]
    assert top["verdict"] == "comm" and top["evidence"][0]["metric"] == "comm_share"
    assert top["evidence"][0]["value"] > top["evidence"][0]["threshold"] == 0.85
    assert "comm" in report["actions"] and report["breaches"]

    text = _cli(db, "diagnose", "--run-id", "job")
    assert text.returncode == 3
    for needle in ("overall:", "worst windows", "stragglers", "comm_share", "breach:", "Communication-bound"):
        assert needle in text.stdout, text.stdout

    relaxed = _cli(db, "diagnose", "--run-id", "job", "--json",
                   env={"TRISCOPE_STALLS__ALERT_SHARE": "0.9", "TRISCOPE_STALLS__STRAGGLER_ALERT_SECONDS": "1"})
    assert relaxed.returncode == 0 and json.loads(relaxed.stdout)["breaches"] == []

    strag = _cli(db, "nccl", "stragglers", "--run-id", "job")
    assert strag.returncode == 0 and "rank 1" in strag.stdout


def test_since_finds_a_fresh_job(tmp_path: Path) -> None:
    """A real gloo job that just ran is found by ``--since 10m`` and its straggler breaches."""
    out = tmp_path / "job"
    port = free_port()
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(out), str(port), str(r), "2", "0", "0.12", "3"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for r in (0, 1)]
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    db = tmp_path / "db"
    ranks = [str(out / "rank0.json"), str(out / "rank1.json")]
    assert _cli(db, "ingest", "trace", *ranks, "--run-id", "fresh").returncode == 0
    assert _cli(db, "nccl", "kineto", "fresh").returncode == 0
    res = _cli(db, "diagnose", "--since", "10m", "--json")
    assert res.returncode == 3, res.stderr
    report = json.loads(res.stdout)
    assert report["stragglers"]["by_rank"][0]["rank"] == 0  # this time rank 0 slept
    units = {u["unit"].split("/")[-1]: u["shares"] for u in report["units"]}
    assert units["cpu-rank1"].get("comm", 0) > units["cpu-rank0"].get("comm", 0)
    only = _cli(db, "diagnose", "--since", "10m", "--json", "--host", "no-such-host")
    assert only.returncode == 0
    assert json.loads(only.stdout)["units"] == []


def test_empty_range_and_bad_duration(tmp_path: Path) -> None:
    db = tmp_path / "db"
    empty = _cli(db, "diagnose", "--since", "1m")
    assert empty.returncode == 0 and "no GPU samples, traces or IO data" in empty.stdout
    bad = _cli(db, "diagnose", "--since", "soon")
    assert bad.returncode == 2 and bad.stderr.strip().count("\n") == 0 and "not a duration" in bad.stderr
    bad_until = _cli(db, "diagnose", "--since", "1m", "--until", "yesterday-ish")
    assert bad_until.returncode == 2 and "--until" in bad_until.stderr


def test_nccl_ingest_reports_bad_files_but_loads_good_ones(tmp_path: Path) -> None:
    db = tmp_path / "db"
    junk = tmp_path / "junk.txt"
    junk.write_text("nothing to see\n")
    res = _cli(db, "nccl", "ingest", str(shared_data("nccl", "inspector_examples.jsonl")), str(junk), "--json")
    assert res.returncode == 1
    body = json.loads(res.stdout)
    assert body["ingested"][0]["rows"] == 2 and "not a recognised" in body["errors"][0]
