"""A real HAProxy 2.6 follows triscope's feed over agent-check: weights, traffic split and drain.

Three tiny HTTP backends (http.server threads) sit behind HAProxy ``balance roundrobin``; every
server has ``agent-check`` pointed at the feed's agent port. The feed's engine inputs come from
``inputs_fn`` (memory ratios we set), and the test reads HAProxy's effective weights and states
back through its runtime API (``show stat`` / ``show servers state`` on a unix admin socket).
"""

from __future__ import annotations

import csv
import http.client
import io
import socket
import subprocess
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import require_binary
from lb_helpers import backends, free_port, stop

from triscope.analyzers.routing import BackendInputs, WeightParams
from triscope.exporters.feed import WeightFeed

INTERVAL_S = 0.1
AGENT_INTER_MS = 200
NAMES = ("s0", "s1", "s2")


class HAProxy:
    def __init__(self, workdir: Path, ports: dict[str, int], agent_port: int) -> None:
        self.sock = workdir / "admin.sock"
        self.port = free_port()
        lines = ["global", f"    stats socket {self.sock} mode 600 level admin", "    nbthread 1",
                 "defaults", "    mode http", "    timeout connect 1s", "    timeout client 5s",
                 "    timeout server 5s", "frontend fe", f"    bind 127.0.0.1:{self.port}",
                 "    default_backend pool", "backend pool", "    balance roundrobin"]
        for name, port in ports.items():
            lines.append(f"    server {name} 127.0.0.1:{port} weight 100 agent-check agent-addr 127.0.0.1 "
                         f"agent-port {agent_port} agent-inter {AGENT_INTER_MS}ms agent-send \"{name}\\n\"")
        cfg = workdir / "haproxy.cfg"
        cfg.write_text("\n".join(lines) + "\n")
        binary = require_binary("haproxy")
        check = subprocess.run([binary, "-c", "-q", "-f", str(cfg)], capture_output=True, text=True, timeout=30)
        assert check.returncode == 0, check.stderr
        self.log = workdir / "haproxy.log"
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen([binary, "-db", "-f", str(cfg)], stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 10
        while not self.sock.exists() or not self._listening():
            assert self.proc.poll() is None, self.log.read_text()
            assert time.monotonic() < deadline, "haproxy did not start"
            time.sleep(0.05)

    def _listening(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                return True
        except OSError:
            return False

    def admin(self, command: str) -> str:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(2.0)
            s.connect(str(self.sock))
            s.sendall(command.encode() + b"\n")
            out = b""
            while chunk := s.recv(65536):
                out += chunk
        return out.decode()

    def stat(self) -> dict[str, dict[str, str]]:
        """``show stat`` rows of the pool's servers, by server name."""
        rows = csv.DictReader(io.StringIO(self.admin("show stat").lstrip("# ")))
        return {r["svname"]: r for r in rows if r["pxname"] == "pool" and r["svname"] in NAMES}

    def servers_state(self) -> dict[str, dict[str, str]]:
        """``show servers state pool``: srv_uweight is the weight the agent set."""
        lines = self.admin("show servers state pool").splitlines()[1:]  # the first line is the format version
        header = next(ln for ln in lines if ln.startswith("# be_id")).lstrip("# ").split()
        rows = [dict(zip(header, ln.split(), strict=False)) for ln in lines if ln[:1].isdigit()]
        return {r["srv_name"]: r for r in rows}

    def weights(self) -> dict[str, int]:
        return {n: int(r["weight"]) for n, r in self.stat().items()}

    def close(self) -> None:
        stop(self.proc)


class Inputs:
    def __init__(self) -> None:
        self.mem = {n: 0.0 for n in NAMES}

    def __call__(self) -> list[BackendInputs]:
        now = time.time()
        return [BackendInputs(n, memory_used_bytes=m * 80e9, memory_total_bytes=80e9, sources={"gpu": now})
                for n, m in self.mem.items()]


@pytest.fixture()
def stack(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[HAProxy, Inputs, WeightFeed]]:
    """HAProxy over three backends checking the feed's agent port (in a process of its own when the
    test parametrizes ``stack`` with True)."""
    require_binary("haproxy")
    inputs = Inputs()
    # fast damping so a change reaches its target within one update (the bounds are tested elsewhere)
    params = WeightParams.from_config({"weights": {"interval_s": INTERVAL_S, "ewma_up": 1.0, "ewma_down": 1.0,
                                                   "max_step_up": 1.0, "max_step_down": 1.0, "slow_start": False,
                                                   "feed": {"port": 0, "agent_port": 0,
                                                            "serve_process": getattr(request, "param", False)}}})
    with backends(list(NAMES)) as ports:
        feed = WeightFeed(params, inputs_fn=inputs).start()
        try:
            hap = HAProxy(tmp_path, ports, feed.agent_port)
            try:
                yield hap, inputs, feed
            finally:
                hap.close()
        finally:
            feed.close()


def wait_weights(hap: HAProxy, want: dict[str, int], timeout_s: float = 5.0) -> float:
    t0 = time.monotonic()
    while True:
        got = hap.weights()
        if all(got.get(k) == v for k, v in want.items()):
            return time.monotonic() - t0
        assert time.monotonic() - t0 < timeout_s, f"HAProxy weights {got}, wanted {want}"
        time.sleep(0.02)


def traffic(hap: HAProxy, n: int) -> Counter:
    hits: Counter = Counter()
    for _ in range(n):
        conn = http.client.HTTPConnection("127.0.0.1", hap.port, timeout=5)
        conn.request("GET", "/", headers={"Connection": "close"})
        resp = conn.getresponse()
        assert resp.status == 200
        hits[resp.read().decode()] += 1
        conn.close()
    return hits


@pytest.mark.parametrize("stack", [False, True], ids=["in-process", "serve-process"], indirect=True)
def test_haproxy_weights_and_traffic_follow_memory(stack) -> None:
    hap, inputs, feed = stack
    wait_weights(hap, {"s0": 100, "s1": 100, "s2": 100})
    # s1 at 50% memory: penalty 2 -> target 0.5 -> "ready 50%"; s2 at 75%: penalty 4 -> 25%
    inputs.mem.update({"s1": 0.5, "s2": 0.75})
    lag = wait_weights(hap, {"s0": 100, "s1": 50, "s2": 25})
    # within one feed update plus one agent interval (+ scheduling slack on a shared CI box)
    assert lag < INTERVAL_S + AGENT_INTER_MS / 1000 + 1.0, lag
    state = hap.servers_state()
    assert state["s1"]["srv_uweight"] == "50" and state["s1"]["srv_iweight"] == "100"
    hits = traffic(hap, 350)
    # roundrobin 100:50:25 -> 4/7, 2/7, 1/7 of the requests
    assert hits["s0"] == pytest.approx(350 * 4 / 7, abs=12)
    assert hits["s1"] == pytest.approx(350 * 2 / 7, abs=12)
    assert hits["s2"] == pytest.approx(350 * 1 / 7, abs=12)
    assert feed.result is not None and feed.result.backends["s1"].lb_weight == 50

    # memory released: the weights come back up
    inputs.mem.update({"s1": 0.0, "s2": 0.0})
    wait_weights(hap, {"s0": 100, "s1": 100, "s2": 100})


def test_drain_puts_the_server_in_drain_and_ready_lifts_it(stack) -> None:
    hap, inputs, _feed = stack
    wait_weights(hap, {"s0": 100, "s1": 100, "s2": 100})
    inputs.mem["s2"] = 0.99  # >= drain_memory_ratio 0.97
    deadline = time.monotonic() + 5
    while not hap.stat()["s2"]["status"].startswith("DRAIN"):  # "DRAIN (agent)"
        assert time.monotonic() < deadline, hap.stat()["s2"]
        time.sleep(0.02)
    assert int(hap.servers_state()["s2"]["srv_admin_state"]) & 0x08  # SRV_ADMF_DRAIN set by the agent
    assert int(hap.servers_state()["s1"]["srv_admin_state"]) == 0
    hits = traffic(hap, 60)
    assert hits["s2"] == 0 and hits["s0"] + hits["s1"] == 60
    inputs.mem["s2"] = 0.5  # below release 0.92: "ready 50%" lifts the drain
    deadline = time.monotonic() + 5
    # without a health check HAProxy shows a serving server as "no check"
    while (row := hap.stat()["s2"])["status"].startswith("DRAIN") or row["weight"] != "50":
        assert time.monotonic() < deadline, {k: row[k] for k in ("status", "weight", "agent_desc")}
        time.sleep(0.02)
    assert traffic(hap, 50)["s2"] > 0


class KillableInputs(Inputs):
    """Inputs whose backends can be marked as refusing their scrape (what a SIGKILLed engine looks like)."""

    def __init__(self) -> None:
        super().__init__()
        self.refused: set[str] = set()

    def __call__(self) -> list[BackendInputs]:
        return [i if i.backend not in self.refused else
                BackendInputs(i.backend, sources={"gpu": i.sources["gpu"] - 60}, scrape_up=0.0,
                              scrape_error=f"{i.backend}: scrape failed: connection refused")
                for i in super().__call__()]


def test_a_down_backend_is_marked_down_and_comes_back_when_it_answers(tmp_path: Path) -> None:
    """A backend whose scrape is refused: the agent answers ``down``, HAProxy marks it DOWN and sends it
    nothing, while the rest keep their weights; when its scrape answers again it is UP and served."""
    require_binary("haproxy")
    inputs = KillableInputs()
    params = WeightParams.from_config({"weights": {"interval_s": INTERVAL_S, "slow_start": False, "ewma_up": 1.0,
                                                   "max_step_up": 1.0, "feed": {"port": 0, "agent_port": 0}}})
    with backends(list(NAMES)) as ports:
        feed = WeightFeed(params, inputs_fn=inputs).start()
        hap = HAProxy(tmp_path, ports, feed.agent_port)
        try:
            wait_weights(hap, {"s0": 100, "s1": 100, "s2": 100})
            inputs.refused.add("s2")
            deadline = time.monotonic() + 5
            while not (row := hap.stat()["s2"])["status"].startswith("DOWN"):
                assert time.monotonic() < deadline, {k: row[k] for k in ("status", "weight", "agent_desc")}
                time.sleep(0.02)
            hits = traffic(hap, 60)
            assert hits["s2"] == 0 and hits["s0"] + hits["s1"] == 60
            assert feed.result is not None and feed.result.down_backends == ("s2",)
            assert hap.weights()["s0"] == 100 and hap.weights()["s1"] == 100  # the rest keep their weights
            inputs.refused.clear()
            deadline = time.monotonic() + 5
            while (row := hap.stat()["s2"])["status"].startswith("DOWN"):
                assert time.monotonic() < deadline, {k: row[k] for k in ("status", "weight", "agent_desc")}
                time.sleep(0.02)
            assert traffic(hap, 60)["s2"] > 0
        finally:
            hap.close()
            feed.close()
