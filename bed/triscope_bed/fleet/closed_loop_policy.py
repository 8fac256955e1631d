"""One closed-loop run: a policy's HAProxy (and triscope feed) in front of the simulated backends."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import time
from pathlib import Path
from typing import Any

from triscope.analyzers.routing import WeightParams
from triscope.exporters.haproxy_gate import gate_limits
from triscope_bed.engines.backend import BackendSpec
from triscope_bed.fleet.bench_fleet import BENCH_WEIGHTS, FeedWorker, SimFleet
from triscope_bed.peers.haproxy import HAProxy, Server
from triscope_bed.reports.closed_loop_stats import FeedSample, Policy, RawRun
from triscope_bed.workloads.arrivals import Arrival
from triscope_bed.workloads.driver import Result, drive

WeightSample = tuple[float, dict[str, int]]

# HAProxy priority classes for --class-priority (lower leaves the queue first).
CLASS_PRIORITY = {"realtime_speech": -10, "interactive_image_text": 0, "offline_video": 10}

# --class-admission: KV usage at which a backend stops taking a class (triscope's admit_kv_ratio);
# speech has no limit of its own (it follows the backend's drain at drain_kv_ratio).
CLASS_ADMISSION = {"offline_video": 0.60, "interactive_image_text": 0.92}


async def _sample_weights(hap: HAProxy, stop: asyncio.Event, out: list[WeightSample],
                          feed: FeedWorker | None = None, feed_out: list[tuple[float, FeedSample]] | None = None,
                          period_s: float = 0.5) -> None:
    """Every ``period_s``: HAProxy's effective weights and, for triscope, the feed's verdicts."""
    loop = asyncio.get_running_loop()
    t0 = time.monotonic()
    while not stop.is_set():
        with contextlib.suppress(OSError, ValueError):
            w = await loop.run_in_executor(None, hap.weights)
            out.append((time.monotonic() - t0, w))
        if feed is not None and feed_out is not None:
            with contextlib.suppress(OSError, ValueError, KeyError):
                doc = await loop.run_in_executor(None, feed.weights_doc)
                feed_out.append((time.monotonic() - t0, {
                    b: (v["lb_weight"], v["state"], v["inputs"].get("kv_cache_usage_ratio"))
                    for b, v in doc["backends"].items()}))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), period_s)


async def _drive_with_sampler(hap: HAProxy, schedule: list[Arrival], timeout_factor: float,
                              feed: FeedWorker | None = None
                              ) -> tuple[list[Result], float, list[WeightSample], list[tuple[float, FeedSample]]]:
    samples: list[WeightSample] = []
    feed_samples: list[tuple[float, FeedSample]] = []
    stop = asyncio.Event()
    sampler = asyncio.create_task(_sample_weights(hap, stop, samples, feed, feed_samples))
    try:
        results, lag = await drive("127.0.0.1", hap.port, schedule, timeout_factor=timeout_factor)
    finally:
        stop.set()
        await sampler
    return results, lag, samples, feed_samples


def run_policy(policy: Policy, fleet: SimFleet, schedule: list[Arrival], args: argparse.Namespace,
               workdir: Path) -> RawRun:
    """Replay ``schedule`` through HAProxy under ``policy``."""
    fleet.wait_idle()
    fleet.reset()
    for name, ratio in parse_pressure(args.pressure).items():
        spec = next(x for x in fleet.specs if x.name == name)
        fleet.set_pressure(name, int(ratio * spec.kv_gib * 1024**3))
    feed: FeedWorker | None = None
    t0 = time.monotonic()
    try:
        agent_port = None
        gate: dict[str, dict[str, float]] = {}
        if policy.triscope:
            overrides = weights_overrides(args)
            if args.agent_maxconn:
                set_per_backend(overrides, "max_inflight",
                                {s.name: server_maxconn(s, args.maxconn_per_slot) for s in fleet.specs})
            if policy.class_pools:
                classes = {k: dict(v) for k, v in overrides.get("classes", {}).items()}
                for cls, ratio in args.class_admission.items():
                    classes.setdefault(cls, {})["admit_kv_ratio"] = ratio
                for cls, ratio in args.class_batch_admission.items():
                    classes.setdefault(cls, {})["admit_batch_ratio"] = ratio
                overrides["classes"] = classes
                if args.class_batch_admission:  # the engine's max_num_seqs: the sim's batch slots
                    set_per_backend(overrides, "max_num_seqs", {s.name: s.slots for s in fleet.specs})
                if args.class_lb_gate:  # the feed's own class limits, applied by HAProxy per request
                    gate = gate_limits(WeightParams.from_config({"weights": overrides}))
            feed = FeedWorker({s.name: fleet.url(s) for s in fleet.specs}, overrides, args.feed_window_s).start()
            agent_port = feed.agent_port
        pools = list(CLASS_PRIORITY) if policy.class_pools else []
        most_slots = max(s.slots for s in fleet.specs)
        servers = [Server(s.name, s.port, maxconn=server_maxconn(s, args.maxconn_per_slot),
                          weight=max(1, round(100 * s.slots / most_slots)) if args.capacity_weights else 100)
                   for s in fleet.specs]
        pool_caps = ({c: {s.name: server_maxconn(s, per_slot) for s in fleet.specs}
                      for c, per_slot in args.class_maxconn.items()} if policy.class_pools else {})
        pool_queue = ({c: int(ms) for c, ms in args.class_timeout_queue_ms.items()} if policy.class_pools else {})
        with HAProxy(workdir / policy.name, servers, balance=policy.balance, agent_port=agent_port,
                     agent_inter_ms=args.agent_inter_ms, timeout_queue_ms=args.timeout_queue_ms,
                     queue_priority=CLASS_PRIORITY if args.class_priority else None, class_pools=pools,
                     pool_maxconn=pool_caps, pool_timeout_queue_ms=pool_queue, class_gate=gate) as hap:
            if policy.triscope:
                time.sleep(max(0.5, 3 * args.agent_inter_ms / 1000))
            results, lag, samples, feed_samples = asyncio.run(
                _drive_with_sampler(hap, schedule, args.timeout_factor, feed))
        fleet.wait_idle()
        states = fleet.states()
    finally:
        if feed is not None:
            feed.stop()
    return RawRun(results, lag, samples, feed_samples, states, time.monotonic() - t0,
                  feed.info.get("feed", "") if feed is not None else "")


def set_per_backend(overrides: dict[str, Any], key: str, values: dict[str, Any]) -> None:
    """Set ``[weights.backends.NAME] key`` for each backend in ``overrides`` (copied, not shared)."""
    backends = {k: dict(v) for k, v in overrides.get("backends", {}).items()}
    for name, value in values.items():
        backends.setdefault(name, {})[key] = value
    overrides["backends"] = backends


def server_maxconn(spec: BackendSpec, per_slot: float) -> int:
    """HAProxy ``maxconn`` of a server: ``per_slot`` x its batch slots (0 = unlimited)."""
    return max(1, math.ceil(per_slot * spec.slots)) if per_slot > 0 else 0


def parse_pressure(items: list[str]) -> dict[str, float]:
    """``NAME=RATIO`` items (memory pinned on a backend for the whole run, 0..1 of its KV pool)."""
    out = {}
    for item in items:
        name, sep, ratio = item.partition("=")
        if not sep:
            raise SystemExit(f"--pressure {item!r}: expected NAME=RATIO")
        out[name] = min(1.0, max(0.0, float(ratio)))
    return out


def weights_overrides(args: argparse.Namespace) -> dict[str, Any]:
    out = dict(BENCH_WEIGHTS)
    out.update(json.loads(args.weights) if args.weights else {})
    return out


