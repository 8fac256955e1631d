"""Routing-weight engine (triscope.analyzers.routing): properties and the documented formula."""

from __future__ import annotations

import math
import re
import statistics

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from triscope.analyzers.routing import (
    NAN,
    BackendInputs,
    WeightParams,
    class_priorities,
    compute_weights,
    damp,
    factors,
    headroom_penalty,
    latency_penalty,
)
from triscope.errors import ConfigError
from triscope.exporters.haproxy_agent import agent_reply

P = WeightParams()
NOW = 1_800_000_000.0
NAMES = ["a:1", "b:2", "c:3", "d:4"]
CLASSES = list(P.classes)
SETTINGS = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])

ratio = st.one_of(st.just(NAN), st.floats(0.0, 1.0))


def mk(name: str, mem: float = NAN, kv: float = NAN, qps: float = NAN, cap: float = NAN,
       p99: dict[str, float] | None = None, healthy: bool = True, at: float = NOW) -> BackendInputs:
    """Inputs with memory as a ratio of a 80 GB GPU (NaN = not measured), sampled at ``at``."""
    total = 80e9 if math.isfinite(mem) else NAN
    return BackendInputs(name, memory_used_bytes=mem * 80e9 if math.isfinite(mem) else NAN,
                         memory_total_bytes=total, kv_cache_usage_ratio=kv, qps=qps, capacity_qps=cap,
                         p99_seconds=p99 or {}, healthy=healthy, sources={"gpu": at, "serving": at})


@st.composite
def backend(draw: st.DrawFn, name: str) -> BackendInputs:
    p99 = draw(st.dictionaries(st.sampled_from(CLASSES + ["unknown"]), st.floats(0.001, 30.0), max_size=3))
    return mk(name, mem=draw(ratio), kv=draw(ratio),
              qps=draw(st.one_of(st.just(NAN), st.floats(0.0, 200.0))),
              cap=draw(st.one_of(st.just(NAN), st.floats(1.0, 100.0))),
              p99=p99, healthy=draw(st.sampled_from([True, True, True, False])))


@st.composite
def fleet(draw: st.DrawFn, min_size: int = 1) -> list[BackendInputs]:
    names = draw(st.lists(st.sampled_from(NAMES), min_size=min_size, max_size=4, unique=True))
    return [draw(backend(n)) for n in sorted(names)]


@st.composite
def history(draw: st.DrawFn) -> tuple[list[list[BackendInputs]], list[BackendInputs]]:
    """Some earlier updates (to build a realistic previous state) and the current inputs."""
    past = draw(st.lists(fleet(), min_size=0, max_size=3))
    return past, draw(fleet())


def run(past: list[list[BackendInputs]], current: list[BackendInputs], params: WeightParams = P):
    state = None
    t = NOW - len(past)
    for inputs in past:
        shifted = [i.__class__(**{**i.__dict__, "sources": {"gpu": t, "serving": t}}) for i in inputs]
        _, state = compute_weights(shifted, state, params, t)
        t += 1.0
    result, new_state = compute_weights(current, state, params, NOW)
    return state, result, new_state


# --------------------------------------------------------------------------- properties


@SETTINGS
@given(history(), st.data())
def test_more_memory_never_raises_a_weight(hist, data) -> None:
    past, current = hist
    state = run(past, current)[0]
    idx = data.draw(st.integers(0, len(current) - 1))
    base = current[idx]
    lo = data.draw(st.floats(0.0, 1.0))
    hi = data.draw(st.floats(lo, 1.0))
    low = [mk(base.backend, mem=lo, kv=base.kv_cache_usage_ratio, qps=base.qps, cap=base.capacity_qps,
              p99=dict(base.p99_seconds), healthy=base.healthy) if i == idx else b for i, b in enumerate(current)]
    high = [mk(base.backend, mem=hi, kv=base.kv_cache_usage_ratio, qps=base.qps, cap=base.capacity_qps,
               p99=dict(base.p99_seconds), healthy=base.healthy) if i == idx else b for i, b in enumerate(current)]
    r_low, _ = compute_weights(low, state, P, NOW)
    r_high, _ = compute_weights(high, state, P, NOW)
    assert r_high.backends[base.backend].weight <= r_low.backends[base.backend].weight + 1e-12
    assert r_high.backends[base.backend].lb_weight <= r_low.backends[base.backend].lb_weight
    assert r_high.backends[base.backend].target <= r_low.backends[base.backend].target + 1e-12


@SETTINGS
@given(history())
def test_weights_never_all_zero_and_drain_is_a_state(hist) -> None:
    past, current = hist
    _, result, _ = run(past, current)
    ws = result.backends.values()
    assert any(b.state == "ready" and b.lb_weight >= 1 for b in ws)
    for b in ws:
        if b.state == "drain":
            assert b.weight == 0 and b.lb_weight == 0 and b.reasons
            assert agent_reply(result, b.backend) == "drain\n"
        else:
            assert b.state == "ready"
            assert P.floor <= b.weight <= 1.0
            assert isinstance(b.lb_weight, int) and 1 <= b.lb_weight <= P.lb_scale
            m = re.fullmatch(r"up ready (\d+)%\n", agent_reply(result, b.backend))
            assert m and 1 <= int(m.group(1)) <= 100
        assert 0.0 <= b.target <= 1.0


@SETTINGS
@given(fleet(min_size=2), st.data())
def test_one_stale_backend_eases_to_the_median_alone(current, data) -> None:
    """A backend with late inputs neither resets the fleet nor wins: the others keep exactly the weights
    they would have without it, and it moves towards the median target of the fresh ready ones."""
    idx = data.draw(st.integers(0, len(current) - 1))
    age = data.draw(st.floats(P.stale_after_s + 0.001, 1e6))
    old = current[idx]
    current[idx] = old.__class__(**{**old.__dict__, "sources": {"gpu": NOW - age, "serving": NOW}})
    state = run([current], current)[0]
    result, _ = compute_weights(current, state, P, NOW)
    without, _ = compute_weights([b for b in current if b.backend != old.backend], state, P, NOW)
    assert not result.stale and result.stale_backends == (old.backend,)
    for name, b in without.backends.items():
        if name != old.backend:
            assert result.backends[name].weight == b.weight and result.backends[name].state == b.state
    mine = result.backends[old.backend]
    assert mine.state == "ready" and mine.reasons == ("stale",) and P.floor <= mine.weight <= 1.0
    ready = sorted(b.target for n, b in result.backends.items() if n != old.backend and b.state == "ready")
    assert mine.target == pytest.approx(statistics.median(ready))


@SETTINGS
@given(fleet(min_size=1), st.data())
def test_equal_weights_only_when_no_backend_is_fresh(current, data) -> None:
    ages = [data.draw(st.floats(P.stale_after_s + 0.001, 1e6)) for _ in current]
    current = [i.__class__(**{**i.__dict__, "sources": {"gpu": NOW - a, "serving": NOW}})
               for i, a in zip(current, ages, strict=True)]
    state = run([current], current)[0]
    result, new_state = compute_weights(current, state, P, NOW)
    assert result.stale and new_state.stale and result.stale_backends == tuple(sorted(b.backend for b in current))
    for b in result.backends.values():
        assert b.weight == 1.0 and b.lb_weight == P.lb_scale and b.state == "ready" and b.reasons == ("stale",)
    assert result.scale.action == "hold"


@SETTINGS
@given(st.floats(P.floor, 1.0), st.floats(0.0, 1.0))
def test_damp_cuts_fast_raises_slowly_with_bounded_steps(w, t) -> None:
    out = damp(w, t, P)
    assert P.floor <= out <= 1.0
    assert -P.max_step_down - 1e-12 <= out - w <= P.max_step_up + 1e-12
    if t < w:
        assert out <= w
        assert out == pytest.approx(max(P.floor, w + max(-P.max_step_down, P.ewma_down * (t - w))))
    else:
        assert w <= out <= max(w, t) + 1e-12
        assert out == pytest.approx(min(1.0, w + min(P.max_step_up, P.ewma_up * (t - w))))
    # the same distance down moves at least as far as up
    d = min(w - P.floor, 1.0 - w)
    if d > 1e-6:
        assert w - damp(w, w - d, P) >= damp(w, w + d, P) - w - 1e-12


@SETTINGS
@given(st.lists(fleet(min_size=2), min_size=2, max_size=6))
def test_continuing_backends_move_by_bounded_steps(seq) -> None:
    state = None
    prev = None
    for k, inputs in enumerate(seq):
        t = NOW + k
        inputs = [i.__class__(**{**i.__dict__, "sources": {"gpu": t, "serving": t}}) for i in inputs]
        result, state_new = compute_weights(inputs, state, P, t)
        if prev is not None and not result.drain_suppressed and not prev.drain_suppressed:
            for name, b in result.backends.items():
                old = prev.backends.get(name)
                if old is None or old.state == "drain" or b.state == "drain":
                    continue
                assert -P.max_step_down - 1e-12 <= b.weight - old.weight <= P.max_step_up + 1e-12
        prev, state = result, state_new


@SETTINGS
@given(st.lists(st.lists(st.sampled_from(NAMES), max_size=4, unique=True), min_size=1, max_size=6))
def test_a_published_backend_never_vanishes_by_silence(seq) -> None:
    """Whatever subset reports at each update (none included), every backend published once is
    still published, ready with a weight >= 1 unless drained; with nobody reporting, equal weights."""
    state, ever = None, set()
    for k, names in enumerate(seq):
        result, state = compute_weights([mk(n, mem=0.5, at=NOW + k) for n in sorted(names)], state, P, NOW + k)
        ever |= set(names)
        assert set(result.backends) == ever
        assert set(result.absent_backends) == ever - set(names)
        assert all(b.lb_weight >= 1 for b in result.backends.values())
        if not names and ever:
            assert result.stale and {b.lb_weight for b in result.backends.values()} == {P.lb_scale}


# --------------------------------------------------------------------------- formula examples


def test_memory_penalty_examples() -> None:
    assert headroom_penalty(0.6) == pytest.approx(2.5)
    assert headroom_penalty(0.0) == 1.0
    assert headroom_penalty(0.99) == pytest.approx(20.0)  # capped by max(0.05, ...)
    assert headroom_penalty(NAN) == 1.0
    assert headroom_penalty(1.7) == pytest.approx(20.0)  # out-of-range ratios are clamped
    assert headroom_penalty(-0.5) == 1.0
    f = factors(mk("a:1", mem=0.75), P)
    assert f == {"memory": pytest.approx(4.0), "kv_cache": 1.0, "load": 1.0, "latency": 1.0}


def test_targets_follow_the_product_of_penalties() -> None:
    inputs = [mk("a:1", mem=0.5, kv=0.0, qps=0, cap=40), mk("b:2", mem=0.0, kv=0.75, qps=0, cap=40),
              mk("c:3", mem=0.2, kv=0.0, qps=20, cap=40)]
    result, _ = compute_weights(inputs, None, P, NOW)
    assert all(b.missing == () for b in result.backends.values())  # nobody measures latency: 1 for all
    # raw: a = 1/2, b = 1/4, c = 1/(1.25*2) = 0.4 -> normalised by the best (a)
    assert result.backends["a:1"].target == pytest.approx(1.0)
    assert result.backends["b:2"].target == pytest.approx(0.5)
    assert result.backends["c:3"].target == pytest.approx(0.8)
    assert [result.backends[n].lb_weight for n in ("a:1", "b:2", "c:3")] == [100, 50, 80]  # first update: target


def test_a_missing_signal_takes_the_fleets_median_penalty() -> None:
    """Five engines report a P99 at 4x, 3x, 5x, 6x and 4x the SLA; a Triton exports none. Before, its
    latency factor was 1 and it won the fleet's traffic; now it takes the median penalty (4x -> 16)."""
    sla = P.classes[P.default_class].sla_seconds
    engines = [mk(f"e{k}:1", kv=0.2, p99={P.default_class: sla * x}) for k, x in enumerate((4, 3, 5, 6, 4))]
    triton = mk("triton:1", kv=0.2)
    result, _ = compute_weights([*engines, triton], None, P, NOW)
    t = result.backends["triton:1"]
    assert t.missing == ("latency",) and t.factors["latency"] == pytest.approx(16.0)
    assert t.target == pytest.approx(result.backends["e0:1"].target) and t.target < 1.0
    assert result.backends["e1:1"].target == 1.0  # the 3x engine is the best, not the silent one
    assert result.to_dict()["backends"]["triton:1"]["missing"] == ["latency"]
    # memory measured by nobody (a CPU fleet): 1 for all, not listed as missing
    assert "memory" not in t.missing and t.factors["memory"] == 1.0


def test_p99_priority_weights_of_the_design_classes() -> None:
    rc = P.classes
    assert (rc["realtime_speech"].sla_seconds, rc["realtime_speech"].weight, rc["realtime_speech"].alpha) == (
        0.2, 8.0, 2.5)
    assert (rc["interactive_image_text"].sla_seconds, rc["interactive_image_text"].weight,
            rc["interactive_image_text"].alpha) == (0.8, 4.0, 2.0)
    assert (rc["offline_video"].sla_seconds, rc["offline_video"].weight, rc["offline_video"].alpha) == (5.0, 1.0, 1.0)
    assert latency_penalty(0.4, rc["realtime_speech"]) == pytest.approx(2 ** 2.5)
    assert latency_penalty(0.1, rc["realtime_speech"]) == 1.0  # under SLA: max(1, .)
    inputs = [mk("a:1", p99={"realtime_speech": 0.4, "interactive_image_text": 0.4}),
              mk("b:2", p99={"realtime_speech": 0.1, "interactive_image_text": 1.6, "offline_video": 10.0})]
    pr = class_priorities(inputs, P)
    assert pr["realtime_speech"]["priority_weight"] == pytest.approx(8 * 2 ** 2.5)  # fleet P99 = worst, 0.4
    assert pr["interactive_image_text"]["priority_weight"] == pytest.approx(4 * 2 ** 2.0)
    assert pr["offline_video"]["priority_weight"] == pytest.approx(1 * 2 ** 1.0)
    assert pr["realtime_speech"]["p99_seconds"] == pytest.approx(0.4)
    # the latency factor of a backend is its worst class, capped
    assert factors(inputs[1], P)["latency"] == pytest.approx(4.0)
    assert factors(mk("x:1", p99={"realtime_speech": 20.0}), P)["latency"] == P.latency_penalty_cap
    # unknown class names count as the default class (interactive_image_text)
    assert factors(mk("x:1", p99={"chat": 1.6}), P)["latency"] == pytest.approx(4.0)
    result, _ = compute_weights(inputs, None, P, NOW)
    assert result.to_dict()["classes"]["realtime_speech"]["priority_weight"] == pytest.approx(8 * 2 ** 2.5)


def test_no_class_data_gives_base_priority() -> None:
    pr = class_priorities([mk("a:1")], P)
    assert pr["realtime_speech"]["priority_weight"] == 8.0
    assert pr["realtime_speech"]["p99_seconds"] != pr["realtime_speech"]["p99_seconds"]  # NaN
    assert P.classes["realtime_speech"].weight == 8.0


def test_drain_hysteresis_and_slow_start() -> None:
    a = lambda mem, t: mk("a:1", mem=mem, at=t)  # noqa: E731
    b = lambda t: mk("b:2", mem=0.1, at=t)  # noqa: E731
    r, s = compute_weights([a(0.5, NOW), b(NOW)], None, P, NOW)
    assert r.backends["a:1"].state == "ready"
    r, s = compute_weights([a(0.97, NOW + 1), b(NOW + 1)], s, P, NOW + 1)
    assert r.backends["a:1"].state == "drain" and r.backends["a:1"].reasons == ("memory",)
    r, s = compute_weights([a(0.95, NOW + 2), b(NOW + 2)], s, P, NOW + 2)  # above release 0.92: still drained
    assert r.backends["a:1"].state == "drain"
    r, s = compute_weights([a(0.5, NOW + 3), b(NOW + 3)], s, P, NOW + 3)  # released: slow start at floor
    assert r.backends["a:1"].state == "ready" and r.backends["a:1"].weight == P.floor
    assert r.backends["a:1"].lb_weight == round(P.floor * P.lb_scale)
    # a backend at 0.96 (below drain) is low but ready, not drained
    r, _ = compute_weights([a(0.96, NOW), b(NOW)], None, P, NOW)
    assert r.backends["a:1"].state == "ready" and r.backends["a:1"].lb_weight >= 1
    # a new backend in a running feed starts at the floor
    r, s2 = compute_weights([b(NOW)], None, P, NOW)
    r, _ = compute_weights([a(0.0, NOW + 1), b(NOW + 1)], s2, P, NOW + 1)
    assert r.backends["a:1"].weight == P.floor and r.backends["a:1"].target == 1.0


def test_unhealthy_and_kv_drain_and_all_drained_suppression() -> None:
    r, _ = compute_weights([mk("a:1", healthy=False), mk("b:2", kv=0.985), mk("c:3")], None, P, NOW)
    assert r.backends["a:1"].reasons == ("health",) and r.backends["b:2"].reasons == ("kv_cache",)
    assert r.backends["c:3"].state == "ready" and not r.drain_suppressed
    r, _ = compute_weights([mk("a:1", healthy=False), mk("b:2", mem=0.99)], None, P, NOW)
    assert r.drain_suppressed
    for b in r.backends.values():
        assert b.state == "ready" and b.weight == P.floor and b.lb_weight >= 1 and b.drain_suppressed


def test_version_increments_only_when_published_weights_change() -> None:
    inputs = [mk("a:1", mem=0.5), mk("b:2", mem=0.1)]
    r1, s = compute_weights(inputs, None, P, NOW)
    for k in range(1, 30):  # converge
        r, s = compute_weights([i.__class__(**{**i.__dict__, "sources": {"gpu": NOW + k}}) for i in inputs], s, P,
                               NOW + k)
    r2, s2 = compute_weights([i.__class__(**{**i.__dict__, "sources": {"gpu": NOW + 31}}) for i in inputs], s, P,
                             NOW + 31)
    assert r2.version == r.version  # nothing published changed
    r3, _ = compute_weights([mk("a:1", mem=0.9, at=NOW + 32), mk("b:2", mem=0.1, at=NOW + 32)], s2, P, NOW + 32)
    assert r3.version == r2.version + 1
    assert r1.version == 1


def _kv(kv: float, t: float, names: tuple[str, ...] = ("a:1", "b:2")) -> list[BackendInputs]:
    return [mk(n, kv=kv, at=t) for n in names]


def test_kv_scale_up_after_two_seconds_at_85_percent() -> None:
    actions = []
    s = None
    for k, kv in enumerate([0.86, 0.9, 0.95, 0.95, 0.5, 0.9, 0.9]):
        r, s = compute_weights(_kv(kv, NOW + k), s, P, NOW + k)
        actions.append(r.scale.action)
    assert actions == ["hold", "hold", "up", "up", "hold", "hold", "hold"]
    r, _ = compute_weights(_kv(0.849, NOW), None, P, NOW)
    assert r.scale.fleet_kv_cache_usage_ratio == pytest.approx(0.849)


def test_kv_scale_down_after_five_seconds_with_cooldown_for_new_instances() -> None:
    s = None
    actions = []
    for k in range(7):
        r, s = compute_weights(_kv(0.3, NOW + k), s, P, NOW + k)
        actions.append(r.scale.action)
    assert actions == ["hold"] * 5 + ["down", "down"]
    # a new instance appears at NOW+7: no scale-down before NOW+37
    actions = {}
    for k in range(7, 40):
        r, s = compute_weights(_kv(0.3, NOW + k, ("a:1", "b:2", "c:3")), s, P, NOW + k)
        actions[k] = r.scale.action
    assert all(actions[k] == "hold" for k in range(7, 37))
    assert actions[37] == "down"
    reasons = {}
    s2 = None
    for k in range(8):
        names = ("a:1", "b:2") if k < 6 else ("a:1", "b:2", "c:3")
        r, s2 = compute_weights(_kv(0.3, NOW + k, names), s2, P, NOW + k)
        reasons[k] = (r.scale.action, r.scale.reason)
    assert reasons[5][0] == "down" and reasons[6][0] == "hold" and "cooldown" in reasons[6][1]
    # exactly 40% counts as low, 40.1% does not
    s = None
    for k in range(6):
        r, s = compute_weights(_kv(0.401, NOW + k), s, P, NOW + k)
    assert r.scale.action == "hold"


def test_config_overrides_and_errors() -> None:
    p = WeightParams.from_config({"weights": {"floor": 0.1, "classes": {"batch": {"sla_ms": 60000, "weight": 0.5,
                                                                                   "alpha": 1}}}})
    assert p.floor == 0.1 and "batch" in p.classes and "realtime_speech" in p.classes
    for bad in ({"flor": 1}, {"floor": 0}, {"floor": "x"}, {"classes": {"x": {"sla_ms": 0, "weight": 1, "alpha": 1}}},
                {"release_memory_ratio": 0.99}, {"default_class": "nope"}, {"backends": {"a": {"gpus": ["x"]}}}):
        with pytest.raises(ConfigError):
            WeightParams.from_config({"weights": bad})


def test_stale_inputs_hold_scaling_and_restart_its_timer() -> None:
    s = None
    for k in range(3):
        r, s = compute_weights(_kv(0.95, NOW + k), s, P, NOW + k)
    assert r.scale.action == "up"
    stale = [mk("a:1", kv=0.95, at=NOW - 100), mk("b:2", kv=0.95, at=NOW - 100)]
    r, s = compute_weights(stale, s, P, NOW + 3)
    assert r.stale and r.scale.action == "hold" and "stale" in r.scale.reason
    r, s = compute_weights(_kv(0.95, NOW + 4), s, P, NOW + 4)  # fresh again: the 2 s start over
    assert r.scale.action == "hold"
    r, s = compute_weights(_kv(0.95, NOW + 6), s, P, NOW + 6)
    assert r.scale.action == "up"


def test_a_configured_backend_without_inputs_is_stale_alone() -> None:
    params = WeightParams.from_config({"weights": {"backends": {"b:2": {"address": "127.0.0.1:2"}}}})
    r, _ = compute_weights([mk("a:1", mem=0.99), BackendInputs("b:2")], None, params, NOW)
    assert not r.stale and r.stale_backends == ("b:2",)
    assert r.backends["a:1"].target == 1.0 and r.backends["b:2"].reasons == ("stale",)
    r, _ = compute_weights([], None, P, NOW)
    assert r.stale and r.backends == {}


def test_sharpness_compresses_targets() -> None:
    soft = WeightParams.from_config({"weights": {"sharpness": 0.5}})
    inputs = [mk("a:1", mem=0.0), mk("b:2", mem=0.75)]
    assert compute_weights(inputs, None, P, NOW)[0].backends["b:2"].target == pytest.approx(0.25)
    assert compute_weights(inputs, None, soft, NOW)[0].backends["b:2"].target == pytest.approx(0.5)
    with pytest.raises(ConfigError):
        WeightParams.from_config({"weights": {"sharpness": 0}})


# --------------------------------------------------------------------------- down backends


def _spans(name: str, at: float, spans: float, errors: float = 0.0, up: float = NAN) -> BackendInputs:
    return BackendInputs(name, kv_cache_usage_ratio=0.1, sources={"serving": at, "requests": at}, span_count=spans,
                         trailing_errors=errors, scrape_up=up,
                         scrape_error="scrape failed: [Errno 111] Connection refused" if up == 0 else "")


def test_a_backend_whose_spans_stop_is_down_once_its_share_would_have_shown() -> None:
    s = None
    for k in range(12):  # both ready for longer than window_s, 50 spans each per window
        r, s = compute_weights([_spans("a:1", NOW + k, 50), _spans("b:2", NOW + k, 50)], s, P, NOW + k)
    assert {b.state for b in r.backends.values()} == {"ready"}
    r, s = compute_weights([_spans("a:1", NOW + 12, 0), _spans("b:2", NOW + 12, 60)], s, P, NOW + 12)
    assert r.backends["a:1"].state == "down" and r.backends["a:1"].reasons == ("spans_stopped",)
    assert r.down_backends == ("a:1",) and r.backends["b:2"].state == "ready"
    # little traffic: 10 spans in the fleet's window cannot tell silence from chance
    s2 = None
    for k in range(12):
        r2, s2 = compute_weights([_spans("a:1", NOW + k, 5), _spans("b:2", NOW + k, 5)], s2, P, NOW + k)
    r2, _ = compute_weights([_spans("a:1", NOW + 12, 0), _spans("b:2", NOW + 12, 10)], s2, P, NOW + 12)
    assert r2.backends["a:1"].state == "ready"
    # back from down it is not judged before its share had a window to show (no flapping)
    r, s = compute_weights([_spans("a:1", NOW + 13, 0), _spans("b:2", NOW + 13, 60)], s, P, NOW + 13)
    assert r.backends["a:1"].state == "ready" and r.backends["a:1"].weight == P.floor


def test_a_scrape_that_only_times_out_is_down_after_stale_after_s() -> None:
    """An overloaded engine may answer its scrape late: refused is down at once, a timeout only once it
    has lasted ``stale_after_s``."""
    def slow(failing_s: float) -> BackendInputs:
        return BackendInputs("b:2", kv_cache_usage_ratio=0.9, sources={"serving": NOW - failing_s}, scrape_up=0.0,
                             scrape_error="http://b:2/metrics: no complete answer within 3 s (total deadline)",
                             scrape_failing_s=failing_s)

    ok = _spans("a:1", NOW, 50)
    assert compute_weights([ok, slow(4.0)], None, P, NOW)[0].backends["b:2"].state == "ready"
    r = compute_weights([ok, slow(P.stale_after_s + 1)], None, P, NOW)[0]
    assert r.backends["b:2"].state == "down" and r.backends["b:2"].reasons == ("scrape_failed",)


def test_every_backend_down_reads_as_our_view_broken_not_a_dead_fleet() -> None:
    r, _ = compute_weights([_spans("a:1", NOW, 5, up=0.0), _spans("b:2", NOW, 5, up=0.0)], None, P, NOW)
    assert r.down_backends == () and r.drain_suppressed
    for b in r.backends.values():
        assert b.state == "ready" and b.lb_weight >= 1 and "scrape_failed" in b.reasons and b.drain_suppressed


@SETTINGS
@given(fleet(min_size=2), st.data())
def test_a_down_backend_gets_no_traffic_and_never_moves_the_others(current, data) -> None:
    idx = data.draw(st.integers(0, len(current) - 1))
    dead = current[idx]
    state = run([current], current)[0]
    current[idx] = BackendInputs(dead.backend, sources={"serving": NOW - data.draw(st.floats(0, 1e5))}, scrape_up=0.0,
                                 scrape_error="http://x/metrics: scrape failed: [Errno 111] Connection refused")
    result, _ = compute_weights(current, state, P, NOW)
    without, _ = compute_weights([b for b in current if b.backend != dead.backend], state, P, NOW)
    d = result.backends[dead.backend]
    assert d.state == "down" and d.lb_weight == 0 and agent_reply(result, dead.backend) == "down\n"
    assert all(result.class_state(dead.backend, c) == "drain" for c in P.classes)
    for name, b in without.backends.items():
        if name != dead.backend:  # (without its inputs it is absent there)
            assert result.backends[name].weight == b.weight and result.backends[name].state == b.state
