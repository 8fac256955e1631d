"""bench/pick_log.py: a test-bed run read request by request from HAProxy's log (PICK_LOG_FORMAT lines)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from conftest import REPO

SCRIPT = REPO / "bench" / "pick_log.py"

# three requests: one to b0 at t=0 (1 s), at t=0.5 one more to b0, where HAProxy had one in flight, because
# b1's free KV did not hold it (in-flight spread at its arrival 1), at t=0.6 one to b1 (spread 2: b0 has two)
LINES = [
    "[NOTICE] (1) : haproxy started",
    "triscope-pick 1000.000 b0 200 0 0 990 1000 speech 96 b0:0+0:fit:0|b1:0+0:fit:0",
    "triscope-pick 1000.600 b1 200 0 0 990 1000 video 400 b0:2+0:fit:2|b1:0+0:fit:0",
    "triscope-pick 1000.500 b0 200 0 0 290 300 video 400 b0:1+0:fit:1|b1:0+0:misfit:1",
    "triscope-pick 1000.600 <NOSRV> 503 -1 -1 -1 0 video 400 -",
]


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=60, cwd=REPO)


def test_a_log_read_request_by_request(tmp_path: Path) -> None:
    log = tmp_path / "haproxy.log"
    log.write_text("\n".join(LINES) + "\n")
    done = run(str(log), "--json")
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)[str(log)]
    assert doc["requests"] == 3 and doc["split"] == {"b0": 2, "b1": 1}  # the refusal reached no server
    assert doc["active_ms"]["max"] == 1000 and doc["spread_mean"] == (0 + 1 + 2) / 3
    assert doc["fit_chosen_other"] == {"fit/fit": 2, "fit/misfit": 1} and doc["external_seen"] == 0
    [busier] = doc["sent_to_busier"]
    assert busier["server"] == "b0" and busier["t_s"] == 0.5 and busier["standings"]["b1"] == "0+0:misfit:1.0"
    text = run("--run", str(tmp_path))  # no work/*/haproxy.log under it
    assert text.returncode == 2 and "no log" in text.stderr
    assert run(str(tmp_path / "absent.log")).returncode == 2
