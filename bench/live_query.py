"""Board queries through the daemon's query endpoint while the writer ingests: does either starve the other?

As in ``triscope run``: one process holds an embedded store seeded with an hour of a fleet's serving
metrics and request spans, the writer ingesting synthetic ``serving_metrics`` rows as fast as it takes
them (a producer submitting 20,000-row batches), and the query endpoint (``[query]``) serving N clients,
each a process of its own (clickhouse-connect, a general client parsing Native as Grafana's plugin does)
running every panel of the fleet and weights boards in a loop.
For N = 4 and 16 the writer ingests throughout while the clients alternate: idle, N clients querying, idle,
... (``--pairs`` loaded phases of ``--seconds``). Each loaded phase's rows/s is judged against the idle phases
either side: the idle writer's own rate moves by up to 2x over tens of seconds on a small machine (the
store grows and merges), and a drift slower than a phase weighs on both sides of a ratio alike. It prints the
ratios' median with a bootstrap 95 % interval, the same reckoning on idle phases alone (the method's noise
floor), the spool's depth and the query latency. Then the boards' queries' latency through the endpoint
against the same queries on the store opened directly (median ratio), from a client process of its own: the
CLI's (the served store of ``triscope/store/served.py``, the target's) and clickhouse-connect's, each with its
CPU per query.
``--client-nice 19`` runs the clients at the lowest priority: on a machine of two cores their own CPU
(an interpreter parsing every answer) otherwise weighs in the writer's figure, where a deployment's
Grafana runs elsewhere.

    .venv/bin/python bench/live_query.py [--pairs 10] [--seconds 6] [--client-nice 19] [--json]

Targets: writer >= 0.8x of idle at 4 concurrent queries (median; ``met`` says too whether the interval's
floor is); endpoint latency <= 1.3x direct (median).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import threading
import time
from datetime import UTC, datetime
from typing import Any

import numpy as np

from triscope.dashboards.boards import all_boards
from triscope.dashboards.macros import ALL, Context, Var, expand
from triscope.query_discovery import Endpoint
from triscope.query_endpoint import QueryConfig, QueryEndpoint
from triscope.schema import REQUESTS, SERVING_METRICS, migrate, qualified
from triscope.store.embedded import EmbeddedStore
from triscope.store.served import ServedStore
from triscope.store.server import ServerStore
from triscope.writer import Writer

BACKENDS = [f"10.0.{i // 256}.{i % 256}:8000" for i in range(64)]
HOUR_S = 3600
LOADED_LEVELS = (4, 16)
BACKLOG_CAP_ROWS = 1_000_000  # five of the writer's batches: it never waits for rows


def seed(store: EmbeddedStore, end_s: int) -> None:
    """An hour of 64 backends' scrapes (1 s) and 50 request spans a second."""
    rng = np.random.default_rng(7)
    n = HOUR_S * len(BACKENDS)
    ts = np.repeat(np.arange(end_s - HOUR_S, end_s, dtype=np.int64) * 10**9, len(BACKENDS))
    store.insert(qualified(store, SERVING_METRICS), {
        "ts": ts, "host": ["h"] * n, "backend": BACKENDS * HOUR_S, "server": ["vllm"] * n, "model": ["m"] * n,
        "queue_length": rng.poisson(3, n).astype(float), "running_requests": rng.poisson(8, n).astype(float),
        "kv_cache_usage_ratio": rng.uniform(0, 1, n), "requests_total": np.arange(n, dtype=float),
        "latency_p99_seconds": rng.gamma(2, 0.5, n)})
    m = HOUR_S * 50
    store.insert(qualified(store, REQUESTS), {
        "ts": np.sort(rng.integers((end_s - HOUR_S) * 10**9, end_s * 10**9, m)),
        "backend": [BACKENDS[i % len(BACKENDS)] for i in range(m)], "model": ["m"] * m,
        "request_class": ["interactive_image_text"] * m, "latency_seconds": rng.gamma(2, 0.4, m),
        "status": ["ok"] * m})
    for table in (SERVING_METRICS, REQUESTS):  # merged now, so no background merge runs under one measurement
        store.command(f"OPTIMIZE TABLE {qualified(store, table)} FINAL")


def board_queries(store: EmbeddedStore, start: datetime, end: datetime) -> list[str]:
    """Every panel's SQL of the fleet and weights boards, variables at All, over [start, end]."""
    out = []
    for name in ("fleet", "weights"):
        board = all_boards()[name]
        variables: dict[str, Var] = {}
        for v in board["templating"]["list"]:
            if v["type"] == "textbox":
                variables[v["name"]] = Var(store.database, [store.database], multi=False)
                continue
            sql = expand(v["query"]["rawSql"], Context(start, end, 10.0, variables))
            variables[v["name"]] = Var([ALL], [str(r[0]) for r in store.query(sql).rows] or [""], multi=v["multi"])
        for panel in board["panels"]:
            for target in panel.get("targets", []):
                if "rawSql" in target:
                    out.append(expand(target["rawSql"], Context(start, end, 10.0, variables)))
    return out


class Producer(threading.Thread):
    """Submits 20,000-row serving_metrics batches as fast as the writer takes them (its backlog held at a cap)."""

    def __init__(self, writer: Writer, start_s: int) -> None:
        super().__init__(daemon=True)
        self.writer, self.t = writer, start_s * 10**9
        self.stop = threading.Event()

    def run(self) -> None:
        n = 20_000
        while not self.stop.is_set():
            if self.writer.snapshot()["rows_pending"] >= BACKLOG_CAP_ROWS:
                time.sleep(0.005)  # the writer stays saturated while the spool stays bounded
                continue
            ts = self.t + np.arange(n, dtype=np.int64)
            self.t += n
            # encode_ts's text, vectorized: a per-row Python call would make this producer, not the writer,
            # the bottleneck (63 ms of one core per batch against 15 ms)
            stamps = np.char.replace(np.datetime_as_string(ts.astype("datetime64[ns]"), unit="ns"), "T", " ")
            self.writer.submit(SERVING_METRICS, {"ts": stamps.tolist(), "backend": ["w:1"] * n,
                                                 "kv_cache_usage_ratio": [0.5] * n})


def _gated_client(url: str, database: str, username: str, token: str, queries: list[str], go: Any, stop: Any,
                  out: Any, nice: int = 0) -> None:
    """One dashboard client in a process of its own (as Grafana or the CLI are): board queries in a loop while
    ``go`` is set, idle while it is clear, until ``stop``; its interpreter and connection stay up in between, so
    a loaded phase starts at once."""
    if nice:
        os.nice(nice)
    remote = ServerStore(url, database=database, username=username, password=token, create_database=False)
    remote.query("SELECT 1")
    out.put(None)
    latencies: list[float] = []
    cpu0 = time.process_time()
    try:
        while not stop.is_set():
            if not go.wait(0.1):
                continue
            for sql in queries:
                if not go.is_set():
                    break
                t0 = time.perf_counter()
                remote.query(sql)
                latencies.append(time.perf_counter() - t0)
    finally:
        remote.close()
        out.put((latencies, time.process_time() - cpu0))


def _phase(writer: Writer, seconds: float) -> dict[str, Any]:
    """The writer's rows/s, the spool's depth and this process's CPU over ``seconds``."""
    before = writer.snapshot()["rows_written"]
    cpu0 = _cpu_s()
    t0 = time.monotonic()
    depth = []
    while time.monotonic() - t0 < seconds:
        time.sleep(0.25)
        depth.append(writer.snapshot()["rows_pending"])
    elapsed = time.monotonic() - t0
    return {"writer_rows_per_s": round((writer.snapshot()["rows_written"] - before) / elapsed),
            "spool_rows_max": max(depth or [0]), "daemon_cpu_cores": round((_cpu_s() - cpu0) / elapsed, 3)}


def alternate(store: EmbeddedStore, writer: Writer, endpoint: QueryEndpoint, queries: list[str], clients: int,
              pairs: int, seconds: float, client_nice: int = 0) -> dict[str, Any]:
    """The writer, ingesting throughout, in ``2 * pairs + 1`` phases of ``seconds``: idle, ``clients`` board
    clients, idle, ... idle. Each loaded phase is judged against the mean of the idle phases either side, so a
    drift slower than a phase (the store's growth, its merges, the host) weighs on both sides of a ratio alike;
    the ratios' median comes with a bootstrap 95 % interval. The same reckoning on idle phases alone (each
    against the idle phases two steps either side) gives the method's own spread: the noise floor."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    go, stop, results = ctx.Event(), ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_gated_client, args=(endpoint.url, store.database, endpoint.username,
                                                     endpoint.token, queries, go, stop, results, client_nice),
                         daemon=True) for _ in range(clients)]
    for proc in procs:
        proc.start()
    for _ in procs:
        results.get(timeout=120)  # connected
    producer = Producer(writer, int(time.time()) + 10 * HOUR_S)
    producer.start()
    time.sleep(2.0)  # the writer reaches its steady backlog before the first phase
    phases = []
    try:
        for i in range(2 * pairs + 1):
            loaded = i % 2 == 1
            (go.set if loaded else go.clear)()
            time.sleep(0.5)  # the queries in flight when a phase turns finish outside it
            phases.append({"clients": clients if loaded else 0, **_phase(writer, seconds)})
    finally:
        go.clear()
        stop.set()
        producer.stop.set()
    latencies: list[float] = []
    client_cpu = 0.0
    for _ in procs:
        got, cpu = results.get(timeout=120)
        latencies += got
        client_cpu += cpu
    for proc in procs:
        proc.join(timeout=60)
    producer.join(timeout=60)
    writer.flush(timeout_s=300)
    rates = [ph["writer_rows_per_s"] for ph in phases]
    ratios = [rates[i] / max(1.0, (rates[i - 1] + rates[i + 1]) / 2) for i in range(1, len(rates), 2)]
    floor = [rates[i] / max(1.0, (rates[i - 2] + rates[i + 2]) / 2) for i in range(2, len(rates) - 2, 2)]
    loaded_phases = phases[1::2]
    return {"clients": clients, "pairs": pairs, "phase_seconds": seconds,
            "writer_ratio_median": round(statistics.median(ratios), 3),
            "writer_ratio_ci95": bootstrap_median_ci(ratios),
            "writer_ratio_mean": round(statistics.fmean(ratios), 3),
            "noise_floor_median": round(statistics.median(floor), 3) if floor else None,
            "noise_floor_ci95": bootstrap_median_ci(floor) if len(floor) > 1 else None,
            "idle_rows_per_s_median": round(statistics.median(rates[0::2])),
            "loaded_rows_per_s_median": round(statistics.median(rates[1::2])),
            "spool_rows_max_loaded": max(ph["spool_rows_max"] for ph in loaded_phases),
            "spool_rows_max_idle": max(ph["spool_rows_max"] for ph in phases[0::2]),
            "daemon_cpu_cores_idle": round(statistics.median(ph["daemon_cpu_cores"] for ph in phases[0::2]), 3),
            "daemon_cpu_cores_loaded": round(statistics.median(ph["daemon_cpu_cores"] for ph in loaded_phases), 3),
            "queries": len(latencies),
            "query_median_ms": round(1000 * statistics.median(latencies), 2) if latencies else None,
            "client_cpu_ms_per_query": round(1000 * client_cpu / len(latencies), 3) if latencies else None,
            "ratios": [round(r, 3) for r in ratios], "phases": phases}


def bootstrap_median_ci(values: list[float], draws: int = 4000, seed: int = 1) -> list[float]:
    """The 2.5 and 97.5 percentiles of the median over ``draws`` resamples of ``values``."""
    rng = np.random.default_rng(seed)
    arr = np.asarray(values, dtype=float)
    medians = np.median(rng.choice(arr, size=(draws, arr.size), replace=True), axis=1)
    return [round(float(np.quantile(medians, 0.025)), 3), round(float(np.quantile(medians, 0.975)), 3)]


def _open(client: str, endpoint: Endpoint) -> ServedStore | ServerStore:
    if client == "triscope":
        return ServedStore(endpoint)
    return ServerStore(endpoint.url, database=endpoint.database, username=endpoint.username,
                       password=endpoint.token, create_database=False)


def _served_passes(client: str, endpoint: Endpoint, queries: list[str], asks: Any, out: Any) -> None:
    """Passes over ``queries`` through the endpoint, one per ``asks`` message until None, from a process of
    its own (a client's parsing must not share the endpoint's interpreter, as Grafana or the CLI do not):
    each pass's per-query seconds and the client's CPU seconds for it."""
    remote = _open(client, endpoint)
    _pass(remote, queries)  # the client's connection opens, and the daemon's query threads warm up
    out.put(None)
    while asks.get() is not None:
        cpu0 = time.process_time()
        times = _pass(remote, queries)
        out.put((times, time.process_time() - cpu0))
    remote.close()


def _pass(store: Any, queries: list[str]) -> list[float]:
    """Seconds of each query, once, on ``store`` (direct or through the endpoint)."""
    times = []
    for sql in queries:
        t0 = time.perf_counter()
        store.query(sql)
        times.append(time.perf_counter() - t0)
    return times


def _cpu_s() -> float:
    """This process's CPU seconds (user + system, every thread: the engine's, the endpoint's, the writer's)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _endpoint(store: EmbeddedStore, endpoint: QueryEndpoint) -> Endpoint:
    return Endpoint(os.getpid(), endpoint.cfg.bind, endpoint.port, store.path, store.database, endpoint.username,
                    endpoint.token)


def latency_ratio(store: EmbeddedStore, endpoint: QueryEndpoint, queries: list[str], rounds: int = 5,
                  client: str = "triscope") -> dict[str, Any]:
    """Per query: median over ``rounds`` through the endpoint (from a client process) / the same directly
    (in the store's process), idle writer; served and direct passes alternate, so other load on the machine
    weighs on both alike. With the CPU each costs per query (the daemon's process and the client's; directly
    the store's process)."""
    import multiprocessing as mp

    for _ in range(4):  # both ways meet a warm engine (it compiles an expression seen thrice: 5x the CPU)
        _pass(store, queries)
    ctx = mp.get_context("spawn")
    asks, results = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_served_passes, args=(client, _endpoint(store, endpoint), queries, asks, results),
                       daemon=True)
    proc.start()
    results.get(timeout=300)  # connected and warm
    served: list[list[float]] = []
    direct: list[list[float]] = []
    server_cpu = client_cpu = direct_cpu = 0.0
    for _ in range(rounds):
        cpu0 = _cpu_s()
        asks.put(True)
        times, cpu = results.get(timeout=600)
        server_cpu += _cpu_s() - cpu0
        served.append(times)
        client_cpu += cpu
        cpu0 = _cpu_s()
        direct.append(_pass(store, queries))
        direct_cpu += _cpu_s() - cpu0
    asks.put(None)
    proc.join(timeout=60)
    served_med = [statistics.median(t) for t in zip(*served, strict=True)]
    direct_med = [statistics.median(t) for t in zip(*direct, strict=True)]
    n = len(queries) * rounds
    ratios = [s_ / d for s_, d in zip(served_med, direct_med, strict=True)]
    return {"client": client, "queries": len(queries), "rounds": rounds,
            "median_ratio": round(statistics.median(ratios), 3),
            "p90_ratio": round(float(np.quantile(ratios, 0.9)), 3),
            "direct_median_ms": round(1000 * statistics.median(direct_med), 3),
            "served_median_ms": round(1000 * statistics.median(served_med), 3),
            "overhead_median_ms": round(1000 * statistics.median(s_ - d for s_, d in zip(served_med, direct_med,
                                                                                         strict=True)), 3),
            "direct_cpu_ms_per_query": round(1000 * direct_cpu / n, 3),
            "served_daemon_cpu_ms_per_query": round(1000 * server_cpu / n, 3),
            "served_client_cpu_ms_per_query": round(1000 * client_cpu / n, 3)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=6.0, help="per phase (idle or loaded)")
    p.add_argument("--pairs", type=int, default=10, help="loaded phases per client count, each between idle ones")
    p.add_argument("--max-concurrent", type=int, default=0, help="[query] max_concurrent (0: its default)")
    p.add_argument("--client-nice", type=int, default=0,
                   help="niceness of the client processes (19: they stand for a Grafana on another machine, whose "
                        "CPU is not the daemon's)")
    p.add_argument("--max-threads", type=int, default=-1, help="[query] max_threads (-1: its default)")
    p.add_argument("--thread-nice", type=int, default=-1, help="[query] thread_nice (-1: its default)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        store = EmbeddedStore(f"{tmp}/store")
        migrate(store)
        end_s = int(time.time())
        seed(store, end_s)
        queries = board_queries(store, datetime.fromtimestamp(end_s - HOUR_S, UTC), datetime.fromtimestamp(end_s, UTC))
        writer = Writer(store, f"{tmp}/spool", flush_interval_s=0.5)
        writer.start()
        query_cfg: dict[str, Any] = {"port": 0}
        if args.max_concurrent:
            query_cfg["max_concurrent"] = args.max_concurrent
        if args.max_threads >= 0:
            query_cfg["max_threads"] = args.max_threads
        if args.thread_nice >= 0:
            query_cfg["thread_nice"] = args.thread_nice
        endpoint = QueryEndpoint(store, QueryConfig.from_config({"query": query_cfg})).start()
        try:
            fixed = latency_ratio(store, endpoint, ["SELECT 1"] * 20, rounds=20)
            latency = latency_ratio(store, endpoint, queries)
            general = latency_ratio(store, endpoint, queries, client="clickhouse-connect")
            levels = [alternate(store, writer, endpoint, queries, n, args.pairs, args.seconds, args.client_nice)
                      for n in LOADED_LEVELS]
            writer_stats = {k: writer.snapshot()[k] for k in ("rows_written", "rows_dropped", "rows_rejected")}
        finally:
            endpoint.close()
            writer.close(timeout_s=120)
            store.close()
    loaded = {lv["clients"]: lv for lv in levels}
    doc = {"board_queries": len(queries), "client_nice": args.client_nice, "query_config": query_cfg,
           "levels": levels, "writer": writer_stats, "endpoint_latency": latency,
           "endpoint_latency_clickhouse_connect": general, "select_1": fixed,
           "targets": {"writer_ratio_at_4": 0.8, "latency_median_ratio": 1.3},
           "met": {"writer_ratio_at_4": loaded[4]["writer_ratio_median"] >= 0.8,
                   "writer_ratio_at_4_interval": loaded[4]["writer_ratio_ci95"][0] >= 0.8,
                   "latency_median_ratio": latency["median_ratio"] <= 1.3}}
    if args.json:
        print(json.dumps(doc, indent=2))
        return 0
    print(f"{len(queries)} board queries (fleet and weights boards, one hour of 64 backends)")
    print(f"writer rows/s, {args.pairs} loaded phases of {args.seconds:g} s per client count, each between idle ones")
    print("clients  idle rows/s  loaded rows/s  x idle either side [95 %]  noise floor [95 %]  spool max  "
          "queries  query median ms  daemon CPU idle/loaded")
    for lv in levels:
        ci, fl, flci = lv["writer_ratio_ci95"], lv["noise_floor_median"], lv["noise_floor_ci95"] or ["-", "-"]
        print(f"{lv['clients']:>7}  {lv['idle_rows_per_s_median']:>11,}  {lv['loaded_rows_per_s_median']:>13,}  "
              f"{lv['writer_ratio_median']:>9.3f} [{ci[0]:.3f}, {ci[1]:.3f}]  {fl!s:>8} [{flci[0]}, {flci[1]}]  "
              f"{lv['spool_rows_max_loaded']:>9,}  {lv['queries']:>7}  {lv['query_median_ms']!s:>15}  "
              f"{lv['daemon_cpu_cores_idle']}/{lv['daemon_cpu_cores_loaded']}")
    print(f"writer: {writer_stats['rows_written']:,} rows written, {writer_stats['rows_dropped']:,} dropped, "
          f"{writer_stats['rows_rejected']:,} rejected")
    for name, lat in (("board queries", latency), ("board queries, clickhouse-connect", general),
                      ("SELECT 1", fixed)):
        print(f"{name}: endpoint / direct latency median {lat['median_ratio']:.2f}x (p90 {lat['p90_ratio']:.2f}x), "
              f"{lat['served_median_ms']} / {lat['direct_median_ms']} ms; CPU ms per query: direct "
              f"{lat['direct_cpu_ms_per_query']}, served {lat['served_daemon_cpu_ms_per_query']} (daemon) + "
              f"{lat['served_client_cpu_ms_per_query']} (client)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
