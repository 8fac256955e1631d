"""The CLI end to end in a subprocess with its own embedded store."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from conftest import shared_data
from kineto_helpers import kernel, write_trace


def _triscope(args: list[str], store: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "TRISCOPE_STORE__PATH": str(store)}
    return subprocess.run([sys.executable, "-m", "triscope", *args], capture_output=True, text=True, env=env,
                          timeout=180)


def test_ingest_then_diagnose_json(tmp_path: Path):
    store = tmp_path / "store"
    trace = shared_data("kineto", "a100_ddp_2024_rank0.json.gz")
    ingest = _triscope(["ingest", "trace", "--json", "--run-id", "job", str(trace)], store)
    assert ingest.returncode == 0, ingest.stderr
    assert json.loads(ingest.stdout)["ingested"][0]["events"] > 0
    report = _triscope(["diagnose", "--trace-run", "job", "--json"], store)
    assert report.returncode == 0, report.stderr
    whole = json.loads(report.stdout)["ranks"][0]["whole"]
    assert whole["span_ns"] == whole["busy_ns"] + whole["idle_ns"]
    assert whole["busy_ns"] == whole["compute_ns"] + whole["non_compute_ns"]
    table = _triscope(["diagnose", "--trace-run", "job"], store)
    assert table.returncode == 0 and "whole run" in table.stdout and "step 5" in table.stdout


def test_bad_input_exits_non_zero_with_one_line_and_keeps_good_files(tmp_path: Path):
    store = tmp_path / "store"
    good = write_trace(tmp_path / "good.json", [kernel("k", 1, 1)])
    bad = tmp_path / "bad.json"
    bad.write_text('{"traceEvents": [{"ph": "X", "name": ')
    res = _triscope(["ingest", "trace", "--no-progress", str(good), str(bad)], store)
    assert res.returncode == 1
    assert "bad.json" in res.stderr and "truncated or corrupt" in res.stderr
    assert "good.json" in res.stdout
    missing = _triscope(["diagnose", "--trace-run", "nope"], store)
    assert missing.returncode == 2 and missing.stderr.strip().count("\n") == 0
    assert "no trace run 'nope'" in missing.stderr and "good" in missing.stderr
