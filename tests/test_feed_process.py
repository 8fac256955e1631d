"""The feed's ports in a process of their own (``[weights.feed] serve_process``): the agent's tables
give every answer the in-process agent gives, polled HTTP routes come from the table and the rest
pass through to the feed unchanged (pipelined, in order), a killed child comes back on the same ports
at the next update, and no child outlives its parent. Real processes and sockets on 127.0.0.1."""

from __future__ import annotations

import contextlib
import json
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
from triscope.exporters.feed import WeightFeed
from triscope.exporters.feed_process import FeedProcess, agent_table
from triscope.exporters.haproxy_agent import agent_reply, parse_agent_line
from triscope.exporters.table_servers import table_reply

VIDEO, IMAGE = "offline_video", "interactive_image_text"
TIERED = {"classes": {VIDEO: {"admit_kv_ratio": 0.80}, IMAGE: {"admit_kv_ratio": 0.90}}}


def check(port: int, line: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(line + b"\n")
        out = b""
        while chunk := s.recv(256):
            out += chunk
        return out


def http(port: int, raw: bytes) -> list[tuple[int, dict[str, str], bytes]]:
    """Send ``raw`` (one or more pipelined requests, the last with ``Connection: close``); the
    responses in order."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(raw)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    out = []
    while data:
        head, _, data = data.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
        size = int(headers.get("content-length", "0"))
        out.append((int(lines[0].split(" ")[1]), headers, data[:size]))
        data = data[size:]
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
    assert {b"drain\n", b"up ready 100%\n"} < answers and any(b"maxconn:" in a for a in answers)
    assert agent_table(None, inflight) == {} and table_reply({}, "a:1") == b"up ready 100%\n"


@pytest.fixture()
def fleet_feed():
    kv = {"a:1": 0.2, "b:1": 0.2, "127.0.0.1:9001": 0.3}  # the last has an address Envoy can take

    def inputs() -> list[BackendInputs]:
        now = time.time()
        return [BackendInputs(n, kv_cache_usage_ratio=v, sources={"serving": now}) for n, v in kv.items()]

    params = WeightParams.from_config({"weights": {"interval_s": 0.1, "ewma_down": 1.0, "max_step_down": 1.0,
                                                   "feed": {"port": 0, "agent_port": 0, "serve_process": True}}})
    feed = WeightFeed(params, inputs_fn=inputs).start()
    try:
        yield feed, kv
    finally:
        feed.close()


def test_a_killed_serving_process_comes_back_on_the_same_ports(fleet_feed) -> None:
    feed, kv = fleet_feed
    agent = feed._process
    assert isinstance(agent, FeedProcess) and agent.pid is not None and agent.pid != os.getpid()
    port, http_port, first_pid = feed.agent_port, feed.http_port, agent.pid
    assert check(port, b"a:1") == b"up ready 100%\n"
    os.kill(first_pid, signal.SIGKILL)
    kv["a:1"] = 0.99  # the next update drains a:1 and finds the child dead
    assert wait_for(lambda: check(port, b"a:1") == b"drain\n", 10, "the restarted agent to answer drain")
    assert agent.restarts_total >= 1 and agent.pid not in (None, first_pid)
    assert (feed.agent_port, feed.http_port) == (port, http_port)
    assert http(http_port, b"GET /v1/weights HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")[0][0] == 200
    assert wait_for(lambda: agent.counters.get("agent", {}).get("requests_total", 0) >= 1, 5, "the child's counters")


def test_the_serving_process_ends_with_its_feed_and_with_a_killed_parent(fleet_feed, tmp_path) -> None:
    feed, _ = fleet_feed
    pid = feed._process.pid
    feed.close()
    wait_for(lambda: not _alive(pid), 5, "the agent process to exit after close")
    # a parent killed outright: the child sees its pipe close and exits
    script = tmp_path / "parent.py"
    script.write_text(textwrap.dedent("""
        import sys, time
        from triscope.exporters.feed_process import FeedProcess
        agent = FeedProcess("127.0.0.1", 0, None).start({}, {})
        print(agent.pid, agent.port("agent"), flush=True)
        time.sleep(60)
    """))
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        child_pid, port = map(int, parent.stdout.readline().split())
        assert check(port, b"x:1") == b"up ready 100%\n"  # no table yet: fail open
        parent.kill()
        parent.wait(timeout=5)
        wait_for(lambda: not _alive(child_pid), 5, "the orphaned agent process to exit")
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()


def test_polled_routes_come_from_the_table_and_the_rest_pass_through_in_order(fleet_feed) -> None:
    feed, _ = fleet_feed
    eds = b'{"node": {"id": "t"}, "resource_names": ["triscope"]}'
    raw = (b"GET /v1/weights HTTP/1.1\r\nHost: x\r\n\r\n"
           b"POST /v3/discovery:endpoints HTTP/1.1\r\nHost: x\r\nContent-Length: " + str(len(eds)).encode()
           + b"\r\n\r\n" + eds + b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n"
           b"GET /nowhere HTTP/1.1\r\nHost: x\r\n\r\n"
           b"GET /v1/traefik HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    answers = http(feed.http_port, raw)
    assert [status for status, _, _ in answers] == [200, 200, 200, 404, 200]
    weights, discovery, metrics, missing, traefik = (body for _, _, body in answers)
    assert set(json.loads(weights)["backends"]) == {"a:1", "b:1", "127.0.0.1:9001"}
    cla = json.loads(discovery)["resources"][0]
    assert cla["cluster_name"] == "triscope" and len(cla["endpoints"][0]["lb_endpoints"]) == 1
    assert b"triscope_weights_updates_total" in metrics and "no such endpoint" in json.loads(missing)["error"]
    assert "http" in json.loads(traefik) and answers[-1][1].get("connection") == "close"
    # the three passed on were answered by the feed's own server; the two polled routes were not
    counts = wait_for(lambda: (c := feed._process.counters.get("http", {})).get("passed_total", 0) >= 3 and c, 5,
                      "the child's counters")
    assert counts["passed_total"] == 3


def test_the_table_server_answers_502_when_the_feed_behind_it_is_gone() -> None:
    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        gone = probe.getsockname()[1]
    ok = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
    proc = FeedProcess("127.0.0.1", None, 0, upstream_port=gone).start({}, {("GET", "/x"): (ok, ok)})
    try:
        port = proc.port("http")
        assert proc.port("agent") == -1
        answers = http(port, b"GET /x HTTP/1.1\r\nHost: y\r\n\r\nGET /metrics HTTP/1.1\r\nHost: y\r\n\r\n")
        assert [a[0] for a in answers] == [200, 502] and answers[0][2] == b"ok"
        assert "feed unavailable" in json.loads(answers[1][2])["error"] and answers[1][1]["connection"] == "close"
    finally:
        proc.close()


def _answers(port: int, http_port: int) -> bool:
    """Whether the agent and /v1/weights both answer within 0.3 s."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.3) as s:
            s.settimeout(0.3)
            s.sendall(b"a:1\n")
            if not s.recv(64):
                return False
        with socket.create_connection(("127.0.0.1", http_port), timeout=0.3) as s:
            s.settimeout(0.3)
            s.sendall(b"GET /v1/weights HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            return s.recv(64).startswith(b"HTTP/1.1 200")
    except OSError:
        return False


def test_a_hung_serving_process_is_replaced_within_two_seconds(fleet_feed) -> None:
    """The attack: a SIGSTOPped child left 100 of 249 polls and 20 of 50 agent checks unanswered for 15 s."""
    feed, _ = fleet_feed
    agent = feed._process
    port, http_port, first_pid = feed.agent_port, feed.http_port, agent.pid
    assert _answers(port, http_port)
    os.kill(first_pid, signal.SIGSTOP)
    try:
        stopped = time.monotonic()
        assert wait_for(lambda: _answers(port, http_port), 10, "answers from a replaced child")
        gap = time.monotonic() - stopped
        assert gap < 2.5, gap  # HANG_S (1 s) + a child's start + the last unanswered poll's timeout
        assert wait_for(lambda: agent.pid not in (None, first_pid), 5, "the new child's handle")
        assert agent.hangs_total == 1 and not _alive(first_pid)
        assert all(_answers(port, http_port) for _ in range(20))
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(first_pid, signal.SIGCONT)
