"""The picker's prefix term: the prompt's block hashes, the index of what each backend was sent, and how the
term weighs against outstanding work and the KV fit. Pure logic on made-up scrapes and prompts."""

from __future__ import annotations

import json
import random
from collections import Counter
from dataclasses import replace

from triscope.analyzers.routing.picker import HeadroomPicker, LiveSignals, PickerParams, RequestNeed
from triscope.analyzers.routing.prefix_index import PrefixIndex, block_hashes, prompt_text
from triscope.exporters.epp import HeadroomChooser

NOW = 1000.0
SYSTEM = "You are a careful assistant for a travel agency. " * 40  # about 2,000 characters shared


def _picker(n: int = 2, **params: object) -> HeadroomPicker:
    params = {"prefix_weight": 2.0, **params}
    picker = HeadroomPicker({f"b{i}": f"127.0.0.1:{9000 + i}" for i in range(n)}, PickerParams(seed=1, **params))
    for name in picker.backends:
        picker.observe(name, LiveSignals(waiting=0, running=0, kv_usage=0.0, kv_capacity_tokens=100_000.0,
                                         updated=NOW))
    return picker


def _need(text: str, block_chars: int = 256) -> RequestNeed:
    return RequestNeed("chat", 600.0, 500.0, block_hashes(text, block_chars, 512, "model-a"))


def test_equal_prefixes_hash_equal_until_they_part() -> None:
    a = block_hashes(SYSTEM + "question one " * 30, 64, 512)
    b = block_hashes(SYSTEM + "question two " * 30, 64, 512)
    shared = len(SYSTEM) // 64
    assert a[:shared] == b[:shared] and a[shared + 1] != b[shared + 1]
    assert block_hashes(SYSTEM, 64, 512, "model-a")[0] != block_hashes(SYSTEM, 64, 512, "model-b")[0]
    assert len(block_hashes("x" * 200, 64, 512)) == 3  # the partial block is left out
    assert len(block_hashes(SYSTEM, 64, 5)) == 5 and block_hashes("short", 64, 512) == ()


def test_prompt_text_of_chats_and_completions() -> None:
    chat = {"messages": [{"role": "system", "content": "rules"},
                         {"role": "user", "content": [{"type": "text", "text": "hi"}]}]}
    assert prompt_text(chat) == "<system>rules<user>hi"
    assert prompt_text({"prompt": ["a", "b"]}) == "a\nb" and prompt_text({"prompt": "p"}) == "p"
    assert prompt_text({"input": 3}) == ""


def test_the_index_evicts_a_prompt_s_tail_first_and_forgets_a_dead_backend() -> None:
    index = PrefixIndex(default_capacity=6)
    first, second = tuple(range(1, 5)), tuple(range(11, 15))
    index.record("b0", first)
    index.record("b0", second)  # 8 blocks over a capacity of 6: the first prompt's last two go
    assert index.match(first, ["b0"]) == {"b0": 2} and index.match(second, ["b0"]) == {"b0": 4}
    index.set_capacity("b0", 3)
    assert index.match(second, ["b0"]) == {"b0": 3} and index.blocks("b0") == 3
    index.forget("b0")
    assert index.match(second, ["b0", "b1"]) == {"b0": 0, "b1": 0}


def test_a_shared_prompt_follows_the_backend_that_holds_it_until_its_line_is_longer() -> None:
    picker = _picker(2)
    first = picker.pick(_need(SYSTEM + "first"), NOW)
    other = "b1" if first.backend == "b0" else "b0"
    # one request in flight there, none on the other: the whole prompt held is worth two requests of work
    second = picker.pick(_need(SYSTEM + "second"), NOW + 0.01)
    assert second.backend == first.backend
    assert second.factors["prefix_matched_blocks"][first.backend] == len(SYSTEM) // 256
    assert second.factors["backends"][first.backend]["prefix_bonus"] > 1.5
    third = picker.pick(_need(SYSTEM + "third"), NOW + 0.02)  # two in flight there now: a tie at best
    fourth = picker.pick(_need(SYSTEM + "fourth"), NOW + 0.03)
    assert other in {third.backend, fourth.backend}  # the line outweighs the cache before it grows long


def test_affinity_never_sends_a_request_where_it_does_not_fit() -> None:
    picker = _picker(2)
    first = picker.pick(_need(SYSTEM + "first"), NOW)
    picker.finish(first, now=NOW + 0.5)
    full = LiveSignals(waiting=0, running=0, kv_usage=0.999, kv_capacity_tokens=100_000.0, updated=NOW + 1)
    picker.observe(first.backend, full)
    again = picker.pick(_need(SYSTEM + "again"), NOW + 1.01)
    assert again.backend != first.backend
    assert again.factors["backends"][first.backend]["prefix_bonus"] == 0.0


def test_without_shared_prefixes_the_picks_are_those_without_the_term() -> None:
    """Random prompts share no block: the same picks, in the same order, as with the term off."""
    rng = random.Random(4)
    prompts = ["".join(rng.choice("abcdefghij ") for _ in range(rng.randint(100, 3000))) for _ in range(300)]
    picks = {}
    for weight in (0.0, 2.0):
        picker = _picker(4, prefix_weight=weight)
        held, seq = [], []
        for i, text in enumerate(prompts):
            p = picker.pick(_need(text), NOW + i * 0.01)
            held.append(p)
            seq.append(p.backend)
            if len(held) > 6:
                picker.finish(held.pop(0), now=NOW + i * 0.01)
        picks[weight] = seq
    assert picks[0.0] == picks[2.0]


def test_conversations_stay_with_their_backend_across_turns() -> None:
    """Eight conversations of six turns each, interleaved: each turn's prompt holds the whole history, so
    every later turn finds its history on one backend, while the load stays spread."""
    picker = _picker(4)
    history = {c: f"conversation {c}: " + f"topic {c} " * 60 for c in range(8)}
    homes: dict[int, Counter[str]] = {c: Counter() for c in history}
    for turn in range(6):
        held = []
        for c in history:
            history[c] += f" turn {turn} of {c}: " + "words " * 50
            p = picker.pick(_need(history[c]), NOW + turn + c * 0.01)
            homes[c][p.backend] += 1
            held.append(p)
        for p in held:
            picker.finish(p, now=NOW + turn + 0.5)
    assert all(counts.most_common(1)[0][1] >= 5 for counts in homes.values()), homes
    assert len({counts.most_common(1)[0][0] for counts in homes.values()}) >= 3


def test_a_refused_backend_loses_its_prefixes() -> None:
    picker = _picker(2)
    first = picker.pick(_need(SYSTEM + "first"), NOW)
    picker.finish(first, now=NOW + 0.1)
    picker.refused(first.backend)
    assert picker.explain(NOW + 0.2)[first.backend]["prefix_index_blocks"] == 0


def test_the_ext_proc_chooser_hashes_the_request_body() -> None:
    picker = _picker(2)
    chooser = HeadroomChooser(picker)
    body = {"model": "m", "max_tokens": 16, "messages": [{"role": "system", "content": SYSTEM},
                                                           {"role": "user", "content": "hello"}]}
    first = chooser.choose(json.dumps(body).encode(), {})
    body["messages"][1]["content"] = "hello again"
    second = chooser.choose(json.dumps(body).encode(), {})
    assert second.name == first.name and second.detail.factors["prefix_blocks"] > 5
    other_model = chooser.choose(json.dumps({**body, "model": "n"}).encode(), {})
    assert max(other_model.detail.factors["prefix_matched_blocks"].values()) == 0
    off = HeadroomChooser(_picker(2, prefix_weight=0.0)).choose(json.dumps(body).encode(), {})
    assert off.detail.factors["prefix_blocks"] == 0


def test_prefix_knobs_are_validated() -> None:
    import pytest

    from triscope.errors import ConfigError

    with pytest.raises(ConfigError, match="prefix_block_chars"):
        PickerParams.from_mapping({"prefix_block_chars": 0})
    with pytest.raises(ConfigError, match="prefix_weight"):
        PickerParams.from_mapping({"prefix_weight": -1.0})
    assert PickerParams().prefix_weight == 0.0  # off until measured against the peers
    assert replace(PickerParams(), prefix_weight=2.0).prefix_weight == 2.0


def test_the_index_is_sized_from_kv_capacity_with_the_epp_s_chars_per_token() -> None:
    """A backend's cache holds its KV tokens times the characters a token stands for: an EPP configured for
    2 characters a token gives half the blocks, and the service hands its setting to the picker."""
    from triscope.exporters.epp_service import EppConfig, EppService

    def capacity(picker: HeadroomPicker) -> int:
        picker.observe("b0", LiveSignals(waiting=0, running=0, kv_usage=0.0, kv_capacity_tokens=25_600.0,
                                         updated=NOW))
        picker.prefixes.record("b0", list(range(1_000)))  # more than fits: the index keeps its capacity
        return picker.prefixes.blocks("b0")

    assert capacity(HeadroomPicker({"b0": "h:1"}, PickerParams())) == 25_600 * 4 // 256
    assert capacity(HeadroomPicker({"b0": "h:1"}, PickerParams(), chars_per_token=2.0)) == 25_600 * 2 // 256
    service = EppService(EppConfig(chars_per_token=2.5), {"b0": "127.0.0.1:9"})
    assert service.picker.chars_per_token == 2.5
