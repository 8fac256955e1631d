"""The stall rules over many windows at once (``classify_windows``) give what the one-window rules
(``classify_window``) give, window by window: verdict, every class that held, severity, and the evidence
that :class:`LazyEvidence` builds when a window is shown. Checked on metrics drawn around every threshold,
with signals missing (absent keys and NaN) as real units have them, and with the precedence reordered."""

from __future__ import annotations

import math
import random
from typing import Any

import pytest

from triscope.analyzers.stalls import classify_window, stall_config
from triscope.analyzers.stalls.rules import LazyEvidence, classify_windows, columns_of

KEYS = {  # metric: values around its default threshold, and a value far either side
    "comm_share": (0.0, 0.84, 0.85, 0.86, 1.0),
    "sm_active_ratio": (0.0, 0.04, 0.5, 0.95, 0.96, 1.0),
    "l2_bandwidth_ratio": (0.1, 0.6, 0.61),
    "dram_active_ratio": (0.1, 0.59, 0.6, 0.9),
    "trace_compute_share": (0.2, 0.95, 0.96),
    "gpu_busy_share": (0.0, 0.49, 0.5, 0.9),
    "host_busy_share": (0.0, 0.04, 0.5, 0.51, 0.9),
    "gpu_activity_ratio": (0.0, 0.04, 0.05, 0.49, 0.5, 0.99),
    "serving_queue_length": (0.0, 0.99, 1.0, 7.0),
    "device_busy_share": (0.0, 0.04, 0.05, 0.6),
    "has_gpu": (0.0, 1.0),
}


def _draw(rng: random.Random) -> dict[str, Any]:
    m: dict[str, Any] = {}
    for key, values in KEYS.items():
        roll = rng.random()
        if roll < 0.25:
            continue  # not measured in this window
        m[key] = math.nan if roll < 0.35 else rng.choice(values)
    if rng.random() < 0.3:
        ok = rng.random() < 0.5
        m.update(io_read_p99_seconds=rng.choice((0.002, 0.0005, math.nan)), io_queue_depth=rng.choice((10.0, 128.0)),
                 io_met=float(ok), io_device="nvme0n1")
    return m


@pytest.mark.parametrize("precedence", [None, ["idle", "host", "io", "compute", "comm"], ["io", "comm"]])
def test_many_windows_at_once_equal_one_at_a_time(precedence: list[str] | None) -> None:
    cfg = stall_config({"stalls": {"precedence": precedence}} if precedence else {})
    rng = random.Random(20261207)
    metrics = [_draw(rng) for _ in range(3000)]
    verdicts, matched, severity = classify_windows(columns_of(metrics), cfg)
    seen = set()
    for i, m in enumerate(metrics):
        verdict, also, evidence, sev = classify_window(dict(m), cfg)
        assert (verdicts[i], matched[i]) == (verdict, also), m
        assert severity[i] == pytest.approx(sev, rel=1e-12, abs=0.0) or (math.isnan(sev) and math.isnan(severity[i])), m
        lazy = LazyEvidence(m, cfg)
        assert {c: [e.to_json() for e in ev] for c, ev in lazy.items()} == \
            {c: [e.to_json() for e in ev] for c, ev in evidence.items()}
        seen.add(verdict)
    assert seen == {*cfg.precedence, "unclassified"}, seen  # every rule was reached


def test_no_windows() -> None:
    verdicts, matched, severity = classify_windows(columns_of([]), stall_config({}))
    assert verdicts == [] and matched == [] and len(severity) == 0
