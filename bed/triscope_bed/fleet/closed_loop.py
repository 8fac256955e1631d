"""Closed-loop bench: simulated GPU backends behind real HAProxy, balancing policies compared.

``bench/closed_loop.py`` runs :func:`main`; docs/closed_loop.md describes the policies, the
options and the results.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

from triscope_bed.engines.backend import BackendSpec
from triscope_bed.fleet.bench_fleet import SimFleet
from triscope_bed.fleet.closed_loop_policy import CLASS_ADMISSION, CLASS_PRIORITY, run_policy, weights_overrides
from triscope_bed.ports import free_port
from triscope_bed.reports.closed_loop_report import print_report
from triscope_bed.reports.closed_loop_stats import Policy, RawRun, comparison, summarize
from triscope_bed.workloads.arrivals import LoadShape


def parse_admission(text: str, option: str = "--class-admission",
                    default: dict[str, float] | None = None) -> dict[str, float]:
    """A per-class option (``--class-admission``, ``--class-batch-admission``, ``--class-maxconn``,
    ``--class-timeout-queue-ms``): ``default`` (``default``, else :data:`CLASS_ADMISSION`),
    ``none`` or ``CLASS=NUMBER,...``."""
    if text in ("", "default"):
        return dict(CLASS_ADMISSION if default is None else default)
    if text == "none":
        return {}
    out = {}
    for item in filter(None, (x.strip() for x in text.split(","))):
        name, sep, ratio = item.partition("=")
        if not sep or name not in CLASS_PRIORITY:
            raise SystemExit(f"{option} {item!r}: expected CLASS=NUMBER with CLASS in {', '.join(CLASS_PRIORITY)}")
        try:
            out[name] = float(ratio)
        except ValueError:
            raise SystemExit(f"{option} {item!r}: {ratio!r} is not a number") from None
    return out


def default_specs(n: int, kv_gib: float, slots: int) -> list[BackendSpec]:
    """``n`` backends; the last has half the KV memory and half the batch slots."""
    specs = [BackendSpec(f"b{i}", free_port(), kv_gib, slots, 1.0) for i in range(n)]
    if n >= 2:
        specs[-1].kv_gib = kv_gib / 2
        specs[-1].slots = max(1, slots // 2)
    return specs


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="closed-loop load-balancing bench (see docs/closed_loop.md)")
    p.add_argument("--backends", type=int, default=4, help="number of simulated backends (last: half memory)")
    p.add_argument("--backend", action="append", default=[],
                   help="explicit backend name:port:kv_gib:slots:speed (repeat; overrides --backends)")
    p.add_argument("--kv-gib", type=float, default=40.0, help="KV pool of a full-size backend")
    p.add_argument("--slots", type=int, default=16, help="max running requests of a full-size backend")
    p.add_argument("--batch-slowdown", type=float, default=0.8)
    p.add_argument("--base-qps", type=float, default=24.0)
    p.add_argument("--step-factor", type=float, default=1.3)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--step-s", type=float, default=8.0)
    p.add_argument("--burst-factor", type=float, default=3.0)
    p.add_argument("--burst-s", type=float, default=1.0)
    p.add_argument("--burst-period-s", type=float, default=4.0)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--pressure", action="append", default=[],
                   help="NAME=RATIO: pin that share of a backend's memory for the run (a leak, a big tenant)")
    p.add_argument("--policies", default="roundrobin,leastconn,triscope,triscope-classes")
    p.add_argument("--triscope-balance", default="leastconn", choices=["leastconn", "roundrobin"])
    p.add_argument("--agent-inter-ms", type=int, default=100)
    p.add_argument("--maxconn-per-slot", type=float, default=0.0,
                   help="HAProxy server maxconn = this x the server's batch slots, every policy (0 = unlimited)")
    p.add_argument("--timeout-queue-ms", type=int, default=0,
                   help="HAProxy 'timeout queue' (503 after waiting this long for a server slot; 0 = HAProxy default)")
    p.add_argument("--capacity-weights", action="store_true",
                   help="HAProxy server weight = 100 x its batch slots / the largest (every policy; "
                        "an agent's NN%% then scales that weight)")
    p.add_argument("--class-priority", action="store_true",
                   help="HAProxy queue priority by class (speech, then image-text, then video), every policy")
    p.add_argument("--agent-maxconn", action="store_true",
                   help="triscope: the agent also sends maxconn:round(server maxconn x weight) "
                        "(needs --maxconn-per-slot)")
    p.add_argument("--class-admission", default="default", metavar="default|none|CLASS=KV,...",
                   help="triscope-classes: the KV usage at which the feed closes a backend to a class "
                        "(admit_kv_ratio); 'default' = "
                        + ",".join(f"{k}={v}" for k, v in CLASS_ADMISSION.items()))
    p.add_argument("--class-batch-admission", default="none", metavar="none|CLASS=OCCUPANCY,...",
                   help="triscope-classes: the batch occupancy, (running + waiting) / slots, at which the "
                        "feed closes a backend to a class (admit_batch_ratio; max_num_seqs = the backend's slots)")
    p.add_argument("--class-maxconn", default="none", metavar="none|CLASS=PER_SLOT,...",
                   help="triscope-classes: the class pool's servers get maxconn = PER_SLOT x their batch slots "
                        "(at least 1): a per-class cap on requests in flight per backend, enforced by HAProxy")
    p.add_argument("--class-timeout-queue-ms", default="none", metavar="none|CLASS=MS,...",
                   help="triscope-classes: 'timeout queue' of that class's pool (default: --timeout-queue-ms)")
    p.add_argument("--class-lb-gate", action="store_true",
                   help="triscope-classes: HAProxy also applies each --class-batch-admission limit to every "
                        "request of that class at once, on its own in-flight counts (exporters/haproxy_gate.lua)")
    p.add_argument("--repeat", type=int, default=1, help="repetitions with seeds seed..seed+N-1, results pooled")
    p.add_argument("--feed-window-s", type=float, default=5.0, help="P99/QPS window of the metrics adapter")
    p.add_argument("--weights", default="", help="JSON object of [weights] overrides for the triscope feed")
    p.add_argument("--max-error", type=float, default=0.01, help="error rate a held step may have")
    p.add_argument("--timeout-factor", type=float, default=6.0, help="client timeout = max(2s, SLA x this)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--dump-results", default="", help="write every request's outcome to this JSON-lines file")
    p.add_argument("--workdir", default="")
    # internal: the feed worker process
    p.add_argument("--feed-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--feed-backends", default="{}", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.class_admission = parse_admission(args.class_admission)  # checked before any run starts
    args.class_batch_admission = parse_admission(args.class_batch_admission, "--class-batch-admission", {})
    args.class_maxconn = parse_admission(args.class_maxconn, "--class-maxconn", {})
    args.class_timeout_queue_ms = parse_admission(args.class_timeout_queue_ms, "--class-timeout-queue-ms", {})
    if any(v <= 0 for v in args.class_maxconn.values()) or any(v < 0 for v in args.class_timeout_queue_ms.values()):
        raise SystemExit("--class-maxconn needs values > 0 and --class-timeout-queue-ms values >= 0")
    if args.class_lb_gate and not args.class_batch_admission:
        raise SystemExit("--class-lb-gate needs --class-batch-admission (the limits it applies)")
    return args


def run(args: argparse.Namespace) -> dict[str, Any]:
    """The whole bench; returns the JSON document."""
    specs = ([BackendSpec.parse(b) for b in args.backend] if args.backend
             else default_specs(args.backends, args.kv_gib, args.slots))
    shape = LoadShape(base_qps=args.base_qps, step_factor=args.step_factor, steps=args.steps,
                      step_s=args.step_s, burst_period_s=args.burst_period_s, burst_s=args.burst_s,
                      burst_factor=args.burst_factor)
    if args.agent_maxconn and args.maxconn_per_slot <= 0:
        raise SystemExit("--agent-maxconn needs --maxconn-per-slot (the static maxconn it scales)")
    seeds = [args.seed + k for k in range(max(1, args.repeat))]
    schedules = [shape.schedule(seed) for seed in seeds]
    catalog = {"roundrobin": Policy("roundrobin", "roundrobin"), "leastconn": Policy("leastconn", "leastconn"),
               "triscope": Policy("triscope", args.triscope_balance, triscope=True),
               "triscope-classes": Policy("triscope-classes", args.triscope_balance, triscope=True, class_pools=True)}
    names = [p.strip() for p in args.policies.split(",") if p.strip()]
    unknown = [n for n in names if n not in catalog]
    if unknown:
        raise SystemExit(f"--policies: unknown {', '.join(unknown)} (known: {', '.join(catalog)})")
    policies = [catalog[n] for n in names]
    raw: dict[str, list[RawRun]] = {p.name: [] for p in policies}
    with tempfile.TemporaryDirectory(prefix="triscope-closed-loop-", dir=args.workdir or None) as tmp:
        fleet = SimFleet(specs, args.batch_slowdown).start()
        try:
            for rep, schedule in enumerate(schedules):  # policies interleaved: machine-load drift hits all
                for policy in policies:
                    if not args.json:
                        print(f"running {policy.name} ({policy.balance}), seed {seeds[rep]} ...", file=sys.stderr,
                              flush=True)
                    raw[policy.name].append(run_policy(policy, fleet, schedule, args, Path(tmp)))
        finally:
            fleet.stop()
    if args.dump_results:
        with open(args.dump_results, "w") as fh:
            for name, runs in raw.items():
                for rep, one in enumerate(runs):
                    for r in one.results:
                        fh.write(json.dumps({"policy": name, "rep": rep, **asdict(r)}) + "\n")
    reports = {name: summarize(catalog[name], runs, shape, args.max_error) for name, runs in raw.items()}
    for name, runs in raw.items():
        if runs[0].feed_kind:
            reports[name].extra["feed"] = runs[0].feed_kind
    comps = [comparison(reports, "leastconn", "triscope", raw), comparison(reports, "roundrobin", "triscope", raw),
             comparison(reports, "leastconn", "triscope-classes", raw),
             comparison(reports, "triscope", "triscope-classes", raw)]
    doc = {"backends": [asdict(s) for s in specs], "load": asdict(shape), "arrivals": len(schedules[0]),
           "arrivals_total": sum(len(x) for x in schedules), "seeds": seeds,
           "haproxy": {"maxconn_per_slot": args.maxconn_per_slot, "timeout_queue_ms": args.timeout_queue_ms,
                       "agent_inter_ms": args.agent_inter_ms, "agent_maxconn": args.agent_maxconn,
                       "class_priority": args.class_priority, "capacity_weights": args.capacity_weights,
                       "class_admission": args.class_admission, "class_batch_admission": args.class_batch_admission,
                       "class_maxconn_per_slot": args.class_maxconn,
                       "class_timeout_queue_ms": args.class_timeout_queue_ms, "class_lb_gate": args.class_lb_gate},
           "weights_overrides": weights_overrides(args) if any(catalog[n].triscope for n in reports) else {},
           "policies": {k: asdict(v) for k, v in reports.items()}, "comparisons": [c for c in comps if c]}
    if args.json:
        json.dump(doc, sys.stdout, indent=2, default=str)
        sys.stdout.write("\n")
    else:
        print_report(reports, comps, shape, specs)
    return doc


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.feed_worker:
        from triscope_bed.fleet.feed_worker import run_feed_worker

        run_feed_worker(json.loads(args.feed_backends), weights_overrides(args), args.feed_window_s)
        return 0
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
