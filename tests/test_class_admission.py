"""Per-class admission (``[weights.classes.NAME] admit_kv_ratio`` / ``admit_batch_ratio``): a
filling backend closes to the low-priority classes first, the HAProxy agent answers per class,
and a real HAProxy with one pool per class drains a server in one pool only and sheds a class
with 503 when every server is closed.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import pytest
from conftest import require_binary
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from lb_helpers import backends, http_get

from triscope.analyzers.routing import DRAIN, READY, BackendInputs, WeightParams, compute_weights
from triscope.errors import ConfigError
from triscope.exporters.feed import WeightFeed
from triscope.exporters.haproxy_agent import agent_reply, parse_agent_line
from triscope.exporters.prometheus_text import render_weights

VIDEO, IMAGE, SPEECH = "offline_video", "interactive_image_text", "realtime_speech"


def params(**classes: dict) -> WeightParams:
    cfg = {"interval_s": 0.1, "feed": {"port": 0, "agent_port": 0}, "classes": classes}
    return WeightParams.from_config({"weights": cfg})


TIERED = params(offline_video={"admit_kv_ratio": 0.80}, interactive_image_text={"admit_kv_ratio": 0.90,
                                                                               "readmit_kv_ratio": 0.70})


def inputs(kv: dict[str, float], now: float, healthy: dict[str, bool] | None = None) -> list[BackendInputs]:
    return [BackendInputs(n, kv_cache_usage_ratio=v, healthy=(healthy or {}).get(n, True), sources={"serving": now})
            for n, v in kv.items()]


def test_default_classes_have_no_limit_and_follow_the_backend() -> None:
    p = WeightParams()
    assert not any(c.has_admission_limit for c in p.classes.values())
    now = time.time()
    res, _ = compute_weights(inputs({"a": 0.95, "b": 0.99}, now), None, p, now)
    for cls in p.classes:
        assert res.class_admission[cls] == {"a": READY, "b": DRAIN}  # b drained at kv >= 0.98
    doc = res.to_dict()["class_admission"]
    assert doc[VIDEO] == {"backends": {"a": READY, "b": DRAIN}, "open_backends": 1, "shedding": False}


def test_low_priority_classes_close_first_and_reopen_with_hysteresis() -> None:
    t = time.time()
    res, state = compute_weights(inputs({"a": 0.85, "b": 0.5}, t), None, TIERED, t)
    assert res.class_state("a", VIDEO) == DRAIN and res.class_state("a", IMAGE) == READY
    assert res.class_state("a", SPEECH) == READY and res.backends["a"].state == READY
    assert res.class_state("b", VIDEO) == READY
    assert agent_reply(res, "a", request_class=VIDEO) == "drain\n"
    assert (agent_reply(res, "a", request_class=IMAGE) == agent_reply(res, "a")
            == f"up ready {res.backends['a'].lb_weight}%\n")
    assert agent_reply(res, "a", request_class="no_such_class") == agent_reply(res, "a")

    t += 0.1  # a fills further: image-text closes too; video below 0.80 but above readmit 0.75 stays closed
    res, state = compute_weights(inputs({"a": 0.92, "b": 0.78}, t), state, TIERED, t)
    assert (res.class_state("a", VIDEO), res.class_state("a", IMAGE)) == (DRAIN, DRAIN)
    assert res.class_state("b", VIDEO) == READY  # never closed: 0.78 < admit 0.80
    t += 0.1
    res, state = compute_weights(inputs({"a": 0.76, "b": 0.5}, t), state, TIERED, t)
    assert res.class_state("a", VIDEO) == DRAIN, "0.76 >= default readmit 0.80 - 0.05"
    assert res.class_state("a", IMAGE) == DRAIN, "0.76 >= configured readmit 0.70"
    t += 0.1
    res, state = compute_weights(inputs({"a": 0.72, "b": 0.5}, t), state, TIERED, t)
    assert (res.class_state("a", VIDEO), res.class_state("a", IMAGE)) == (READY, DRAIN)
    t += 0.1
    res, _ = compute_weights(inputs({"a": 0.69, "b": 0.5}, t), state, TIERED, t)
    assert (res.class_state("a", VIDEO), res.class_state("a", IMAGE)) == (READY, READY)


def test_a_class_may_be_shed_fleet_wide_but_speech_is_not() -> None:
    t = time.time()
    res, state = compute_weights(inputs({"a": 0.85, "b": 0.91}, t), None, TIERED, t)
    doc = res.to_dict()["class_admission"]
    assert doc[VIDEO]["shedding"] and doc[VIDEO]["open_backends"] == 0
    assert doc[IMAGE] == {"backends": {"a": READY, "b": DRAIN}, "open_backends": 1, "shedding": False}
    assert doc[SPEECH]["open_backends"] == 2 and not res.drain_suppressed
    text = render_weights(res, 1, 0, t, 0.0).decode()
    assert 'triscope_backend_class_admitted{backend="a",request_class="offline_video"} 0' in text
    assert 'triscope_backend_class_admitted{backend="a",request_class="interactive_image_text"} 1' in text
    v1 = res.version
    res2, _ = compute_weights(inputs({"a": 0.85, "b": 0.5}, t + 0.1), state, TIERED, t + 0.1)
    assert res2.class_state("b", VIDEO) == READY  # 0.5 < readmit 0.75
    assert res2.version > v1, "a class opening is a published change"


def test_drained_backends_are_closed_to_every_class_and_stale_inputs_open_them() -> None:
    t = time.time()
    res, state = compute_weights(inputs({"a": 0.85, "b": 0.2}, t, healthy={"b": False}), None, TIERED, t)
    assert all(res.class_state("b", c) == DRAIN for c in TIERED.classes)
    assert agent_reply(res, "b", request_class=SPEECH) == "drain\n"
    old = t - 60  # every input older than stale_after_s: equal weights, every class open
    stale, _ = compute_weights(inputs({"a": 0.85, "b": 0.2}, old), state, TIERED, t)
    assert stale.stale and all(s == READY for states in stale.class_admission.values() for s in states.values())


def test_agent_line_parsing() -> None:
    assert parse_agent_line("b0") == ("b0", "")
    assert parse_agent_line("10.0.0.1:8000 offline_video") == ("10.0.0.1:8000", "offline_video")
    assert parse_agent_line("  b0   realtime_speech ") == ("b0", "realtime_speech")
    assert parse_agent_line("") == ("", "")


def test_admission_config_is_validated() -> None:
    assert TIERED.classes[VIDEO].readmit_kv_ratio == pytest.approx(0.75)
    assert TIERED.classes[VIDEO].sla_seconds == 5.0, "a default class keeps its SLA when only the limit is set"
    assert math.isnan(TIERED.classes[SPEECH].admit_kv_ratio)
    for bad in ({"admit_kv_ratio": 1.5}, {"admit_kv_ratio": 0.8, "readmit_kv_ratio": 0.9},
                {"admit_kv_ratio": "high"}, {"readmit_kv_ratio": 0.5}):
        with pytest.raises(ConfigError, match="offline_video"):
            params(offline_video=bad)
    with pytest.raises(ConfigError, match="must be a table"):
        params(offline_video=0.8)


def batch_params(**video: float) -> WeightParams:
    cfg = {"interval_s": 0.1, "feed": {"port": 0, "agent_port": 0}, "classes": {VIDEO: video},
           "backends": {"a": {"max_num_seqs": 16}, "b": {"max_num_seqs": 8}}}
    return WeightParams.from_config({"weights": cfg})


def batch_inputs(running: dict[str, float], waiting: dict[str, float], now: float,
                 kv: float = 0.3) -> list[BackendInputs]:
    return [BackendInputs(n, kv_cache_usage_ratio=kv, running_requests=r, queue_length=waiting.get(n, 0.0),
                          sources={"serving": now}) for n, r in running.items()]


def test_batch_occupancy_closes_a_class_on_crowded_batches_with_hysteresis() -> None:
    """``admit_batch_ratio``: (running + waiting) / max_num_seqs, per backend's own batch size."""
    p = batch_params(admit_batch_ratio=0.5, readmit_batch_ratio=0.25)
    assert p.classes[VIDEO].has_batch_limit and not p.classes[VIDEO].has_kv_limit
    t = time.time()
    # a: 6 of 16 (0.375) open; b: 4 of 8 (0.5) closed, by the same ratio on a smaller batch
    res, state = compute_weights(batch_inputs({"a": 6, "b": 4}, {}, t), None, p, t)
    assert (res.class_state("a", VIDEO), res.class_state("b", VIDEO)) == (READY, DRAIN)
    assert res.class_state("b", SPEECH) == READY and res.backends["b"].state == READY
    t += 0.1  # waiting requests count: 5 running + 3 waiting of 16 = 0.5 closes a
    res, state = compute_weights(batch_inputs({"a": 5, "b": 3}, {"a": 3}, t), state, p, t)
    assert (res.class_state("a", VIDEO), res.class_state("b", VIDEO)) == (DRAIN, DRAIN), "b: 0.375 >= readmit 0.25"
    assert res.to_dict()["class_admission"][VIDEO]["shedding"]
    assert agent_reply(res, "a", request_class=VIDEO) == "drain\n"
    t += 0.1
    res, state = compute_weights(batch_inputs({"a": 3, "b": 1}, {}, t), state, p, t)
    assert (res.class_state("a", VIDEO), res.class_state("b", VIDEO)) == (READY, READY)


def test_batch_limit_needs_max_num_seqs_and_the_running_gauge() -> None:
    """Without a backend's max_num_seqs, or without its running gauge, occupancy is unknown and the
    class follows the backend (never closed on a guess); KV and batch limits combine with OR."""
    cfg = {"interval_s": 0.1, "feed": {"port": 0, "agent_port": 0},
           "classes": {VIDEO: {"admit_batch_ratio": 0.5, "admit_kv_ratio": 0.8}},
           "backends": {"a": {"max_num_seqs": 16}}}
    p = WeightParams.from_config({"weights": cfg})
    t = time.time()
    unknown = [BackendInputs("a", kv_cache_usage_ratio=0.3, sources={"serving": t}),  # no running gauge
               BackendInputs("b", kv_cache_usage_ratio=0.3, running_requests=50, sources={"serving": t})]
    res, _ = compute_weights(unknown, None, p, t)
    assert res.class_state("a", VIDEO) == READY and res.class_state("b", VIDEO) == READY
    full_kv = batch_inputs({"a": 1, "b": 1}, {}, t, kv=0.85)
    res, _ = compute_weights(full_kv, None, p, t)
    assert res.class_state("a", VIDEO) == DRAIN and res.class_state("b", VIDEO) == DRAIN, "KV limit still applies"


def test_batch_admission_config_is_validated() -> None:
    assert batch_params(admit_batch_ratio=0.5).classes[VIDEO].readmit_batch_ratio == pytest.approx(0.45)
    assert batch_params(admit_batch_ratio=1.5).classes[VIDEO].admit_batch_ratio == 1.5, "past 1 = queued requests"
    for bad in ({"admit_batch_ratio": 0.5, "readmit_batch_ratio": 0.6}, {"readmit_batch_ratio": 0.5},
                {"admit_batch_ratio": -1}, {"admit_batch_ratio": "busy"}):
        with pytest.raises(ConfigError, match="offline_video"):
            batch_params(**bad)
    for bad_backend in ({"max_num_seqs": -1}, {"max_num_seqs": "many"}):
        with pytest.raises(ConfigError, match="max_num_seqs"):
            WeightParams.from_config({"weights": {"backends": {"a": bad_backend}}})


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.floats(0.0, 1.0), min_size=1, max_size=12), st.floats(0.0, 1.0), st.floats(0.0, 1.0))
def test_a_class_with_a_lower_limit_is_closed_wherever_a_higher_one_is(kvs, low, high) -> None:
    """Ordered limits (admit and readmit) give nested closures at every step of any KV path."""
    low, high = sorted((low, high))
    p = params(offline_video={"admit_kv_ratio": low, "readmit_kv_ratio": low * 0.9},
               interactive_image_text={"admit_kv_ratio": high, "readmit_kv_ratio": high * 0.9})
    state, t = None, time.time()
    for kv in kvs:
        t += 0.1
        res, state = compute_weights(inputs({"a": kv}, t), state, p, t)
        if res.class_state("a", IMAGE) == DRAIN:
            assert res.class_state("a", VIDEO) == DRAIN, (kv, low, high)
        if res.class_state("a", VIDEO) == READY:
            assert kv < low or res.backends["a"].state == DRAIN
        assert res.class_state("a", SPEECH) == res.backends["a"].state


def test_real_haproxy_class_pools_follow_the_feed(tmp_path: Path) -> None:
    """HAProxy 2.6, one pool per class: the video pool drains ``a`` while the speech pool keeps it;
    when every server is closed to video, video requests get HAProxy's own 503 at once."""
    require_binary("haproxy")
    from triscope_bed.peers.haproxy import HAProxy, Server

    kv = {"a": 0.0, "b": 0.0}
    with backends(list(kv)) as ports, \
            WeightFeed(TIERED, inputs_fn=lambda: inputs(kv, time.time())).start() as feed, \
            HAProxy(tmp_path, [Server(n, ports[n]) for n in kv], balance="roundrobin", agent_port=feed.agent_port,
                    agent_inter_ms=100, class_pools=[SPEECH, VIDEO]) as hap:
        assert 'agent-send "a offline_video\\n"' in hap.config_text()

        def states(pool: str) -> dict[str, str]:  # "DRAIN (agent)"; a serving server shows "no check"
            return {r["svname"]: "DRAIN" if r["status"].startswith("DRAIN") else "UP" for r in hap.stats(pool)}

        def wait(pool: str, want: dict[str, str]) -> None:
            deadline = time.monotonic() + 5
            while states(pool) != want:
                assert time.monotonic() < deadline, (pool, states(pool), want)
                time.sleep(0.05)

        wait(f"pool_{VIDEO}", {"a": "UP", "b": "UP"})
        kv["a"] = 0.85  # video limit 0.80: a closes to video only
        wait(f"pool_{VIDEO}", {"a": "DRAIN", "b": "UP"})
        assert states(f"pool_{SPEECH}") == {"a": "UP", "b": "UP"} and states("gpus") == {"a": "UP", "b": "UP"}
        served = {http_get(hap.port, f"/v1/{VIDEO}")[1] for _ in range(10)}
        assert served == {b"b"}, "video requests avoid the server closed to video"
        assert {http_get(hap.port, f"/v1/{SPEECH}")[1] for _ in range(10)} == {b"a", b"b"}

        kv["b"] = 0.85  # every server closed to video: the video pool sheds, speech is untouched
        wait(f"pool_{VIDEO}", {"a": "DRAIN", "b": "DRAIN"})
        t0 = time.monotonic()
        status, _ = http_get(hap.port, f"/v1/{VIDEO}")
        assert status == 503 and time.monotonic() - t0 < 1.0
        assert http_get(hap.port, f"/v1/{SPEECH}")[0] == 200
        kv["a"] = kv["b"] = 0.5  # below readmit 0.75: video comes back
        wait(f"pool_{VIDEO}", {"a": "UP", "b": "UP"})
        assert http_get(hap.port, f"/v1/{VIDEO}")[0] == 200


def test_the_documented_haproxy_snippet_is_valid(tmp_path: Path) -> None:
    require_binary("haproxy")
    import re
    import subprocess

    doc = (Path(__file__).resolve().parent.parent / "docs" / "weights.md").read_text()
    snippet = re.search(r"```haproxy-class-pools\n(.*?)```", doc, re.S)
    assert snippet, "docs/weights.md lost its class-pools snippet"
    cfg = tmp_path / "haproxy.cfg"
    cfg.write_text("defaults\n    timeout connect 1s\n    timeout client 5s\n    timeout server 5s\n" + snippet[1])
    check = subprocess.run(["haproxy", "-c", "-f", str(cfg)], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
