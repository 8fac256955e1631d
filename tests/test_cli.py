"""The CLI end to end in a subprocess with its own embedded store."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import TEST_DATA, shared_data
from kineto_helpers import kernel, write_trace

from triscope.commands._common import parse_when, since_start, utc_text
from triscope.errors import InputError


def _triscope(args: list[str], store: Path, env_extra: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "TRISCOPE_STORE__PATH": str(store), **(env_extra or {})}
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


def test_files_that_are_not_traces_exit_2_and_are_skipped_in_a_directory(tmp_path: Path):
    store = tmp_path / "store"
    not_kineto = TEST_DATA / "not_kineto"
    res = _triscope(["ingest", "trace", "--no-progress", str(not_kineto / "execution_trace.json")], store)
    assert res.returncode == 2, res.stderr
    errors = [line for line in res.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "not a Kineto trace: a PyTorch execution trace" in errors[0]
    job = tmp_path / "job"
    job.mkdir()
    write_trace(job / "rank0.json", [kernel("k", 1, 1)])
    shutil.copy(not_kineto / "memory_timeline.json", job)
    res = _triscope(["ingest", "trace", "--json", str(job)], store)
    assert res.returncode == 0, res.stderr
    body = json.loads(res.stdout)
    assert [r["rank"] for r in body["ingested"]] == [0] and body["errors"] == []
    assert len(body["skipped"]) == 1 and "memory_timeline.json" in body["skipped"][0]
    assert "warning:" in res.stderr and "skipped" in res.stderr
    only = tmp_path / "only"
    only.mkdir()
    shutil.copy(not_kineto / "memory_timeline.json", only)
    res = _triscope(["ingest", "trace", "--no-progress", str(only)], store)
    assert res.returncode == 2 and "no Kineto trace among" in res.stderr


def test_a_gzip_over_the_decompressed_limit_exits_2(tmp_path: Path):
    store = tmp_path / "store"
    big = write_trace(tmp_path / "big.json.gz", [kernel(f"k{i}", i, 1) for i in range(2000)])
    res = _triscope(["ingest", "trace", "--no-progress", "--max-decompressed-bytes", "65536", str(big)], store)
    assert res.returncode == 2 and "decompresses to more than 65,536 bytes" in res.stderr
    assert "(limit [ingest] max_decompressed_bytes / --max-decompressed-bytes)" in res.stderr  # printed as is
    zero = {"TRISCOPE_INGEST__MAX_DECOMPRESSED_BYTES": "0"}
    res = _triscope(["ingest", "trace", "--no-progress", str(big)], store, zero)
    assert res.returncode == 2 and "max_decompressed_bytes must be > 0" in res.stderr
    assert res.stderr.strip().count("\n") == 0
    res = _triscope(["ingest", "trace", "--no-progress", str(big)], store)
    assert res.returncode == 0 and "2,000 events (2,000 GPU)" in res.stdout


def test_time_arguments_shared_by_heatmap_and_diagnose() -> None:
    """``parse_when``: ISO-8601 (UTC unless an offset is given), a duration ago, and a bare number as
    epoch seconds (``heatmap --from``) or as seconds ago (``diagnose --until``)."""
    now = 1_767_225_600 * 10**9  # 2026-01-01T00:00:00Z
    assert parse_when("2026-01-01T00:00:00", now) == parse_when("2026-01-01T01:00:00+01:00", now) == now
    assert parse_when(" 90s ", now) == now - 90 * 10**9
    assert parse_when("1767225500.5", now) == now - 99_500_000_000
    assert parse_when("100", now, epoch_seconds=False) == now - 100 * 10**9
    assert since_start(None, now) == now - 600 * 10**9 and since_start("2h", now) == now - 7200 * 10**9
    assert utc_text(now + 1_500_000) == "2026-01-01 00:00:00.001"
    with pytest.raises(InputError, match=r"^not an ISO-8601 time, epoch seconds or duration: 'soon'$"):
        parse_when("soon", now)
    with pytest.raises(InputError, match=r"^--until: not a duration or ISO-8601 time: 'soon'$"):
        parse_when("soon", now, epoch_seconds=False, flag="--until")
