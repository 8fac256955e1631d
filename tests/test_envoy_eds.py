"""Envoy REST EDS responses built from real engine results (compute_weights)."""

from __future__ import annotations

import json

import pytest

from triscope.analyzers.routing import BackendInputs, WeightParams, compute_weights
from triscope.exporters.envoy_eds import CLA_TYPE, eds_response

GIB = 1024**3
NOW = 1_800_000_000.0


def _inputs(mem: dict[str, float], addresses: dict[str, str] | None = None) -> list[BackendInputs]:
    addresses = addresses or {}
    return [BackendInputs(name, memory_used_bytes=ratio * 80 * GIB, memory_total_bytes=80 * GIB,
                          sources={"gpu": NOW - 0.5, "serving": NOW - 0.5},
                          address=addresses.get(name, f"127.0.0.1:{9001 + i}"))
            for i, (name, ratio) in enumerate(sorted(mem.items()))]


def _result(mem: dict[str, float], params: WeightParams | None = None, **kw):
    params = params or WeightParams()
    result, _ = compute_weights(_inputs(mem, **kw), None, params, NOW)
    return result, params


def _request(names: list[str] | None = None, **extra) -> bytes:
    body = {"version_info": "", "node": {"id": "test", "cluster": "c"}, "type_url": CLA_TYPE,
            "resource_names": ["triscope"] if names is None else names, **extra}
    return json.dumps(body).encode()


def _endpoints(body: bytes) -> dict[int, dict]:
    doc = json.loads(body)
    (cla,) = doc["resources"]
    return {e["endpoint"]["address"]["socket_address"]["port_value"]: e
            for group in cla["endpoints"] for e in group["lb_endpoints"]}


def test_weights_follow_memory_headroom() -> None:
    result, params = _result({"a:1": 0.0, "b:1": 0.5, "c:1": 0.75})
    status, body = eds_response(result, _request(), params)
    assert status == 200
    doc = json.loads(body)
    assert doc["type_url"] == CLA_TYPE and doc["version_info"] == str(result.version) and doc["nonce"]
    cla = doc["resources"][0]
    assert cla["@type"] == CLA_TYPE and cla["cluster_name"] == "triscope"
    eps = _endpoints(body)
    # memory penalty 1 / (1 - used): 1, 2, 4 -> targets 1, 0.5, 0.25 -> lb weights 100, 50, 25
    assert [eps[p]["load_balancing_weight"] for p in (9001, 9002, 9003)] == [100, 50, 25]
    assert {e["health_status"] for e in eps.values()} == {"HEALTHY"}
    assert eps[9001]["endpoint"]["address"]["socket_address"]["address"] == "127.0.0.1"
    assert eps[9002]["metadata"]["filter_metadata"]["triscope"]["backend"] == "b:1"


def test_drained_backend_is_draining_with_weight_one() -> None:
    result, params = _result({"a:1": 0.1, "b:1": 0.99})
    assert result.backends["b:1"].lb_weight == 0  # the engine's integer; Envoy must not get it
    _, body = eds_response(result, _request(), params)
    eps = _endpoints(body)
    assert eps[9002]["health_status"] == "DRAINING" and eps[9002]["load_balancing_weight"] == 1
    assert eps[9001]["health_status"] == "HEALTHY"
    assert all(e["load_balancing_weight"] >= 1 for e in eps.values())


def test_floor_weight_never_zero() -> None:
    result, params = _result({"a:1": 0.0, "b:1": 0.96})  # penalty 20 -> target 0.05 -> 5
    eps = _endpoints(eds_response(result, _request(), params)[1])
    assert eps[9002]["load_balancing_weight"] == 5 and eps[9002]["health_status"] == "HEALTHY"


def test_resource_names_select_the_configured_cluster() -> None:
    params = WeightParams.from_config({"weights": {"feed": {"envoy_cluster": "llm"}}})
    result, _ = _result({"a:1": 0.2}, params)
    doc = json.loads(eds_response(result, _request(["other"]), params)[1])
    assert doc["resources"] == [] and doc["version_info"] == str(result.version)
    doc = json.loads(eds_response(result, _request(["other", "llm", "llm"]), params)[1])
    assert [r["cluster_name"] for r in doc["resources"]] == ["llm"]
    doc = json.loads(eds_response(result, _request([]), params)[1])  # none named: the configured one
    assert [r["cluster_name"] for r in doc["resources"]] == ["llm"]
    assert json.loads(eds_response(result, b"", params)[1])["resources"][0]["cluster_name"] == "llm"


def test_nonce_changes_every_response_version_only_with_weights() -> None:
    params = WeightParams()
    inputs = _inputs({"a:1": 0.1, "b:1": 0.2})
    r1, s1 = compute_weights(inputs, None, params, NOW)
    n1 = json.loads(eds_response(r1, _request(), params)[1])
    n2 = json.loads(eds_response(r1, _request(version_info=n1["version_info"],
                                              response_nonce=n1["nonce"]), params)[1])
    assert n1["nonce"] != n2["nonce"] and n1["version_info"] == n2["version_info"]
    assert n1["resources"] == n2["resources"]
    r2, _ = compute_weights(_inputs({"a:1": 0.1, "b:1": 0.9}), s1, params, NOW + 1)
    n3 = json.loads(eds_response(r2, _request(), params)[1])
    assert int(n3["version_info"]) > int(n1["version_info"])
    assert _endpoints(json.dumps(n3).encode())[9002]["load_balancing_weight"] < 100


def test_hostname_addresses_are_resolved_and_bad_ones_left_out() -> None:
    result, params = _result({"a:1": 0.1, "b:1": 0.1, "c:1": 0.1},
                             addresses={"a:1": "localhost:9001", "b:1": "no-port", "c:1": "[::1]:9003"})
    eps = _endpoints(eds_response(result, _request(), params)[1])
    assert set(eps) == {9001, 9003}
    assert eps[9001]["endpoint"]["hostname"] == "localhost"
    assert eps[9001]["endpoint"]["address"]["socket_address"]["address"] in ("127.0.0.1", "::1")
    assert eps[9003]["endpoint"]["address"]["socket_address"]["address"] == "::1"


@pytest.mark.parametrize("body, fragment", [
    (b"{not json", "invalid DiscoveryRequest JSON"),
    (b"\xff\xfe", "invalid DiscoveryRequest JSON"),
    (b"[1, 2]", "expected a JSON object"),
    (b'{"resource_names": "triscope"}', "resource_names must be a list"),
    (b'{"type_url": "type.googleapis.com/envoy.config.cluster.v3.Cluster"}', "unsupported type_url"),
])
def test_bad_requests_get_one_line_400(body: bytes, fragment: str) -> None:
    result, params = _result({"a:1": 0.1})
    status, text = eds_response(result, body, params)
    assert status == 400 and fragment in json.loads(text)["error"]
    assert text.decode().count("\n") == 1 and text.endswith(b"\n")


def test_oversized_body_413() -> None:
    params = WeightParams.from_config({"weights": {"feed": {"max_body_bytes": 100}}})
    result, _ = _result({"a:1": 0.1}, params)
    status, text = eds_response(result, _request(["x" * 200]), params)
    assert status == 413 and "max_body_bytes=100" in json.loads(text)["error"]


def test_stale_feed_publishes_equal_weights() -> None:
    params = WeightParams()
    inputs = _inputs({"a:1": 0.1, "b:1": 0.9})
    result, _ = compute_weights(inputs, None, params, NOW + 60)  # inputs 60 s old > stale_after_s
    assert result.stale
    eps = _endpoints(eds_response(result, _request(), params)[1])
    assert {e["load_balancing_weight"] for e in eps.values()} == {100}
