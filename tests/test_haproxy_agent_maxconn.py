"""HAProxy agent admission control: ``maxconn:N`` scaled by weight when ``max_inflight`` is set.

Unit checks of the reply and the config key, then a real HAProxy 2.6 whose server ``maxconn``
(``show stat`` column ``slim``) must follow what triscope's feed answers on agent-check.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from conftest import require_binary

from triscope.analyzers.routing import BackendInputs, WeightParams, compute_weights
from triscope.errors import ConfigError
from triscope.exporters.feed import WeightFeed
from triscope.exporters.haproxy_agent import agent_reply


def params(backends: dict | None = None, **weights: object) -> WeightParams:
    cfg = {"interval_s": 0.1, "feed": {"port": 0, "agent_port": 0}, "backends": backends or {}, **weights}
    return WeightParams.from_config({"weights": cfg})


def result_for(kv: dict[str, float], p: WeightParams):
    now = time.time()
    inputs = [BackendInputs(n, kv_cache_usage_ratio=v, sources={"serving": now}) for n, v in kv.items()]
    return compute_weights(inputs, None, p, now)[0]


def test_reply_adds_maxconn_scaled_by_weight() -> None:
    p = params()
    res = result_for({"a": 0.0, "b": 0.5, "c": 0.99}, p)  # c: drained (kv >= 0.98)
    wb = res.backends["b"].weight
    assert 0.4 < wb < 0.6
    assert agent_reply(res, "a", 16) == "up ready 100% maxconn:16\n"
    assert agent_reply(res, "b", 16) == f"up ready {res.backends['b'].lb_weight}% maxconn:{round(16 * wb)}\n"
    assert agent_reply(res, "b", 0) == f"up ready {res.backends['b'].lb_weight}%\n", "unset: weight only"
    assert agent_reply(res, "b", 1) == f"up ready {res.backends['b'].lb_weight}% maxconn:1\n", "never below 1"
    assert agent_reply(res, "c", 16) == "drain\n"
    assert agent_reply(res, "nobody", 16) == "up ready 100%\n"


def test_max_inflight_config_is_validated() -> None:
    assert params({"a": {"max_inflight": 12}}).backends["a"].max_inflight == 12
    assert params({"a": {}}).backends["a"].max_inflight == 0
    with pytest.raises(ConfigError, match="max_inflight"):
        params({"a": {"max_inflight": -1}})
    with pytest.raises(ConfigError, match="max_inflight"):
        params({"a": {"max_inflight": "many"}})


def test_haproxy_applies_agent_maxconn(tmp_path: Path) -> None:
    require_binary("haproxy")
    from triscope_bed.peers.haproxy import HAProxy, Server
    from triscope_bed.ports import free_port

    kv = {"s0": 0.0, "s1": 0.75}
    p = params({"s0": {"max_inflight": 20}, "s1": {"max_inflight": 20}})

    def inputs() -> list[BackendInputs]:
        now = time.time()
        return [BackendInputs(n, kv_cache_usage_ratio=v, sources={"serving": now}) for n, v in kv.items()]

    servers = [Server(n, free_port(), maxconn=20) for n in kv]
    with WeightFeed(p, inputs_fn=inputs).start() as feed, \
            HAProxy(tmp_path, servers, balance="leastconn", agent_port=feed.agent_port, agent_inter_ms=100,
                    timeout_queue_ms=500, queue_priority={"realtime_speech": -10}) as hap:
        cfg = hap.config_text()  # the bench's admission recipe, accepted by the real binary at start
        assert "timeout queue 500ms" in cfg and "set-priority-class int(-10)" in cfg
        want = {"s0": 20, "s1": round(20 * feed.result.backends["s1"].weight)}
        assert want["s1"] < 10  # kv 0.75: penalty 4 -> weight 0.25
        deadline = time.monotonic() + 10
        while True:
            slim = {r["svname"]: int(r["slim"] or 0) for r in hap.stats()}
            if slim == want or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert slim == want
        kv["s1"] = 0.0  # headroom back: the cap rises again with the weight (damped)
        deadline = time.monotonic() + 10
        while int(next(r for r in hap.stats() if r["svname"] == "s1")["slim"]) <= want["s1"]:
            assert time.monotonic() < deadline, "maxconn did not rise with the weight"
            time.sleep(0.1)


def test_queue_penalty_off_by_default_and_steers_from_blocked_queues() -> None:
    """``queue_weight`` > 0 adds a ``queue`` factor from vLLM's waiting/running gauges."""
    now = time.time()
    blocked = BackendInputs("a", queue_length=12, running_requests=4, sources={"serving": now})
    flowing = BackendInputs("b", queue_length=1, running_requests=16, sources={"serving": now})
    off = params()
    assert "queue" not in compute_weights([blocked, flowing], None, off, now)[0].backends["a"].factors
    on = params(queue_weight=0.5)
    res = compute_weights([blocked, flowing], None, on, now)[0]
    assert res.backends["a"].factors["queue"] == pytest.approx(1 + 0.5 * 12 / 4)
    assert res.backends["b"].factors["queue"] == pytest.approx(1 + 0.5 / 16)
    assert res.backends["a"].target < res.backends["b"].target
    unknown = BackendInputs("c", sources={"serving": now})
    assert compute_weights([unknown], None, on, now)[0].backends["c"].factors["queue"] == 1.0
    huge = BackendInputs("d", queue_length=10_000, running_requests=0, sources={"serving": now})
    assert compute_weights([huge], None, on, now)[0].backends["d"].factors["queue"] == pytest.approx(20.0)
    with pytest.raises(ConfigError, match="queue_weight"):
        params(queue_weight=-1)
