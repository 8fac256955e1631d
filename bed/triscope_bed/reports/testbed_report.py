"""The test bed's side-by-side tables (text): one row per policy, one block per fleet."""

from __future__ import annotations

from typing import Any

from triscope_bed.engines.engine import CLASSES
from triscope_bed.reports.judge import ERROR_KINDS

SHORT = {"realtime_speech": "speech", "interactive_image_text": "image", "offline_video": "video"}


def _ms(v: Any) -> str:
    if v is None:
        return "-"
    return "inf" if v == "inf" else f"{float(v) * 1000:.0f}"


def policy_row(name: str, d: dict[str, Any]) -> list[str]:
    """peak QPS held, goodput, offered, P99 over all offered per class, errors by kind, preemptions, the share
    of prompt tokens found in the engines' prefix caches."""
    errors = d["errors"]
    err = " ".join(f"{k}:{v}" for k, v in errors.items() if v) or "0"
    return [name, f"{d['peak_qps_held']:.2f}", f"{float(d['goodput_qps']):.2f}", f"{float(d['offered_qps']):.2f}",
            *(_ms(d["classes"][c]["p99_all_s"]) for c in CLASSES), f"{100 * float(d['error_rate'] or 0):.1f}",
            err, str(d.get("preemptions", "-")), _hit(d)]


def _hit(d: dict[str, Any]) -> str:
    ratio = (d.get("prefix_cache") or {}).get("hit_ratio")
    return "-" if ratio is None else f"{100 * ratio:.1f}"


def step_rows(policies: dict[str, dict[str, Any]]) -> list[list[str]]:
    """Goodput / offered per window and policy (a held window is marked *)."""
    n = max((len(d["buckets"]) for d in policies.values()), default=0)
    rows = []
    for k in range(n):
        row = [str(k)]
        for d in policies.values():
            b = d["buckets"][k] if k < len(d["buckets"]) else None
            row.append("-" if b is None or not b["requests"] else
                       f"{float(b['goodput_qps']):.2f}/{float(b['offered_qps']):.2f}{'*' if b['held'] else ''}")
        rows.append(row)
    return rows


def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows, strict=True)]
    line = lambda r: "  ".join(str(x).rjust(w) if i else str(x).ljust(w)  # noqa: E731
                                for i, (x, w) in enumerate(zip(r, widths, strict=True)))
    return "\n".join([line(header), line(["-" * w for w in widths]), *(line(r) for r in rows)])


def _mean_sd(s: dict[str, Any], digits: int = 2) -> str:
    if not s.get("n"):
        return "-"
    sd = f" ± {s['sd']:.{digits}f}" if s.get("sd") is not None else ""
    return f"{s['mean']:.{digits}f}{sd} ({s['min']:.{digits}f}-{s['max']:.{digits}f})"


def _tail(s: dict[str, Any]) -> str:
    return "-" if not s.get("n") else f"{_ms(s['median'])} ({_ms(s['min'])}-{_ms(s['max'])})"


def _ratio(r: dict[str, Any]) -> str:
    if "geo_mean" not in r:
        return "-"
    ci = f" [{r['ci95'][0]:.2f}, {r['ci95'][1]:.2f}]" if "ci95" in r else ""
    return f"{r['geo_mean']:.2f}x{ci}" + (f" ({r['dropped']} rounds left out)" if r["dropped"] else "")


def print_repeat(rep: dict[str, Any]) -> None:
    """Each policy's mean ± sd (range) over the rounds, then triscope's paired ratios with 95 % CIs."""
    print(f"\nover {rep['rounds']} rounds (order rotated each round): mean ± sd (min-max); P99: median (min-max)")
    header = ["policy", "goodput/s", "peak QPS held", *(f"P99 {SHORT[c]} ms" for c in CLASSES), "errors",
              "preemptions"]
    rows = [[name, _mean_sd(p["goodput_qps"]), _mean_sd(p["peak_qps_held"]),
             *(_tail(p["p99_all_s"][c]) for c in CLASSES), _mean_sd(p["errors"], 1), _mean_sd(p["preemptions"], 1)]
            for name, p in rep["policies"].items()]
    print(_table(header, rows))
    if rep["ratios"]:
        print("\ntriscope / peer, paired by round: geometric mean [95 % CI]")
        rows = [[pair, _ratio(r["goodput_qps"]), _ratio(r["peak_qps_held"])] for pair, r in rep["ratios"].items()]
        print(_table(["pair", "goodput", "peak QPS held"], rows))


def print_tables(doc: dict[str, Any]) -> None:
    slas = ", ".join(f"{SHORT[c]} {v * 1000:.0f} ms" for c, v in doc["sla_s"].items())
    print(f"workload {doc['workload']}, scenario {doc['scenario']}, seed {doc['seed']}; class SLAs: {slas}")
    print(f"errors: {', '.join(ERROR_KINDS)}; P99 over all offered requests (a failure is infinitely slow)")
    for kind, f in doc["fleets"].items():
        print(f"\n## {kind} fleet: {f['backends']} backends, {f['arrivals']} requests"
              + (f" - {f['error']}" if f.get("error") else ""))
        if not f["policies"]:
            continue
        header = ["policy", "peak QPS held", "goodput/s", "offered/s", *(f"P99 {SHORT[c]} ms" for c in CLASSES),
                  "errors %", "errors", "preemptions", "prefix hit %"]
        print(_table(header, [policy_row(n, d) for n, d in f["policies"].items()]))
        whole = [n for n, d in f["policies"].items() if all(b["held"] for b in d["buckets"] if b["requests"])]
        if whole:
            print(f"\nheld every window: {', '.join(whole)}; no policy can make more goodput at this load than "
                  "one that held every window (raise --qps-per-backend to find where they break)")
        print(f"\ngoodput/offered per {f['bucket_s']:g} s window (* = held)")
        print(_table(["window", *f["policies"]], step_rows(f["policies"])))
        if f.get("png"):
            print(f"PNG: {f['png']}")
        if f.get("repeat"):
            print_repeat(f["repeat"])
    if doc.get("json_path"):
        print(f"\nJSON: {doc['json_path']}")
