"""One connection budget for every server of ``triscope run`` (a real subprocess at 1,024 descriptors).

The attack that broke it: 1,100 idle TCP connections to the EPP's gRPC port took all 1,024 descriptors,
every pick timed out, OTLP stopped answering, the writer failed and 31,200 rows were lost at SIGTERM.
Here the same, plus 1,000 idle connections to the query endpoint and 300 to every other port. Now the
gRPC port accepts its cap and closes the rest, the HTTP servers evict idle connections when the
process's budget is empty, a reserve of descriptors stays for the writer, and nothing is lost.
"""

from __future__ import annotations

import contextlib
import json
import resource
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from conftest import free_port
from otlp_helpers import post
from run_helpers import clean_env

from tests.test_otlp_limits import span_request

pytestmark = pytest.mark.slow


def _limit_fds() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 1024))


class _Rx:
    def __init__(self, port: int) -> None:
        self.address = ("127.0.0.1", port)


def _up(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


def test_idle_connections_on_every_port_cannot_take_the_writer_s_descriptors(store_path: Path,
                                                                                tmp_path: Path) -> None:
    ports = {name: free_port() for name in ("otlp", "prom", "feed", "agent", "epp", "query")}
    database = f"fdbudget{int(time.time() * 1000) % 10**8}"
    config = tmp_path / "triscope.toml"
    config.write_text(f"""
[run]
collectors = ["otlp", "blockio_diskstats"]
exporters = ["prometheus", "weights_feed", "epp"]
status_interval_s = 0
[store]
path = "{tmp_path / 'store'}"
database = "{database}"
[writer]
spool_dir = "{tmp_path / 'spool'}"
flush_interval_s = 0.2
[blockio]
interval_s = 0.2
[otlp]
port = {ports['otlp']}
[prometheus]
port = {ports['prom']}
[weights.feed]
port = {ports['feed']}
agent_port = {ports['agent']}
[weights.backends."127.0.0.1:9"]
address = "127.0.0.1:9"
[epp]
port = {ports['epp']}
[query]
port = {ports['query']}
""")
    proc = subprocess.Popen([sys.executable, "-m", "triscope", "run", "--config", str(config), "--json"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=clean_env(),
                            preexec_fn=_limit_fds)
    log: list[str] = []
    assert proc.stderr is not None
    reader = threading.Thread(target=lambda: log.extend(iter(proc.stderr.readline, "")), daemon=True)
    reader.start()
    socks: list[socket.socket] = []
    try:
        deadline = time.monotonic() + 60
        while not all(_up(p) for p in ports.values()):
            assert proc.poll() is None and time.monotonic() < deadline, "".join(log)
            time.sleep(0.2)
        # 1,100 idle connections to the gRPC port, 300 more to each HTTP port and the agent
        for port, n in ((ports["epp"], 1100), (ports["otlp"], 300), (ports["feed"], 300), (ports["prom"], 300),
                        (ports["agent"], 300), (ports["query"], 1000)):
            for _ in range(n):
                with contextlib.suppress(OSError):
                    socks.append(socket.create_connection(("127.0.0.1", port), timeout=2))
        time.sleep(1.5)  # past the HTTP servers' eviction grace
        sent = 0
        for k in range(20):  # the services still answer, and spans still reach the writer
            status, _, _ = post(_Rx(ports["otlp"]), span_request(50, first=k * 50).SerializeToString(), timeout=10)
            assert status == 200, (k, status)
            sent += 50
        with urllib.request.urlopen(f"http://127.0.0.1:{ports['feed']}/v1/weights", timeout=5) as answer:
            assert answer.status == 200 and "backends" in json.loads(answer.read())
        with urllib.request.urlopen(f"http://127.0.0.1:{ports['prom']}/metrics", timeout=5) as answer:
            assert answer.status == 200
        token = json.loads((tmp_path / "store" / ".triscope-query.json").read_text())["token"]
        ask = urllib.request.Request(f"http://127.0.0.1:{ports['query']}/?query=SELECT+count()+FROM+requests",
                                     headers={"X-ClickHouse-User": "triscope", "X-ClickHouse-Key": token})
        with urllib.request.urlopen(ask, timeout=10) as answer:  # the query endpoint too, among 1,000 idle
            assert answer.status == 200 and int(answer.read()) >= 0
        assert proc.poll() is None, "".join(log)
    finally:
        for s in socks:
            s.close()
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
        reader.join(timeout=5)
    assert proc.returncode == 0, "".join(log)[-3000:]
    summary = json.loads(out)
    assert summary["lost"] == {}, summary["lost"]
    assert summary["writer"]["rows_dropped"] == 0 and summary["flushed"]
    assert summary["collectors"]["otlp"]["rows"] == sent
