"""CPU each test-bed policy's data path spends per request (the LB, its picker and their scrapes).

    .venv/bin/python bench/datapath_cpu.py --requests 1500 --policies haproxy-leastconn,gie-epp,triscope-epp

``--idle-s 20`` also measures each policy's CPU with no request (what watching the engines costs:
scrapes, the weight engine, the pick table's polls), per process.

Two simulated vLLM-CPU backends (cheap: they sleep for their compute), one policy at a time in front
of them (``bed/triscope_bed/fleet/testbed_fronts.py``, the same processes as ``bench/testbed.py``), a client in its own
process sending small completions from 8 connections. CPU is read from /proc (psutil) before and
after: the policy's own processes (HAProxy, Envoy, sglang-router, triscope's feed worker) and this
process, which hosts the in-process pickers (GIE's and triscope's ext_proc servers and their 50 ms
scrapers). On a host whose engines are CPU-bound (the 2-core vLLM test bed) this CPU is taken from
the engines; docs/closed_loop.md uses it to read the real-fleet results.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

from triscope_bed.fleet.testbed_fleet import SimTestFleet, backend_layout
from triscope_bed.fleet.testbed_fronts import POLICIES, FrontOptions, front

CLIENT = r"""
import http.client, json, sys, threading, time
port, total, conns = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
body = json.dumps({"model": "tiny-llama", "prompt": "hello world " * 8, "prompt_tokens": 24, "max_tokens": 4,
                   "request_class": "speech"}).encode()
ok = [0] * conns
def run(i):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    for _ in range(total // conns):
        c.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        r = c.getresponse(); r.read()
        ok[i] += r.status == 200
t0 = time.monotonic()
ts = [threading.Thread(target=run, args=(i,)) for i in range(conns)]
[t.start() for t in ts]; [t.join() for t in ts]
print(json.dumps({"ok": sum(ok), "sent": conns * (total // conns), "wall_s": time.monotonic() - t0}))
"""


def _cpu(procs: list[psutil.Process]) -> float:
    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            pass
    return total


def _name(p: psutil.Process) -> str:
    return "feed worker" if "feed_worker" in " ".join(p.cmdline()) else p.name()


def _cpu_by_name(lb: list[psutil.Process], since: dict[int, float]) -> dict[str, float]:
    """CPU seconds each kind of LB process (HAProxy, Envoy, a feed worker) took since ``since`` (pid -> seconds)."""
    by_name: dict[str, float] = {}
    for p in lb:
        try:
            name = _name(p)
        except psutil.Error:
            continue
        by_name[name] = by_name.get(name, 0.0) + _cpu([p]) - since.get(p.pid, 0.0)
    return by_name


def idle_shares(lb: list[psutil.Process], seconds: float) -> dict[str, float]:
    """Share of one core each LB process (and this one, hosting the in-process pickers) takes with no request:
    the price of watching the engines (scrapes, the weight engine, the pick table's polls)."""
    me = psutil.Process()
    each0, own0, t0 = {p.pid: _cpu([p]) for p in lb}, _cpu([me]), time.monotonic()
    time.sleep(seconds)
    elapsed = time.monotonic() - t0
    shares = {name: cpu_s / elapsed for name, cpu_s in _cpu_by_name(lb, each0).items()}
    shares["in-process pickers"] = (_cpu([me]) - own0) / elapsed
    return {k: round(v, 4) for k, v in sorted(shares.items())}


def measure(policy: str, fleet: SimTestFleet, workdir: Path, requests: int, conns: int,
            idle_s: float = 0.0) -> dict[str, Any]:
    me = psutil.Process()
    before = {p.pid for p in me.children(recursive=True)}
    with front(policy, fleet, workdir / policy, FrontOptions(sglang_warmup_s=0.0, seed=1)) as fr:
        lb = [p for p in me.children(recursive=True) if p.pid not in before]
        time.sleep(1.0)  # idle scrapes and health checks settle
        idle = idle_shares(lb, idle_s) if idle_s > 0 else {}
        lb0, own0, t0 = _cpu(lb), _cpu([me]), time.monotonic()
        each0 = {p.pid: _cpu([p]) for p in lb}
        out = subprocess.run([sys.executable, "-c", CLIENT, str(fr.port), str(requests), str(conns)],
                             capture_output=True, text=True, check=True, timeout=600)
        lb1, own1, t1 = _cpu(lb), _cpu([me]), time.monotonic()
        by_name = _cpu_by_name(lb, each0)  # which LB process the CPU went to
    client = json.loads(out.stdout)
    n = max(1, client["ok"])
    return {"requests_ok": client["ok"], "sent": client["sent"], "wall_s": round(t1 - t0, 2),
            "lb_processes_cpu_ms_per_request": round(1000 * (lb1 - lb0) / n, 3),
            "lb_process_cpu_ms_per_request": {k: round(1000 * v / n, 3) for k, v in sorted(by_name.items())},
            "in_process_picker_cpu_ms_per_request": round(1000 * (own1 - own0) / n, 3),
            "total_cpu_ms_per_request": round(1000 * ((lb1 - lb0) + (own1 - own0)) / n, 3),
            "data_path_cpu_share_of_one_core": round(((lb1 - lb0) + (own1 - own0)) / (t1 - t0), 3),
            **({"idle_share_of_one_core": idle, "idle_total_share_of_one_core": round(sum(idle.values()), 4)}
               if idle else {})}


def vllm_scrape_cost(rates_hz: list[float], seconds: float) -> dict[str, dict[str, float]]:
    """CPU a real vLLM-CPU server (API server, engine core, worker: its whole process group) spends
    idle and while ``/metrics`` is scraped at each rate: what a scraping picker takes from the engine."""
    import urllib.request

    from triscope_bed.engines.vllm_cpu import VllmInstall, make_tiny_model, serve

    install = VllmInstall.default()
    if (why := install.missing()) is not None:
        raise SystemExit(why)
    out: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="tsvs-") as tmp, \
            serve(install, make_tiny_model(install, install.model_dir), Path(tmp)) as servers:
        server = servers[0]
        assert server.proc is not None
        group = [psutil.Process(server.proc.pid), *psutil.Process(server.proc.pid).children(recursive=True)]
        time.sleep(3.0)
        for rate in [0.0, *rates_hz]:
            c0, t0, scrapes = _cpu(group), time.monotonic(), 0
            while time.monotonic() - t0 < seconds:
                if rate > 0:
                    with urllib.request.urlopen(server.base_url + "/metrics", timeout=5) as resp:
                        resp.read()
                    scrapes += 1
                    time.sleep(max(0.0, t0 + scrapes / rate - time.monotonic()))
                else:
                    time.sleep(0.1)
            elapsed = time.monotonic() - t0
            out[f"{rate:g} Hz"] = {"engine_cpu_share_of_one_core": round((_cpu(group) - c0) / elapsed, 4),
                                   "scrapes": scrapes}
        idle = out["0 Hz"]["engine_cpu_share_of_one_core"]
        for row in out.values():
            if row["scrapes"]:
                row["cpu_ms_per_scrape"] = round(1000 * (row["engine_cpu_share_of_one_core"] - idle) * seconds
                                                 / row["scrapes"], 3)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="CPU per request of each policy's data path")
    parser.add_argument("--requests", type=int, default=1500)
    parser.add_argument("--connections", type=int, default=8)
    parser.add_argument("--policies", default="haproxy-leastconn,triscope,gie-epp,triscope-epp")
    parser.add_argument("--vllm-scrape-cost", action="store_true",
                        help="also measure a real vLLM-CPU server's CPU while its /metrics is scraped at 4, 10, 20 Hz")
    parser.add_argument("--idle-s", type=float, default=0.0,
                        help="also measure each policy's CPU with no request for this many seconds (its watching)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    policies = [p for p in args.policies.split(",") if p]
    unknown = [p for p in policies if p not in POLICIES]
    if unknown or args.requests < args.connections:
        parser.error(f"unknown policies {unknown} (known: {', '.join(POLICIES)})" if unknown
                     else "--requests must be >= --connections")
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="tsdp-") as tmp, \
            SimTestFleet(backend_layout(2, "none"), Path(tmp)) as fleet:
        for policy in policies:
            results[policy] = measure(policy, fleet, Path(tmp), args.requests, args.connections, args.idle_s)
            if not args.json:
                r = results[policy]
                print(f"{policy:<20} {r['requests_ok']:>5}/{r['sent']} ok  LB processes "
                      f"{r['lb_processes_cpu_ms_per_request']:6.2f} ms  in-process picker "
                      f"{r['in_process_picker_cpu_ms_per_request']:6.2f} ms  total "
                      f"{r['total_cpu_ms_per_request']:6.2f} ms CPU/request  "
                      f"({r['data_path_cpu_share_of_one_core']:.2f} of a core; "
                      + ", ".join(f"{k} {v:.2f}" for k, v in r["lb_process_cpu_ms_per_request"].items()) + ")",
                      flush=True)
                if "idle_share_of_one_core" in r:
                    print(f"{'':<20} idle: {100 * r['idle_total_share_of_one_core']:.2f} % of a core ("
                          + ", ".join(f"{k} {100 * v:.2f} %" for k, v in r["idle_share_of_one_core"].items()) + ")",
                          flush=True)
    if args.vllm_scrape_cost:
        cost = vllm_scrape_cost([4.0, 10.0, 20.0], 15.0)
        results["vllm_scrape_cost"] = cost
        if not args.json:
            for rate, row in cost.items():
                print(f"vLLM-CPU scraped at {rate:>5}: {row['engine_cpu_share_of_one_core']:.3f} of a core"
                      + (f", {row['cpu_ms_per_scrape']:.2f} ms CPU per scrape" if "cpu_ms_per_scrape" in row else ""))
    if args.json:
        print(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
