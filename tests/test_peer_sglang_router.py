"""sglang-router 0.3.2 as a real process in front of real simulated backends (``triscope_bed.engines.backend``).

Needs ``tools/setup_sglang_router.sh`` (skips without it; CI installs it). The power_of_two test waits
for the router's fixed 30 s ``/get_load`` poll, so the module takes about 35 s; its fixture starts
first and the other tests run inside that wait.
"""

from __future__ import annotations

import collections
import json
import os
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from conftest import free_port, require

from triscope_bed.engines.backend import BackendSpec
from triscope_bed.engines.engine import GIB, MODEL
from triscope_bed.fleet.bench_fleet import SimFleet, http_json
from triscope_bed.peers.sglang import (
    LOAD_POLL_S,
    SETUP_SCRIPT,
    SglangRouter,
    SglangRouterError,
    post_completion,
    venv_python,
)

NAMES = ("p0", "p1", "p2", "c0", "c1", "c2", "x0", "x1", "g0")
PRESSURE_BYTES = 20 * GIB
"""Pinned on p0: half its 40 GiB pool, 163,840 tokens at 128 KiB a token."""
KV_BYTES_PER_TOKEN = 128 * 1024


class Bed:
    """The backends (one subprocess) and their URLs by name."""

    def __init__(self, fleet: SimFleet) -> None:
        self.fleet = fleet
        self.url = {s.name: fleet.url(s) for s in fleet.specs}

    def calls(self, name: str) -> dict[str, int]:
        return dict(http_json(self.url[name] + "/sim/calls"))

    def state(self, name: str) -> dict[str, Any]:
        return dict(http_json(self.url[name] + "/sim/state"))

    def urls(self, *names: str) -> list[str]:
        return [self.url[n] for n in names]


@pytest.fixture(scope="module")
def bed() -> Iterator[Bed]:
    require(venv_python() is not None,
            f"sglang-router is not installed (run {SETUP_SCRIPT}; TRISCOPE_SGLANG_ROUTER_VENV moves it)")
    fleet = SimFleet([BackendSpec(n, free_port()) for n in NAMES], batch_slowdown=0.8).start()
    try:
        yield Bed(fleet)
    finally:
        fleet.stop()


class P2:
    """The power_of_two router over p0..p2 with p0's KV half pinned, and what it did before its first poll."""

    def __init__(self, router: SglangRouter, polls_at_ready: dict[str, int], baseline: collections.Counter[str] | None):
        self.router = router
        self.polls_at_ready = polls_at_ready
        self.baseline = baseline


def _route_many(url: str, n: int, prefix: str) -> collections.Counter[str]:
    """``n`` sequential requests (nothing in flight between them): backend -> count of 200s."""
    seen: collections.Counter[str] = collections.Counter()
    for i in range(n):
        status, backend, _ = post_completion(url, f"{prefix} {i}")
        assert status == 200, (status, backend)
        seen[backend] += 1
    return seen


@pytest.fixture(scope="module")
def p2(bed: Bed, tmp_path_factory: pytest.TempPathFactory) -> Iterator[P2]:
    bed.fleet.set_pressure("p0", PRESSURE_BYTES)
    router = SglangRouter(bed.urls("p0", "p1", "p2"), "power_of_two", workdir=tmp_path_factory.mktemp("p2"))
    with router:
        polls = {n: bed.calls(n)["/get_load"] for n in ("p0", "p1", "p2")}
        # 0.3.2's first load poll runs as the router starts, before any worker is registered, so until
        # the next one (30 s later) power_of_two compares the router's in-flight counts only.
        baseline: collections.Counter[str] | None = None
        if not any(polls.values()):
            baseline = _route_many(router.url, 30, "baseline")
            if any(bed.calls(n)["/get_load"] for n in polls):
                baseline = None  # a poll came in between: not a load-blind sample
        yield P2(router, polls, baseline)


@pytest.fixture(scope="module")
def cache_router(bed: Bed, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SglangRouter]:
    with SglangRouter(bed.urls("c0", "c1", "c2"), "cache_aware", workdir=tmp_path_factory.mktemp("ca")) as router:
        yield router


@pytest.mark.parametrize("policy", ["power_of_two", "cache_aware", "round_robin", "random"])
def test_policy_routes_text_completions_to_backends(policy: str, bed: Bed, p2: P2, cache_router: SglangRouter,
                                                    tmp_path: Path) -> None:
    if policy == "power_of_two":
        router, names = p2.router, ("p0", "p1", "p2")
    elif policy == "cache_aware":
        router, names = cache_router, ("c0", "c1", "c2")
    else:
        names = ("c0", "c1", "c2")
        router = SglangRouter(bed.urls(*names), policy, workdir=tmp_path).start()
    try:
        before = {n: sum(bed.state(n)["success"].values()) for n in names}
        for i in range(6):
            status, backend, doc = post_completion(router.url, f"tell me about request {i} of {policy}",
                                                   prompt_tokens=50 + i, max_tokens=3,
                                                   request_class="realtime_speech")
            assert status == 200, doc
            # Served by a real simulated backend, with the body forwarded as is (its extra fields included).
            assert backend in names and doc["backend"] == backend and doc["model"] == MODEL
            assert doc["usage"] == {"prompt_tokens": 50 + i, "completion_tokens": 3}
        after = {n: sum(bed.state(n)["success"].values()) for n in names}
        assert sum(after.values()) - sum(before.values()) == 6
    finally:
        if router not in (p2.router, cache_router):
            router.stop()


def test_backend_serves_sglang_worker_endpoints(bed: Bed) -> None:
    url = bed.url["g0"]
    info = http_json(url + "/server_info")
    assert info["model_path"] == MODEL and info["dp_size"] == 1 and info["max_running_requests"] == 16
    assert http_json(url + "/get_server_info") == info
    assert http_json(url + "/model_info") == http_json(url + "/get_model_info") == {
        "model_path": MODEL, "tokenizer_path": MODEL, "is_generation": True}
    assert http_json(url + "/get_load") == [{"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}]

    # One request in flight (500 tokens decode for about a second): its KV, then pinned KV on top.
    body = json.dumps({"model": MODEL, "prompt": "x", "prompt_tokens": 100, "max_tokens": 500}).encode()
    req = urllib.request.Request(url + "/v1/completions", data=body, method="POST")
    done = threading.Event()

    def slow() -> None:
        with urllib.request.urlopen(req, timeout=30) as resp:
            resp.read()
        done.set()

    threading.Thread(target=slow, daemon=True).start()
    deadline = time.monotonic() + 5
    while bed.state("g0")["running"] == 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert http_json(url + "/get_load") == [{"dp_rank": 0, "num_reqs": 1, "num_waiting_reqs": 0, "num_tokens": 600}]
    bed.fleet.set_pressure("g0", GIB)
    assert http_json(url + "/get_load")[0]["num_tokens"] == 600 + GIB // KV_BYTES_PER_TOKEN
    bed.fleet.set_pressure("g0", 0)
    assert done.wait(10)
    assert http_json(url + "/get_load")[0]["num_tokens"] == 0


def test_cache_aware_keeps_a_prompt_on_its_worker(bed: Bed, cache_router: SglangRouter) -> None:
    url = cache_router.url
    a, b = "the long shared system prompt alpha " * 8, "an unrelated conversation about bravo " * 8
    status, home, _ = post_completion(url, a)
    assert status == 200
    # Three slow requests of prompt A pile on its worker (imbalance 3 < the 64-request balance threshold) ...
    with ThreadPoolExecutor(3) as pool:
        slow = [pool.submit(post_completion, url, a, 100, 1000) for _ in range(3)]
        deadline = time.monotonic() + 5
        while bed.state(home)["running"] < 3 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert bed.state(home)["running"] == 3
        # ... and A still goes there although that worker is the busiest: affinity, not load.
        assert [post_completion(url, a)[1] for _ in range(5)] == [home] * 5
        # A new prompt goes to a less loaded worker and then stays on it.
        b_home = [post_completion(url, b)[1] for _ in range(5)]
        assert len(set(b_home)) == 1 and b_home[0] != home
        assert all(f.result()[:2] == (200, home) for f in slow)


def test_backend_503_reaches_the_client_without_retries(bed: Bed, tmp_path: Path) -> None:
    """x0's KV pool is pinned full, so every request it gets is a 503; x1 is healthy (round robin)."""
    bed.fleet.set_pressure("x0", 40 * GIB)
    try:
        refused = sum(bed.state("x0")["oom"].values())
        with SglangRouter(bed.urls("x0", "x1"), "round_robin", workdir=tmp_path / "off") as router:
            results = [post_completion(router.url, f"q{i}")[:2] for i in range(6)]
        assert sorted(results) == [(200, "x1")] * 3 + [(503, "x0")] * 3
        assert sum(bed.state("x0")["oom"].values()) - refused == 3  # one attempt per request
        # The router's default (5 retries) answers 200 every time: the 503s happened and are hidden.
        refused = sum(bed.state("x0")["oom"].values())
        with SglangRouter(bed.urls("x0", "x1"), "round_robin", retries=True, workdir=tmp_path / "on") as router:
            results = [post_completion(router.url, f"q{i}")[:2] for i in range(6)]
        assert results == [(200, "x1")] * 6
        assert sum(bed.state("x0")["oom"].values()) - refused >= 2
    finally:
        bed.fleet.set_pressure("x0", 0)


def _listening(pid: int) -> set[tuple[str, int]]:
    """(address, port) of the TCP sockets the process listens on (IPv4 and IPv6), from /proc."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        target = os.readlink(fd)
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            cols = line.split()
            if cols[3] != "0A" or cols[9] not in inodes:  # 0A: LISTEN
                continue
            hexaddr, hexport = cols[1].split(":")
            raw = bytes.fromhex(hexaddr)
            # /proc prints each 32-bit word in host (little-endian) order
            words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
            family = socket.AF_INET if len(raw) == 4 else socket.AF_INET6
            found.add((socket.inet_ntop(family, words), int(hexport, 16)))
    return found


def test_router_listens_on_loopback_only_and_bounds_bodies(p2: P2) -> None:
    router = p2.router
    assert router.pid is not None
    assert _listening(router.pid) == {("127.0.0.1", router.port), ("127.0.0.1", router.prometheus_port)}
    assert "smg_http_requests_total" in router.metrics()
    big = json.dumps({"model": MODEL, "prompt": "x" * (100 * 1024), "prompt_tokens": 1, "max_tokens": 1}).encode()
    req = urllib.request.Request(router.url + "/v1/completions", data=big, method="POST",
                                 headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req, timeout=10)
    assert err.value.code == 413


def test_missing_venv_is_one_clear_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRISCOPE_SGLANG_ROUTER_VENV", str(tmp_path / "absent"))
    assert venv_python() is None
    with pytest.raises(SglangRouterError) as err:
        SglangRouter(["http://127.0.0.1:1"]).start()
    message = str(err.value)
    assert "\n" not in message and SETUP_SCRIPT in message and str(tmp_path / "absent") in message


def test_power_of_two_follows_polled_get_load(bed: Bed, p2: P2) -> None:
    """p0 holds 163,840 tokens of KV, p1 and p2 none: once the router has polled ``/get_load`` p0 loses
    every pair it is drawn in. A load-blind choice sends it 1/3 of sequential requests (P(<= 1 of 30) ~ 1e-4)."""
    names = ("p0", "p1", "p2")
    if p2.baseline is not None:  # measured before the router had any load: p0 takes its share
        assert p2.baseline["p0"] >= 3, p2.baseline
    deadline = time.monotonic() + LOAD_POLL_S + 15
    while any(bed.calls(n)["/get_load"] <= p2.polls_at_ready[n] for n in names):
        assert time.monotonic() < deadline, {n: bed.calls(n) for n in names}
        time.sleep(0.25)
    seen = _route_many(p2.router.url, 30, "after poll")
    assert seen["p0"] <= 1, seen
    # The router read the schema the backends serve (a failing read would be load -1).
    loads = p2.router.loads()
    assert loads == {bed.url["p0"]: PRESSURE_BYTES // KV_BYTES_PER_TOKEN, bed.url["p1"]: 0, bed.url["p2"]: 0}
