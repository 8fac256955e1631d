"""Interval algebra on half-open ``[start, end)`` int64 intervals (nanoseconds), vectorised with numpy.

Shared by the stall classifier (busy time per window) and the trace breakdown (union and overlap
lengths). Inputs are parallel arrays of starts and ends in any order; touching intervals merge.
"""

from __future__ import annotations

from typing import Any

import numpy as np


def _ints(values: Any) -> np.ndarray:
    return np.asarray(values, dtype=np.int64)


def merge(starts: Any, ends: Any) -> tuple[np.ndarray, np.ndarray]:
    """The union of the intervals as sorted, disjoint ``(starts, ends)``."""
    starts, ends = _ints(starts), _ints(ends)
    if starts.size == 0:
        return starts, ends
    order = np.argsort(starts, kind="stable")
    s, e = starts[order], ends[order]
    reach = np.maximum.accumulate(e)
    # A new merged group starts where an interval begins after everything before it ended.
    new = np.ones(s.size, dtype=bool)
    new[1:] = s[1:] > reach[:-1]
    first = np.flatnonzero(new)
    last = np.append(first[1:] - 1, s.size - 1)
    return s[first], reach[last]


def union_length(starts: Any, ends: Any) -> int:
    """Total length covered by the intervals."""
    s, e = merge(starts, ends)
    return int((e - s).sum())


def _covered_before(ms: np.ndarray, me: np.ndarray, t: np.ndarray) -> np.ndarray:
    """Length of the disjoint sorted union ``ms``/``me`` lying before each time in ``t``."""
    out = np.zeros(t.size, dtype=np.int64)
    if ms.size == 0:
        return out
    prefix = np.concatenate([[0], np.cumsum(me - ms)])
    i = np.searchsorted(ms, t, side="right")
    mask = i > 0
    j = i[mask] - 1
    out[mask] = prefix[j] + np.minimum(t[mask], me[j]) - ms[j]
    return out


def coverage(starts: Any, ends: Any, w_start: Any, w_end: Any) -> np.ndarray:
    """Length of the union of the intervals inside each window ``[w_start[i], w_end[i])``."""
    ms, me = merge(starts, ends)
    return _covered_before(ms, me, _ints(w_end)) - _covered_before(ms, me, _ints(w_start))


def intersection_length(a_starts: Any, a_ends: Any, b_starts: Any, b_ends: Any) -> int:
    """Length of time covered by both interval sets (the union of ``a`` intersected with the union of ``b``)."""
    a_s, a_e = merge(a_starts, a_ends)
    return int(coverage(b_starts, b_ends, a_s, a_e).sum())
