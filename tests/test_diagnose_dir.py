"""``triscope diagnose DIR`` with a stray non-trace file: a warning, not an error; a refusal is exit 2."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO, TEST_DATA

SAMPLE = REPO / "examples" / "traces" / "triton_single_kernel.json.gz"


def _diagnose(store: Path, *paths: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "TRISCOPE_STORE__PATH": str(store), "COLUMNS": "200"}
    env.pop("TRISCOPE_CONFIG", None)
    return subprocess.run([sys.executable, "-m", "triscope", "diagnose", "--json", *map(str, paths)],
                          capture_output=True, text=True, env=env, cwd=REPO, timeout=300)


def test_a_stray_file_in_a_trace_directory_is_a_warning(tmp_path: Path) -> None:
    job = tmp_path / "job"
    job.mkdir()
    shutil.copy(SAMPLE, job / "rank0.json.gz")
    shutil.copy(TEST_DATA / "not_kineto" / "memory_timeline.json", job / "memory.json")
    res = _diagnose(tmp_path / "store", job)
    doc = json.loads(res.stdout)
    assert res.returncode in (0, 3), res.stderr
    assert doc["errors"] == [] and len(doc["skipped"]) == 1 and "memory.json" in doc["skipped"][0]
    assert len(doc["ingested"]) == 1 and doc["runs"]
    assert "warning:" in res.stderr and "error:" not in res.stderr


def test_a_refused_file_is_exit_2(tmp_path: Path) -> None:
    res = _diagnose(tmp_path / "store", TEST_DATA / "not_kineto" / "execution_trace.json")
    assert res.returncode == 2, res.stderr
    assert "error:" in res.stderr
