"""The shared interval algebra (triscope.analyzers.intervals) against per-nanosecond pixel counts."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from triscope.analyzers.intervals import coverage, intersection_length, merge, union_length

_SPANS = st.lists(st.tuples(st.integers(0, 200), st.integers(0, 40)), max_size=25)


def _arrays(spans: list[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray]:
    return np.array([s for s, _ in spans], dtype=np.int64), np.array([s + d for s, d in spans], dtype=np.int64)


def _pixels(spans: list[tuple[int, int]]) -> np.ndarray:
    mask = np.zeros(260, dtype=bool)
    for s, d in spans:
        mask[s:s + d] = True
    return mask


@settings(max_examples=150, deadline=None)
@given(_SPANS, _SPANS, st.integers(1, 60))
def test_algebra_matches_pixel_counts(a: list[tuple[int, int]], b: list[tuple[int, int]], width: int) -> None:
    pa, pb = _pixels(a), _pixels(b)
    assert union_length(*_arrays(a)) == int(pa.sum())
    assert intersection_length(*_arrays(a), *_arrays(b)) == int((pa & pb).sum())
    ws = np.arange(0, 260, width, dtype=np.int64)
    assert coverage(*_arrays(a), ws, ws + width).tolist() == [int(pa[w:w + width].sum()) for w in ws]
    ms, me = merge(*_arrays(a))
    assert np.all(ms[1:] > me[:-1]) and int((me - ms).sum()) == int(pa.sum())


def test_empty_inputs() -> None:
    empty = np.array([], dtype=np.int64)
    assert union_length(empty, empty) == 0 and intersection_length(empty, empty, [0], [5]) == 0
    assert coverage(empty, empty, [0, 10], [10, 20]).tolist() == [0, 0]
