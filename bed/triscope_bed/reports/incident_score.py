"""Scoring of ``bench/incidents.py``: each injected fault's ground truth against what ``diagnose --json`` said.

Pure functions over plain documents (no fleet, no store), so they are tested on synthetic diagnose output.
A :class:`Injection` is what the bench did (fault, expected cause and backends, when it took effect, the
stretch it owns); :func:`score_injection` picks the incident that overlaps it in the ``incidents`` part of a
``diagnose --json`` document and judges it: cause right, backend set right, onset error, report delay.
A fault whose expected cause is ``None`` (a calm stretch) is right when no incident overlaps it.
:func:`summarise` adds the confusion matrix (rows: expected cause, columns: diagnosed cause or
``no incident``), per-fault figures and the overall shares; :func:`draw_png` draws the matrix.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

NO_INCIDENT = "no incident"
CALM = "calm"
"""The confusion matrix's row for stretches where nothing was injected (expected: no incident)."""
FLEET = "fleet"
"""Expected backends ``fleet``: every backend of the fleet."""
ONSET_TOLERANCE_S = 5.0


@dataclass
class Injection:
    """One injected fault (or calm stretch) and its ground truth."""

    fault: str
    round: int
    expected_cause: str | None
    """``None``: nothing should be reported (calm)."""
    expected_backends: list[str]
    """Backend addresses, or ``[FLEET]``: a fleet-wide fault, scored against the backends the client saw breach
    (``client_breached``; every backend where it measured none)."""
    injected_s: float
    effect_s: float
    """When the fault took effect: the start of the first window in which the client saw a breach (the
    injection where it saw none)."""
    recovered_s: float
    until_s: float
    """The end of the stretch this injection owns (recovery plus the gap before the next one)."""
    from_s: float = math.nan
    """Its start (the calm lead-in before the injection)."""
    needs_breach: bool = False
    """A fault that only makes an incident when it really breaches (a load step): without one it scores as
    ``no breach``, not as a wrong diagnosis."""
    first_report_s: float = math.nan
    """Wall time at which a ``diagnose`` asked during the hold first listed an incident overlapping it."""
    client_breached: list[str] | None = None
    """Backends on which the load generator's own requests broke their SLA from the injection until the client
    saw calm again, the drain included (the ground truth of "it breached"; ``None``: not measured,
    ``needs_breach`` decides)."""
    notes: list[str] = field(default_factory=list)
    lead_breached: list[str] | None = None
    """Backends on which the client saw a breach in the lead-in before the injection (the last one's backlog
    not drained): the bed was not calm, so no cause can be called right or wrong (``None``: not measured)."""


@dataclass
class Score:
    fault: str
    round: int
    expected_cause: str
    diagnosed_cause: str
    outcome: str
    """``right`` / ``wrong`` (an incident, wrong cause or backends) / ``missed`` (the client saw a breach, no
    incident) / ``no breach`` / ``false`` (an incident in a calm stretch the client saw no breach in) /
    ``calm breached`` (one the client saw too: the bed was not calm) / ``calm`` (a calm stretch with none) /
    ``not calm before`` (the client saw a breach before the injection: no ground truth to judge against)."""
    cause_right: bool | None
    backends_right: bool | None
    expected_backends: list[str]
    diagnosed_backends: list[str]
    onset_error_s: float | None
    report_delay_s: float | None
    score: float | None = None
    runners_up: list[str] = field(default_factory=list)
    evidence: list[str] = field(default_factory=list)
    other_incidents: int = 0
    """Further incidents inside the stretch (before the injection's effect, or after the chosen one)."""
    injected_s: float = math.nan
    client_breached: list[str] | None = None
    notes: list[str] = field(default_factory=list)


def incidents_of(doc: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The incident list of a ``diagnose --json`` document (``{"incidents": {"incidents": [...]}}``)."""
    part = doc.get("incidents", {})
    if isinstance(part, Mapping):
        return list(part.get("incidents", []))
    return list(part or [])


def _overlaps(inc: Mapping[str, Any], lo: float, hi: float) -> bool:
    return float(inc["start_s"]) < hi and float(inc["end_s"]) > lo


def expand(backends: Sequence[str], fleet: Sequence[str]) -> list[str]:
    return sorted(fleet) if list(backends) == [FLEET] else sorted(backends)


def _unjudged(base: dict[str, Any], inj: Injection, hits: list[dict[str, Any]], outcome: str) -> Score:
    """A score that counts neither right nor wrong, with what diagnose said of the stretch (its first incident)."""
    seen_inc = hits[0] if hits else None
    return Score(**base, expected_cause=str(inj.expected_cause),
                 diagnosed_cause=str(seen_inc["cause"]["cause"]) if seen_inc else NO_INCIDENT,
                 outcome=outcome, cause_right=None, backends_right=None,
                 diagnosed_backends=sorted(seen_inc["backends"]) if seen_inc else [], onset_error_s=None,
                 report_delay_s=None)


def score_injection(inj: Injection, doc: Mapping[str, Any], fleet: Sequence[str], window_s: float = 5.0) -> Score:
    """Judge one injection from the diagnose document covering its stretch.

    The incident scored is the first that overlaps [injection - window, recovered + 2 windows) (a breach
    window starts up to one window before the injection; a fault's tail drains after recovery). Incidents in
    the stretch outside that are counted in ``other_incidents``.
    """
    # diagnose lists a backend when its own windows breached, so the backends the client saw breach are the
    # truth of the set: for a fleet-wide fault (every backend's load rose, which of them broke their SLA is
    # each one's own measurement), and beside a victim (a backend that breached at the same time is in the
    # incident whatever broke it; it is noted, as the bed was not calm there)
    seen = sorted(inj.client_breached or [])
    victims = expand(inj.expected_backends, fleet)
    if list(inj.expected_backends) == [FLEET] and seen:
        expected = seen
    else:
        expected = sorted(set(victims) | (set(seen) if inj.expected_cause is not None else set()))
    bystanders = [b for b in expected if b not in victims]
    lo, hi = min(inj.injected_s, inj.effect_s) - window_s, inj.recovered_s + 2 * window_s
    stretch_lo = inj.from_s if math.isfinite(inj.from_s) else inj.injected_s
    inside = [i for i in incidents_of(doc) if _overlaps(i, stretch_lo, inj.until_s)]
    if inj.expected_cause is None:
        lo = stretch_lo
    hits = sorted((i for i in inside if _overlaps(i, lo, hi)), key=lambda i: float(i["start_s"]))
    others = len(inside) - (1 if hits else 0)
    base: dict[str, Any] = {"fault": inj.fault, "round": inj.round, "expected_backends": expected,
                            "other_incidents": others, "injected_s": inj.injected_s, "notes": list(inj.notes),
                            "client_breached": inj.client_breached}
    if bystanders:
        base["notes"].append(f"the client saw {', '.join(bystanders)} breach too (not the fault's victim)")
    if inj.expected_cause is None:
        if not inside:
            return Score(**base, expected_cause=CALM, diagnosed_cause=NO_INCIDENT, outcome="calm", cause_right=None,
                         backends_right=None, diagnosed_backends=[], onset_error_s=None, report_delay_s=None)
        first = min(inside, key=lambda i: float(i["start_s"]))
        base["other_incidents"] = len(inside) - 1
        # the client saw the SLA broken too: a real breach of a bed that was not calm, not a false report
        real = bool(inj.client_breached)
        return Score(**base, expected_cause=CALM, diagnosed_cause=str(first["cause"]["cause"]),
                     outcome="calm breached" if real else "false",
                     cause_right=False, backends_right=False, diagnosed_backends=sorted(first["backends"]),
                     onset_error_s=None, report_delay_s=None, score=float(first["cause"].get("score", math.nan)),
                     evidence=list(first["cause"].get("evidence", [])))
    if inj.lead_breached:
        # an earlier fault's backlog still breached when this one was injected: whatever diagnose says is judged
        # against a bed that was not calm, so it counts neither way (the bench waits for calm first; this is
        # what its drain limit left)
        base["notes"].append(f"the client saw {', '.join(sorted(inj.lead_breached))} breach before the injection")
        return _unjudged(base, inj, hits, "not calm before")
    if seen and not set(seen) & set(victims) and list(inj.expected_backends) != [FLEET]:
        # the fault's victim never breached: nothing of the fault's to diagnose; the bystanders' breach is the
        # bed's own noise (a tight class's SLA), judged as a calm stretch's would be, not as the fault
        base["notes"].append(f"the client saw only {', '.join(seen)} breach, not the fault's victim")
        return _unjudged(base, inj, hits, "no breach")
    if not hits:
        breached = bool(inj.client_breached) if inj.client_breached is not None else not inj.needs_breach
        return Score(**base, expected_cause=inj.expected_cause, diagnosed_cause=NO_INCIDENT,
                     outcome="missed" if breached else "no breach", cause_right=False if breached else None,
                     backends_right=False if breached else None, diagnosed_backends=[],
                     onset_error_s=None, report_delay_s=None)
    inc = hits[0]
    cause = str(inc["cause"]["cause"])
    got = sorted(inc["backends"])
    cause_right, backends_right = cause == inj.expected_cause, got == expected
    onset = float(inc["start_s"]) - inj.effect_s
    # an incident already open at the injection was reported before it: no delay of this fault's to measure
    fresh = float(inc["start_s"]) >= inj.injected_s - window_s
    delay = inj.first_report_s - inj.effect_s if math.isfinite(inj.first_report_s) and fresh else None
    if not fresh:
        base["notes"].append("the incident was open before the injection")
    return Score(**base, expected_cause=inj.expected_cause, diagnosed_cause=cause,
                 outcome="right" if cause_right and backends_right else "wrong", cause_right=cause_right,
                 backends_right=backends_right, diagnosed_backends=got, onset_error_s=round(onset, 2),
                 report_delay_s=None if delay is None else round(delay, 2),
                 score=float(inc["cause"].get("score", math.nan)),
                 runners_up=[f"{c['cause']} {c.get('score', '')}" for c in inc.get("runners_up", [])],
                 evidence=list(inc["cause"].get("evidence", [])))


@dataclass(frozen=True)
class Sent:
    """One request of the load generator as the client saw it."""

    start_s: float
    backend: str
    request_class: str
    latency_s: float
    ok: bool
    arrival_s: float = math.nan
    """When the open-loop arrival happened (before a load worker picked it up): latency from it is what an
    open-loop client waits, the capacity probe's measure."""


def client_breaches(sent: Iterable[Sent], lo: float, hi: float, sla_s: Mapping[str, float], window_s: float = 5.0,
                    min_requests: int = 3, error_ratio: float = 0.05) -> list[str]:
    """Backends whose requests started in [lo, hi) broke their SLA in some window, as the client measured them:
    a class's P99 over its SLA (at least ``min_requests``), or at least ``min_requests`` failed and
    ``error_ratio`` of all (the rule ``diagnose`` applies to spans, docs/diagnose.md)."""
    return sorted(client_breach_starts(sent, lo, hi, sla_s, window_s, min_requests, error_ratio))


def client_breach_starts(sent: Iterable[Sent], lo: float, hi: float, sla_s: Mapping[str, float],
                         window_s: float = 5.0, min_requests: int = 3, error_ratio: float = 0.05) -> dict[str, float]:
    """:func:`client_breaches` with the start of each backend's first breached window (``diagnose``'s epoch
    windows): when the fault's effect reached the users."""
    cells: dict[tuple[str, int], list[Sent]] = {}
    for s in sent:
        if lo <= s.start_s < hi:
            cells.setdefault((s.backend, int(s.start_s // window_s)), []).append(s)  # diagnose's epoch windows
    out: dict[str, float] = {}
    for (backend, k), reqs in sorted(cells.items()):
        failed = sum(1 for r in reqs if not r.ok)
        hit = failed >= min_requests and failed / len(reqs) >= error_ratio
        for cls in {r.request_class for r in reqs}:
            lat = sorted(r.latency_s for r in reqs if r.ok and r.request_class == cls)
            sla = sla_s.get(cls)
            hit = hit or bool(sla and len(lat) >= min_requests and _p99(lat) > sla)
        if hit and backend not in out:
            out[backend] = k * window_s
    return out


def _p99(sorted_values: list[float]) -> float:
    """The 0.99 quantile as ClickHouse's ``quantileExact`` takes it (the value at rank floor(0.99 n))."""
    return sorted_values[min(len(sorted_values) - 1, int(0.99 * len(sorted_values)))]


def confusion(scores: Iterable[Score]) -> dict[str, dict[str, int]]:
    """Rows: the expected cause (``calm`` for calm stretches), columns: the diagnosed cause or ``no incident``.
    Injections that did not breach (``no breach``) or landed in a breach (``not calm before``) are left out:
    nothing was there to diagnose, or nothing to judge it against."""
    out: dict[str, dict[str, int]] = {}
    for s in scores:
        if s.outcome in ("no breach", "not calm before"):
            continue
        row = out.setdefault(s.expected_cause, {})
        row[s.diagnosed_cause] = row.get(s.diagnosed_cause, 0) + 1
    return out


def _share(flags: list[bool]) -> float | None:
    return round(sum(flags) / len(flags), 3) if flags else None


def _spread(values: list[float]) -> dict[str, float] | None:
    vals = sorted(v for v in values if v is not None and math.isfinite(v))
    if not vals:
        return None
    return {"median": round(statistics.median(vals), 2), "min": round(vals[0], 2), "max": round(vals[-1], 2)}


def summarise(scores: Sequence[Score], calm_minutes: float = 0.0, target: float = 0.9) -> dict[str, Any]:
    """The whole document: per score, per fault, the confusion matrix and the overall figures against the
    targets (right cause and backends in >= ``target`` of the incidents that breached, onset within 5 s, no
    incident in the calm minutes)."""
    faults: dict[str, Any] = {}
    for name in dict.fromkeys(s.fault for s in scores):
        mine = [s for s in scores if s.fault == name]
        judged = [s for s in mine if s.outcome in ("right", "wrong", "missed")]
        onsets = [s.onset_error_s for s in mine if s.onset_error_s is not None]
        faults[name] = {
            "expected_cause": mine[0].expected_cause, "rounds": len(mine),
            "outcomes": {o: sum(1 for s in mine if s.outcome == o) for o in sorted({s.outcome for s in mine})},
            "cause_right": _share([bool(s.cause_right) for s in judged]),
            "backends_right": _share([bool(s.backends_right) for s in judged]),
            "both_right": _share([s.outcome == "right" for s in judged]),
            "onset_error_s": _spread([float(x) for x in onsets]),
            "onset_within_5s": _share([abs(x) <= ONSET_TOLERANCE_S for x in onsets]),
            "report_delay_s": _spread([float(s.report_delay_s) for s in mine if s.report_delay_s is not None]),
            "diagnosed": {c: sum(1 for s in mine if s.diagnosed_cause == c) for c in
                          sorted({s.diagnosed_cause for s in mine})},
        }
    judged = [s for s in scores if s.outcome in ("right", "wrong", "missed")]
    calm = [s for s in scores if s.expected_cause == CALM]
    onsets = [float(s.onset_error_s) for s in judged if s.onset_error_s is not None]
    both = _share([s.outcome == "right" for s in judged])
    false_in_calm = sum(1 + s.other_incidents for s in calm if s.outcome == "false")
    breached_calm = sum(1 for s in calm if s.outcome == "calm breached")
    overall = {
        "injected": len([s for s in scores if s.expected_cause != CALM]),
        "breached_and_judged": len(judged),
        "no_breach": sum(1 for s in scores if s.outcome == "no breach"),
        "not_calm_before": sum(1 for s in scores if s.outcome == "not calm before"),
        "cause_right": _share([bool(s.cause_right) for s in judged]),
        "backends_right": _share([bool(s.backends_right) for s in judged]),
        "cause_and_backends_right": both,
        "onset_within_5s": _share([abs(x) <= ONSET_TOLERANCE_S for x in onsets]),
        "onset_error_s": _spread(onsets),
        "report_delay_s": _spread([float(s.report_delay_s) for s in judged if s.report_delay_s is not None]),
        "calm_stretches": len(calm),
        "calm_minutes": round(calm_minutes, 2),
        "false_incidents_in_calm": false_in_calm,
        "calm_stretches_breached": breached_calm,
        "incidents_outside_injections": sum(s.other_incidents for s in scores if s.expected_cause != CALM),
        "target": target,
        "meets_target": bool(both is not None and both >= target and false_in_calm == 0
                             and (not onsets or all(abs(x) <= ONSET_TOLERANCE_S for x in onsets))),
    }
    matrix = confusion(scores)
    return {"overall": overall, "faults": faults, "confusion": matrix,
            "confusion_columns": columns(matrix), "scores": [asdict(s) for s in scores]}


def columns(matrix: Mapping[str, Mapping[str, int]]) -> list[str]:
    """The matrix's columns: the rows' causes first (so the diagonal is the diagonal), then the others, then
    ``no incident``."""
    rows = [r for r in matrix if r != CALM]
    seen = [c for r in matrix.values() for c in r if c not in rows and c != NO_INCIDENT]
    return rows + sorted(set(seen)) + [NO_INCIDENT]


def matrix_text(matrix: Mapping[str, Mapping[str, int]]) -> str:
    """The confusion matrix as a fixed-width table."""
    cols = columns(matrix)
    width = max([len(c) for c in cols] + [len(r) for r in matrix] + [8]) + 1
    lines = ["expected \\ diagnosed".ljust(width) + "".join(c.rjust(width) for c in cols)]
    for r, row in matrix.items():
        lines.append(r.ljust(width) + "".join(str(row.get(c, 0) or ".").rjust(width) for c in cols))
    return "\n".join(lines)


def report_text(doc: Mapping[str, Any]) -> str:
    """The summary a person reads: the matrix, per fault, overall."""
    o = doc["overall"]
    lines = [matrix_text(doc["confusion"]), "",
             f"{'fault':<18}{'rounds':>7}{'cause':>8}{'backend':>9}{'onset s (med)':>15}{'delay s (med)':>15}"
             "  outcomes"]

    def pct(x: float | None) -> str:
        return "-" if x is None else f"{x:.0%}"

    def med(x: Mapping[str, float] | None) -> str:
        return "-" if not x else f"{x['median']:+.1f}"

    for name, f in doc["faults"].items():
        outcomes = ", ".join(f"{k} {v}" for k, v in f["outcomes"].items())
        lines.append(f"{name:<18}{f['rounds']:>7}{pct(f['cause_right']):>8}{pct(f['backends_right']):>9}"
                     f"{med(f['onset_error_s']):>15}{med(f['report_delay_s']):>15}  {outcomes}")
    lines += ["", f"overall: cause and backends right {pct(o['cause_and_backends_right'])} of "
                  f"{o['breached_and_judged']} breached incidents (cause {pct(o['cause_right'])}, backends "
                  f"{pct(o['backends_right'])}); {o['no_breach']} injections did not breach, "
                  f"{o.get('not_calm_before', 0)} landed in an earlier breach; onset within 5 s "
                  f"{pct(o['onset_within_5s'])}; false incidents in {o['calm_minutes']} calm minutes: "
                  f"{o['false_incidents_in_calm']} (and {o['calm_stretches_breached']} calm stretches the client "
                  f"saw breached); target met: {'yes' if o['meets_target'] else 'no'}"]
    return "\n".join(lines)


def draw_png(doc: Mapping[str, Any], path: Path, title: str = "") -> None:
    """A heatmap of the confusion matrix (counts in the cells)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    matrix, cols = doc["confusion"], doc["confusion_columns"]
    rows = list(matrix)
    grid = [[matrix[r].get(c, 0) for c in cols] for r in rows] or [[0]]
    fig, ax = plt.subplots(figsize=(1.2 + 1.1 * len(cols), 1.2 + 0.6 * max(1, len(rows))))
    im = ax.imshow(grid, cmap="Blues", aspect="auto")
    ax.set_xticks(range(len(cols)), labels=cols, rotation=35, ha="right")
    ax.set_yticks(range(len(rows)), labels=rows)
    ax.set_xlabel("diagnosed cause")
    ax.set_ylabel("injected (expected cause)")
    top = max((v for row in grid for v in row), default=0)
    for i, row in enumerate(grid):
        for j, v in enumerate(row):
            if v:
                ax.text(j, i, str(v), ha="center", va="center", color="white" if v > top / 2 else "black")
    fig.colorbar(im, ax=ax, fraction=0.04)
    ax.set_title(title or "incidents: injected vs diagnosed", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


__all__ = ["CALM", "FLEET", "NO_INCIDENT", "Injection", "Score", "Sent", "client_breach_starts", "client_breaches",
           "confusion", "draw_png", "expand", "incidents_of", "matrix_text", "report_text", "score_injection",
           "summarise"]
