"""Weight-feed bench: HTTP throughput/P99 against nginx, and memory-change -> HAProxy-weight lag.

    .venv/bin/python bench/feed.py              # ~1 minute on 2 cores
    .venv/bin/python bench/feed.py --duration-s 15 --lag-trials 20 --json

1. ``wrk`` drives triscope's feed (``GET /v1/weights``, real ``WeightFeed`` fed by live scrapes of
   simulated backends), once with its ports served by a process of their own (``[weights.feed]
   serve_process``) and once as default, and then nginx serving the very same JSON document as a
   static file, with the same connections, threads and duration. Prints requests/s, P50/P99 and the
   ratios.
2. Two simulated backends sit behind real HAProxy whose servers use agent-check against the
   feed. The bench pins memory on one backend (``/sim/pressure``) and times until HAProxy's
   ``get weight`` for that server changes; then releases it and times the recovery. It also
   times when ``/v1/weights`` changed, splitting the lag into feed and load-balancer parts.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from triscope_bed.engines.backend import BackendSpec
from triscope_bed.fleet.bench_fleet import BENCH_WEIGHTS, FeedWorker, SimFleet
from triscope_bed.peers.haproxy import HAProxy, Server
from triscope_bed.peers.nginx import Nginx
from triscope_bed.ports import free_port, wait_port

_UNIT = {"us": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0}


def _seconds(text: str) -> float:
    m = re.fullmatch(r"([\d.]+)(us|ms|s|m)", text.strip())
    if not m:
        return math.nan
    return float(m.group(1)) * _UNIT[m.group(2)]


def parse_wrk(text: str) -> dict[str, float]:
    """Requests/s, latency percentiles (s) and error counts from ``wrk --latency`` output."""
    out: dict[str, float] = {"rps": math.nan, "p50_s": math.nan, "p90_s": math.nan, "p99_s": math.nan,
                             "non_2xx": 0.0, "socket_errors": 0.0, "requests": math.nan}
    if m := re.search(r"Requests/sec:\s+([\d.]+)", text):
        out["rps"] = float(m.group(1))
    for pct in ("50", "90", "99"):
        if m := re.search(rf"^\s+{pct}(?:\.000)?%\s+(\S+)", text, re.MULTILINE):
            out[f"p{pct}_s"] = _seconds(m.group(1))
    if m := re.search(r"(\d+) requests in", text):
        out["requests"] = float(m.group(1))
    if m := re.search(r"Non-2xx or 3xx responses:\s+(\d+)", text):
        out["non_2xx"] = float(m.group(1))
    if m := re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", text):
        out["socket_errors"] = float(sum(int(g) for g in m.groups()))
    return out


def run_wrk(url: str, threads: int, connections: int, duration_s: float) -> dict[str, float]:
    wrk = shutil.which("wrk")
    if wrk is None:
        raise SystemExit("wrk is not installed (Debian package wrk)")
    proc = subprocess.run([wrk, f"-t{threads}", f"-c{connections}", f"-d{duration_s:g}s", "--latency", url],
                          capture_output=True, text=True, timeout=duration_s + 30)
    if proc.returncode != 0:
        raise RuntimeError(f"wrk failed: {proc.stderr.strip()}")
    return parse_wrk(proc.stdout)


def nginx_serving(prefix: Path, root: Path) -> Nginx:
    """nginx serving the files of ``root`` over HTTP."""
    tmp = prefix / "tmp"
    return Nginx(prefix, lambda port: f"""http {{
    access_log off;
    client_body_temp_path {tmp}/body;
    proxy_temp_path {tmp}/proxy;
    fastcgi_temp_path {tmp}/fastcgi;
    uwsgi_temp_path {tmp}/uwsgi;
    scgi_temp_path {tmp}/scgi;
    types {{ application/json json; }}
    server {{
        listen 127.0.0.1:{port};
        root {root};
        location / {{ }}
    }}
}}""")


def _get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=2) as resp:
        return resp.read()


def throughput(feed: FeedWorker, workdir: Path, args: argparse.Namespace,
               before: dict[str, dict[str, float]] | None = None) -> dict[str, Any]:
    """wrk against the feed's /v1/weights, then against nginx serving the same bytes; ``before``: results
    of other feeds measured just before (the serving-process mode), reported with their ratios."""
    feed_url = f"http://127.0.0.1:{feed.info['http_port']}/v1/weights"
    body = _get(feed_url)
    root = workdir / "www"
    root.mkdir(parents=True, exist_ok=True)
    (root / "weights.json").write_bytes(body)
    nginx = nginx_serving(workdir / "nginx", root).start()
    try:
        nginx_url = f"http://127.0.0.1:{nginx.port}/weights.json"
        assert _get(nginx_url) == body
        feed_res = wrk_feed(feed, args)
        nginx_res = run_wrk(nginx_url, args.threads, args.connections, args.duration_s)
    finally:
        nginx.stop()
    doc: dict[str, Any] = {"body_bytes": len(body), "feed": feed_res, **(before or {}), "nginx": nginx_res}
    for label in ("feed", *(before or {})):
        res = doc[label]
        doc[f"rps_ratio_{label}_over_nginx"] = res["rps"] / nginx_res["rps"] if nginx_res["rps"] else math.nan
        doc[f"p99_ratio_{label}_over_nginx"] = res["p99_s"] / nginx_res["p99_s"] if nginx_res["p99_s"] else math.nan
    return doc


def wrk_feed(feed: FeedWorker, args: argparse.Namespace) -> dict[str, float]:
    """wrk against one feed's /v1/weights after a one-second warm-up."""
    feed_url = f"http://127.0.0.1:{feed.info['http_port']}/v1/weights"
    run_wrk(feed_url, args.threads, args.connections, 1)
    return run_wrk(feed_url, args.threads, args.connections, args.duration_s)


def _feed_lb_weight(feed: FeedWorker, name: str) -> int | None:
    try:
        doc = feed.weights_doc()
    except OSError:
        return None
    b = doc.get("backends", {}).get(name, {})
    return 0 if b.get("state") == "drain" else b.get("lb_weight")


def measure_lag(fleet: SimFleet, feed: FeedWorker, hap: HAProxy, name: str, ratio: float,
                trials: int, timeout_s: float = 15.0, poll_s: float = 0.005) -> dict[str, Any]:
    """Pin/unpin memory on ``name``; time until the feed's and HAProxy's weights change."""
    spec = next(s for s in fleet.specs if s.name == name)
    lb_lags, feed_lags = [], []
    misses = 0
    for i in range(trials):
        pressure = int(ratio * spec.kv_gib * 1024**3) if i % 2 == 0 else 0
        settle_deadline = time.monotonic() + timeout_s
        before = hap.weights()[name]
        while time.monotonic() < settle_deadline:  # wait until HAProxy is steady
            time.sleep(0.3)
            now_w = hap.weights()[name]
            if now_w == before:
                break
            before = now_w
        feed_before = _feed_lb_weight(feed, name)
        t0 = time.monotonic()
        fleet.set_pressure(name, pressure)
        feed_t = lb_t = None
        while time.monotonic() - t0 < timeout_s and lb_t is None:
            now = time.monotonic()
            if feed_t is None and feed_before is not None and _feed_lb_weight(feed, name) != feed_before:
                feed_t = now - t0
            if hap.weights()[name] != before:
                lb_t = time.monotonic() - t0
            time.sleep(poll_s)
        if lb_t is None:
            misses += 1
            continue
        lb_lags.append(lb_t)
        if feed_t is not None:
            feed_lags.append(min(feed_t, lb_t))
    fleet.set_pressure(name, 0)

    def stats(xs: list[float]) -> dict[str, float]:
        if not xs:
            return {"n": 0}
        s = sorted(xs)
        return {"n": len(s), "median_s": statistics.median(s), "p90_s": s[min(len(s) - 1, int(0.9 * len(s)))],
                "max_s": s[-1], "min_s": s[0]}

    return {"lb": stats(lb_lags), "feed": stats(feed_lags), "misses": misses}


def run(args: argparse.Namespace) -> dict[str, Any]:
    specs = [BackendSpec("b0", free_port(), 40.0, 16, 1.0), BackendSpec("b1", free_port(), 40.0, 16, 1.0)]
    overrides = dict(BENCH_WEIGHTS)
    overrides.update(json.loads(args.weights) if args.weights else {})
    doc: dict[str, Any] = {"weights_overrides": overrides, "agent_inter_ms": args.agent_inter_ms}
    with tempfile.TemporaryDirectory(prefix="triscope-feed-bench-") as tmp:
        workdir = Path(tmp)
        fleet = SimFleet(specs, 0.8).start()
        feed = None
        try:
            urls = {s.name: fleet.url(s) for s in specs}
            # the serving-process mode first, alone (its feed engine scrapes the same backends)
            feed = FeedWorker(urls, {**overrides, "feed": {"serve_process": True}}, 3.0).start()
            before = {"feed_process": wrk_feed(feed, args)} if int(feed.info.get("http_port", -1)) > 0 else {}
            feed.stop()
            feed = FeedWorker(urls, overrides, 3.0).start()
            doc["feed_impl"] = feed.info.get("feed", "")
            if int(feed.info.get("http_port", -1)) > 0:
                doc["throughput"] = throughput(feed, workdir, args, before)
            else:
                doc["throughput"] = {"skipped": "the feed has no HTTP endpoint (triscope.exporters.feed absent)"}
            servers = [Server(s.name, s.port) for s in specs]
            with HAProxy(workdir / "haproxy", servers, balance="leastconn", agent_port=feed.agent_port,
                         agent_inter_ms=args.agent_inter_ms) as hap:
                wait_port(hap.port)
                doc["lag"] = measure_lag(fleet, feed, hap, "b1", args.pressure, args.lag_trials)
        finally:
            if feed is not None:
                feed.stop()
            fleet.stop()
    return doc


def print_report(doc: dict[str, Any]) -> None:
    print(f"feed: {doc.get('feed_impl')}; engine overrides {doc['weights_overrides']}; "
          f"HAProxy agent-inter {doc['agent_inter_ms']} ms")
    tp = doc["throughput"]
    if "skipped" in tp:
        print(f"throughput: skipped ({tp['skipped']})")
    else:
        print(f"throughput (wrk, same connections/duration, {tp['body_bytes']} B JSON):")
        labels = [k for k in ("feed", "feed_process") if k in tp]
        for name in (*labels, "nginx"):
            r = tp[name]
            print(f"  {name:12s} {r['rps']:10.0f} req/s   p50 {r['p50_s'] * 1e3:7.2f} ms   "
                  f"p99 {r['p99_s'] * 1e3:7.2f} ms   errors {r['non_2xx'] + r['socket_errors']:.0f}")
        for name in labels:
            print(f"  {name}/nginx: throughput x{tp[f'rps_ratio_{name}_over_nginx']:.2f}, "
                  f"p99 x{tp[f'p99_ratio_{name}_over_nginx']:.2f}")
    lag = doc["lag"]
    for part, label in (("feed", "memory change -> /v1/weights change"),
                        ("lb", "memory change -> HAProxy weight change")):
        s = lag[part]
        if s.get("n"):
            print(f"lag {label}: median {s['median_s'] * 1e3:.0f} ms, p90 {s['p90_s'] * 1e3:.0f} ms, "
                  f"max {s['max_s'] * 1e3:.0f} ms (n={s['n']})")
    if lag["misses"]:
        print(f"  {lag['misses']} trial(s) saw no HAProxy weight change within the timeout")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="weight-feed throughput vs nginx and end-to-end LB lag")
    p.add_argument("--duration-s", type=float, default=8.0, help="wrk run per server")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--connections", type=int, default=32)
    p.add_argument("--lag-trials", type=int, default=10, help="pressure on/off transitions to time")
    p.add_argument("--pressure", type=float, default=0.9, help="memory ratio pinned in a lag trial")
    p.add_argument("--agent-inter-ms", type=int, default=250)
    p.add_argument("--weights", default="", help="JSON object of [weights] overrides")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    doc = run(args)
    if args.json:
        json.dump(doc, sys.stdout, indent=2, default=str)
        sys.stdout.write("\n")
    else:
        print_report(doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
