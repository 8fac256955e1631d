"""Prometheus text parsers: prometheus-client's against triscope's own, speed and exactness.

    .venv/bin/python bench/prom_parsers.py [--page PATH] [--repeat 30] [--json OUT]

Parsers (every sample of the page: name, labels, value):

* ``prometheus_client``: ``prometheus_client.parser.text_string_to_metric_families``;
* ``scan``: :func:`triscope.prom_text.scan`, triscope's one own parser (a regex per line, labels
  by a second regex, malformed lines counted and skipped, sample timestamps kept): the line parser
  that dcgm had, now shared by dcgm, serving_metrics, the NCCL Inspector reader and blockio;
* ``parse_exposition``: :func:`triscope.prom_text.parse_exposition`, ``scan`` grouped by name and
  strict (InputError at a malformed line), what serving_metrics and the picker call.

Speed: the best of ``--repeat`` parses of a vLLM ``/metrics`` page (default
``../shared/data/vllm/vllm_0.33_v1_two_engines.prom``, 874 lines, two engines), and the picker's
case (four families of the page, :func:`triscope.prom_text.keep_families` first). Ratios are
prometheus-client's time over each parser's, in the same run. Exactness: each parser's samples
against prometheus-client's on the page and on an edge-case page (escaped labels, NaN, +-Inf,
timestamps, exponents, a brace and comma inside a label value, UTF-8, a bucket ``le="+Inf"``), and
what each keeps of the page with one malformed line appended.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from triscope import prom_text

PAGE = Path(__file__).resolve().parents[1] / ".." / "shared" / "data" / "vllm" / "vllm_0.33_v1_two_engines.prom"
EDGES = r'''# HELP edge_gauge Edge cases.
# TYPE edge_gauge gauge
edge_gauge{a="q\"uote",b="back\\slash",c="new\nline"} 1
edge_gauge{a="nan"} NaN
edge_gauge{a="pinf"} +Inf
edge_gauge{a="ninf"} -Inf
edge_gauge{a="stamp"} 3 1700000000000
edge_gauge{a="exp"} 1.5e-3
edge_gauge{a="comma,brace}"} 2
edge_gauge{a="utf8 é ✓"} 5
edge_gauge 7
# TYPE edge_seconds histogram
edge_seconds_bucket{le="0.1"} 1
edge_seconds_bucket{le="+Inf"} 4
edge_seconds_sum 0.7
edge_seconds_count 4
'''
PICKER_FAMILIES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                   "vllm:num_preemptions_total")

Sample = tuple[str, tuple[tuple[str, str], ...], str]


def _key(name: str, labels: dict[str, str], value: float) -> Sample:
    return name, tuple(sorted(labels.items())), "NaN" if math.isnan(value) else repr(float(value))


def by_prometheus_client(text: str) -> list[Sample]:
    return [_key(s.name, s.labels, s.value) for fam in text_string_to_metric_families(text) for s in fam.samples]


def by_scan(text: str) -> list[Sample]:
    return [_key(n, lab, v) for n, lab, v in prom_text.scan(text).samples]


def by_prom_text(text: str) -> list[Sample]:
    return [_key(n, lab, v) for n, rows in prom_text.parse_exposition(text).items() for lab, v in rows]


def kept_of_damaged(parse: Callable[[str], list[Sample]], text: str) -> int | str:
    """Samples a parser keeps of ``text`` with one malformed line appended (or its error)."""
    try:
        return len(parse(text + 'vllm:num_requests_running{engine="0" 1\n'))
    except Exception as exc:  # prometheus-client and the strict wrapper refuse the page
        return f"{type(exc).__name__}: {str(exc)[:60]}"


def best_ms(fn: Callable[[], Any], repeat: int) -> float:
    best = math.inf
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def diff(got: list[Sample], want: list[Sample]) -> dict[str, Any]:
    g, w = Counter(got), Counter(want)
    return {"samples": len(got), "exact": g == w, "missing": [list(s) for s in (w - g)][:5],
            "extra": [list(s) for s in (g - w)][:5]}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--page", type=Path, default=PAGE)
    ap.add_argument("--repeat", type=int, default=30)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    text = args.page.read_text()
    parsers: dict[str, Callable[[str], list[Sample]]] = {
        "prometheus_client": by_prometheus_client, "scan": by_scan, "parse_exposition": by_prom_text}
    speed = {name: best_ms(lambda p=p: p(text), args.repeat) for name, p in parsers.items()}
    picker = {
        "prometheus_client": best_ms(
            lambda: by_prometheus_client(prom_text.keep_families(text, PICKER_FAMILIES)), args.repeat),
        "parse_exposition": best_ms(
            lambda: by_prom_text(prom_text.keep_families(text, PICKER_FAMILIES)), args.repeat)}
    want_page, want_edges = by_prometheus_client(text), by_prometheus_client(EDGES)
    out = {
        "page": str(args.page.name), "page_lines": text.count("\n"), "page_bytes": len(text.encode()),
        "python": sys.version.split()[0], "repeat": args.repeat,
        "parse_ms": {k: round(v, 3) for k, v in speed.items()},
        "ratio_vs_prometheus_client": {k: round(speed["prometheus_client"] / v, 2) for k, v in speed.items()},
        "picker_four_families_ms": {k: round(v, 3) for k, v in picker.items()},
        "picker_ratio": round(picker["prometheus_client"] / picker["parse_exposition"], 2),
        "exact_page": {k: diff(p(text), want_page) for k, p in parsers.items() if k != "prometheus_client"},
        "exact_edges": {k: diff(p(EDGES), want_edges) for k, p in parsers.items() if k != "prometheus_client"},
        "kept_of_page_with_one_bad_line": {k: kept_of_damaged(p, text) for k, p in parsers.items()},
    }
    print(json.dumps(out, indent=1, ensure_ascii=False))
    if args.json:
        args.json.write_text(json.dumps(out, indent=1, ensure_ascii=False) + "\n")
    return out


if __name__ == "__main__":
    main()
