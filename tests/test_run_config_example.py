"""The full example of docs/run.md, run as written: ``triscope run`` with diskstats + torch_allocator.

The TOML is read from the page (the block after ``<!-- run-example -->``), so the documented
file is the tested one. The daemon runs as a subprocess in a temporary working directory (the
example's relative store and spool paths land there), with two environment overrides (a free
Prometheus port, a short status interval) as docs/run.md describes. It gets real disk writes for
/proc/diskstats, is scraped, stopped with SIGTERM, and its store is read back by another
subprocess (chDB: one data path per process). On this CPU machine the real torch has no CUDA:
the torch_allocator collector must start cleanly, log one line and write nothing.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import tomllib
import urllib.request
from pathlib import Path

import pytest
from conftest import free_port
from disk_helpers import synced_write
from run_helpers import clean_env, running_daemon, written_counts

pytestmark = pytest.mark.slow

DOC = Path(__file__).resolve().parent.parent / "docs" / "run.md"
QUERY = r'''
import json
from triscope.store import open_store
s = open_store({"store": {"backend": "embedded", "path": "var/triscope-data", "database": "triscope"}})
out = {t: s.query(f"SELECT count() FROM triscope.{t}").scalar() for t in ("io_latency", "allocator_samples")}
out["sources"] = s.query("SELECT groupUniqArray(source) FROM triscope.io_latency").scalar()
out["gpu_version"] = s.query("SELECT max(version) FROM triscope.schema_migrations WHERE domain = 'gpu'").scalar()
out["active_col"] = s.query("SELECT count() FROM system.columns WHERE database = 'triscope' "
                            "AND table = 'allocator_samples' AND name = 'active_bytes'").scalar()
print(json.dumps(out))
'''


def example_toml() -> str:
    text = DOC.read_text()
    m = re.search(r"<!-- run-example -->\s*```toml\n(.*?)```", text, re.S)
    assert m, "docs/run.md lost its <!-- run-example --> TOML block"
    return m[1]


def _metric(text: str, name: str, labels: str) -> float | None:
    m = re.search(rf"^{re.escape(name)}\{{{re.escape(labels)}\}} (\S+)$", text, re.M)
    return float(m[1]) if m else None


def test_docs_example_config_runs(tmp_path: Path) -> None:
    toml = example_toml()
    cfg = tomllib.loads(toml)
    assert cfg["run"]["collectors"] == ["blockio_diskstats", "torch_allocator"]
    (tmp_path / "triscope.toml").write_text(toml)
    port = free_port()
    env = clean_env(TRISCOPE_PROMETHEUS__PORT=str(port), TRISCOPE_RUN__STATUS_INTERVAL_S="0.3")
    metrics = ""
    with running_daemon("triscope.toml", env, cwd=tmp_path) as daemon:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            daemon.assert_alive()
            synced_write(tmp_path / "io.bin", 1 << 20)  # real disk writes for diskstats to see
            try:
                metrics = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read().decode()
            except OSError:
                metrics = ""
            rows = _metric(metrics, "triscope_collector_rows_total", 'collector="blockio_diskstats",table="io_latency"')
            written = written_counts(daemon.log_lines)
            if rows and rows >= 2 and written and written[-1] >= 2:
                break
            time.sleep(0.3)
        else:
            pytest.fail("no diskstats rows written in 60 s:\n" + daemon.log)
        summary = daemon.stop()
    logs = daemon.log
    assert _metric(metrics, "triscope_collector_up", 'collector="torch_allocator"') == 1.0
    assert _metric(metrics, "triscope_collector_errors_total", 'collector="torch_allocator"') == 0.0

    assert summary["flushed"] and summary["not_started"] == {}
    w = summary["writer"]
    assert w["rows_written"] == w["rows_submitted"] == summary["collectors"]["blockio_diskstats"]["rows"] > 0
    assert w["rows_pending"] == w["rows_dropped"] == w["rows_rejected"] == 0
    assert summary["collectors"]["torch_allocator"] == {"rows": 0, "errors": 0, "last_error": ""}
    cuda_lines = [x for x in daemon.log_lines if "torch_allocator" in x and "CUDA is not available" in x]
    assert len(cuda_lines) == 1, logs
    spool = tmp_path / "var" / "triscope-spool"
    assert spool.is_dir() and list(spool.glob("*.batch")) == list(spool.glob("*.open")) == []

    query = tmp_path / "query.py"
    query.write_text(QUERY)
    res = subprocess.run([sys.executable, str(query)], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                         env=env)
    assert res.returncode == 0, res.stderr
    got = json.loads(res.stdout)
    assert got["io_latency"] == w["rows_written"] and got["sources"] == ["diskstats"]
    assert got["allocator_samples"] == 0 and got["gpu_version"] >= 3 and got["active_col"] == 1
