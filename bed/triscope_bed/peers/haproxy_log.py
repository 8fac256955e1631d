"""What HAProxy's request log says about a test-bed run (``PICK_LOG_FORMAT`` lines, bed/triscope_bed/peers/haproxy.py).

Per run: where the requests went, HAProxy's time per request (accept to the end of the answer), how
uneven the backends' requests in flight were at each arrival (from the logged intervals, so any balance
can be read), and, with triscope's picker inside HAProxy, the fit states it saw and every pick it sent
where HAProxy had more requests in flight than on another candidate (where leastconn would not have).
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections import Counter
from pathlib import Path
from typing import Any

from triscope.exporters.haproxy_pick import PickLogRecord, parse_pick_log_line
from triscope_bed.peers.gateway_log import quantiles


def read_request_log(path: Path) -> list[PickLogRecord]:
    """The log's requests (HAProxy's own lines left out); none when the file is absent."""
    try:
        lines = path.read_text(errors="replace").splitlines()
    except FileNotFoundError:
        return []
    return [r for r in map(parse_pick_log_line, lines) if r is not None]


def spread_at_arrivals(records: list[PickLogRecord]) -> list[float]:
    """Per request (by arrival), max - min over the backends of their requests in flight when it arrived
    (itself not counted)."""
    ordered = sorted(records, key=lambda r: r.accepted_s)
    servers = sorted({r.server for r in ordered})
    starts = {s: sorted(r.accepted_s for r in ordered if r.server == s) for s in servers}
    ends = {s: sorted(r.accepted_s + max(r.active_ms, 0) / 1000.0 for r in ordered if r.server == s)
            for s in servers}
    out = []
    for r in ordered:
        busy = [bisect_left(starts[s], r.accepted_s) - bisect_right(ends[s], r.accepted_s) for s in servers]
        out.append(float(max(busy) - min(busy)))
    return out


def summarize(records: list[PickLogRecord], window_s: float = 10.0) -> dict[str, Any]:
    """The run's split, times and spread, per window of ``window_s`` too, and the picker's factors."""
    records = sorted((r for r in records if not r.server.startswith("<")), key=lambda r: r.accepted_s)
    if not records:
        return {"requests": 0}
    t0 = records[0].accepted_s
    spread = spread_at_arrivals(records)
    windows: dict[int, list[tuple[PickLogRecord, float]]] = {}
    for r, s in zip(records, spread, strict=True):
        windows.setdefault(int((r.accepted_s - t0) // window_s), []).append((r, s))
    doc: dict[str, Any] = {
        "requests": len(records), "split": dict(sorted(Counter(r.server for r in records).items())),
        "active_ms": quantiles([float(r.active_ms) for r in records]), "spread_mean": sum(spread) / len(spread),
        "windows": [{"t0_s": w * window_s, "requests": len(rs),
                     "split": dict(sorted(Counter(r.server for r, _ in rs).items())),
                     "active_ms": quantiles([float(r.active_ms) for r, _ in rs]),
                     "spread_mean": sum(s for _, s in rs) / len(rs)} for w, rs in sorted(windows.items())],
    }
    picked = [r for r in records if r.server in r.standings]
    if picked:
        pairs: Counter[str] = Counter()
        busier = []
        for r in picked:
            chosen = r.standings[r.server]
            others = [s for n, s in r.standings.items() if n != r.server and s.score is not None]
            pairs[f"{chosen.fit}/" + ",".join(sorted(s.fit for s in others))] += 1
            if others and chosen.busy > min(s.busy for s in others):
                busier.append({"t_s": round(r.accepted_s - t0, 3), "server": r.server, "class": r.request_class,
                               "need": r.need_tokens, "active_ms": r.active_ms,
                               "standings": {n: f"{s.busy:g}+{s.external:g}:{s.fit}:{s.score}"
                                             for n, s in r.standings.items()}})
        doc["fit_chosen_other"] = dict(pairs.most_common())
        doc["external_seen"] = sum(1 for r in picked if any(s.external > 0 for s in r.standings.values()))
        doc["sent_to_busier"] = busier
    return doc


def brief(doc: dict[str, Any]) -> dict[str, Any]:
    """The summary without its per-window and per-pick lists (for the test bed's JSON)."""
    out = {k: v for k, v in doc.items() if k not in ("windows", "sent_to_busier")}
    if "sent_to_busier" in doc:
        out["sent_to_busier"] = len(doc["sent_to_busier"])
    return out
