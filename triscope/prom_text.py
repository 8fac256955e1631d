"""Prometheus text exposition: the one parser of every scraper, and the histogram arithmetic done on it.

:func:`scan` is triscope's own line parser, used by every reader of a ``/metrics`` page
(serving_metrics, dcgm, the NCCL Inspector reader, ebpf_exporter, the picker's live signals).
prometheus-client's ``text_string_to_metric_families`` is exact too (the same 742 samples of a
two-engine vLLM 0.33 page, and of escaped labels, NaN, +-Inf, timestamps), but it took 13.4-24.9 ms
for that page against 3.9 ms here (3.4x-6.5x over three runs on 2 loaded cores;
``bench/prom_parsers.py``, bench/results/2026-12-07-prom-parsers.md; the picker's four families
1.34x), a page is scraped per backend every few seconds (and by the picker several times a second),
it refuses the whole page for one malformed line where dcgm must keep the good ones, and it drops
the sample timestamps ``/federate`` needs. So it is not used to read; it stays what writes
triscope's own ``/metrics``.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from collections.abc import Collection
from dataclasses import dataclass, field

from triscope.errors import InputError

Series = dict[str, list[tuple[dict[str, str], float]]]
"""Sample name -> [(labels, value)]."""

_SAMPLE = re.compile(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?[ \t]+(\S+)(?:[ \t]+(-?\d+))?[ \t]*\r?")
_LABEL = re.compile(r'[ \t]*([a-zA-Z_][a-zA-Z0-9_]*)[ \t]*=[ \t]*"((?:[^"\\]|\\.)*)"[ \t]*(,|$)')
_UNESCAPE = re.compile(r"\\(.)")
MAX_BAD_LINES_KEPT = 100


def _labels(body: str) -> dict[str, str] | None:
    out: dict[str, str] = {}
    pos, n = 0, len(body.rstrip())
    while pos < n:
        m = _LABEL.match(body, pos)
        if m is None:
            return None
        value = m.group(2)
        if "\\" in value:
            value = _UNESCAPE.sub(lambda e: "\n" if e.group(1) == "n" else e.group(1), value)
        out[m.group(1)] = value
        pos = m.end()
        if not m.group(3):
            break
    return out if pos >= n else None


@dataclass
class Parsed:
    """The samples of one exposition and the lines that were not Prometheus text."""

    samples: list[tuple[str, dict[str, str], float]] = field(default_factory=list)
    stamps_ms: list[int | None] = field(default_factory=list)
    """The sample timestamp of each of ``samples`` (a federation endpoint writes one), else None."""
    bad_lines: int = 0
    first_bad: str = ""
    bad_numbers: list[int] = field(default_factory=list)
    """Line numbers (from 1) of the first MAX_BAD_LINES_KEPT bad lines."""
    unmapped: dict[str, int] = field(default_factory=dict)
    """Names starting with ``count_prefix`` that were not asked for -> sample count."""


def scan(text: str, names: Collection[str] | None = None, *, fold_case: bool = False,
         count_prefix: str = "") -> Parsed:
    """The samples of ``text`` (all, or only those named in ``names``); a malformed line (of any
    family) is counted and skipped, never fatal; the labels of a family not asked for are not read.
    ``fold_case``: a name matches its upper-case spelling in ``names`` (relabelled pages)."""
    wanted = None if names is None else set(names)
    out = Parsed()
    for lineno, line in enumerate(text.split("\n"), 1):
        if not line or line[0] == "#" or line.isspace():
            continue
        m = _SAMPLE.fullmatch(line)
        value: float | None = None
        labels: dict[str, str] | None = {}
        name = ""
        if m is not None:
            name = m.group(1)
            if wanted is not None and name not in wanted:
                upper = name.upper()
                if fold_case and upper in wanted:
                    name = upper
                else:  # another family: its labels are not read
                    if count_prefix and upper.startswith(count_prefix):
                        out.unmapped[upper] = out.unmapped.get(upper, 0) + 1
                    continue
            if m.group(2):
                labels = _labels(m.group(2))
            try:
                value = float(m.group(3))
            except ValueError:
                value = None
        if m is None or labels is None or value is None:
            out.bad_lines += 1
            if len(out.bad_numbers) < MAX_BAD_LINES_KEPT:
                out.bad_numbers.append(lineno)
            if not out.first_bad:
                out.first_bad = f"line {lineno}: {line.strip()[:80]!r}"
            continue
        out.samples.append((name, labels, value))
        out.stamps_ms.append(int(m.group(4)) if m.group(4) else None)
    return out


def parse_exposition(text: str, source: str = "metrics", names: Collection[str] | None = None) -> Series:
    """The samples of a Prometheus text exposition (only ``names`` when given) by name; InputError
    (one line) at the first malformed line."""
    parsed = scan(text, names)
    if parsed.bad_lines:
        raise InputError(f"{source}: not Prometheus text format: {parsed.first_bad}")
    series: Series = defaultdict(list)
    for name, labels, value in parsed.samples:
        series[name].append((labels, value))
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


__all__ = ["Parsed", "Series", "bucket_delta", "histogram_quantile", "le_bound", "parse_exposition", "scan"]
