"""The weight feed when telemetry or the store fails: the real feed over a
real embedded store (chDB) and real sockets on 127.0.0.1; the feed's clock is moved instead of
waiting minutes for rows to age past ``lookback_s``."""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from conftest import REPO, free_port

from triscope.analyzers.routing import WeightParams
from triscope.errors import StoreError
from triscope.exporters.feed import WeightFeed
from triscope.schema import SERVING_METRICS, encode_ts, qualified

NAMES = [f"127.0.0.1:{9001 + i}" for i in range(3)]


def _serving(store: Any, t: float, kv: dict[str, float]) -> None:
    rows = [{"ts": encode_ts(int(t * 1e9)), "backend": name, "host": "127.0.0.1", "server": "vllm",
             "kv_cache_usage_ratio": value} for name, value in kv.items()]
    store.insert(qualified(store, SERVING_METRICS), SERVING_METRICS.columns_of(rows))


def _request(port: int, method: str, path: str, body: bytes | None = None) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request(method, path, body=body)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def _weights(feed: WeightFeed) -> dict:
    status, body = _request(feed.http_port, "GET", "/v1/weights")
    assert status == 200
    return json.loads(body)


def _eds(feed: WeightFeed) -> tuple[int, dict[int, int]]:
    """Status and {port: load_balancing_weight} of the Envoy answer."""
    status, body = _request(feed.http_port, "POST", "/v3/discovery:endpoints", b'{"resource_names": ["triscope"]}')
    if status != 200:
        return status, {}
    (cla,) = json.loads(body)["resources"]
    return status, {e["endpoint"]["address"]["socket_address"]["port_value"]: e["load_balancing_weight"]
                    for group in cla["endpoints"] for e in group["lb_endpoints"]}


def _traefik(feed: WeightFeed) -> tuple[int, dict[str, int]]:
    status, body = _request(feed.http_port, "GET", "/v1/traefik")
    if status != 200:
        return status, {}
    services = json.loads(body)["http"]["services"]
    return status, {s["name"]: s["weight"] for s in services["triscope"]["weighted"]["services"]}


def _agent(feed: WeightFeed, name: str) -> bytes:
    with socket.create_connection(("127.0.0.1", feed.agent_port), timeout=5) as s:
        s.sendall(name.encode() + b"\n")
        return s.recv(100)


def _params(**extra: Any) -> WeightParams:
    return WeightParams.from_config({"weights": {
        "interval_s": 3600, "lookback_s": 30, "stale_after_s": 5, "history": False,  # the test drives updates
        "feed": {"port": 0, "agent_port": 0}, **extra}})


@pytest.fixture()
def clock() -> list[float]:
    return [time.time()]


@pytest.fixture()
def feed(store: Any, clock: list[float]) -> Iterator[WeightFeed]:
    _serving(store, clock[0] - 1, dict(zip(NAMES, (0.0, 0.5, 0.75), strict=True)))
    f = WeightFeed(_params(), store=store, clock=lambda: clock[0]).start()
    try:
        yield f
    finally:
        f.close()


def test_telemetry_stopping_keeps_the_known_fleet_published(feed: WeightFeed, store: Any, clock: list[float]) -> None:
    ports = [9001, 9002, 9003]
    assert _eds(feed) == (200, dict(zip(ports, (100, 50, 25), strict=True)))  # KV penalties 1, 2, 4

    clock[0] += 60  # every row is now older than lookback_s = 30 s: the reader finds no backend
    feed.step()
    doc = _weights(feed)
    assert doc["stale"] is True and doc["absent_backends"] == NAMES
    assert {n: (b["lb_weight"], b["state"], b["reasons"]) for n, b in doc["backends"].items()} == {
        n: (100, "ready", ["absent"]) for n in NAMES}
    assert _eds(feed) == (200, dict.fromkeys(ports, 100))  # Envoy keeps every host, equal weights
    assert _traefik(feed) == (200, {f"b-127-0-0-1-{p}": 100 for p in ports})
    assert {_agent(feed, n) for n in NAMES} == {b"up ready 100%\n"}
    metrics = _request(feed.http_port, "GET", "/metrics")[1].decode()
    assert "triscope_weights_absent_backends 3" in metrics and "triscope_weights_stale 1" in metrics

    # telemetry returns for two: they are weighed again, the silent one stays listed, eased to the floor
    lb = []
    for _ in range(6):
        clock[0] += 1
        _serving(store, clock[0] - 0.5, {NAMES[0]: 0.0, NAMES[1]: 0.5})
        feed.step()
        doc = _weights(feed)
        assert doc["stale"] is False and doc["absent_backends"] == [NAMES[2]]
        assert doc["backends"][NAMES[2]]["reasons"] == ["absent"] and doc["backends"][NAMES[2]]["state"] == "ready"
        lb.append(doc["backends"][NAMES[2]]["lb_weight"])
    assert lb == [50, 18, 9, 6, 5, 5]  # bounded, damped steps down to floor * lb_scale
    assert _eds(feed)[1][9003] == 5

    # the operator removes it (SIGHUP to `triscope weights serve`; feed.forget() here)
    assert feed.forget() == (NAMES[2],)
    clock[0] += 1
    _serving(store, clock[0] - 0.5, {NAMES[0]: 0.0, NAMES[1]: 0.5})
    feed.step()
    assert set(_weights(feed)["backends"]) == set(NAMES[:2]) and set(_eds(feed)[1]) == {9001, 9002}

    # with nothing known at all, the LB formats answer 503 (keep what you have), never an empty list
    clock[0] += 60
    feed.step()
    assert feed.forget() == tuple(NAMES[:2])
    feed.step()
    assert _weights(feed)["backends"] == {}
    assert _eds(feed)[0] == 503 and _traefik(feed)[0] == 503
    assert _agent(feed, NAMES[0]) == b"up ready 100%\n"  # fail open


def test_forget_after_s_drops_the_silent_only_while_others_report(store: Any, clock: list[float]) -> None:
    _serving(store, clock[0] - 1, dict.fromkeys(NAMES, 0.2))
    with WeightFeed(_params(forget_after_s=20), store=store, clock=lambda: clock[0]).start() as feed:
        clock[0] += 100  # everyone silent: nothing is forgotten, however long
        feed.step()
        assert _weights(feed)["absent_backends"] == NAMES
        _serving(store, clock[0] - 0.5, {NAMES[0]: 0.2})  # one reports again: the others are past 20 s
        feed.step()
        doc = _weights(feed)
        assert set(doc["backends"]) == {NAMES[0]} and doc["stale"] is False


class Flaky:
    """The test's store, lent to the feed, refusing every call while ``down`` (a server store
    that is unreachable answers StoreError just like this)."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self.down = True
        self.database = getattr(store, "database", "")

    def open(self) -> Flaky:
        if self.down:
            raise StoreError("cannot reach ClickHouse at http://127.0.0.1:1: connection refused")
        return self

    def query(self, *args: Any, **kwargs: Any) -> Any:
        if self.down:
            raise StoreError("query failed: connection refused")
        return self.store.query(*args, **kwargs)

    def close(self) -> None:
        pass


def test_store_down_at_start_then_back_then_down_again(store: Any, clock: list[float]) -> None:
    flaky = Flaky(store)
    params = _params(backends={"gpu-a": {"address": "127.0.0.1:9101"}})
    with WeightFeed(params, store=flaky.open, clock=lambda: clock[0]).start() as feed:
        doc = _weights(feed)  # down from the start: configured backends at equal weights, marked stale
        assert feed.fallback and "connection refused" in feed.last_error
        assert doc["stale"] is True and doc["backends"]["gpu-a"]["lb_weight"] == 100
        assert _eds(feed) == (200, {9101: 100})
        assert _request(feed.http_port, "GET", "/healthz")[0] == 503  # the operator still sees it

        flaky.down = False  # the store returns: the next update reads it
        _serving(store, clock[0] - 0.5, {"gpu-a": 0.0, NAMES[0]: 0.75})
        feed.step()
        doc = _weights(feed)
        assert not feed.fallback and feed.last_error == "" and doc["stale"] is False
        assert doc["backends"][NAMES[0]]["target"] == pytest.approx(0.25)

        flaky.down = True  # down again: the last good weights for stale_after_s, then equal ones
        feed.step()
        assert _weights(feed)["stale"] is False and not feed.fallback
        clock[0] += 6
        feed.step()
        doc = _weights(feed)
        assert feed.fallback and doc["stale"] is True
        assert {n: b["lb_weight"] for n, b in doc["backends"].items()} == {"gpu-a": 100, NAMES[0]: 100}
        assert doc["absent_backends"] == [NAMES[0]]  # known from the store, unreadable now: kept


def test_store_down_without_any_known_backend_keeps_503(clock: list[float]) -> None:
    flaky = Flaky(None)
    with WeightFeed(_params(), store=flaky.open, clock=lambda: clock[0]).start() as feed:
        status, body = _request(feed.http_port, "GET", "/v1/weights")
        assert status == 503 and "connection refused" in json.loads(body)["error"]
        assert _eds(feed)[0] == 503


@pytest.mark.parametrize("body", [b"[" * 100_000, b'{"a":' * 100_000, b'{"resource_names": ' + b"7" * 5000 + b"}"],
                         ids=["deep-array", "deep-object", "huge-int"])
def test_hostile_eds_bodies_get_400_not_500(feed: WeightFeed, body: bytes) -> None:
    status, text = _request(feed.http_port, "POST", "/v3/discovery:endpoints", body)
    assert status == 400 and text.count(b"\n") == 1
    assert "invalid DiscoveryRequest JSON" in json.loads(text)["error"]
    assert _eds(feed)[0] == 200  # and the feed goes on


# --------------------------------------------------------------------------- `triscope weights serve`


def _serve(tmp_path: Any, config: str) -> tuple[subprocess.Popen, int, int]:
    path = tmp_path / "triscope.toml"
    path.write_text(config + f'\n[writer]\nspool_dir = "{tmp_path / "spool"}"\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRISCOPE_")}
    proc = subprocess.Popen([sys.executable, "-m", "triscope", "weights", "serve", "-c", str(path), "--port", "0",
                             "--agent-port", "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, cwd=REPO)
    timer = threading.Timer(60, proc.kill)  # a hung start fails the test instead of hanging it
    timer.start()
    try:
        line = proc.stdout.readline() if proc.stdout else ""
    finally:
        timer.cancel()
    m = re.search(r"weights=http://127\.0\.0\.1:(\d+)/v1/weights .*haproxy_agent=tcp://127\.0\.0\.1:(\d+)", line)
    if not m:
        proc.kill()
        raise AssertionError(f"no feed line: {line!r} {proc.communicate()[1]}")
    return proc, int(m.group(1)), int(m.group(2))


def _stop(proc: subprocess.Popen, timeout_s: float) -> tuple[int, float, str]:
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    try:
        _, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
        raise AssertionError(f"no exit within {timeout_s}s of SIGTERM: {err[-2000:]}") from None
    return proc.returncode, time.monotonic() - t0, err


def test_serve_starts_while_the_server_store_refuses(tmp_path: Any) -> None:
    dead = free_port()  # nothing listens: every connection is refused
    proc, http_port, agent_port = _serve(tmp_path, f"""
[store]
backend = "server"
url = "http://127.0.0.1:{dead}"
[weights]
interval_s = 0.2
[weights.backends.gpu-a]
address = "127.0.0.1:9201"
[weights.backends.gpu-b]
address = "127.0.0.1:9202"
""")
    try:
        status, body = _request(http_port, "GET", "/v1/weights")
        doc = json.loads(body)
        assert status == 200 and doc["stale"] is True
        assert {n: b["lb_weight"] for n, b in doc["backends"].items()} == {"gpu-a": 100, "gpu-b": 100}
        status, body = _request(http_port, "POST", "/v3/discovery:endpoints", b"{}")
        assert status == 200 and body.count(b"load_balancing_weight") == 2
        with socket.create_connection(("127.0.0.1", agent_port), timeout=5) as s:
            s.sendall(b"gpu-a\n")
            assert s.recv(100) == b"up ready 100%\n"
        assert _request(http_port, "GET", "/healthz")[0] == 503
    finally:
        code, took, err = _stop(proc, 20)
    assert code == 0, err
    assert "first update failed: cannot reach ClickHouse" in err and "Traceback" not in err


def _hammer(http_port: int, agent_port: int, stop: threading.Event, counts: list[int]) -> None:
    """One LB-like poller: /v1/weights, Envoy EDS and the agent, back to back."""
    while not stop.is_set():
        try:
            _request(http_port, "GET", "/v1/weights")
            _request(http_port, "POST", "/v3/discovery:endpoints", b"{}")
            with socket.create_connection(("127.0.0.1", agent_port), timeout=5) as s:
                s.sendall(b"x:1\n")
                s.recv(100)
            counts.append(1)
        except OSError:
            if not stop.is_set():
                time.sleep(0.01)


def test_serve_stops_promptly_on_sigterm_under_polling(tmp_path: Any) -> None:
    """SIGTERM used to wait behind a bare Event.wait() while threads served polls."""
    took_all = []
    for _ in range(2):
        proc, http_port, agent_port = _serve(tmp_path, f"""
[store]
path = "{tmp_path / 'db'}"
[weights]
interval_s = 0.2
[weights.backends.gpu-a]
address = "127.0.0.1:9301"
""")
        stop, counts = threading.Event(), []
        pollers = [threading.Thread(target=_hammer, args=(http_port, agent_port, stop, counts), daemon=True)
                   for _ in range(8)]
        idle = [socket.create_connection(("127.0.0.1", http_port)) for _ in range(50)]  # held, silent
        try:
            for t in pollers:
                t.start()
            time.sleep(2.0)
            assert len(counts) > 10  # the LB load is real
            code, took, err = _stop(proc, 15)
        finally:
            stop.set()
            for t in pollers:
                t.join(timeout=10)
            for s in idle:
                s.close()
        assert code == 0 and "Traceback" not in err, err
        took_all.append(took)
    print(f"\nSIGTERM to exit under polling: {', '.join(f'{t:.2f}s' for t in took_all)}")
    assert max(took_all) < 8.0
