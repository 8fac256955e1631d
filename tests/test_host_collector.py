"""The host collector (collectors/host) on this machine's real /proc: an engine stand-in process found from
its listening port with its child, its RSS, its run-queue wait when a CPU hog shares its core (a real
fault: a busy loop pinned to the same CPU at a higher priority), the host's PSI; and the incident cause it
makes possible (``host_cpu``)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import free_port

from triscope.collectors.host import HostCollector, HostConfig
from triscope.schema import HOST_SAMPLES, qualified

ENGINE = r"""
import http.server, os, socketserver, sys, subprocess, time
port = int(sys.argv[1])
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
ballast = bytearray(64 << 20)  # 64 MiB resident
for i in range(0, len(ballast), 4096):
    ballast[i] = 1
srv = socketserver.TCPServer(("127.0.0.1", port), http.server.SimpleHTTPRequestHandler)
import threading
threading.Thread(target=srv.serve_forever, daemon=True).start()
print("ready", flush=True)
end = time.time() + 600
while time.time() < end:  # an engine's decode loop: busy
    sum(range(20000))
"""
HOG = "import time\nend = time.time() + 600\nwhile time.time() < end:\n    pass\n"


def _pinned(code: str, *args: str, nice: int = 0, cpu: int = 0) -> subprocess.Popen[str]:
    def setup() -> None:
        os.sched_setaffinity(0, {cpu})
        os.nice(nice)

    return subprocess.Popen([sys.executable, "-c", code, *args], stdout=subprocess.PIPE, text=True, preexec_fn=setup)


def _windows(collector: HostCollector, n: int) -> list[dict[str, Any]]:
    out = []
    for _ in range(n):
        time.sleep(collector.interval_s)
        cols = collector.collect()[HOST_SAMPLES]
        out += [dict(zip(cols, values, strict=True)) for values in zip(*cols.values(), strict=True)]
    return out


def test_an_engine_is_found_by_its_port_and_its_cpu_starvation_measured() -> None:
    port = free_port()
    engine = _pinned(ENGINE, str(port), nice=10)
    hog = None
    try:
        assert engine.stdout is not None and engine.stdout.readline().strip() == "ready"
        collector = HostCollector(HostConfig.from_config({"host": {"interval_s": 0.5,
                                                                   "engines": [f"127.0.0.1:{port}"]}}))
        collector.start()
        calm = [r for r in _windows(collector, 4) if r["backend"] == f"127.0.0.1:{port}"][1:]
        assert all(r["processes"] == 2 and r["rss_bytes"] > 64 << 20 for r in calm), calm
        assert all(r["cpu_seconds"] > 0.3 * r["window_seconds"] for r in calm), calm  # it runs
        hog = _pinned(HOG, nice=0)  # the same core, a higher priority: the engine waits
        time.sleep(0.5)
        starved = [r for r in _windows(collector, 4) if r["backend"] == f"127.0.0.1:{port}"][1:]
        calm_wait = max(r["wait_seconds"] / r["window_seconds"] for r in calm)
        starved_wait = min(r["wait_seconds"] / r["window_seconds"] for r in starved)
        assert starved_wait > 0.3 and starved_wait > 3 * calm_wait, (calm, starved)
        host = [r for r in _windows(collector, 1) if r["backend"] == ""]
        assert host and (Path("/proc/pressure/cpu").exists() is (host[0]["psi_cpu_some"] == host[0]["psi_cpu_some"]))
    finally:
        for p in (hog, engine):
            if p is not None:
                p.kill()
                p.wait(timeout=10)


def test_a_starved_engine_is_the_incident_s_host_cpu_cause(store: Any) -> None:
    """Rows as the collector writes them beside the engine's own: the breach on B comes with its threads
    waiting on the run queue most of the time: host_cpu, not unknown."""
    import test_incidents as ti

    from triscope.analyzers.incidents import find_incidents
    from triscope.schema import encode_ts

    def slow(s: int, b: str, f: dict[str, float]) -> None:
        if b == ti.B and s >= 100:
            f.update(latency=3.0)

    ti.Fleet().write(store, slow)
    rows = []
    for s in range(180):
        for b in (ti.A, ti.B):
            starved = b == ti.B and s >= 95
            rows.append({"ts": encode_ts((ti.T0 + s) * 10**9), "host": "h", "backend": b, "processes": 2,
                         "window_seconds": 1.0, "cpu_seconds": 0.2 if starved else 0.9,
                         "wait_seconds": 0.8 if starved else 0.02, "rss_bytes": 2e9, "psi_cpu_some": 0.4 if s >= 95
                         else 0.01})
    store.insert(qualified(store, HOST_SAMPLES), HOST_SAMPLES.columns_of(rows))
    (incident,) = find_incidents(store, (ti.T0 + 30) * 10**9, (ti.T0 + 180) * 10**9, {}).incidents
    assert incident.cause.name == "host_cpu" and incident.backends == [ti.B], incident.to_dict()
    assert "run queue" in incident.cause.evidence[0] and incident.lead_times_s["cpu_wait"] >= 0
    assert not any("host CPU" in m for m in incident.missing)


@pytest.mark.parametrize("engines", [[{"backend": "x:1", "pidd": 3}], ["nohostport"]])
def test_bad_engine_entries_are_one_line_errors(engines: list[Any]) -> None:
    from triscope.errors import ConfigError

    with pytest.raises(ConfigError) as err:
        HostCollector(HostConfig.from_config({"host": {"engines": engines}}))
    assert "\n" not in str(err.value)
