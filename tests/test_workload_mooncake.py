"""The Mooncake conversation trace replayed with its prefix sharing kept (triscope_bed.workloads.mooncake).

The real trace's first 400 rows (tests/data, Apache-2.0, Qin et al., FAST 2025): equal block ids must give
equal prompt text on every replay, scaling must keep the blocks, a cut must keep the prefix, and the
rate must be what was asked. The full trace is read from ../shared when present.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from conftest import shared_data

from triscope_bed.workloads.arrivals import Arrival
from triscope_bed.workloads.mooncake import BLOCK_TOKENS, load_mooncake, mooncake, recurring_share, scaled
from triscope_bed.workloads.named import WORKLOADS, WorkloadError, build
from triscope_bed.workloads.prompts import completion_body

EXCERPT = Path(__file__).parent / "data" / "mooncake_conversation_excerpt.jsonl"


def _prompt(a: Arrival, salt: str = "round-1") -> str:
    return str(json.loads(completion_body(a, 0, salt=salt))["prompt"])


def _common_blocks(a: Arrival, b: Arrival) -> int:
    n = 0
    for x, y in zip(a.blocks, b.blocks, strict=False):
        if x != y:
            break
        n += 1
    return n


def test_rows_are_the_trace_s_own() -> None:
    rows = load_mooncake(EXCERPT)
    assert len(rows) == 400 and rows[0].t == 0.0 and rows[-1].t == 141.0
    assert rows[0].input_length == 6758 and rows[0].hash_ids[:3] == (0, 1, 2)
    assert all(len(r.hash_ids) == math.ceil(r.input_length / BLOCK_TOKENS) for r in rows)


def test_equal_block_ids_are_equal_text_and_others_differ() -> None:
    arrivals = mooncake(3, 2, trace=EXCERPT, duration_s=141.0, token_scale=0.25)
    pairs = [(a, b) for a, b in zip(arrivals, arrivals[1:], strict=False) if 0 < _common_blocks(a, b) < len(a.blocks)]
    assert len(pairs) >= 20, "the excerpt's conversations share prefixes"
    for a, b in pairs[:50]:
        k = _common_blocks(a, b)
        chars = round(a.block_tokens * 4.0)
        pa, pb = _prompt(a), _prompt(b)
        head = len("round-1 ")
        assert pa[:head + k * chars] == pb[:head + k * chars]  # the shared blocks, character for character
        assert pa[head + k * chars:head + (k + 1) * chars] != pb[head + k * chars:head + (k + 1) * chars]
    # another round's salt shares nothing with this one: no replay finds an earlier round's prefix cached
    a = pairs[0][0]
    assert _prompt(a, "round-1")[:40] != _prompt(a, "round-2")[:40]
    body = json.loads(completion_body(a, 0))
    assert body["prefix_blocks"] == list(a.blocks) and body["block_tokens"] == a.block_tokens


def test_scaling_keeps_the_blocks_and_a_cut_keeps_the_prefix() -> None:
    (row,) = [r for r in load_mooncake(EXCERPT)[:1]]
    prompt, out, ids, per_block = scaled(row, 0.125, None)
    assert per_block == 64 and ids == row.hash_ids and prompt == 64 * 13 + round((6758 - 512 * 13) * 0.125)
    prompt, out, ids, per_block = scaled(row, 0.125, 512)
    assert prompt + out <= 512 and ids == row.hash_ids[:len(ids)] and len(ids) == (512 - out) // 64
    assert scaled(row, 1.0, None)[:2] == (6758, 500)


def test_rate_window_and_sharing_as_asked() -> None:
    own = mooncake(1, 4, trace=EXCERPT, duration_s=60.0)
    assert own and all(a.t < 60.0 for a in own) and own == mooncake(1, 4, trace=EXCERPT, duration_s=60.0)
    fast = mooncake(1, 4, trace=EXCERPT, qps_per_backend=1.0, duration_s=50.0)
    assert len(fast) == 200 and fast[-1].t < 50.0 and fast[-1].t > 45.0
    assert {a.cls for a in fast} >= {"realtime_speech", "interactive_image_text"}
    # the infinite-cache hit share is the trace's, whatever the scale
    assert recurring_share(mooncake(1, 4, trace=EXCERPT, duration_s=141.0, token_scale=0.1)) == pytest.approx(
        recurring_share(mooncake(1, 4, trace=EXCERPT, duration_s=141.0)))
    assert "mooncake" in WORKLOADS and build("mooncake", 1, 2, trace=EXCERPT, duration_s=10.0, step_s=5.0)


def test_the_full_trace_recurs_as_published() -> None:
    path = shared_data("workloads", "mooncake_conversation_trace.jsonl")
    rows = load_mooncake(path)
    assert len(rows) == 12_031
    ids = [i for r in rows for i in r.hash_ids]
    counts: dict[int, int] = {}
    for i in ids:
        counts[i] = counts.get(i, 0) + 1
    assert sum(n for n in counts.values() if n > 1) / len(ids) == pytest.approx(0.52, abs=0.01)  # "52 % recur"


@pytest.mark.parametrize(("line", "message"), [
    ('{"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [1]}', "2 blocks of 512 expected"),
    ('{"timestamp": -1, "input_length": 6, "output_length": 5, "hash_ids": [1]}', "must be integers"),
    ('{"timestamp": 0, "input_length": 6, "output_length": 5, "hash_ids": ["a"]}', "non-negative integers"),
    ("not json", "not JSON"),
])
def test_bad_rows_are_one_line_errors(tmp_path: Path, line: str, message: str) -> None:
    bad = tmp_path / "t.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 6, "output_length": 5, "hash_ids": [1]}\n' + line + "\n")
    with pytest.raises(WorkloadError, match=message) as err:
        load_mooncake(bad)
    assert "\n" not in str(err.value) and "line 2" in str(err.value)
    with pytest.raises(WorkloadError, match="not found"):
        load_mooncake(tmp_path / "missing.jsonl")
