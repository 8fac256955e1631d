"""Weight feed (triscope.exporters.feed) over real sockets: HTTP endpoints, update loop, HAProxy agent."""

from __future__ import annotations

import contextlib
import http.client
import json
import math
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest
from conftest import free_port, require_binary
from prometheus_client.parser import text_string_to_metric_families

from triscope.analyzers.routing import BackendInputs, WeightParams
from triscope.component import Context
from triscope.errors import ConfigError
from triscope.exporters.feed import WeightFeed, create
from triscope.exporters.haproxy_agent import MAX_LINE


class Fleet:
    """Mutable engine inputs: memory ratio / KV / health per backend, fresh on every call."""

    def __init__(self, **mem: float) -> None:
        self.mem = dict(mem)
        self.kv: dict[str, float] = {}
        self.healthy: dict[str, bool] = {}
        self.calls = 0
        self.fail: str = ""
        self.lock = threading.Lock()

    def __call__(self) -> list[BackendInputs]:
        with self.lock:
            self.calls += 1
            if self.fail:
                raise RuntimeError(self.fail)
            now = time.time()
            return [BackendInputs(f"127.0.0.1:{9000 + i}", memory_used_bytes=m * 1e9, memory_total_bytes=1e9,
                                  kv_cache_usage_ratio=self.kv.get(n, float("nan")),
                                  healthy=self.healthy.get(n, True), sources={"gpu": now, "serving": now})
                    for i, (n, m) in enumerate(sorted(self.mem.items()))]


def name(i: int) -> str:
    return f"127.0.0.1:{9000 + i}"


def params(**weights: object) -> WeightParams:
    cfg = {"interval_s": 0.1, "feed": {"port": 0, "agent_port": 0, "max_body_bytes": 1024}, **weights}
    return WeightParams.from_config({"weights": cfg})


@pytest.fixture()
def fleet() -> Fleet:
    return Fleet(a=0.1, b=0.5)


@pytest.fixture(params=[False, True], ids=["in-process", "serve-process"])
def feed(request: pytest.FixtureRequest, fleet: Fleet) -> Iterator[WeightFeed]:
    """A feed serving its ports itself, then through a serving process (``serve_process``)."""
    feed_cfg = {"port": 0, "agent_port": 0, "max_body_bytes": 1024, "serve_process": request.param}
    f = WeightFeed(params(feed=feed_cfg), inputs_fn=fleet).start()
    try:
        yield f
    finally:
        f.close()


def get(feed: WeightFeed, path: str, method: str = "GET", body: bytes | None = None,
        headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", feed.http_port, timeout=5)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


def weights(feed: WeightFeed) -> dict:
    status, headers, body = get(feed, "/v1/weights")
    assert status == 200 and headers["content-type"] == "application/json"
    return json.loads(body)


def wait_for(pred, timeout_s: float = 5.0, every_s: float = 0.02):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(every_s)
    raise AssertionError(f"condition not met within {timeout_s}s")


def agent(port: int, payload: bytes, shutdown_write: bool = False) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(payload)
        if shutdown_write:
            s.shutdown(socket.SHUT_WR)
        out = b""
        while chunk := s.recv(1024):
            out += chunk
        return out


# --------------------------------------------------------------------------- HTTP


def test_weights_document_follows_inputs_and_versions(feed: WeightFeed, fleet: Fleet) -> None:
    doc = weights(feed)
    a, b = doc["backends"][name(0)], doc["backends"][name(1)]
    # first update: weights at their targets; memory penalties 1/0.9 and 1/0.5
    assert a["lb_weight"] == 100 and b["lb_weight"] == round(100 * 0.5 / 0.9)
    assert a["inputs"]["memory_used_ratio"] == pytest.approx(0.1)
    assert a["factors"]["memory"] == pytest.approx(1 / 0.9) and b["state"] == "ready"
    assert a["address"] == name(0) and doc["stale"] is False and doc["interval_s"] == 0.1
    assert set(doc["classes"]) == {"realtime_speech", "interactive_image_text", "offline_video"}
    assert doc["classes"]["realtime_speech"]["priority_weight"] == 8.0
    assert doc["scale"]["action"] == "hold"
    v0 = doc["version"]

    fleet.mem["a"] = 0.99  # drain a: the loop (0.1 s) publishes it
    doc = wait_for(lambda: (d := weights(feed))["backends"][name(0)]["state"] == "drain" and d)
    assert doc["backends"][name(0)]["reasons"] == ["memory"] and doc["backends"][name(0)]["lb_weight"] == 0
    assert doc["backends"][name(0)]["weight"] == 0 and doc["version"] > v0
    assert doc["backends"][name(0)]["drained"] is True and doc["backends"][name(1)]["drained"] is False
    assert doc["backends"][name(1)]["target"] == 1.0

    # converged inputs stop changing the version
    wait_for(lambda: weights(feed)["backends"][name(1)]["lb_weight"] == 100)
    v1 = weights(feed)["version"]
    n = feed.updates_total
    wait_for(lambda: feed.updates_total >= n + 3)
    assert weights(feed)["version"] == v1


def test_a_stale_backend_is_flagged_alone_and_a_stale_fleet_gets_equal_weights(fleet: Fleet) -> None:
    late = {"gpu": 60.0}

    def stale_inputs() -> list[BackendInputs]:
        fresh = fleet()
        return [BackendInputs(fresh[0].backend, 1e8, 1e9, sources={"gpu": time.time()}),
                BackendInputs(fresh[1].backend, 9e8, 1e9, sources={"gpu": time.time() - late["gpu"]})]

    with WeightFeed(params(), inputs_fn=stale_inputs).start() as feed:
        doc = weights(feed)
        assert doc["stale"] is False and doc["stale_backends"] == [name(1)]
        assert doc["backends"][name(0)]["lb_weight"] == 100 and doc["backends"][name(1)]["reasons"] == ["stale"]
        metrics = {f.name: f for f in text_string_to_metric_families(get(feed, "/metrics")[2].decode())}
        assert metrics["triscope_weights_stale"].samples[0].value == 0
        assert {s.labels["backend"]: s.value for s in metrics["triscope_backend_stale"].samples} == {
            name(0): 0, name(1): 1}
        assert max(s.value for s in metrics["triscope_backend_input_age_seconds"].samples) >= 59

    def all_stale() -> list[BackendInputs]:
        return [BackendInputs(i.backend, 9e8, 1e9, sources={"gpu": time.time() - 60}) for i in fleet()]

    with WeightFeed(params(), inputs_fn=all_stale).start() as feed:
        doc = weights(feed)
        assert doc["stale"] is True and doc["stale_backends"] == [name(0), name(1)]
        assert {b["lb_weight"] for b in doc["backends"].values()} == {100}
        metrics = {f.name: f for f in text_string_to_metric_families(get(feed, "/metrics")[2].decode())}
        assert metrics["triscope_weights_stale"].samples[0].value == 1


def test_metrics_exposition(feed: WeightFeed, fleet: Fleet) -> None:
    fleet.kv["b"] = 0.5
    fleet.healthy["a"] = False
    wait_for(lambda: weights(feed)["backends"][name(0)]["state"] == "drain")
    status, headers, body = get(feed, "/metrics")
    assert status == 200 and headers["content-type"].startswith("text/plain; version=0.0.4")
    fams = {f.name: f for f in text_string_to_metric_families(body.decode())}
    by = {(s.name, tuple(sorted(s.labels.items()))): s.value for fam in fams.values() for s in fam.samples}
    assert by[("triscope_backend_drained", (("backend", name(0)),))] == 1
    assert by[("triscope_backend_drained", (("backend", name(1)),))] == 0
    assert by[("triscope_backend_draining", (("backend", name(0)),))] == 1
    assert by[("triscope_backend_weight", (("backend", name(0)),))] == 0
    assert by[("triscope_backend_lb_weight", (("backend", name(1)),))] >= 1
    assert by[("triscope_weights_input_kv_cache_usage_ratio", (("backend", name(1)),))] == 0.5
    assert by[("triscope_backend_weight_factor", (("backend", name(1)), ("factor", "kv_cache")))] == pytest.approx(2)
    assert by[("triscope_weights_input_memory_used_ratio", (("backend", name(1)),))] == pytest.approx(0.5)
    assert fams["triscope_weights_updates"].type == "counter"
    assert by[("triscope_weights_updates_total", ())] >= 1
    assert 1 <= by[("triscope_weights_version", ())] <= weights(feed)["version"]
    assert 0 <= by[("triscope_weights_inputs_age_seconds", ())] < 5
    assert by[("triscope_kv_cache_scale_recommendation", (("action", "hold"),))] == 1
    assert by[("triscope_request_class_priority_weight", (("request_class", "realtime_speech"),))] == 8
    assert by[("triscope_weights_last_update_timestamp_seconds", ())] == pytest.approx(time.time(), abs=5)


def test_metrics_pass_promtool(feed: WeightFeed, tmp_path) -> None:
    promtool = require_binary("promtool")
    body = get(feed, "/metrics")[2]
    proc = subprocess.run([promtool, "check", "metrics"], input=body, capture_output=True, timeout=30)
    assert proc.returncode == 0, proc.stderr.decode() + proc.stdout.decode()


def test_request_bodies_are_bounded_and_errors_are_json(feed: WeightFeed) -> None:
    status, _, body = get(feed, "/v3/discovery:endpoints", "POST", b"x" * 2000,
                          {"Content-Type": "application/json"})
    assert status == 413 and "max_body_bytes" in json.loads(body)["error"]
    status, _, body = get(feed, "/v1/weights", "GET", b"y" * 1025)
    assert status == 413
    # a lying Content-Length is refused before reading anything
    with socket.create_connection(("127.0.0.1", feed.http_port), timeout=5) as s:
        s.sendall(b"POST /v3/discovery:endpoints HTTP/1.1\r\nHost: x\r\nContent-Length: 99999999\r\n\r\n")
        assert s.recv(100).startswith(b"HTTP/1.1 413")
    with socket.create_connection(("127.0.0.1", feed.http_port), timeout=5) as s:
        s.sendall(b"POST /v3/discovery:endpoints HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
        assert s.recv(100).startswith(b"HTTP/1.1 411")
    status, _, body = get(feed, "/v1/weights", "GET", headers={"Content-Length": "-3"})
    assert status == 400
    status, _, body = get(feed, "/nope")
    assert status == 404 and json.loads(body)["error"].startswith("no such endpoint")
    status, _, _ = get(feed, "/v1/weights", "POST", b"{}")
    assert status == 405
    # the server survives all of that
    assert weights(feed)["backends"]


def test_envoy_and_traefik_routes(feed: WeightFeed) -> None:
    status, _, body = get(feed, "/v3/discovery:endpoints", "POST",
                          json.dumps({"resource_names": ["triscope"]}).encode(), {"Content-Type": "application/json"})
    assert status == 200
    doc = json.loads(body)
    assert doc["version_info"] == str(weights(feed)["version"])  # inputs are steady: no new version
    assert doc["resources"][0]["cluster_name"] == "triscope"
    status, _, body = get(feed, "/v1/traefik")
    assert status == 200 and "http" in json.loads(body)


def test_absent_envoy_or_traefik_module_gives_503(feed: WeightFeed, monkeypatch: pytest.MonkeyPatch) -> None:
    """``None`` in sys.modules makes the import fail exactly as an absent module does."""
    monkeypatch.setitem(sys.modules, "triscope.exporters.envoy_eds", None)
    monkeypatch.setitem(sys.modules, "triscope.exporters.traefik_provider", None)
    status, _, body = get(feed, "/v3/discovery:endpoints", "POST", b"{}")
    assert status == 503 and "envoy_eds" in json.loads(body)["error"] and body.count(b"\n") == 1
    # a serving process answers GET /v1/traefik from the table of the next update
    status, _, body = wait_for(lambda: (r := get(feed, "/v1/traefik"))[0] != 200 and r)
    assert status == 503 and "traefik_provider" in json.loads(body)["error"]


def test_failing_inputs_keep_the_last_result_and_health(fleet: Fleet) -> None:
    feed = WeightFeed(params(), inputs_fn=fleet)
    assert not feed.healthy() and feed.http_port == -1
    with feed.start():
        assert get(feed, "/healthz")[:1] == (200,)
        before = weights(feed)
        fleet.fail = "scrape refused"
        wait_for(lambda: feed.update_errors_total >= 2)
        assert feed.last_error == "scrape refused"
        assert weights(feed)["backends"] == before["backends"]  # last good result still served
        assert weights(feed)["computed_at"] == feed.result.computed_at  # not refreshed by failed updates
        fleet.fail = ""
        n = feed.updates_total
        wait_for(lambda: feed.updates_total > n)
        assert feed.last_error == ""


def test_no_result_yet_is_503() -> None:
    def broken() -> list[BackendInputs]:
        raise RuntimeError("store down")

    with WeightFeed(params(), inputs_fn=broken).start() as feed:
        status, _, body = get(feed, "/v1/weights")
        assert status == 503 and "store down" in json.loads(body)["error"]
        assert get(feed, "/healthz")[0] == 503
        assert agent(feed.agent_port, b"x\n") == b"up ready 100%\n"


def test_feed_binds_loopback_and_ports_can_be_off(fleet: Fleet) -> None:
    with WeightFeed(params(), inputs_fn=fleet, agent_port=-1).start() as feed:
        assert feed.agent_port == -1 and feed.http_port > 0
        assert feed.urls["weights"].startswith("http://127.0.0.1:")
        assert "haproxy_agent" not in feed.urls
    with pytest.raises(ConfigError):
        WeightFeed(params())
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    try:
        with pytest.raises(ConfigError, match="cannot listen"):
            WeightFeed(params(), inputs_fn=fleet, port=busy.getsockname()[1]).start()
    finally:
        busy.close()


def test_factory_builds_a_feed_from_config() -> None:
    feed = create({"weights": {"interval_s": 0.5, "feed": {"port": 0, "agent_port": -1}}},
                  Context(open_store=lambda: None))
    assert isinstance(feed, WeightFeed) and feed.params.interval_s == 0.5
    with pytest.raises(ConfigError):
        create({"weights": {"interval": 1}}, Context(open_store=lambda: None))


# --------------------------------------------------------------------------- HAProxy agent


def test_agent_replies_percent_drain_and_unknown(feed: WeightFeed, fleet: Fleet) -> None:
    doc = weights(feed)
    lb_b = doc["backends"][name(1)]["lb_weight"]
    assert agent(feed.agent_port, name(0).encode() + b"\n") == b"up ready 100%\n"
    reply = agent(feed.agent_port, name(1).encode() + b"\n")
    assert reply in (f"up ready {lb_b}%\n".encode(),
                     f"up ready {weights(feed)['backends'][name(1)]['lb_weight']}%\n".encode())
    assert agent(feed.agent_port, b"nobody:1\n") == b"up ready 100%\n"
    assert agent(feed.agent_port, b"\n") == b"up ready 100%\n"
    fleet.mem["a"] = 0.98
    wait_for(lambda: weights(feed)["backends"][name(0)]["state"] == "drain")
    # an agent process gets the update's table just after /v1/weights has it
    wait_for(lambda: agent(feed.agent_port, name(0).encode() + b"\r\n") == b"drain\n")
    fleet.mem["a"] = 0.1  # released: slow start, never 0%
    wait_for(lambda: weights(feed)["backends"][name(0)]["state"] == "ready")
    first = wait_for(lambda: (r := agent(feed.agent_port, name(0).encode() + b"\n")) != b"drain\n" and r)
    assert first.startswith(b"up ready ") and first.endswith(b"%\n") and int(first[9:-2]) >= 1


def test_agent_line_framing(feed: WeightFeed) -> None:
    # split across writes, no newline but EOF, trailing words ignored only after the newline
    with socket.create_connection(("127.0.0.1", feed.agent_port), timeout=5) as s:
        s.sendall(name(0).encode()[:5])
        time.sleep(0.05)
        s.sendall(name(0).encode()[5:] + b"\n")
        assert s.recv(100) == b"up ready 100%\n"
    assert agent(feed.agent_port, name(0).encode(), shutdown_write=True) == b"up ready 100%\n"
    # an over-long line gets no answer: the connection is closed
    assert agent(feed.agent_port, b"x" * (MAX_LINE + 10)) == b""
    assert agent(feed.agent_port, b"x" * MAX_LINE + b"\n") == b""
    # the agent is still serving
    assert agent(feed.agent_port, name(0).encode() + b"\n") == b"up ready 100%\n"


def test_agent_silent_client_times_out_without_blocking_others(feed: WeightFeed) -> None:
    silent = socket.create_connection(("127.0.0.1", feed.agent_port), timeout=5)
    try:
        t0 = time.monotonic()
        assert agent(feed.agent_port, name(0).encode() + b"\n") == b"up ready 100%\n"
        assert time.monotonic() - t0 < 0.5
        assert silent.recv(100) == b"up ready 100%\n"  # after the read timeout: unknown (empty) name
    finally:
        silent.close()


def test_urlopen_roundtrip(feed: WeightFeed) -> None:
    with urllib.request.urlopen(feed.urls["weights"], timeout=5) as resp:
        assert json.load(resp)["backends"]
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(feed.urls["weights"].replace("/v1/weights", "/v2"), timeout=5)
    assert err.value.code == 404


# --------------------------------------------------------------------------- store reader


def _ts(t: float) -> str:
    ns = int(t * 1e9)
    return f"{ns // 1_000_000_000}.{ns % 1_000_000_000:09d}"


def _seed(store, now: float) -> None:
    from triscope.schema import qualified

    gpu_rows = [  # gpu-a: GPUs 0 (40%) and 1 (90%, worst); gpu-b: GPU 0 lost; an old sample is superseded
        ("gpu-a", 0, now - 1, 32e9, 80e9, "ok"), ("gpu-a", 1, now - 30, 10e9, 80e9, "ok"),
        ("gpu-a", 1, now - 2, 72e9, 80e9, "ok"), ("gpu-b", 0, now - 1, 8e9, 80e9, "lost"),
    ]
    store.insert(qualified(store, "gpu_samples"), {
        "ts": [_ts(r[2]) for r in gpu_rows], "host": [r[0] for r in gpu_rows], "gpu": [r[1] for r in gpu_rows],
        "memory_used_bytes": [r[3] for r in gpu_rows], "memory_total_bytes": [r[4] for r in gpu_rows],
        "state": [r[5] for r in gpu_rows], "source": ["nvml"] * len(gpu_rows)})
    sm = [("gpu-a:8000", now - 4, 0.2, 100.0, 0.3), ("gpu-a:8000", now - 0.5, 0.6, 140.0, 0.5),
          ("gpu-b:8000", now - 0.5, 0.1, 10.0, 2.0)]
    store.insert(qualified(store, "serving_metrics"), {
        "ts": [_ts(r[1]) for r in sm], "backend": [r[0] for r in sm], "kv_cache_usage_ratio": [r[2] for r in sm],
        "requests_total": [r[3] for r in sm], "latency_p99_seconds": [r[4] for r in sm],
        "host": [r[0].split(":")[0] for r in sm]})
    reqs = [("gpu-a:8000", "gpu-a", "0", now - 3 + i * 0.01, 0.1 + i * 0.001, "realtime_speech") for i in range(100)]
    reqs += [("gpu-a:8000", "gpu-a", "1", now - 2, 3.0, "mystery")]  # unknown class -> default class
    store.insert(qualified(store, "requests"), {
        "ts": [_ts(r[3]) for r in reqs], "backend": [r[0] for r in reqs], "host": [r[1] for r in reqs],
        "gpu": [r[2] for r in reqs], "latency_seconds": [r[4] for r in reqs],
        "request_class": [r[5] for r in reqs]})


def test_store_reader_and_feed(store, tmp_path) -> None:
    from triscope.analyzers.routing import read_inputs
    from triscope.writer import Writer

    now = time.time()
    _seed(store, now)
    p = WeightParams.from_config({"weights": {"interval_s": 0.2, "feed": {"port": 0, "agent_port": 0},
                                              "backends": {"gpu-b:8000": {"host": "gpu-b", "gpus": [0],
                                                                          "address": "127.0.0.1:9002"}}}})
    inputs = {i.backend: i for i in read_inputs(store, p, now)}
    assert set(inputs) == {"gpu-a:8000", "gpu-b:8000"}
    a, b = inputs["gpu-a:8000"], inputs["gpu-b:8000"]
    assert a.memory_used_ratio == pytest.approx(0.9)  # worst GPU of the backend, latest sample
    assert a.kv_cache_usage_ratio == pytest.approx(0.6)
    assert a.qps == pytest.approx(101 / p.window_s)  # requests rows win over the counter
    assert a.p99_seconds["realtime_speech"] == pytest.approx(0.1 + 0.99 * 99 * 0.001, abs=2e-3)
    assert a.p99_seconds["interactive_image_text"] == pytest.approx(3.0)
    assert a.sources["gpu"] == pytest.approx(now - 2, abs=1e-3) and a.healthy
    assert not b.healthy and b.memory_used_ratio == pytest.approx(0.1) and b.address == "127.0.0.1:9002"
    assert b.p99_seconds == {"interactive_image_text": 2.0}  # serving P99 as the default class
    assert b.qps != b.qps  # one counter sample: no rate
    writer = Writer(store, str(tmp_path / "spool"))
    with WeightFeed(p, store=store, submit=writer.submit).start() as feed:
        doc = weights(feed)
        assert doc["backends"]["gpu-b:8000"]["state"] == "drain"
        assert doc["backends"]["gpu-b:8000"]["reasons"] == ["health"]
        assert doc["backends"]["gpu-a:8000"]["factors"]["memory"] == pytest.approx(10.0)
        assert agent(feed.agent_port, b"gpu-b:8000\n") == b"drain\n"
        updates = feed.updates_total
    # the writer's close() flushed the history: one row per backend per update
    writer.close()
    from triscope.schema import qualified

    rows = store.query(f"SELECT backend, state, reasons, lb_weight, factor_memory, version, "
                       f"toUnixTimestamp64Nano(ts) FROM {qualified(store, 'weights_history')} ORDER BY ts, backend"
                       ).rows
    assert len(rows) >= 2 * updates - 2 and len(rows) % 2 == 0  # an update may race the flush at close
    assert tuple(rows[0][:4]) == ("gpu-a:8000", "ready", "", 100)  # the only ready backend
    assert tuple(rows[1][1:4]) == ("drain", "health", 0)
    assert rows[0][4] == pytest.approx(10.0) and rows[0][5] >= 1
    assert abs(rows[0][6] / 1e9 - now) < 30
    # a store opener (what `triscope run` passes) works too
    with WeightFeed(p, store=lambda: store).start() as feed:
        assert weights(feed)["backends"]["gpu-a:8000"]["state"] == "ready"


# --------------------------------------------------------------------------- CLI


def _config_file(tmp_path, store, extra: str = "") -> str:
    path = tmp_path / "triscope.toml"
    path.write_text(f'[store]\nbackend = "embedded"\npath = "{store.path}"\ndatabase = "{store.database}"\n'
                    f'[weights]\ndiscover = true\n{extra}')
    return str(path)


def test_cli_serve_once_json_and_table(store, tmp_path, capsys, monkeypatch) -> None:
    from triscope.cli import main

    monkeypatch.delenv("TRISCOPE_CONFIG", raising=False)
    monkeypatch.setenv("COLUMNS", "200")
    _seed(store, time.time())
    cfg = _config_file(tmp_path, store, '[weights.backends."gpu-b:8000"]\nhost = "gpu-b"\ngpus = [0]\n')
    assert main(["weights", "serve", "--once", "--json", "-c", cfg]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert set(doc["backends"]) == {"gpu-a:8000", "gpu-b:8000"}
    assert doc["backends"]["gpu-a:8000"]["inputs"]["memory_used_ratio"] == pytest.approx(0.9)
    assert doc["backends"]["gpu-b:8000"]["state"] == "drain"
    assert main(["weights", "show", "-c", cfg]) == 0
    out = capsys.readouterr().out
    assert "gpu-a:8000" in out and "drain" in out and "KV-cache scaling" in out
    assert "class offline_video" not in out, "no class limit configured: nothing to report"
    limited = _config_file(tmp_path, store, '[weights.backends."gpu-b:8000"]\nhost = "gpu-b"\ngpus = [0]\n'
                           "[weights.classes.offline_video]\nadmit_kv_ratio = 0.0\n")
    assert main(["weights", "show", "-c", limited]) == 0  # every measured KV is >= 0: video closed everywhere
    assert "class offline_video: SHEDDING" in capsys.readouterr().out
    assert main(["weights", "serve", "--once", "--json", "-c", limited]) == 0
    adm = json.loads(capsys.readouterr().out)["class_admission"]
    assert adm["offline_video"]["shedding"] and adm["realtime_speech"]["backends"]["gpu-a:8000"] == "ready"
    bad = _config_file(tmp_path, store, "floor = 0\n")
    assert main(["weights", "serve", "--once", "-c", bad]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "floor" in err


def test_cli_serve_runs_until_sigterm(tmp_path) -> None:
    import os
    import re
    import signal

    from conftest import REPO

    env = {**os.environ, "TRISCOPE_STORE__PATH": str(tmp_path / "db"), "TRISCOPE_WEIGHTS__INTERVAL_S": "0.2",
           "TRISCOPE_WRITER__SPOOL_DIR": str(tmp_path / "spool")}
    env.pop("TRISCOPE_CONFIG", None)
    proc = subprocess.Popen([sys.executable, "-m", "triscope", "weights", "serve", "--port", "0", "--agent-port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)
    try:
        line = proc.stdout.readline()
        m = re.search(r"weights=http://127\.0\.0\.1:(\d+)/v1/weights .*haproxy_agent=tcp://127\.0\.0\.1:(\d+)", line)
        assert m, line + proc.stderr.read() if proc.poll() is not None else line
        http_port, agent_port = int(m.group(1)), int(m.group(2))
        with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/v1/weights", timeout=10) as resp:
            doc = json.load(resp)
        assert doc["backends"] == {} and doc["stale"] is True  # empty store: nothing known yet
        with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/healthz", timeout=10) as resp:
            assert resp.read() == b"ok\n"
        assert agent(agent_port, b"x:1\n") == b"up ready 100%\n"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# --------------------------------------------------------------------------- triscope run


def test_triscope_run_serves_weights_from_scraped_metrics(tmp_path) -> None:
    """``triscope run`` (own chDB dir): serving_metrics scrapes a vLLM-style /metrics into the store,
    the ``weights_feed`` exporter reads it back and publishes the backend's weight."""
    import os
    import signal

    from prometheus_client import CollectorRegistry, Gauge, start_http_server

    registry = CollectorRegistry()
    kv = Gauge("vllm:kv_cache_usage_perc", "kv", ["model_name", "engine"], registry=registry)
    kv.labels("llama", "0").set(0.75)
    metrics_port = free_port()
    server, _ = start_http_server(metrics_port, addr="127.0.0.1", registry=registry)
    feed_port = free_port()
    cfg = tmp_path / "triscope.toml"
    cfg.write_text(f"""
[store]
path = "{tmp_path / 'chdb'}"
database = "feedrun"
[run]
collectors = ["serving_metrics"]
exporters = ["weights_feed"]
[writer]
spool_dir = "{tmp_path / 'spool'}"
flush_interval_s = 0.2
[serving_metrics]
interval_s = 0.2
targets = ["http://127.0.0.1:{metrics_port}/metrics"]
[weights]
interval_s = 0.2
[weights.feed]
port = {feed_port}
agent_port = -1
""")
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRISCOPE_") or k == "TRISCOPE_REQUIRE_ALL"}
    proc = subprocess.Popen([sys.executable, "-m", "triscope", "run", "--config", str(cfg)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    backend = f"127.0.0.1:{metrics_port}"
    try:
        deadline = time.monotonic() + 60
        doc: dict = {}
        while time.monotonic() < deadline:
            assert proc.poll() is None, proc.stderr.read()
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{feed_port}/v1/weights", timeout=2) as resp:
                    doc = json.load(resp)
            except (OSError, ValueError):
                doc = {}
            b = doc.get("backends", {}).get(backend)
            if b and b["inputs"]["kv_cache_usage_ratio"] == 0.75:
                break
            time.sleep(0.2)
        b = doc["backends"][backend]
        assert b["factors"]["kv_cache"] == pytest.approx(4.0) and b["state"] == "ready"
        assert b["address"] == backend and doc["stale"] is False
        kv.labels("llama", "0").set(0.99)  # >= drain_kv_ratio: the next scrape drains it (sole backend:
        deadline = time.monotonic() + 30  # drain suppressed, stays ready at the floor, flagged)
        while time.monotonic() < deadline:
            with urllib.request.urlopen(f"http://127.0.0.1:{feed_port}/v1/weights", timeout=2) as resp:
                doc = json.load(resp)
            if doc["drain_suppressed"]:
                break
            time.sleep(0.2)
        assert doc["drain_suppressed"] and doc["backends"][backend]["reasons"] == ["kv_cache"]
        assert doc["backends"][backend]["lb_weight"] == 5
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        server.shutdown()


@pytest.mark.parametrize("serve_process", [False, True], ids=["in-process", "serve-process"])
def test_connection_cap_closes_extra_connections(fleet: Fleet, serve_process: bool) -> None:
    p = WeightParams.from_config({"weights": {"interval_s": 0.1,
                                              "feed": {"port": 0, "agent_port": 0, "max_connections": 2,
                                                       "serve_process": serve_process}}})
    with WeightFeed(p, inputs_fn=fleet).start() as feed:
        # two keep-alive connections that have been answered hold the HTTP port's slots: never evicted
        held = [socket.create_connection(("127.0.0.1", feed.http_port), timeout=5) for _ in range(2)]
        try:
            for s in held:
                s.sendall(b"GET /v1/weights HTTP/1.1\r\nHost: x\r\n\r\n")
                assert s.recv(65536).startswith(b"HTTP/1.1 200")
            with socket.create_connection(("127.0.0.1", feed.http_port), timeout=5) as extra:
                extra.sendall(b"GET /v1/weights HTTP/1.1\r\nHost: x\r\n\r\n")
                with contextlib.suppress(ConnectionResetError):  # closed without an answer
                    assert extra.recv(100) == b""
        finally:
            for s in held:
                s.close()
        # two idle agent connections: a check sent at once takes the slot of the older one
        idle = [socket.create_connection(("127.0.0.1", feed.agent_port), timeout=5) for _ in range(2)]
        try:
            time.sleep(0.3)
            assert agent(feed.agent_port, name(0).encode() + b"\n") == b"up ready 100%\n"
        finally:
            for s in idle:
                s.close()
        time.sleep(0.2)  # slots freed
        assert agent(feed.agent_port, name(0).encode() + b"\n") == b"up ready 100%\n"
        assert weights(feed)["backends"]
        with pytest.raises(ConfigError):
            WeightFeed(WeightParams.from_config({"weights": {"feed": {"max_connections": 0}}}), inputs_fn=fleet)


def test_history_rows_survive_a_refusing_store(store, tmp_path) -> None:
    """History rows go to the writer, which keeps them while the store is down and writes them once it is back."""
    from triscope.errors import StoreError
    from triscope.schema import qualified
    from triscope.writer import Writer

    class Borrowed:
        """The test's store, lent to the writer (which closes what its opener returns)."""

        def __getattr__(self, attr: str):
            return getattr(store, attr)

        def close(self) -> None:
            pass

    down = {"now": False}

    def opener():
        if down["now"]:
            raise StoreError("store down")
        return Borrowed()

    now = time.time()
    _seed(store, now)
    p = WeightParams.from_config({"weights": {"feed": {"port": -1, "agent_port": -1}}})
    writer = Writer(opener, str(tmp_path / "spool"), retry_max_s=0.1)
    feed = WeightFeed(p, store=store, submit=writer.submit)
    down["now"] = True
    feed.update()
    feed.update()
    assert not writer.flush(timeout_s=0.5)  # the store refuses: kept in the spool for the next try
    snap = writer.snapshot()
    assert snap["rows_pending"] == 4 and snap["rows_written"] == 0
    assert feed.history is not None and feed.history.rows_submitted == 4
    down["now"] = False
    feed.update()
    time.sleep(0.6)  # past the writer's retry backoff
    assert writer.flush(timeout_s=10) and writer.snapshot()["rows_written"] == 6
    writer.close()
    versions = store.query(f"SELECT count(), uniqExact(ts) FROM {qualified(store, 'weights_history')}").rows[0]
    assert tuple(versions) == (6, 3)


def test_store_reader_counter_rate_and_lookback(store) -> None:
    from triscope.analyzers.routing import read_inputs
    from triscope.schema import qualified

    now = time.time()
    sm = [("c:1", now - 8, 1000.0), ("c:1", now - 3, 1100.0), ("c:1", now - 1, 1180.0),
          ("old:1", now - 400, 5.0)]  # outside lookback_s (300 s): not discovered
    store.insert(qualified(store, "serving_metrics"), {
        "ts": [_ts(r[1]) for r in sm], "backend": [r[0] for r in sm], "requests_total": [r[2] for r in sm],
        "kv_cache_usage_ratio": [0.5] * len(sm), "latency_p99_seconds": [float("nan")] * len(sm)})
    inputs = read_inputs(store, WeightParams(), now)
    assert [i.backend for i in inputs] == ["c:1"]
    c = inputs[0]
    assert c.qps == pytest.approx(180.0 / 7.0, rel=1e-6)  # counter rate over the 10 s window
    assert c.p99_seconds == {}  # NaN P99 = not measured
    assert c.memory_used_ratio != c.memory_used_ratio and c.sources["serving"] == pytest.approx(now - 1, abs=1e-3)


def _read_responses(sock: socket.socket, count: int) -> list[bytes]:
    """``count`` complete HTTP responses (Content-Length framed) from ``sock``."""
    data, out = b"", []
    while len(out) < count:
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
        while (end := data.find(b"\r\n\r\n")) >= 0:
            head = data[:end].decode("latin-1")
            length = int(next(h.split(":", 1)[1] for h in head.split("\r\n")
                              if h.lower().startswith("content-length")))
            if len(data) < end + 4 + length:
                break
            out.append(data[:end + 4 + length])
            data = data[end + 4 + length:]
    return out


def test_keep_alive_pipelining_and_connection_close(feed: WeightFeed) -> None:
    request = b"GET /v1/weights HTTP/1.1\r\nHost: x\r\n\r\n"
    with socket.create_connection(("127.0.0.1", feed.http_port), timeout=5) as s:
        s.sendall(request * 3 + b"HEAD /v1/weights HTTP/1.1\r\nHost: x\r\n\r\n"[:20])  # 3 whole, 1 split
        answers = _read_responses(s, 3)
        assert len(answers) == 3 and all(a.startswith(b"HTTP/1.1 200") for a in answers)
        assert len(set(answers)) == 1  # the same pre-encoded bytes
        s.sendall(b"HEAD /v1/weights HTTP/1.1\r\nHost: x\r\n\r\n"[20:]
                  + b"GET /healthz HTTP/1.1\r\nConnection: close\r\n\r\n")
        rest = b""
        while chunk := s.recv(65536):
            rest += chunk
        head_answer, _, after = rest.partition(b"\r\n\r\n")
        assert head_answer.startswith(b"HTTP/1.1 200") and after.startswith(b"HTTP/1.1 200")  # HEAD: no body
        assert after.endswith(b"ok\n") and b"Connection: close" in after
    with socket.create_connection(("127.0.0.1", feed.http_port), timeout=5) as s:  # HTTP/1.0: one request
        s.sendall(b"GET /v1/weights HTTP/1.0\r\n\r\n")
        assert _read_responses(s, 1)[0].startswith(b"HTTP/1.1 200") and s.recv(10) == b""


def test_oversized_head_malformed_line_and_idle_connections_are_closed(fleet: Fleet) -> None:
    p = params(feed={"port": 0, "agent_port": -1, "header_timeout_s": 0.3})
    with WeightFeed(p, inputs_fn=fleet).start() as feed:
        with socket.create_connection(("127.0.0.1", feed.http_port), timeout=5) as s:
            s.sendall(b"GET /v1/weights HTTP/1.1\r\nX-Big: " + b"a" * 20_000)
            assert s.recv(100).startswith(b"HTTP/1.1 431")
        with socket.create_connection(("127.0.0.1", feed.http_port), timeout=5) as s:
            s.sendall(b"BREW\r\n\r\n")
            assert s.recv(100).startswith(b"HTTP/1.1 400")
        with socket.create_connection(("127.0.0.1", feed.http_port), timeout=5) as s:
            s.sendall(b"GET /v1/weights HTTP/1.1\r\n")  # never finished
            started = time.monotonic()
            assert s.recv(100) == b"" and time.monotonic() - started < 3
        assert weights(feed)["backends"]  # still serving


def test_cli_explain_shows_every_factor_of_one_backend(store, tmp_path, capsys, monkeypatch) -> None:
    from triscope.cli import main

    monkeypatch.delenv("TRISCOPE_CONFIG", raising=False)
    monkeypatch.setenv("COLUMNS", "200")
    _seed(store, time.time())
    cfg = _config_file(tmp_path, store, '[weights.backends."gpu-b:8000"]\nhost = "gpu-b"\ngpus = [0]\n')
    assert main(["weights", "explain", "gpu-a:8000", "--json", "-c", cfg]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["inputs"]["memory_used_ratio"] == pytest.approx(0.9)
    assert doc["penalties"]["memory"] > 1 and set(doc["penalties"]) >= {"memory", "kv_cache", "load", "latency"}
    product = math.prod(v for v in doc["penalties"].values())
    assert doc["penalty_product"] == pytest.approx(product) and doc["raw_weight"] == pytest.approx(1 / product)
    assert doc["haproxy_agent_reply"] == f"up ready {doc['lb_weight']}%"
    assert main(["weights", "explain", "gpu-b:8000", "-c", cfg]) == 0
    out = capsys.readouterr().out
    assert "gpu-b:8000" in out and "drain because" in out and "penalties" in out and "'drain'" in out
    assert main(["weights", "explain", "nope:1", "-c", cfg]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "gpu-a:8000" in err
