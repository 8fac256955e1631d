"""The per-request headroom picker (analyzers/routing/picker.py) and its request-need parser (exporters/epp.py).

Pure logic on made-up scrapes; the picker behind a real Envoy is in tests/test_epp_gateway.py.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import replace

import pytest

from triscope.analyzers.routing.model import BackendInputs, BackendWeight, ScaleDecision, WeightsResult
from triscope.analyzers.routing.picker import EngineView, HeadroomPicker, LiveSignals, PickerParams, RequestNeed
from triscope.exporters.epp import HeadroomChooser, NeedParams, request_need

NOW = 1000.0


def _picker(n: int = 2, **params: object) -> HeadroomPicker:
    return HeadroomPicker({f"b{i}": f"127.0.0.1:{9000 + i}" for i in range(n)}, PickerParams(seed=1, **params))


def _idle(picker: HeadroomPicker, capacity: float = 1024.0, at: float = NOW) -> None:
    for name in picker.backends:
        picker.observe(name, LiveSignals(waiting=0, running=0, kv_usage=0.0, kv_capacity_tokens=capacity, updated=at))


def test_a_burst_between_scrapes_spreads_by_the_ledger() -> None:
    picker = _picker(4)
    _idle(picker)
    picks = [picker.pick(RequestNeed("speech", 64), NOW + 0.01 * i) for i in range(40)]
    assert Counter(p.backend for p in picks) == {f"b{i}": 10 for i in range(4)}  # no herding on stale zeros
    for p in picks:
        picker.finish(p)
        picker.finish(p)  # idempotent
    assert picker.in_flight() == {f"b{i}": 0 for i in range(4)}


def test_a_request_that_ended_after_the_scrape_is_not_another_clients() -> None:
    """A scrape that saw our request running, read after the request ended: the engine's count still holds it,
    but it is ours (not external load) until the next scrape."""
    picker = _picker(2)
    _idle(picker, at=NOW)
    short = picker.pick(RequestNeed("speech", 64), NOW + 0.01)
    other = "b1" if short.backend == "b0" else "b0"
    picker.observe(short.backend, LiveSignals(0, 1, 0.0, 1024.0, NOW + 0.05))  # it runs at the scrape
    picker.finish(short, now=NOW + 0.06)
    rows = picker.explain(NOW + 0.07)
    assert rows[short.backend]["external_requests"] == 0 and rows[short.backend]["work_tokens"] == 0
    picker.observe(short.backend, LiveSignals(0, 1, 0.0, 1024.0, NOW + 0.10))  # another client's, this time
    assert picker.explain(NOW + 0.11)[short.backend]["external_requests"] == 1
    assert picker.explain(NOW + 0.11)[other]["external_requests"] == 0


def test_a_request_that_ended_while_the_scrape_was_in_flight_is_not_another_clients() -> None:
    """The engine took its figures at some moment between the scrape's send and its answer: a request of
    ours that ended in between may be in them, and must not read as a tenant's (extra work, strict fit)."""
    picker = _picker(2)
    _idle(picker, at=NOW)
    done = picker.pick(RequestNeed("speech", 64), NOW + 0.01)
    picker.finish(done, now=NOW + 0.05)  # ends while a scrape sent at NOW + 0.04 is in flight
    signals = LiveSignals(0, 1, 0.0, 1024.0, updated=NOW + 0.20, requested=NOW + 0.04)
    picker.observe(done.backend, signals)
    row = picker.explain(NOW + 0.21)[done.backend]
    assert row["external_requests"] == 0 and row["work_tokens"] == 0
    # without the send time the scrape counts from its answer: the same page reads as another client's request
    picker.observe(done.backend, LiveSignals(0, 1, 0.0, 1024.0, updated=NOW + 0.30, requested=NOW + 0.25))
    assert picker.explain(NOW + 0.31)[done.backend]["external_requests"] == 1  # sent after it ended: not ours


def test_a_backend_that_preempts_or_queues_for_kv_is_full_whatever_its_gauge() -> None:
    """Early signals: a preemption since the previous scrape, or requests waiting for capacity, mean the
    engine is out of KV now (the usage gauge can read 70 % between two block allocations). With an infinite
    short_penalty such a backend takes nothing that fits elsewhere."""
    picker = _picker(2, short_penalty=math.inf)
    for name in picker.backends:
        picker.observe(name, LiveSignals(0, 2, 0.5, 10_000.0, NOW, preemptions_total=3.0, waiting_for_capacity=0.0))
    picker.observe("b0", LiveSignals(0, 2, 0.7, 10_000.0, NOW + 0.25, preemptions_total=4.0, waiting_for_capacity=0.0))
    picker.observe("b1", LiveSignals(0, 3, 0.6, 10_000.0, NOW + 0.25, preemptions_total=3.0, waiting_for_capacity=0.0))
    rows = picker.explain(NOW + 0.3)
    assert rows["b0"]["preempting"] and rows["b0"]["free_kv_tokens"] == 0 and not rows["b1"]["preempting"]
    assert {picker.pick(RequestNeed("video", 100), NOW + 0.3).backend for _ in range(4)} == {"b1"}
    picker.observe("b0", LiveSignals(0, 2, 0.7, 10_000.0, NOW + 0.5, preemptions_total=4.0, waiting_for_capacity=0.0))
    assert not picker.explain(NOW + 0.5)["b0"]["preempting"]  # no new preemption: its gauge counts again
    picker.observe("b1", LiveSignals(2, 3, 0.6, 10_000.0, NOW + 0.5, preemptions_total=3.0, waiting_for_capacity=2.0))
    assert picker.explain(NOW + 0.5)["b1"]["free_kv_tokens"] == 0


def test_work_can_be_counted_in_tokens_instead_of_requests() -> None:
    picker = _picker(2, work_unit="tokens")
    _idle(picker, capacity=100_000)
    big = picker.pick(RequestNeed("video", 400), NOW)
    smalls = [picker.pick(RequestNeed("speech", 50), NOW) for _ in range(7)]
    assert all(s.backend != big.backend for s in smalls)  # 7 x 50 < 400: leastconn would alternate
    by_count = _picker(2)
    _idle(by_count, capacity=100_000)
    big = by_count.pick(RequestNeed("video", 400), NOW)
    assert Counter(by_count.pick(RequestNeed("speech", 50), NOW).backend == big.backend for _ in range(7)) == {
        False: 4, True: 3}
    with pytest.raises(ValueError, match="work_unit"):
        _picker(2, work_unit="bytes")


def test_a_strict_fit_sends_a_request_only_where_it_fits() -> None:
    picker = _picker(2, misfit_penalty=math.inf, short_penalty=math.inf)
    picker.observe("b0", LiveSignals(0, 1, 0.9, 1024.0, NOW))  # 102 tokens free, lightly loaded
    picker.observe("b1", LiveSignals(0, 4, 0.2, 1024.0, NOW))  # room, busier
    pick = picker.pick(RequestNeed("video", 400), NOW)
    assert pick.backend == "b1" and pick.factors["fits"]
    assert picker.pick(RequestNeed("speech", 30), NOW).backend == "b0"  # small ones still fit b0


def test_a_misfit_penalty_makes_the_fit_a_cost_not_a_filter() -> None:
    picker = _picker(2, misfit_penalty=1.0)
    picker.observe("b0", LiveSignals(0, 0, 0.0, 1024.0, NOW - 1))  # b1 not scraped yet: b0 only
    assert picker.pick(RequestNeed("video", 400), NOW - 0.5).backend == "b0"
    picker.observe("b0", LiveSignals(0, 1, 0.9, 1024.0, NOW))  # 102 tokens free, held by the picker's request
    picker.observe("b1", LiveSignals(0, 4, 0.2, 1024.0, NOW))  # room, 4 requests of another client
    picks = [picker.pick(RequestNeed("video", 400), NOW).backend for _ in range(6)]
    # b0's work (1, then 2, plus the penalty) stays under b1's 4 for two picks; then the lines even out
    assert picks[:2] == ["b0", "b0"] and "b1" in picks[2:]
    # KV held by requests the picker did not send (a tenant) may not free soon: with an infinite short_penalty
    # nothing goes there that fits elsewhere, however short its line; nor to a backend short of KV by an
    # early signal
    for b0 in (LiveSignals(0, 2, 0.9, 1024.0, NOW), LiveSignals(1, 0, 0.9, 1024.0, NOW, waiting_for_capacity=1.0)):
        strict = _picker(2, misfit_penalty=1.0, short_penalty=math.inf)
        strict.observe("b0", b0)
        strict.observe("b1", LiveSignals(0, 4, 0.2, 1024.0, NOW))
        assert {strict.pick(RequestNeed("video", 100), NOW).backend for _ in range(3)} == {"b1"}
        # a finite short_penalty makes that a cost too: the short backend's work (its 2 requests, or its 1
        # waiting) plus 2.5 against b1's line of 4 other requests, growing by one per pick
        lenient = _picker(2, misfit_penalty=1.0, short_penalty=2.5)
        lenient.observe("b0", b0)
        lenient.observe("b1", LiveSignals(0, 4, 0.2, 1024.0, NOW))
        picks = [lenient.pick(RequestNeed("video", 100), NOW + 0.01).backend for _ in range(2)]
        assert picks == (["b1", "b0"] if b0.running + b0.waiting == 2 else ["b0", "b1"]), picks


def test_requests_from_other_clients_count_as_work() -> None:
    picker = _picker(2)
    picker.observe("b0", LiveSignals(3, 4, 0.0, math.nan, NOW))  # a pinned tenant's 7 requests
    picker.observe("b1", LiveSignals(0, 0, 0.0, math.nan, NOW))
    got = Counter(picker.pick(RequestNeed("", 256), NOW).backend for _ in range(6))
    assert got == {"b1": 6}


def test_unready_and_drained_backends_leave_the_candidates() -> None:
    picker = _picker(3)
    _idle(picker)
    picker.observe("b2", LiveSignals(0, 0, 0.0, 1024.0, NOW - 10))  # scrapes failing for 10 s
    picker.set_weights(_result({"b0": "drain", "b1": "ready", "b2": "ready"}))
    assert {picker.pick(RequestNeed("speech", 10), NOW).backend for _ in range(5)} == {"b1"}
    explained = picker.explain(NOW, "speech")
    assert explained["b0"]["drained"] and not explained["b2"]["healthy"] and explained["b1"]["in_flight"] == 5


def test_a_drain_for_kv_usage_alone_is_left_to_the_fit_test() -> None:
    """The weight engine drains a backend at high KV usage for at least an engine period; the picker's fit
    test weighs each request against fresher figures, so by default only other drains hold."""
    result = _result({"b0": "drain", "b1": "ready", "b2": "drain"}, {"b0": ("kv_cache",), "b2": ("health",)})
    result = replace(result, class_admission={"speech": {"b0": "drain", "b1": "ready", "b2": "drain"}})
    for view in (result, EngineView.from_document(result.to_dict())):
        assert view is result or view.kv_drained == frozenset({"b0"})
        picker = _picker(3)
        _idle(picker)
        picker.set_weights(view)
        assert {picker.pick(RequestNeed("speech", 10), NOW).backend for _ in range(6)} == {"b0", "b1"}
        rows = picker.explain(NOW, "speech")
        assert not rows["b0"]["drained"] and rows["b0"]["class_state"] is None and rows["b2"]["drained"]
        assert picker.class_drains() == {"b0": [], "b1": [], "b2": ["speech"]}
        strict = _picker(3, engine_kv_drains=True)
        _idle(strict)
        strict.set_weights(view)
        assert {strict.pick(RequestNeed("speech", 10), NOW).backend for _ in range(4)} == {"b1"}
        assert strict.class_drains() == {"b0": ["speech"], "b1": [], "b2": ["speech"]}
    assert _picker(2).class_drains() == {"b0": [], "b1": []}  # no engine result: nothing drained


def test_a_refused_scrape_takes_a_backend_out_until_one_answers() -> None:
    picker = _picker(2)
    _idle(picker)
    picker.refused("b1")  # its port refused a scrape: the engine's process is gone
    row = picker.explain(NOW)["b1"]
    assert row["refused"] and not row["healthy"] and row["scrape_age_s"] == 0
    assert {picker.pick(RequestNeed("speech", 10), NOW).backend for _ in range(4)} == {"b0"}
    picker.observe("b1", LiveSignals(0, 0, 0.0, 1024.0, NOW + 1))  # restarted: its scrape answers again
    assert picker.explain(NOW + 1)["b1"]["healthy"]
    assert picker.pick(RequestNeed("speech", 10), NOW + 1).backend == "b1"  # b0 holds the 4 above


def test_a_backend_that_answers_stays_ready_while_its_scrapes_fail() -> None:
    # an engine too busy to render /metrics within the scrape deadline still serves: out only when it
    # neither answers scrapes nor requests for unready_after_s
    picker = _picker(2, unready_after_s=3.0)
    _idle(picker, at=NOW - 10)
    picker.observe("b0", LiveSignals(0, 0, 0.0, 1024.0, NOW))
    assert not picker.explain(NOW)["b1"]["healthy"]
    picker.answered("b1", 503, NOW - 1)  # the gateway's own 503 (no connection) proves nothing
    assert not picker.explain(NOW)["b1"]["healthy"]
    picker.answered("b1", 200, NOW - 1)
    row = picker.explain(NOW)["b1"]
    assert row["healthy"] and not row["fresh"] and row["answer_age_s"] == 1.0
    assert math.isinf(row["free_kv_tokens"]) and row["external_requests"] == 0  # its stale figures don't count
    assert Counter(picker.pick(RequestNeed("speech", 10), NOW).backend for _ in range(4)) == {"b0": 2, "b1": 2}
    assert not picker.explain(NOW + 2.5)["b1"]["healthy"]  # 3.5 s since its last answer
    picker.refused("b1")  # nothing listens any more: an answer does not outvote a refused scrape
    picker.answered("b1", 200, NOW + 3)
    assert not picker.explain(NOW + 3)["b1"]["healthy"]


def test_a_scrape_stays_fresh_for_two_of_its_periods() -> None:
    picker = _picker(2, stale_after_s=1.0)
    picker.observe("b0", LiveSignals(0, 0, 0.5, 1024.0, NOW - 1.5, period_s=1.0))  # scraped every 1 s
    picker.observe("b1", LiveSignals(0, 0, 0.5, 1024.0, NOW - 1.5, period_s=0.25))
    rows = picker.explain(NOW)
    assert rows["b0"]["fresh"] and rows["b0"]["free_kv_tokens"] == 512.0
    assert not rows["b1"]["fresh"] and not picker.explain(NOW + 0.6)["b0"]["fresh"]


def test_when_nothing_is_eligible_it_still_routes() -> None:
    picker = _picker(2)  # never scraped: a gateway starting up
    assert picker.pick(RequestNeed("", math.nan), NOW).backend in ("b0", "b1")


def test_stale_kv_is_not_trusted_for_fit() -> None:
    picker = _picker(2, stale_after_s=1.0)
    picker.observe("b0", LiveSignals(0, 0, 1.0, 1024.0, NOW - 2))  # full, but 2 s ago
    picker.observe("b1", LiveSignals(0, 0, 0.0, 1024.0, NOW))
    row = picker.explain(NOW)["b0"]
    assert not row["fresh"] and row["healthy"] and math.isinf(row["free_kv_tokens"])


def test_the_kv_of_a_request_the_scrape_saw_end_is_free_again() -> None:
    """A scrape that saw a backend nearly full, read before its requests ended: until the next scrape the
    backend would look full. Their prompts' KV (a floor under what they held) counts free again; not while
    requests were waiting at the scrape (they take the freed KV first)."""
    picker = _picker(2, visible_after_s=0.2)
    _idle(picker, at=NOW)
    big = [picker.pick(RequestNeed("video", 400, 300), NOW + 0.01) for _ in range(2)]
    assert {p.backend for p in big} == {"b0", "b1"}
    late = picker.pick(RequestNeed("speech", 64, 48), NOW + 0.45)  # just before the scrape: not yet in it
    name = late.backend  # each held one video: the seeded tie chose
    other = "b1" if name == "b0" else "b0"
    video = next(p for p in big if p.backend == name)

    def scrape(waiting: float) -> None:
        picker.observe(name, LiveSignals(waiting, 2, 0.9, 1024.0, NOW + 0.5, requested=NOW + 0.49))

    scrape(0)
    before = picker.explain(NOW + 0.6)[name]
    assert before["free_kv_tokens"] == pytest.approx(1024 * 0.1 - 64) and before["freed_tokens"] == 0
    picker.finish(video, now=NOW + 0.7)
    picker.finish(late, now=NOW + 0.7)  # it was not in the figure: neither subtracted nor credited now
    after = picker.explain(NOW + 0.8)[name]
    assert after["freed_tokens"] == 300 and after["free_kv_tokens"] == pytest.approx(1024 * 0.1 + 300)
    assert picker.explain(NOW + 0.8)[other]["freed_tokens"] == 0  # its video still runs
    scrape(1)  # the same page with a request waiting: the freed KV is its
    waited = picker.explain(NOW + 0.9)[name]
    assert waited["freed_tokens"] == 0 and waited["free_kv_tokens"] == pytest.approx(1024 * 0.1)
    picker.observe(name, LiveSignals(0, 0, 0.0, 1024.0, NOW + 1.0, requested=NOW + 0.99))
    assert picker.explain(NOW + 1.1)[name]["freed_tokens"] == 0  # ended before the next scrape was sent


def _result(states: dict[str, str], reasons: dict[str, tuple[str, ...]] | None = None) -> WeightsResult:
    why = reasons or {}
    backends = {n: BackendWeight(n, 1.0, 1.0, 100, s, why.get(n, ()), {}, BackendInputs(n), 0.0)
                for n, s in states.items()}
    return WeightsResult(backends, 1, NOW, False, (), False, {}, ScaleDecision("hold", math.nan, ""))


@pytest.mark.parametrize(("doc", "headers", "cls", "tokens"), [
    ({"prompt": "x" * 400, "max_tokens": 100}, {}, "", 200.0),
    ({"prompt": [1, 2, 3], "max_tokens": 7, "request_class": "speech"}, {}, "speech", 10.0),
    ({"messages": [{"role": "user", "content": "y" * 40}], "max_completion_tokens": 5},
     {"x-triscope-class": "video"}, "video", 15.0),
    ({"prompt": "z" * 8}, {}, "", 258.0),  # no max_tokens: the default output
])
def test_request_need_from_openai_bodies(doc: dict, headers: dict, cls: str, tokens: float) -> None:
    need = request_need(doc, headers, NeedParams())
    assert need.request_class == cls and need.kv_tokens == pytest.approx(tokens)
    output = doc.get("max_tokens", doc.get("max_completion_tokens", 256))
    assert need.prompt_tokens == pytest.approx(tokens - output)


def test_chooser_refuses_a_body_that_is_not_json_and_closes_the_ledger() -> None:
    picker = _picker(2)
    chooser = HeadroomChooser(picker)
    assert chooser.choose(b"[1, 2", {}).status == 400
    choice = chooser.choose(b'{"prompt": "hello", "max_tokens": 4}', {})
    assert choice.address.startswith("127.0.0.1:") and sum(picker.in_flight().values()) == 1
    chooser.done(choice)
    assert sum(picker.in_flight().values()) == 0
