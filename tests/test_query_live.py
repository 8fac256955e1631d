"""Ask while it runs: query commands against a store held by a running ``triscope run`` (a real subprocess).

The daemon holds the embedded store (chDB allows one process per data directory) and serves it on its
query endpoint; the commands find it through the discovery file and print what they print after the
daemon has stopped and the store is opened directly. A daemon killed with SIGKILL leaves a stale file:
the next command opens the store directly.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import pytest
from otlp_helpers import post
from run_helpers import clean_env, running_daemon

from tests.test_otlp_limits import span_request
from triscope.query_discovery import FILE_NAME

pytestmark = pytest.mark.slow


class _Rx:
    def __init__(self, port: int) -> None:
        self.address = ("127.0.0.1", port)


def _cli(config: Path, *args: str) -> tuple[int, str, str]:
    done = subprocess.run([sys.executable, "-m", "triscope", "-c", str(config), *args], capture_output=True,
                          text=True, timeout=120, env=clean_env())
    return done.returncode, done.stdout, done.stderr


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _config(tmp_path: Path, otlp_port: int) -> Path:
    config = tmp_path / "triscope.toml"
    config.write_text(f"""
[run]
collectors = ["blockio_diskstats", "otlp"]
status_interval_s = 0
[store]
path = "{tmp_path / 'store'}"
[writer]
spool_dir = "{tmp_path / 'spool'}"
flush_interval_s = 0.2
[blockio]
interval_s = 0.2
[otlp]
port = {otlp_port}
[query]
port = 0
""")
    return config


def test_query_commands_answer_while_the_daemon_collects(tmp_path: Path) -> None:
    from conftest import free_port

    otlp = free_port()
    config = _config(tmp_path, otlp)
    trace = Path(__file__).resolve().parent.parent / "examples" / "traces" / "a100_ddp_2024_rank0.json.gz"
    code, _, err = _cli(config, "ingest", "trace", str(trace), "--run-id", "live-a100")
    assert code == 0, err
    with running_daemon(config, clean_env()) as daemon:
        deadline = time.monotonic() + 60
        while not (tmp_path / "store" / FILE_NAME).exists():
            daemon.assert_alive()
            assert time.monotonic() < deadline, daemon.log
            time.sleep(0.1)
        start = time.time()
        for k in range(5):  # request spans of two backends, spread over a few seconds
            assert post(_Rx(otlp), span_request(40, first=k * 40, attrs={"server.address": f"10.0.0.{k % 2}",
                                                                        "server.port": "8000"}).SerializeToString()
                        )[0] == 200
            time.sleep(0.3)
        until = time.time() - 1  # a range that ended: every row of it has reached the store
        time.sleep(2.0)
        fixed = [("diagnose", "--since", "1h", "--until", _iso(until), "--json"),
                 ("heatmap", "--from", _iso(start - 3600), "--to", _iso(until), "--json"),
                 ("diagnose", "--trace-run", "live-a100", "--json"),
                 ("nccl", "stragglers", "--json"),
                 ("weights", "explain", "10.0.0.1:8000", "--json")]
        live = {args: _cli(config, *args) for args in fixed}
        assert live[fixed[2]][0] == 0 and json.loads(live[fixed[2]][1]), live[fixed[2]][2]
        code, out, err = _cli(config, "weights", "show", "--json")
        assert code == 0, err
        assert json.loads(out)["backends"] is not None
        daemon.assert_alive()
        summary = daemon.stop()
    # collection went on while the commands queried: nothing lost, every span stored
    assert summary["lost"] == {} and summary["collectors"]["blockio_diskstats"]["rows"] > 0
    assert summary["collectors"]["otlp"]["rows"] == 200
    assert not (tmp_path / "store" / FILE_NAME).exists()  # withdrawn at shutdown
    for args in fixed:
        direct = _cli(config, *args)
        assert live[args] == direct, (args, live[args][2][-500:], direct[2][-500:])
        assert direct[0] == 0 or "error" in direct[2], direct


def test_a_killed_daemon_s_discovery_file_is_stale(tmp_path: Path) -> None:
    from conftest import free_port

    config = _config(tmp_path, free_port())
    with running_daemon(config, clean_env()) as daemon:
        deadline = time.monotonic() + 60
        while not (tmp_path / "store" / FILE_NAME).exists():
            daemon.assert_alive()
            assert time.monotonic() < deadline, daemon.log
            time.sleep(0.1)
        os.kill(daemon.proc.pid, signal.SIGKILL)
        daemon.proc.wait(timeout=30)
    assert (tmp_path / "store" / FILE_NAME).exists()  # left behind
    code, out, err = _cli(config, "diagnose", "--since", "10m", "--json")
    assert code in (0, 3), err  # opened directly: an answer, not "in use by another process"
    assert "in use by another process" not in err and json.loads(out)
