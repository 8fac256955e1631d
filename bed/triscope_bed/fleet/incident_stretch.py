"""One stretch of the incident bench (``bench/incidents.py``): a calm lead-in, a fault injected and held with its
ground truth, the recovery, the wait for calm, and ``triscope diagnose``'s answer over it; and the restart of a
fleet that stays saturated after its load fell back."""

from __future__ import annotations

import json
import math
import random
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from triscope_bed.fleet.incident_faults import Bed, Fault
from triscope_bed.paths import REPO
from triscope_bed.reports.incident_score import FLEET, Injection, client_breach_starts, incidents_of

WINDOW_S = 5.0
MERGE_GAP_S = 10.0
"""``[incidents] merge_gap_s``: breaches closer than this are one incident."""


@dataclass(frozen=True)
class Timing:
    """How long each part of a stretch lasts (the bench's options of the same names, which hold the defaults)."""

    lead_s: float
    hold_s: float
    gap_s: float
    max_drain_s: float
    poll_s: float
    flush_s: float = 0.5
    """The daemon's ``[writer] flush_interval_s``: the last windows reach the store within two of it."""


def say(text: str) -> None:
    print(f"[{datetime.now(UTC).strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


def diagnose(cfg: Path, since_s: float, until_s: float | None = None, timeout_s: float = 180) -> dict[str, Any]:
    """``triscope diagnose --since ... [--until ISO] --json`` as a user runs it (exit 3 is an open incident)."""
    argv = [sys.executable, "-m", "triscope", "diagnose", "--since", f"{math.ceil(since_s)}s", "--json",
            "--config", str(cfg)]
    if until_s is not None:
        argv += ["--until", datetime.fromtimestamp(until_s, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")]
    out = subprocess.run(argv, capture_output=True, text=True, cwd=REPO, timeout=timeout_s)
    if out.returncode not in (0, 3):
        raise RuntimeError(f"diagnose exited {out.returncode}: {out.stderr.strip()[-500:]}")
    return json.loads(out.stdout)


def wait_client_calm(bed: Bed, sla_s: dict[str, float], calm_from: float, deadline: float) -> float:
    """Wait until the client saw two windows without a breach (judged once their slowest request is past every
    SLA), or ``deadline``: the start of those calm windows (at least ``calm_from``)."""
    late = max(sla_s.values())
    while time.time() < deadline:
        hi = (time.time() - late) // WINDOW_S * WINDOW_S
        with bed.load.lock:
            recent = [s for s in bed.load.sent if s.start_s >= hi - 2 * WINDOW_S]
        calm_from = max(calm_from, hi - 2 * WINDOW_S)
        if not client_breach_starts(recent, hi - 2 * WINDOW_S, hi, sla_s, WINDOW_S):
            return calm_from
        time.sleep(WINDOW_S)
    return math.inf


def restart_stuck(bed: Bed, sla_s: dict[str, float], wait_s: float) -> bool:
    """Restart every engine (as an operator would a fleet that stays saturated after its load fell back) and
    wait up to ``wait_s`` for the client to see calm: whether it did."""
    for e in bed.fleet.engines:
        say(f"  restarting {e.address}")
        bed.fleet.restart(e)
    return math.isfinite(wait_client_calm(bed, sla_s, time.time(), time.time() + wait_s))


def overlapping(doc: dict[str, Any], lo: float) -> bool:
    part = doc.get("incidents", {})
    incs = part.get("incidents", []) if isinstance(part, dict) else []
    return any(float(i["end_s"]) > lo for i in incs)


def run_one(fault: Fault, rnd: int, bed: Bed, cfg: Path, timing: Timing, rng: random.Random,
            sla_s: dict[str, float]) -> tuple[Injection, dict[str, Any], bool]:
    """One stretch: its injection with the ground truth, diagnose's answer over it, and whether the client saw
    calm again within the drain wait (``sla_s``: the client's SLA per class, seconds)."""
    from_s = time.time()
    time.sleep(timing.lead_s)
    victim = rng.choice(bed.fleet.engines) if fault.hits == "one" else None
    expected = [victim.address] if victim is not None else ([FLEET] if fault.hits == "fleet" else [])
    say(f"{fault.name} round {rnd}: inject" + (f" on {victim.address}" if victim else ""))
    injected = time.time()
    recover = fault.inject(bed, victim)
    first_report = math.nan
    hold_end = injected + timing.hold_s
    try:
        while time.time() < hold_end:
            if fault.expected_cause is not None and timing.poll_s > 0 and not math.isfinite(first_report):
                try:
                    doc = diagnose(cfg, time.time() - from_s + 1)
                    if overlapping(doc, injected - WINDOW_S):
                        first_report = time.time()
                        say(f"  reported {first_report - injected:.1f} s after the injection")
                except (RuntimeError, subprocess.TimeoutExpired, ValueError) as exc:
                    say(f"  diagnose during the hold failed: {exc}")
                time.sleep(max(0.0, min(timing.poll_s, hold_end - time.time())))
            else:
                time.sleep(max(0.0, min(1.0, hold_end - time.time())))
    finally:
        recover()
    recovered = time.time()
    time.sleep(timing.gap_s)
    # a backlog can outlast the gap (a skewed engine drains for minutes): the next stretch starts once the client
    # saw two windows without a breach (judged once their slowest request is past every SLA), or --max-drain-s
    late = max(sla_s.values())
    calm_from = wait_client_calm(bed, sla_s, recovered + WINDOW_S, recovered + timing.gap_s + timing.max_drain_s)
    # and until diagnose saw no breach for a merge gap either (an engine's own histogram lags the client): a
    # backlog's incident still open would swallow the next stretch's injection
    while time.time() < recovered + timing.gap_s + timing.max_drain_s:
        try:
            ends = [float(i["end_s"]) for i in incidents_of(diagnose(cfg, time.time() - from_s + 1))]
        except (RuntimeError, subprocess.TimeoutExpired, ValueError):
            break
        if not ends or max(ends) <= time.time() - MERGE_GAP_S - 2 * WINDOW_S:
            break
        time.sleep(WINDOW_S)
    until = time.time()
    with bed.load.lock:
        sent = list(bed.load.sent)
    lo = injected - WINDOW_S if fault.expected_cause else from_s
    starts = client_breach_starts(sent, lo, recovered + WINDOW_S, sla_s, WINDOW_S)
    # the lead-in, up to the window before the injection's: a breach there is an earlier backlog's
    lead = sorted(client_breach_starts(sent, from_s, injected - WINDOW_S, sla_s, WINDOW_S)) \
        if fault.expected_cause else []
    # the effect: the first window the client saw breached while the fault was on (on an expected backend where
    # there is one)
    mine = [t for b, t in starts.items() if b in expected or expected == [FLEET]] or list(starts.values())
    effect = max(injected - WINDOW_S, min(mine)) if mine else injected
    # the backends it breached: through the drain, as diagnose's incident spans the drain too (a skewed engine's
    # backlog spills onto its neighbours after the recovery), and on to the end of the stretch diagnose is asked
    # about (its windows whose slowest request is past every SLA): an incident diagnose saw while the bench
    # waited for it to end is judged against what the client saw then, not called false unseen
    calm_seen = calm_from if math.isfinite(calm_from) else until
    breached = sorted(client_breach_starts(sent, lo, max(calm_seen, (until - late) // WINDOW_S * WINDOW_S), sla_s,
                                           WINDOW_S))
    time.sleep(2 * timing.flush_s)  # the last windows reach the store
    doc = diagnose(cfg, until - from_s, until)
    inj = Injection(fault.name, rnd, fault.expected_cause, expected, injected, effect, recovered, until, from_s,
                    fault.needs_breach, first_report, breached, lead_breached=lead)
    if set(breached) - set(starts):
        inj.notes.append(f"{', '.join(sorted(set(breached) - set(starts)))} breached after the recovery, "
                         f"(the client first saw calm {calm_seen - recovered:.0f} s after it)")
    return inj, doc, math.isfinite(calm_from)
