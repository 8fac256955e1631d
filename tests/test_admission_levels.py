"""Admission levels per class (analyzers/routing/levels.py) and their enforcement at the gateway
(analyzers/routing/gate.py): pure logic on made-up inputs; tests/test_epp_run.py runs them in a daemon."""

from __future__ import annotations

from collections import Counter

import pytest

from triscope.analyzers.routing import BackendInputs, WeightParams, compute_weights
from triscope.analyzers.routing.gate import MAX_TRACKED_CLASSES, ClassGate
from triscope.analyzers.routing.model import BREAK, DEGRADE, LIMIT, NORMAL, ClassLevel
from triscope.analyzers.routing.picker import EngineView
from triscope.errors import ConfigError

VIDEO, IMAGE, SPEECH = "offline_video", "interactive_image_text", "realtime_speech"


def _params(**levels: object) -> WeightParams:
    return WeightParams.from_config({"weights": {"levels": {"enabled": True, "hold_s": 3.0, **levels}}})


def _inputs(now: float, kv: float, **extra: object) -> list[BackendInputs]:
    return [BackendInputs(name, kv_cache_usage_ratio=kv, address=f"127.0.0.1:{9000 + i}",
                          sources={"serving": now}, **extra)  # type: ignore[arg-type]
            for i, name in enumerate(("a", "b"))]


def _levels(steps: list[tuple[float, float]], params: WeightParams) -> list[dict[str, tuple[str, float]]]:
    """(time, KV usage of every backend) -> each update's (level, shed ratio) per class."""
    state, out = None, []
    for now, kv in steps:
        result, state = compute_weights(_inputs(now, kv), state, params, now)
        out.append({c: (lv.level, round(lv.shed_ratio, 3)) for c, lv in result.class_levels.items()})
    return out


def test_levels_rise_with_pressure_by_class_priority_and_come_down_with_hysteresis() -> None:
    seen = _levels([(0, 0.5), (1, 0.9), (2, 0.96), (3, 0.93), (4, 0.89), (6, 0.89), (8, 0.5), (9, 0.5), (12, 0.5)],
                   _params())
    assert seen[0] == {VIDEO: (NORMAL, 0), IMAGE: (NORMAL, 0), SPEECH: (NORMAL, 0)}
    assert seen[1] == {VIDEO: (DEGRADE, 0.25), IMAGE: (NORMAL, 0), SPEECH: (NORMAL, 0)}  # lowest class first
    assert seen[2] == {VIDEO: (LIMIT, 0.5), IMAGE: (LIMIT, 0), SPEECH: (NORMAL, 0)}  # the top class is never limited
    assert seen[3][IMAGE][0] == LIMIT  # 0.93 is within the release margin of limit_at 0.95
    assert seen[4][IMAGE][0] == LIMIT  # below the margin, but held for less than hold_s (3 s)
    assert seen[5][IMAGE][0] == NORMAL and seen[5][VIDEO] == (DEGRADE, 0.2)  # released to what 0.89 calls for
    assert seen[6][VIDEO][0] == DEGRADE  # degrade is held too
    assert seen[8] == {VIDEO: (NORMAL, 0), IMAGE: (NORMAL, 0), SPEECH: (NORMAL, 0)}


def test_levels_are_off_by_default_and_on_stale_inputs() -> None:
    off = WeightParams.from_config({})
    result, _ = compute_weights(_inputs(0, 0.99), None, off, 0)
    assert {lv.level for lv in result.class_levels.values()} == {NORMAL}
    stale, _ = compute_weights(_inputs(0, 0.99), None, _params(), 100)  # inputs 100 s old
    assert stale.stale and {lv.level for lv in stale.class_levels.values()} == {NORMAL}


def test_queue_and_latency_raise_pressure_too() -> None:
    params = _params()
    queued, _ = compute_weights(_inputs(0, 0.2, queue_length=9.0, running_requests=10.0), None, params, 0)
    assert queued.pressure == pytest.approx(0.9) and queued.class_levels[VIDEO].level == DEGRADE
    slow, _ = compute_weights(_inputs(0, 0.2, p99_seconds={SPEECH: 0.3, VIDEO: 60.0}), None, params, 0)
    assert slow.pressure == pytest.approx(1.5)  # speech at 1.5 x its 200 ms SLA; the video P99 does not count
    assert slow.class_levels[IMAGE].level == LIMIT and slow.class_levels[SPEECH].level == NORMAL


def test_a_class_closed_everywhere_breaks_and_recovers_at_once() -> None:
    params = WeightParams.from_config({"weights": {"levels": {"enabled": True},
                                                   "classes": {VIDEO: {"admit_kv_ratio": 0.3}}}})
    closed, state = compute_weights(_inputs(0, 0.5), None, params, 0)
    assert closed.class_levels[VIDEO].level == BREAK and closed.class_levels[IMAGE].level == NORMAL
    doc = closed.to_dict()
    assert doc["class_levels"][VIDEO]["level"] == BREAK and doc["pressure"] == pytest.approx(0.5)
    reopened, _ = compute_weights(_inputs(1, 0.1), state, params, 1)
    assert reopened.class_levels[VIDEO].level == NORMAL


@pytest.mark.parametrize(("levels", "message"), [
    ({"degrade_at": 0.9, "limit_at": 0.8}, "degrade_at <= limit_at"),
    ({"max_shed_ratio": 1.5}, "max_shed_ratio must be in"),
    ({"hold_s": -1}, "hold_s must be >= 0"),
    ({"shed": 1}, "unknown keys: shed"),
])
def test_bad_levels_config_is_one_line(levels: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        WeightParams.from_config({"weights": {"levels": levels}})


def test_gate_sheds_a_share_limits_to_a_share_of_the_rate_and_breaks() -> None:
    gate = ClassGate(window_s=10.0, burst_s=1.0, seed=7)
    assert all(gate.admit(VIDEO, t * 0.1) is None for t in range(100))  # no levels yet: 10 req/s admitted
    gate.set_levels({VIDEO: ClassLevel(DEGRADE, shed_ratio=0.3), SPEECH: ClassLevel(NORMAL)})
    shed = Counter(gate.admit(VIDEO, 10 + t * 0.001) for t in range(2000))
    assert 0.25 < shed[DEGRADE] / 2000 < 0.35 and set(shed) == {None, DEGRADE}
    for t in range(200):  # image-text offered at 20 req/s, admitted while normal
        assert gate.admit(IMAGE, 20 + t * 0.05) is None
    gate.set_levels({IMAGE: ClassLevel(LIMIT, admit_ratio=0.5)})
    admitted = sum(gate.admit(IMAGE, 30 + t * 0.05) is None for t in range(400))  # 20 s more at 20 req/s
    assert 200 <= admitted <= 212, admitted  # 0.5 x 20 req/s for 20 s, plus the first bucket of 10
    gate.set_levels({IMAGE: ClassLevel(BREAK)})
    assert gate.admit(IMAGE, 41) == BREAK and gate.admit(SPEECH, 41) is None and gate.admit("", 41) is None
    gate.set_levels({})
    assert gate.admit(IMAGE, 42) is None


def test_gate_counts_a_bounded_number_of_classes() -> None:
    """The class is the client's to name: invented names must not grow the gate without bound."""
    gate = ClassGate(window_s=10.0, burst_s=1.0)
    gate.set_levels({VIDEO: ClassLevel(NORMAL)})
    for i in range(3 * MAX_TRACKED_CLASSES):
        assert gate.admit(f"made-up-{i}", 1.0) is None
    assert gate.admit(VIDEO, 1.0) is None  # a class with a level is always counted
    assert len(gate._arrivals) <= MAX_TRACKED_CLASSES + 1 and VIDEO in gate._arrivals
    assert gate.admit("late", 20.0) is None  # the idle names left the window: room again
    assert "late" in gate._arrivals and len(gate._arrivals) <= 3


def test_engine_view_carries_levels_from_the_feed_document() -> None:
    params = WeightParams.from_config({"weights": {"levels": {"enabled": True},
                                                   "classes": {VIDEO: {"admit_kv_ratio": 0.3}}}})
    result, _ = compute_weights(_inputs(0, 0.5), None, params, 0)
    view = EngineView.from_document(result.to_dict())
    assert view.class_levels[VIDEO].level == BREAK and view.class_levels[SPEECH].level == NORMAL
    assert EngineView.of(result).class_levels[VIDEO].level == BREAK
    with pytest.raises(ValueError, match="unknown admission level"):
        EngineView.from_document({"backends": {}, "class_levels": {VIDEO: {"level": "panic"}}})
