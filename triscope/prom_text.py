"""Prometheus text exposition: parse it into samples, and the histogram arithmetic done on them.

Used by the serving-metrics scraper and by anything else that reads a ``/metrics`` page (the
simulator's feed worker, bench code). Parsing uses ``prometheus_client.parser``.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Collection

from triscope.errors import InputError

Series = dict[str, list[tuple[dict[str, str], float]]]
"""Sample name -> [(labels, value)]."""


def parse_exposition(text: str, source: str = "metrics") -> Series:
    """All samples of a Prometheus text exposition; InputError (one line) when it is not one."""
    from prometheus_client.parser import text_string_to_metric_families

    series: Series = defaultdict(list)
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                series[sample.name].append((dict(sample.labels), float(sample.value)))
    except (ValueError, TypeError, IndexError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise InputError(f"{source}: not Prometheus text format: {first}") from None
    return dict(series)


def keep_families(text: str, names: Collection[str]) -> str:
    """Only the lines (samples and comments) of the metric families ``names``: parsing a whole vLLM page
    (~200 lines) several times a second per backend costs a core's share in Python; the lines a caller
    reads are a handful."""
    keep = []
    for line in text.splitlines():
        if line.startswith("#"):
            parts = line.split(" ", 3)
            name = parts[2] if len(parts) > 2 else ""
        else:
            name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in names:
            keep.append(line)
    return "\n".join(keep) + "\n"


def le_bound(text: str) -> float:
    """The upper bound of a histogram bucket from its ``le`` label."""
    return math.inf if text in ("+Inf", "Inf", "inf") else float(text)


def bucket_delta(current: dict[float, float], previous: dict[float, float] | None) -> dict[float, float]:
    """Cumulative bucket counts observed between two scrapes; the current counts after a reset."""
    if not previous:
        return {}
    delta = {le: count - previous.get(le, 0.0) for le, count in current.items()}
    if any(v < 0 for v in delta.values()) or set(previous) - set(current):
        return dict(current)  # counter reset (restart): everything counted since the restart
    return delta


def histogram_quantile(q: float, buckets: dict[float, float]) -> float:
    """Quantile of cumulative buckets ``{le: count}`` by linear interpolation within the bucket
    (Prometheus ``histogram_quantile`` semantics); NaN when empty; the +Inf bucket yields the
    highest finite bound."""
    if not buckets:
        return math.nan
    edges = sorted(buckets)
    total = buckets[edges[-1]] if math.isinf(edges[-1]) else max(buckets.values())
    if total <= 0:
        return math.nan
    rank = q * total
    lower, below = 0.0, 0.0
    for le in edges:
        count = buckets[le]
        if count >= rank:
            if math.isinf(le):
                finite = [e for e in edges if not math.isinf(e)]
                return finite[-1] if finite else math.nan
            if count == below:
                return le
            return lower + (le - lower) * (rank - below) / (count - below)
        lower, below = le, count
    return edges[-1]


__all__ = ["Series", "bucket_delta", "histogram_quantile", "le_bound", "parse_exposition"]
