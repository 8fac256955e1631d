"""``triscope demo`` (the README's main job) end to end in a subprocess with its own embedded store."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from kineto_helpers import complete_events, load_json

from triscope.commands.demo import EXAMPLES


def _demo(store_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "TRISCOPE_STORE__PATH": str(store_path)}
    return subprocess.run([sys.executable, "-m", "triscope", "demo", "--json", *args], env=env,
                          capture_output=True, text=True, timeout=300)


def _stored_events(store_path: Path, run_id: str) -> int:
    code = ("import sys; from triscope.config import load_config; from triscope.store import open_store; "
            "from triscope.schema import qualified; s = open_store(load_config(None)); "
            "print(s.query(f\"SELECT count() FROM {qualified(s, 'trace_events')} WHERE run_id = {{r:String}}\", "
            "{'r': sys.argv[1]}).scalar())")
    env = {**os.environ, "TRISCOPE_STORE__PATH": str(store_path)}
    out = subprocess.run([sys.executable, "-c", code, run_id], env=env, capture_output=True, text=True, check=True)
    return int(out.stdout.strip())


def test_demo_ingests_examples_and_a_live_capture_and_reruns_without_duplicates(tmp_path: Path):
    first = _demo(tmp_path / "store")
    assert first.returncode == 0, first.stderr
    assert first.stdout.startswith("{"), first.stdout[:500] + first.stderr[-2000:]
    report = json.loads(first.stdout)
    assert report["errors"] == [] and report["store"] == "embedded"
    runs = {r["run_id"]: r for r in report["runs"]}
    assert "demo-torch-cpu" in runs and runs["demo-torch-cpu"]["events"] > 0
    for trace in sorted(EXAMPLES.glob("*.json.gz")):
        run_id = "demo-" + trace.name.removesuffix(".json.gz")
        expected = len(complete_events(load_json(trace)))
        assert runs[run_id]["events"] == expected, run_id
        whole = runs[run_id]["breakdown"]["ranks"][0]["whole"]
        assert whole["compute_ns"] + whole["non_compute_ns"] + whole["idle_ns"] == whole["span_ns"]
        assert runs[run_id]["stall_shares"]
    # A second run replaces the demo runs instead of appending to them.
    again = _demo(tmp_path / "store", "--no-capture")
    assert again.returncode == 0, again.stderr
    v100 = "demo-v100_resnet_ns_resolution_rank0"
    assert _stored_events(tmp_path / "store", v100) == runs[v100]["events"]


def test_demo_reports_a_corrupt_trace_and_keeps_the_others(tmp_path: Path):
    bad = tmp_path / "broken.json"
    bad.write_text('{"traceEvents": [{"ph": "X", "name": "k", "ts": 1, "dur": 2}, {"ph": ')
    good = EXAMPLES / "triton_single_kernel.json.gz"
    done = _demo(tmp_path / "store", "--no-capture", "--traces", str(bad), str(good))
    assert done.returncode == 1
    report = json.loads(done.stdout)
    assert len(report["errors"]) == 1 and "broken.json" in report["errors"][0]
    assert "\n" not in report["errors"][0]
    assert [r["run_id"] for r in report["runs"]] == ["demo-triton_single_kernel"]
