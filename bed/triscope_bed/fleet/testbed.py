"""Test bed v2: every policy on the real vLLM-CPU fleet and on the calibrated simulator, same offered load.

``bench/testbed.py`` runs :func:`main`. For each fleet (``--fleet sim,vllm``) it starts the backends
once, then for each policy (:mod:`.testbed_fronts`) restores them (a killed backend restarts), applies
the scenario, starts the policy's load balancer, replays the workload's arrivals open loop through it
from a client process of its own (``bed/triscope_bed/workloads/named.py``; the same arrivals for every policy and both
fleets; a picker serving in this process shares no interpreter lock with the client) and judges the results
(``reports.judge.judge``: goodput within the class SLAs, P99 over all offered, errors by kind,
peak QPS held). It prints the side-by-side table, writes one PNG per fleet and, with ``--json``, the
whole document. docs/closed_loop.md has the method and the figures.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import math
import os
import secrets
import sys
import threading
import time
from pathlib import Path
from typing import Any

from triscope.errors import ConfigError
from triscope_bed.engines.calibration import PROFILES, SimProfile
from triscope_bed.engines.vllm_classes import CLASSES as SIZES
from triscope_bed.fleet.testbed_fleet import FLEETS, SCENARIOS, Fleet, FleetError, make_fleet
from triscope_bed.fleet.testbed_fronts import POLICIES, FrontOptions, epp_config, front
from triscope_bed.fleet.testbed_record import MetricsRecorder
from triscope_bed.procs import process_table, tree_cpu_seconds
from triscope_bed.reports.judge import judge, plot_judgements
from triscope_bed.reports.testbed_repeat import rotated, summarize
from triscope_bed.reports.testbed_report import print_tables
from triscope_bed.workloads.arrivals import Arrival
from triscope_bed.workloads.client_process import ClientProcess
from triscope_bed.workloads.named import WORKLOADS, WorkloadError, bucket_seconds, build

QPS_PER_BACKEND = 1.0
"""Default mean offered load per backend of the CPU test bed (the step workload's first step; measured
capacity in docs/closed_loop.md)."""
ENGINE_NICE = 10
"""The real engines' niceness: their engine cores busy-poll the 2 shared cores, which the client and every
load balancer's process, on CPUs of their own in a deployment, share with them here."""
AZURE_DEFAULTS = {"token_scale": 0.15, "max_total_tokens": 420}
"""The Azure trace's tokens (median 1,469 in / 13 out) scaled to the tiny engine's 512-token context. The
prompt is written at the tokenizer's mean characters per token, so a long one can tokenize to more than
planned: 420 leaves 18 % (at 480, 3-5 of 420 requests per policy were refused as over 512 tokens)."""


def parse_params(items: list[str]) -> dict[str, Any]:
    """``KEY=VALUE`` parameters (numbers as numbers, ``true`` / ``false`` as booleans)."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"--param {item!r}: expected KEY=VALUE")
        if value.lower() in ("true", "false"):
            out[key] = value.lower() == "true"
            continue
        try:
            out[key] = int(value) if value.lstrip("-").isdigit() else float(value)
        except ValueError:
            out[key] = value
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="test bed v2: every policy on real vLLM-CPU and the calibrated "
                                            "simulator (docs/closed_loop.md)")
    p.add_argument("--fleet", default="sim,vllm", help=f"comma list of {', '.join(FLEETS)}")
    p.add_argument("--backends", type=int, default=2, help="backends per fleet (vLLM: one core each)")
    p.add_argument("--sim-backends", type=int, default=0, help="backends of the sim fleet (default: --backends)")
    p.add_argument("--policies", default=",".join(POLICIES), help=f"comma list of {', '.join(POLICIES)}")
    p.add_argument("--workload", default="step", choices=sorted(WORKLOADS))
    p.add_argument("--scenario", default="none", choices=SCENARIOS)
    p.add_argument("--qps-per-backend", type=float, default=0.0,
                   help=f"mean offered load per backend (default {QPS_PER_BACKEND})")
    p.add_argument("--param", action="append", default=[], help="workload parameter KEY=VALUE (repeat)")
    p.add_argument("--seed", type=int, default=None, help="arrival seed (default: a fresh one, printed)")
    p.add_argument("--profile", default="vllm-cpu", choices=sorted(PROFILES))
    p.add_argument("--pin-ratio", type=float, default=0.5, help="pinned: share of b0's KV the tenant holds")
    p.add_argument("--kill-at", type=float, default=0.4, help="killed: when b0 dies, as a share of the run")
    p.add_argument("--timeout-factor", type=float, default=6.0, help="client timeout = max(2 s, SLA x this)")
    p.add_argument("--sglang-warmup-s", type=float, default=None, help="wait before the run (default 31 s)")
    p.add_argument("--engine-nice", type=int, default=ENGINE_NICE,
                   help=f"real fleet: the engines' niceness (default {ENGINE_NICE}: the client and the load balancers, "
                        "which a deployment runs on other CPUs, go first on the shared cores; 0: all equal)")
    p.add_argument("--engine-cores", choices=("own", "shared"), default="own",
                   help="real fleet: each engine's whole process tree on a core of its own (default), or only its "
                        "worker's threads bound and its API server and engine core free to run on any core")
    p.add_argument("--epp-scrape-ms", type=float, default=None,
                   help="triscope-epp: /metrics scrape period (default 250 ms; the GIE picker keeps its 50 ms)")
    p.add_argument("--epp-engine-ms", type=float, default=None,
                   help="triscope-epp: its weight engine's period, each a scrape of every engine (default 1000 ms)")
    p.add_argument("--epp-picker", action="append", default=[],
                   help="triscope-epp: an [epp] setting KEY=VALUE (repeat), e.g. engine_weights=false")
    p.add_argument("--out-dir", default="var/testbed", help="PNGs and the JSON document go here")
    p.add_argument("--record-metrics", default="", help="append every backend's KV usage and queue, scraped "
                                                        "every 250 ms during each run, to this CSV")
    p.add_argument("--repeat", type=int, default=1, help="rounds per policy on the same arrivals, in a rotated "
                                                          "order; adds each policy's spread and paired ratios")
    p.add_argument("--json", action="store_true", help="print the JSON document instead of the tables")
    args = p.parse_args(argv)
    args.fleets = [f.strip() for f in args.fleet.split(",") if f.strip()]
    args.policy_list = [x.strip() for x in args.policies.split(",") if x.strip()]
    bad = [f for f in args.fleets if f not in FLEETS] + [x for x in args.policy_list if x not in POLICIES]
    if bad or not args.fleets or not args.policy_list:
        raise SystemExit(f"unknown fleet or policy: {', '.join(bad) or '(none given)'} "
                         f"(fleets: {', '.join(FLEETS)}; policies: {', '.join(POLICIES)})")
    for flag, value in (("--epp-scrape-ms", args.epp_scrape_ms), ("--epp-engine-ms", args.epp_engine_ms)):
        if value is not None and not 10 <= value <= 10_000:
            raise SystemExit(f"{flag} must be 10-10000")
    if not 1 <= args.repeat <= 50:
        raise SystemExit("--repeat must be 1-50")
    if not 0 <= args.engine_nice <= 19:
        raise SystemExit("--engine-nice must be 0-19")
    if args.backends < 1 or args.sim_backends < 0 or not 0 < args.pin_ratio < 1 or not 0 < args.kill_at < 1:
        raise SystemExit("--backends >= 1, --pin-ratio and --kill-at in (0, 1) expected")
    if args.scenario == "killed" and min(args.backends, args.sim_backends or args.backends) < 2:
        raise SystemExit("--scenario killed needs at least 2 backends")
    args.params = parse_params(args.param)
    try:  # an [epp] key that does not exist fails here, not when its policy's turn comes
        epp_config(FrontOptions(picker=parse_params(args.epp_picker)), 4.0)
    except ConfigError as exc:
        raise SystemExit(f"--epp-picker: {exc}") from None
    if args.seed is None:
        args.seed = secrets.randbelow(1_000_000)
    return args


def sized(schedule: list[Arrival]) -> list[Arrival]:
    """Arrivals without token counts get the CPU test bed's class sizes (:mod:`triscope_bed.engines.vllm_classes`)."""
    return [a if a.prompt_tokens is not None else
            Arrival(a.t, a.cls, a.step, SIZES[a.cls].prompt_tokens, SIZES[a.cls].output_tokens) for a in schedule]


def schedule_for(args: argparse.Namespace, backends: int) -> tuple[list[Arrival], float]:
    params = dict(args.params)
    if args.workload == "azure":
        params = {**AZURE_DEFAULTS, **params}
    qps = args.qps_per_backend or QPS_PER_BACKEND
    try:
        arrivals = build(args.workload, args.seed, backends, qps_per_backend=qps, **params)
        return sized(arrivals), bucket_seconds(args.workload, **params)
    except WorkloadError as exc:
        raise SystemExit(f"--workload {args.workload}: {exc}") from None


def run_policy(policy: str, fleet: Fleet, schedule: list[Arrival], bucket_s: float, args: argparse.Namespace,
               profile: SimProfile, workdir: Path, round_index: int = 0) -> dict[str, Any]:
    """One replay of ``schedule`` through ``policy``: the judgement plus what the fleet counted."""
    fleet.restore()
    fleet.wait_idle()
    victim = fleet.backends[0].name
    if args.scenario == "pinned":
        fleet.pin(victim, args.pin_ratio)
    opts = FrontOptions(sla_s=dict(profile.sla_s), seed=args.seed)
    if args.sglang_warmup_s is not None:
        opts.sglang_warmup_s = args.sglang_warmup_s
    if args.epp_scrape_ms is not None:
        opts.epp_scrape_s = args.epp_scrape_ms / 1000
    if args.epp_engine_ms is not None:
        opts.epp_engine_s = args.epp_engine_ms / 1000
    opts.picker = parse_params(args.epp_picker)
    duration = max(a.t for a in schedule) if schedule else 0.0
    before = fleet.counters()
    t0 = time.monotonic()
    try:
        with front(policy, fleet, workdir / f"{fleet.kind}-{policy}", opts) as f, ClientProcess() as client:
            timer = None
            if args.scenario == "killed":
                timer = threading.Timer(args.kill_at * duration, fleet.kill, [victim])
                timer.start()
            recorder = (MetricsRecorder(Path(args.record_metrics), fleet.kind, policy,
                                        {b.name: b.url for b in fleet.backends})
                        if args.record_metrics else contextlib.nullcontext())
            engines = fleet.engine_pids()
            exclude = engines | client.pids()

            def cpu_now() -> tuple[dict[int, float], dict[int, float]]:
                """(LB tier per process, engines per process tree), from one look at the process table."""
                table = process_table()
                return (tree_cpu_seconds(table, os.getpid(), exclude),
                        {pid: sum(tree_cpu_seconds(table, pid, set()).values()) for pid in engines if pid in table})

            tier_before, engines_before = cpu_now()
            try:
                with recorder:
                    results, lag = client.drive(
                        "127.0.0.1", f.port, schedule, timeout_factor=args.timeout_factor, api="completions",
                        model=fleet.model, prompt_salt=prompt_salt(policy, fleet.kind, args.seed, round_index),
                        chars_per_token=fleet.chars_per_token, extra_body=fleet.extra_body or None,
                        slas=profile.sla_s)
            finally:
                if timer is not None:
                    timer.cancel()
                    timer.join()
            tier_after, engines_after = cpu_now()
    finally:
        fleet.unpin()
    after = fleet.counters()
    doc = judge(results, bucket_s, duration_s=math.ceil(duration / bucket_s) * bucket_s if duration else None,
                slas=profile.sla_s)
    doc["preemptions"] = int(sum(after.get(b, {}).get("vllm:num_preemptions_total", 0)
                                 - before.get(b, {}).get("vllm:num_preemptions_total", 0) for b in after))
    doc["served_by"] = {b: int(after[b]["vllm:request_success_total"] - before.get(b, {}).get(
        "vllm:request_success_total", 0)) for b in after}
    looked, found = (sum(after[b].get(k, 0) - before.get(b, {}).get(k, 0) for b in after)
                     for k in ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"))
    # the share of prompt tokens the engines found in their prefix caches (shared-prefix arrivals only)
    doc["prefix_cache"] = {"queried_tokens": int(looked), "hit_tokens": int(found),
                           "hit_ratio": round(found / looked, 4) if looked > 0 else None}
    failed = collections.Counter(f"{r.status} {r.reason[:120]}".strip() for r in results
                                 if r.status not in (200, 0, -1))
    doc["failed_answers"] = dict(failed.most_common(5))  # what the LB or backend said, for the reader
    doc["send_lag_s"] = round(lag, 3)
    # the load-balancing tier (LB, picker, feed) on the cores it shares with the engines; a killed engine's
    # time is lost with it
    tier_s = sum(v - tier_before.get(pid, 0.0) for pid, v in tier_after.items())
    engines_s = sum(v - engines_before.get(pid, 0.0) for pid, v in engines_after.items())
    doc["cpu_s"] = {"lb_tier": round(tier_s, 2), "engines": round(engines_s, 2),
                    "lb_tier_ms_per_request": round(1000 * tier_s / max(1, len(results)), 2),
                    "lb_tier_processes": len(tier_after)}
    doc["wall_s"] = round(time.monotonic() - t0, 1)
    doc["front"] = f.info
    return doc


def prompt_salt(policy: str, fleet: str, seed: int, round_index: int) -> str:
    """Prompts differ per policy and round, so no replay finds another's prefix in an engine's cache."""
    return f"{policy}-{fleet}-s{seed}" + (f"-r{round_index}" if round_index else "")


def run(args: argparse.Namespace) -> dict[str, Any]:
    profile = PROFILES[args.profile]
    out_dir = Path(args.out_dir).resolve()  # HAProxy reads a relative socket path as host:port
    out_dir.mkdir(parents=True, exist_ok=True)
    doc: dict[str, Any] = {"workload": args.workload, "scenario": args.scenario, "seed": args.seed,
                           "params": args.params, "profile": args.profile,
                           "engine_nice": args.engine_nice, "engine_cores": args.engine_cores,
                           "sla_s": profile.sla_s, "fleets": {}}
    say = (lambda *_: None) if args.json else (lambda m: print(m, file=sys.stderr, flush=True))
    say(f"seed {args.seed} (rerun with --seed {args.seed})")
    path = out_dir / f"testbed-{args.workload}-{args.scenario}-s{args.seed}.json"
    for kind in args.fleets:
        n = args.sim_backends or args.backends if kind == "sim" else args.backends
        schedule, bucket_s = schedule_for(args, n)
        fleet_doc: dict[str, Any] = {"backends": n, "arrivals": len(schedule), "bucket_s": bucket_s, "policies": {}}
        rounds: list[dict[str, Any]] = []
        orders: list[list[str]] = []
        say(f"{kind}: starting {n} backends ({args.scenario}) ...")
        try:
            with make_fleet(kind, n, args.scenario, out_dir / "work", args.profile, args.engine_nice,
                            args.engine_cores == "own") as fleet:
                nice, cores = fleet.niceness(), fleet.cores()  # read from the running engines
                fleet_doc["layout"] = [{"name": b.name, "kv_tokens": b.kv_tokens, "slots": b.slots,
                                        "nice": nice.get(b.name), "cores": cores.get(b.name)}
                                       for b in fleet.backends]
                for k in range(args.repeat):
                    order = rotated(args.policy_list, k)
                    orders.append(order)
                    rounds.append({})
                    for policy in order:
                        say(f"{kind}: {policy}{f' (round {k + 1}/{args.repeat})' if args.repeat > 1 else ''}, "
                            f"{len(schedule)} requests over {schedule[-1].t:.0f} s ...")
                        rounds[-1][policy] = run_policy(policy, fleet, schedule, bucket_s, args, profile,
                                                        out_dir / "work", k)
                        # what ran so far survives a crash or a kill of a long repeated run
                        doc["fleets"][kind] = {**fleet_doc, "rounds": rounds, "partial": True}
                        path.write_text(json.dumps(doc, indent=1, default=str))
        except FleetError as exc:
            fleet_doc["error"] = str(exc)
            say(f"{kind}: {exc}")
        if rounds:  # the first round is the side-by-side table and PNG, as a single run's
            fleet_doc["policies"] = {p: rounds[0][p] for p in args.policy_list if p in rounds[0]}
        if args.repeat > 1 and rounds:
            fleet_doc["rounds"] = rounds
            fleet_doc["repeat"] = summarize(rounds, orders)
        if fleet_doc["policies"]:
            png = out_dir / f"testbed-{kind}-{args.workload}-{args.scenario}-s{args.seed}.png"
            plot_judgements(fleet_doc["policies"], str(png),
                            f"{kind} fleet ({n} backends), {args.workload}, {args.scenario}, seed {args.seed}")
            fleet_doc["png"] = str(png)
        doc["fleets"][kind] = fleet_doc
    path.write_text(json.dumps(doc, indent=1, default=str))
    doc["json_path"] = str(path)
    if args.json:
        json.dump(doc, sys.stdout, indent=1, default=str)
        sys.stdout.write("\n")
    else:
        print_tables(doc)
    return doc


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
