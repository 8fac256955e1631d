"""The HAProxy agent port in a process of its own (``[weights.feed] agent_process``): its answer tables
give every answer the in-process agent gives, a killed child comes back on the same port at the next
update, and no child outlives its parent. Real processes and sockets on 127.0.0.1."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from lb_helpers import wait_for

from triscope.analyzers.routing import BackendInputs, WeightParams, compute_weights
from triscope.exporters.agent_process import AgentProcess, agent_table, table_reply
from triscope.exporters.feed import WeightFeed
from triscope.exporters.haproxy_agent import agent_reply, parse_agent_line

VIDEO, IMAGE = "offline_video", "interactive_image_text"
TIERED = {"classes": {VIDEO: {"admit_kv_ratio": 0.80}, IMAGE: {"admit_kv_ratio": 0.90}}}


def check(port: int, line: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(line + b"\n")
        out = b""
        while chunk := s.recv(256):
            out += chunk
        return out


def _alive(pid: int) -> bool:
    """Running (a zombie, reaped or not by whoever adopted it, counts as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def test_table_answers_every_line_as_the_in_process_agent_does() -> None:
    params = WeightParams.from_config({"weights": TIERED})
    now = time.time()
    kv = {"a:1": 0.5, "b:1": 0.85, "c:1": 0.99, "d:1": float("nan")}  # ready, closed to video, drained, unknown
    res, _ = compute_weights([BackendInputs(n, kv_cache_usage_ratio=v, sources={"serving": now})
                              for n, v in kv.items()], None, params, now)
    inflight = {"a:1": 10, "c:1": 4}
    table = agent_table(res, inflight)
    assert len(table) == len(kv) * (1 + len(res.class_admission))
    lines = [""]
    for name in [*kv, "nobody:1"]:
        for cls in ["", *res.class_admission, "no_such_class"]:
            lines += [f"{name} {cls}".strip(), f"{name}  {cls}" if cls else name]
    answers = set()
    for line in lines:
        name, cls = parse_agent_line(line)
        want = agent_reply(res, name, inflight.get(name, 0), cls).encode()
        assert table_reply(table, line) == want, line
        answers.add(want)
    assert {b"drain\n", b"ready 100%\n"} < answers and any(b"maxconn:" in a for a in answers)
    assert agent_table(None, inflight) == {} and table_reply({}, "a:1") == b"ready 100%\n"


@pytest.fixture()
def fleet_feed():
    kv = {"a:1": 0.2, "b:1": 0.2}

    def inputs() -> list[BackendInputs]:
        now = time.time()
        return [BackendInputs(n, kv_cache_usage_ratio=v, sources={"serving": now}) for n, v in kv.items()]

    params = WeightParams.from_config({"weights": {"interval_s": 0.1, "ewma_down": 1.0, "max_step_down": 1.0,
                                                   "feed": {"port": -1, "agent_port": 0, "agent_process": True}}})
    feed = WeightFeed(params, inputs_fn=inputs).start()
    try:
        yield feed, kv
    finally:
        feed.close()


def test_a_killed_agent_process_comes_back_on_the_same_port(fleet_feed) -> None:
    feed, kv = fleet_feed
    agent = feed._agent
    assert isinstance(agent, AgentProcess) and agent.pid is not None and agent.pid != os.getpid()
    port, first_pid = feed.agent_port, agent.pid
    assert check(port, b"a:1") == b"ready 100%\n"
    os.kill(first_pid, signal.SIGKILL)
    kv["a:1"] = 0.99  # the next update drains a:1 and finds the child dead
    assert wait_for(lambda: check(port, b"a:1") == b"drain\n", 10, "the restarted agent to answer drain")
    assert agent.restarts_total >= 1 and agent.pid not in (None, first_pid) and feed.agent_port == port
    assert wait_for(lambda: agent.counters.get("requests_total", 0) >= 1, 5, "the child's counters")


def test_the_agent_process_ends_with_its_feed_and_with_a_killed_parent(fleet_feed, tmp_path) -> None:
    feed, _ = fleet_feed
    pid = feed._agent.pid
    feed.close()
    wait_for(lambda: not _alive(pid), 5, "the agent process to exit after close")
    # a parent killed outright: the child sees its pipe close and exits
    script = tmp_path / "parent.py"
    script.write_text(textwrap.dedent("""
        import sys, time
        from triscope.exporters.agent_process import AgentProcess
        agent = AgentProcess().start(None)
        print(agent.pid, agent.port, flush=True)
        time.sleep(60)
    """))
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        child_pid, port = map(int, parent.stdout.readline().split())
        assert check(port, b"x:1") == b"ready 100%\n"  # no table yet: fail open
        parent.kill()
        parent.wait(timeout=5)
        wait_for(lambda: not _alive(child_pid), 5, "the orphaned agent process to exit")
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
