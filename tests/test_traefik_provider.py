"""Traefik HTTP-provider configuration built from real engine results (compute_weights)."""

from __future__ import annotations

import json

from triscope.analyzers.routing import BackendInputs, WeightParams, compute_weights
from triscope.exporters.traefik_provider import service_names, traefik_config

GIB = 1024**3
NOW = 1_800_000_000.0


def _result(mem: dict[str, float], params: WeightParams | None = None,
            addresses: dict[str, str] | None = None):
    params = params or WeightParams()
    addresses = addresses or {}
    inputs = [BackendInputs(name, memory_used_bytes=ratio * GIB, memory_total_bytes=GIB,
                            sources={"gpu": NOW - 1, "serving": NOW - 1},
                            address=addresses.get(name, f"127.0.0.1:{9001 + i}"))
              for i, (name, ratio) in enumerate(sorted(mem.items()))]
    result, _ = compute_weights(inputs, None, params, NOW)
    return result, params


def test_weighted_service_over_one_service_per_backend() -> None:
    result, params = _result({"gpu-a:8000": 0.0, "gpu-b:8000": 0.5, "gpu-c:8000": 0.75})
    cfg = traefik_config(result, params)
    json.dumps(cfg)  # JSON-serialisable as served
    http = cfg["http"]
    assert http["routers"] == {"triscope": {"rule": "PathPrefix(`/`)", "service": "triscope",
                                            "entryPoints": ["web"]}}
    weighted = http["services"]["triscope"]["weighted"]["services"]
    assert weighted == [{"name": "b-gpu-a-8000", "weight": 100}, {"name": "b-gpu-b-8000", "weight": 50},
                        {"name": "b-gpu-c-8000", "weight": 25}]
    assert http["services"]["b-gpu-b-8000"]["loadBalancer"]["servers"] == [{"url": "http://127.0.0.1:9002"}]


def test_drained_backend_leaves_weighted_service_but_stays_defined() -> None:
    result, params = _result({"a:1": 0.2, "b:1": 0.99})
    http = traefik_config(result, params)["http"]
    assert [s["name"] for s in http["services"]["triscope"]["weighted"]["services"]] == ["b-a-1"]
    assert "b-b-1" in http["services"]
    assert all(s["weight"] >= 1 for s in http["services"]["triscope"]["weighted"]["services"])


def test_config_options_and_addressless_backends() -> None:
    params = WeightParams.from_config({"weights": {"feed": {
        "traefik_service": "llm", "traefik_entrypoints": ["web", "websecure"],
        "traefik_rule": "Host(`llm.example`)", "traefik_scheme": "https"}}})
    result, _ = _result({"a:1": 0.1, "b": 0.1, "c:1": 0.1}, params,
                        addresses={"b": "", "c:1": "[::1]:9443"})
    http = traefik_config(result, params)["http"]
    assert http["routers"]["llm"] == {"rule": "Host(`llm.example`)", "service": "llm",
                                      "entryPoints": ["web", "websecure"]}
    assert sorted(http["services"]) == ["b-a-1", "b-c-1", "llm"]  # "b" has no address
    assert http["services"]["b-c-1"]["loadBalancer"]["servers"] == [{"url": "https://[::1]:9443"}]


def test_identical_results_give_identical_configs() -> None:
    r1, params = _result({"a:1": 0.3, "b:1": 0.6})
    r2, _ = _result({"a:1": 0.3, "b:1": 0.6})
    assert json.dumps(traefik_config(r1, params), sort_keys=True) == json.dumps(traefik_config(r2, params),
                                                                                sort_keys=True)


def test_service_names_unique_after_sanitising() -> None:
    names = service_names(["gpu-a:8000", "gpu-a.8000", "gpu-b"])
    assert names["gpu-b"] == "b-gpu-b"
    assert names["gpu-a:8000"] != names["gpu-a.8000"]
    assert all(n.startswith("b-gpu-a-8000-") for b, n in names.items() if b != "gpu-b")


def test_no_addressed_backend_gives_empty_config() -> None:
    result, params = _result({"a": 0.1}, addresses={"a": ""})
    assert traefik_config(result, params) == {}
