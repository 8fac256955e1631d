"""HAProxy agent-check bench: triscope's agent port against nginx answering the same line, same run.

    .venv/bin/python bench/agent.py [--backends 1000] [--clients 2] [--concurrency 32] [--duration-s 5]

triscope: a :class:`~triscope.exporters.feed.WeightFeed` over ``--backends`` backends (HTTP port
off, the engine updating every second), its agent port answering ``ready NN%`` per backend; measured
twice, the port served on the feed's own event loop (the default) and by a process of its own
(``[weights.feed] serve_process = true``). nginx: one worker, its stream module's
``return`` sending the same kind of answer to every connection; it does not read a line, so its
clients send none (the floor of a TCP answer: a stricter baseline than a server doing the agent's
work). The load: ``--clients`` processes, each keeping ``--concurrency`` checks in flight, a check
being what HAProxy does (connect, send a backend's name and a newline, read to the close), each
naming a backend at random. Printed: checks per second and latency percentiles of each, and
triscope / nginx. Needs nginx with its stream module (Debian: nginx + libnginx-mod-stream).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import multiprocessing
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from triscope.analyzers.routing import BackendInputs, WeightParams
from triscope.exporters.feed import WeightFeed
from triscope_bed.peers.nginx import STREAM_MODULE, Nginx


def _check_loop(port: int, names: list[str], concurrency: int, duration_s: float, seed: int,
                send: bool) -> list[float]:
    async def one(rng: random.Random, until: float, out: list[float]) -> None:
        while time.monotonic() < until:
            t0 = time.perf_counter()
            try:
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                if send:
                    writer.write(rng.choice(names).encode() + b"\n")
                data = await reader.read()
                writer.close()
                if data.startswith((b"ready", b"drain")):
                    out.append(time.perf_counter() - t0)
                else:
                    out.append(math.inf)
            except OSError:
                out.append(math.inf)

    async def main() -> list[float]:
        out: list[float] = []
        until = time.monotonic() + duration_s
        await asyncio.gather(*(one(random.Random(seed * 1000 + i), until, out) for i in range(concurrency)))
        return out

    try:
        import uvloop

        return uvloop.run(main())
    except ImportError:
        return asyncio.run(main())


def _worker(args: tuple[int, list[str], int, float, int, bool]) -> list[float]:
    return _check_loop(*args)


def load(port: int, names: list[str], clients: int, concurrency: int, duration_s: float,
         send: bool = True) -> dict[str, Any]:
    with multiprocessing.get_context("spawn").Pool(clients) as pool:
        parts = pool.map(_worker, [(port, names, concurrency, duration_s, i, send) for i in range(clients)])
    lat = sorted(x for part in parts for x in part)
    ok = [x for x in lat if math.isfinite(x)]
    q = statistics.quantiles(ok, n=100) if len(ok) >= 100 else [math.nan] * 99
    return {"checks": len(lat), "failed": len(lat) - len(ok), "checks_per_s": len(ok) / duration_s,
            "p50_s": q[49], "p99_s": q[98]}


def triscope_agent(n: int, process: bool = False) -> WeightFeed:
    now = time.time()
    inputs = [BackendInputs(f"b{i}", kv_cache_usage_ratio=(i % 10) / 10, address=f"10.0.{i // 250}.{i % 250}:8000",
                            sources={"serving": now}) for i in range(n)]

    def fresh() -> list[BackendInputs]:
        t = time.time()
        return [BackendInputs(**{**i.__dict__, "sources": {"serving": t}}) for i in inputs]

    params = WeightParams.from_config({"weights": {"interval_s": 1.0, "discover": False,
                                                   "feed": {"port": -1, "agent_port": 0, "max_connections": 4096,
                                                            "serve_process": process}}})
    return WeightFeed(params, inputs_fn=fresh).start()


def nginx_answering(prefix: Path, reply: str) -> Nginx:
    """nginx, one worker, answering every TCP connection with ``reply`` and closing it."""
    text = reply.replace("\n", "\\n")
    return Nginx(prefix, lambda port: f"""stream {{
    server {{
        listen 127.0.0.1:{port} backlog=1024;
        return "{text}";
    }}
}}""", modules=[STREAM_MODULE], worker_connections=4096)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backends", type=int, default=1000)
    p.add_argument("--clients", type=int, default=2, help="load processes")
    p.add_argument("--concurrency", type=int, default=32, help="checks in flight per process")
    p.add_argument("--duration-s", type=float, default=5.0)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    names = [f"b{i}" for i in range(args.backends)]
    ours = {}
    for mode, process in (("triscope", False), ("triscope_process", True)):
        feed = triscope_agent(args.backends, process)
        try:
            assert feed.result is not None
            ours[mode] = load(feed.agent_port, names, args.clients, args.concurrency, args.duration_s)
        finally:
            feed.close()
    with tempfile.TemporaryDirectory(prefix="agent-bench-") as tmp:
        nginx = nginx_answering(Path(tmp), "ready 100%\n").start()
        try:
            # nginx's return does not read: a line sent to a socket it already closed resets it, so its
            # clients send nothing (its side is the floor: accept, write, close)
            theirs = load(nginx.port, names, args.clients, args.concurrency, args.duration_s, send=False)
        finally:
            nginx.stop()
    doc: dict[str, Any] = {"backends": args.backends, "clients": args.clients, "concurrency": args.concurrency,
                           "duration_s": args.duration_s, **ours, "nginx": theirs}
    for mode, r in ours.items():
        suffix = mode.removeprefix("triscope")
        doc[f"throughput_ratio{suffix}"] = (r["checks_per_s"] / theirs["checks_per_s"]
                                            if theirs["checks_per_s"] else math.nan)
        doc[f"p99_ratio{suffix}"] = r["p99_s"] / theirs["p99_s"] if theirs["p99_s"] else math.nan
    if args.json:
        json.dump(doc, sys.stdout, indent=2)
        print()
        return 0
    print(f"{args.backends} backends, {args.clients} x {args.concurrency} checks in flight, {args.duration_s:g} s each")
    for name in (*ours, "nginx"):
        r = doc[name]
        print(f"  {name:16s} {r['checks_per_s']:9.0f} checks/s  p50 {r['p50_s'] * 1e3:6.2f} ms  "
              f"p99 {r['p99_s'] * 1e3:6.2f} ms  failed {r['failed']}")
    for mode in ours:
        suffix = mode.removeprefix("triscope")
        print(f"  {mode} / nginx: throughput x{doc['throughput_ratio' + suffix]:.2f}, "
              f"p99 x{doc['p99_ratio' + suffix]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
