"""Read a test-bed run request by request from HAProxy's log: where each request went and, for the picker
inside HAProxy, why.

    .venv/bin/python bench/pick_log.py var/testbed/work/vllm-triscope-haproxy/haproxy.log [...] [--json]
    .venv/bin/python bench/pick_log.py --run var/testbed            # every HAProxy policy of a run

``bench/testbed.py`` logs every request of its HAProxy policies with
``triscope.exporters.haproxy_pick.PICK_LOG_FORMAT`` (``work/<fleet>-<policy>/haproxy.log``). Per log: HAProxy's
time per request (accept to the end of the answer), per window of ``--window-s`` the split and the tail,
how uneven the two (or more) backends' requests in flight were at each arrival (from the logged intervals,
so it works for every balance), and with the picker's factors: which fit states the chosen and the other
backends had, and every pick sent where HAProxy had more requests in flight than on another candidate.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any

from triscope.exporters.haproxy_pick import PickLogRecord, parse_pick_log_line
from triscope.sim.loadgen import percentile


def read(path: Path) -> list[PickLogRecord]:
    """The log's requests that reached a server (HAProxy's own lines and refusals left out)."""
    records = (parse_pick_log_line(line) for line in path.read_text(errors="replace").splitlines())
    return [r for r in records if r is not None and not r.server.startswith("<")]


def spread_at_arrivals(records: list[PickLogRecord]) -> list[float]:
    """Per request, max - min of the backends' requests in flight when it arrived (itself not counted)."""
    spans = sorted((r.accepted_s, r.accepted_s + max(r.active_ms, 0) / 1000.0, r.server) for r in records)
    servers = sorted({r.server for r in records})
    out = []
    for start, _, _ in spans:
        busy = Counter(s for a, b, s in spans if a < start < b)
        out.append(float(max(busy.get(s, 0) for s in servers) - min(busy.get(s, 0) for s in servers)))
    return out


def _q(values: list[float]) -> dict[str, float]:
    return {"p50": percentile(values, 50), "p99": percentile(values, 99), "max": max(values)} if values else {}


def summarize(records: list[PickLogRecord], window_s: float = 10.0) -> dict[str, Any]:
    """What one log says (see the module's docstring)."""
    if not records:
        return {"requests": 0}
    t0 = min(r.accepted_s for r in records)
    spread = spread_at_arrivals(records)
    windows: dict[int, list[tuple[PickLogRecord, float]]] = {}
    for r, s in zip(sorted(records, key=lambda r: r.accepted_s), spread, strict=True):
        windows.setdefault(int((r.accepted_s - t0) // window_s), []).append((r, s))
    doc: dict[str, Any] = {
        "requests": len(records), "split": dict(sorted(Counter(r.server for r in records).items())),
        "active_ms": _q([float(r.active_ms) for r in records]),
        "spread_mean": sum(spread) / len(spread),
        "windows": [{"t0_s": w * window_s, "requests": len(rs),
                     "split": dict(sorted(Counter(r.server for r, _ in rs).items())),
                     "active_ms": _q([float(r.active_ms) for r, _ in rs]),
                     "spread_mean": sum(s for _, s in rs) / len(rs)} for w, rs in sorted(windows.items())],
    }
    picked = [r for r in records if r.standings and r.server in r.standings]
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("logs", nargs="*", type=Path, help="HAProxy logs of the test bed")
    parser.add_argument("--run", type=Path, help="a test-bed --out-dir: every work/*/haproxy.log in it")
    parser.add_argument("--window-s", type=float, default=10.0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    logs = list(args.logs) + (sorted(args.run.glob("work/*/haproxy.log")) if args.run else [])
    if not logs:
        parser.error("no log: name HAProxy logs or --run DIR")
    docs = {}
    for path in logs:
        if not path.is_file():
            print(f"pick_log: no such file: {path}", file=sys.stderr)
            return 2
        docs[str(path)] = summarize(read(path), args.window_s)
    if args.json:
        print(json.dumps(docs, indent=1))
        return 0
    for path, doc in docs.items():
        if not doc["requests"]:
            print(f"{path}: no request logged")
            continue
        a = doc["active_ms"]
        print(f"{path}: {doc['requests']} requests, split {doc['split']}, HAProxy ms p50 {a['p50']:.0f} "
              f"p99 {a['p99']:.0f} max {a['max']:.0f}, in-flight spread at arrival {doc['spread_mean']:.2f}")
        for w in doc["windows"]:
            a = w["active_ms"]
            print(f"  {w['t0_s']:>6.0f} s  {w['requests']:>4} req  split {w['split']}  p50 {a['p50']:.0f} "
                  f"p99 {a['p99']:.0f}  spread {w['spread_mean']:.2f}")
        if "fit_chosen_other" in doc:
            print(f"  fit (chosen/others): {doc['fit_chosen_other']}; picks seeing external requests: "
                  f"{doc['external_seen']}; sent where HAProxy had more in flight: {len(doc['sent_to_busier'])}")
            for b in doc["sent_to_busier"]:
                print(f"    {b['t_s']:>7.2f} s {b['server']} {b['class']} {b['need']} tokens: {b['standings']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
