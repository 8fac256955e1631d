"""Closed-loop bench: simulated GPU backends behind real HAProxy, three balancing policies.

    .venv/bin/python bench/closed_loop.py            # default: 4 policies, one seed, ~3 min on 2 cores
    .venv/bin/python bench/closed_loop.py --repeat 4 # seeds 1-4 pooled (docs/closed_loop.md table), ~12 min
    .venv/bin/python bench/closed_loop.py --steps 8 --step-s 20   # longer
    .venv/bin/python bench/closed_loop.py --json --dump-results out.jsonl

N simulated vLLM-like backends (bench/sim_backend.py, heterogeneous KV capacity) sit behind one
HAProxy. The same seeded, bursty, multimodal arrival schedule (bench/loadgen.py; +30% QPS per
step) is replayed against four policies in turn:

* ``roundrobin``  - HAProxy ``balance roundrobin``, static equal weights;
* ``leastconn``   - HAProxy ``balance leastconn``, static equal weights;
* ``triscope``    - HAProxy ``balance leastconn`` (``--triscope-balance``) whose server weights
  come from triscope's feed over HAProxy's agent-check; the feed runs triscope's weight engine
  on live scrapes of the backends' ``/metrics`` (bench/metrics_adapter.py);
* ``triscope-classes`` - the same plus per-class admission: one HAProxy pool per request class
  whose servers ask the agent ``"NAME CLASS"``, and the feed closes a backend to a class from that
  class's ``admit_kv_ratio`` (``--class-admission``; videos first, then image-text, never speech
  before the backend drains).

It prints, per policy: peak QPS held (highest step, counted from the first, where every class
meets its P99 SLA and errors stay under ``--max-error``), P99 per class (of successes, and of all
offered requests with failures counted as infinitely slow), error, OOM and HAProxy-503 rates,
request share per backend, whether the feed had drained a backend before its 503s; then the
leastconn/triscope ratios, also over the requests that succeeded under both. HAProxy admission
control (``--maxconn-per-slot``, ``--timeout-queue-ms``, ``--class-priority``) is written the same
for every policy. See docs/closed_loop.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from haproxy_ctl import HAProxy, Server, free_port
from loadgen import LoadShape, Result, drive, percentile
from sim_backend import CLASSES, BackendSpec

from triscope.exporters.haproxy_gate import gate_limits
from triscope.exporters.weights import WeightParams

HERE = Path(__file__).resolve().parent
PYTHON = sys.executable

# Engine parameters for a feed that must follow sub-second bursts: faster updates and a short
# window (documented in docs/closed_loop.md; every key is a regular [weights] config key).
# Damping made symmetric (the default cuts fast and raises slowly, which ratchets every
# backend down to the floor under bursty load); values chosen by the runs in docs/closed_loop.md.
# 2026-12-03: interval 0.1 s (with agent-inter 100 ms) and the queue factor (queue_weight 1) cut
# errors in both pairings tried (docs/closed_loop.md, "Past saturation").
BENCH_WEIGHTS: dict[str, Any] = {
    "interval_s": 0.1,
    "queue_weight": 1.0,
    "window_s": 5.0,
    "stale_after_s": 5.0,
    "ewma_down": 0.3,
    "max_step_down": 0.2,
    "ewma_up": 0.3,
    "max_step_up": 0.2,
}


# HAProxy priority classes for --class-priority (lower leaves the queue first).
CLASS_PRIORITY = {"realtime_speech": -10, "interactive_image_text": 0, "offline_video": 10}

# --class-admission: KV usage at which a backend stops taking a class (triscope's admit_kv_ratio);
# speech has no limit of its own (it follows the backend's drain at drain_kv_ratio).
CLASS_ADMISSION = {"offline_video": 0.60, "interactive_image_text": 0.92}


@dataclass
class Policy:
    name: str
    balance: str
    triscope: bool = False
    class_pools: bool = False


@dataclass
class StepStats:
    step: int
    offered_qps: float
    requests: int
    error_rate: float
    oom_rate: float
    p99_s: dict[str, float]
    held: bool
    p99_all_s: dict[str, float] = field(default_factory=dict)


@dataclass
class PolicyReport:
    policy: str
    balance: str
    requests: int
    ok: int
    error_rate: float
    oom_rate: float
    timeout_rate: float
    p99_s: dict[str, float]
    sla_attainment: float
    peak_qps_held: float
    steps: list[StepStats]
    backend_share: dict[str, float]
    backend_oom: dict[str, int]
    backend_peak_kv: dict[str, float]
    weights_mean: dict[str, float]
    weights_min: dict[str, int]
    send_lag_s: float
    wall_s: float
    lb_reject_rate: float = 0.0
    p99_all_s: dict[str, float] = field(default_factory=dict)
    repetitions: int = 1
    drain_check: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)


# --------------------------------------------------------------------------- processes


def _http_json(url: str, method: str = "GET", timeout: float = 2.0) -> Any:
    req = urllib.request.Request(url, method=method, data=b"" if method == "POST" else None)
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def _read_ready(proc: subprocess.Popen, what: str, timeout_s: float = 30.0) -> dict[str, Any]:
    """Wait for the ``{"ready": ...}`` line a helper process prints on stdout."""
    assert proc.stdout is not None
    result: dict[str, Any] = {}

    def reader() -> None:
        for line in proc.stdout:  # type: ignore[union-attr]
            with contextlib.suppress(ValueError):
                doc = json.loads(line)
                if isinstance(doc, dict) and "ready" in doc:
                    result.update(doc)
                    return

    t = threading.Thread(target=reader, daemon=True)
    t.start()
    t.join(timeout_s)
    if not result:
        proc.kill()
        err = proc.stderr.read().decode(errors="replace")[-2000:] if proc.stderr else ""
        raise RuntimeError(f"{what} did not become ready: {err.strip()}")
    return result["ready"]


def _stop(proc: subprocess.Popen | None) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


class SimFleet:
    """The simulated backends, one subprocess serving all of them."""

    def __init__(self, specs: list[BackendSpec], batch_slowdown: float) -> None:
        self.specs = specs
        self.batch_slowdown = batch_slowdown
        self.proc: subprocess.Popen | None = None

    def start(self) -> SimFleet:
        cmd = [PYTHON, str(HERE / "sim_backend.py"), "--batch-slowdown", str(self.batch_slowdown)]
        for s in self.specs:
            cmd += ["--backend", s.to_arg()]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        _read_ready(self.proc, "simulated backends")
        return self

    def url(self, spec: BackendSpec) -> str:
        return f"http://127.0.0.1:{spec.port}"

    def reset(self) -> None:
        for s in self.specs:
            _http_json(self.url(s) + "/sim/reset", "POST")

    def states(self) -> dict[str, dict[str, Any]]:
        return {s.name: _http_json(self.url(s) + "/sim/state") for s in self.specs}

    def set_pressure(self, name: str, nbytes: int) -> None:
        spec = next(s for s in self.specs if s.name == name)
        _http_json(self.url(spec) + f"/sim/pressure?bytes={int(nbytes)}", "POST")

    def wait_idle(self, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if all(st["running"] + st["waiting"] == 0 for st in self.states().values()):
                return
            time.sleep(0.2)

    def stop(self) -> None:
        _stop(self.proc)
        self.proc = None


class FeedWorker:
    """triscope's weight feed in its own process, scraping the simulated backends."""

    def __init__(self, backends: dict[str, str], overrides: dict[str, Any], window_s: float) -> None:
        self.backends = backends
        self.overrides = overrides
        self.window_s = window_s
        self.proc: subprocess.Popen | None = None
        self.info: dict[str, Any] = {}

    def start(self) -> FeedWorker:
        cmd = [PYTHON, str(HERE / "closed_loop.py"), "--feed-worker",
               "--feed-backends", json.dumps(self.backends), "--weights", json.dumps(self.overrides),
               "--feed-window-s", str(self.window_s)]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self.info = _read_ready(self.proc, "triscope weight feed")
        return self

    @property
    def agent_port(self) -> int:
        return int(self.info["agent_port"])

    def weights_doc(self) -> dict[str, Any]:
        return _http_json(f"http://127.0.0.1:{self.info['http_port']}/v1/weights")

    def stop(self) -> None:
        _stop(self.proc)
        self.proc = None


# --------------------------------------------------------------------------- one policy


async def _sample_weights(hap: HAProxy, stop: asyncio.Event, out: list[tuple[float, dict[str, int]]],
                          feed: FeedWorker | None = None, feed_out: list | None = None,
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


async def _drive_with_sampler(hap: HAProxy, schedule, timeout_factor: float, feed: FeedWorker | None = None):
    samples: list[tuple[float, dict[str, int]]] = []
    feed_samples: list[tuple[float, dict[str, tuple]]] = []
    stop = asyncio.Event()
    sampler = asyncio.create_task(_sample_weights(hap, stop, samples, feed, feed_samples))
    try:
        results, lag = await drive("127.0.0.1", hap.port, schedule, timeout_factor=timeout_factor)
    finally:
        stop.set()
        await sampler
    return results, lag, samples, feed_samples


def is_oom(r: Result) -> bool:
    """A 503 from a backend (its KV pool was full); HAProxy's own 503s carry no X-Backend."""
    return r.status == 503 and bool(r.backend)


def is_lb_reject(r: Result) -> bool:
    """A 503 from HAProxy itself (``timeout queue`` expired, or no server usable)."""
    return r.status == 503 and not r.backend


def p99_all(results: list[Result], cls: str) -> float:
    """P99 over every offered request of ``cls``, a failed request counting as infinitely slow."""
    return percentile([r.latency_s if r.status == 200 else math.inf for r in results if r.cls == cls], 99)


def drain_check(results: list[Result], feed_samples: list[tuple[float, dict[str, tuple]]]) -> dict[str, Any]:
    """Did the feed drain a backend before it refused requests? Feed state at each backend 503."""
    if not feed_samples:
        return {}
    times = [t for t, _ in feed_samples]
    out = {"oom_while_drained": 0, "oom_while_ready": 0, "oom_no_sample": 0, "kv_at_oom": [],
           "drained_samples": {}, "max_kv_seen": {}}
    for _, doc in feed_samples:
        for b, (_w, state, kv) in doc.items():
            out["drained_samples"][b] = out["drained_samples"].get(b, 0) + (state == "drain")
            if kv is not None:
                out["max_kv_seen"][b] = round(max(out["max_kv_seen"].get(b, 0.0), kv), 3)
    import bisect

    for r in results:
        if not is_oom(r):
            continue
        k = bisect.bisect_right(times, r.t) - 1
        entry = feed_samples[k][1].get(r.backend) if k >= 0 else None
        if entry is None:
            out["oom_no_sample"] += 1
            continue
        out["oom_while_drained" if entry[1] == "drain" else "oom_while_ready"] += 1
        if entry[2] is not None:
            out["kv_at_oom"].append(entry[2])
    kv = out.pop("kv_at_oom")
    out["feed_kv_at_oom_sum"] = sum(kv)
    out["feed_samples"] = len(feed_samples)
    return out


@dataclass
class RawRun:
    """Everything one replay of the schedule under one policy produced."""

    results: list[Result]
    lag: float
    samples: list[tuple[float, dict[str, int]]]
    feed_samples: list[tuple[float, dict[str, tuple]]]
    states: dict[str, dict[str, Any]]
    wall: float
    feed_kind: str = ""


def summarize(policy: Policy, runs: list[RawRun], shape: LoadShape, max_error: float) -> PolicyReport:
    """Turn the raw results of one or more repetitions (pooled) into the policy's report."""
    results = [r for run in runs for r in run.results]
    samples = [s for run in runs for s in run.samples]
    n = len(results)
    ok = [r for r in results if r.status == 200]
    steps: list[StepStats] = []
    for k in range(shape.steps):
        rs = [r for r in results if r.step == k]
        p99 = {c: percentile([r.latency_s for r in rs if r.cls == c and r.status == 200], 99) for c in CLASSES}
        err = sum(r.status != 200 for r in rs) / len(rs) if rs else math.nan
        oom = sum(is_oom(r) for r in rs) / len(rs) if rs else math.nan
        held = bool(rs) and err <= max_error and all(
            math.isfinite(p99[c]) and p99[c] <= CLASSES[c].sla_s for c in CLASSES
            if any(r.cls == c for r in rs))
        steps.append(StepStats(k, round(shape.step_qps(k), 2), len(rs), err, oom, p99, held,
                               {c: p99_all(rs, c) for c in CLASSES}))
    peak = 0.0
    for s in steps:
        if not s.held:
            break
        peak = s.offered_qps
    served: dict[str, int] = {}
    for r in ok:
        served[r.backend] = served.get(r.backend, 0) + 1
    names = sorted(runs[0].states)
    w_mean = {b: (sum(w.get(b, 0) for _, w in samples) / len(samples)) if samples else math.nan for b in names}
    w_min = {b: min((w.get(b, 0) for _, w in samples), default=-1) for b in names}
    within = sum(1 for r in ok if r.latency_s <= CLASSES[r.cls].sla_s)
    drains = [drain_check(run.results, run.feed_samples) for run in runs]
    drain: dict[str, Any] = {}
    for d in drains:
        for key, value in d.items():
            if isinstance(value, int):
                drain[key] = drain.get(key, 0) + value
    if drains and drains[0]:
        kv_n = drain.get("oom_while_drained", 0) + drain.get("oom_while_ready", 0)
        kv_sum = sum(d.get("feed_kv_at_oom_sum", 0.0) for d in drains)
        drain["feed_kv_at_oom_mean"] = round(kv_sum / kv_n, 3) if kv_n else None
        drain["max_kv_seen"] = {b: max(d["max_kv_seen"].get(b, 0.0) for d in drains) for b in names}
        drain["drained_samples"] = {b: sum(d["drained_samples"].get(b, 0) for d in drains) for b in names}
    return PolicyReport(
        policy=policy.name, balance=policy.balance, requests=n, ok=len(ok),
        error_rate=(n - len(ok)) / n if n else math.nan,
        oom_rate=sum(is_oom(r) for r in results) / n if n else math.nan,
        timeout_rate=sum(r.status == 0 for r in results) / n if n else math.nan,
        p99_s={c: percentile([r.latency_s for r in ok if r.cls == c], 99) for c in CLASSES},
        sla_attainment=within / n if n else math.nan,
        peak_qps_held=peak, steps=steps,
        backend_share={b: served.get(b, 0) / len(ok) if ok else 0.0 for b in names},
        backend_oom={b: sum(sum(run.states[b]["oom"].values()) for run in runs) for b in names},
        backend_peak_kv={b: round(max(run.states[b]["peak_kv_ratio"] for run in runs), 3) for b in names},
        weights_mean={b: round(v, 1) for b, v in w_mean.items()}, weights_min=w_min,
        send_lag_s=max(run.lag for run in runs), wall_s=sum(run.wall for run in runs),
        lb_reject_rate=sum(is_lb_reject(r) for r in results) / n if n else math.nan,
        p99_all_s={c: p99_all(results, c) for c in CLASSES},
        repetitions=len(runs), drain_check=drain,
        extra={"error_rate_by_class": {c: _share(results, c, lambda r: r.status != 200) for c in CLASSES},
               "lb_reject_rate_by_class": {c: _share(results, c, is_lb_reject) for c in CLASSES}})


def _share(results: list[Result], cls: str, pred) -> float:
    """Share of the class's offered requests for which ``pred`` holds (NaN when none were offered)."""
    rs = [r for r in results if r.cls == cls]
    return sum(1 for r in rs if pred(r)) / len(rs) if rs else math.nan


def run_policy(policy: Policy, fleet: SimFleet, schedule, args: argparse.Namespace, workdir: Path) -> RawRun:
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


def weights_overrides(args: argparse.Namespace) -> dict[str, Any]:
    out = dict(BENCH_WEIGHTS)
    out.update(json.loads(args.weights) if args.weights else {})
    return out


# --------------------------------------------------------------------------- report


def _fmt_s(x: float) -> str:
    if not math.isfinite(x):
        return "-"
    return f"{x * 1000:.0f}ms" if x < 10 else f"{x:.1f}s"


def _fmt_inf(x: float) -> str:
    return "inf" if x == math.inf else _fmt_s(x)


def _ratio(a: float, b: float) -> float:
    """``a / b``; an infinite P99 (over 1 % failed) only compares against a finite one."""
    if math.isnan(a) or math.isnan(b) or (math.isinf(a) and math.isinf(b)):
        return math.nan
    if math.isinf(a):
        return math.inf
    if math.isinf(b):
        return 0.0
    if b == 0:
        return math.inf if a > 0 else 1.0
    return a / b


def common_success_p99(base: list[RawRun], cand: list[RawRun], step: int | None = None) -> dict[str, float]:
    """Per class P99 of each policy over the requests that succeeded under *both* (same arrivals)."""
    out: dict[str, float] = {}
    keyed = []
    for runs in (base, cand):
        keyed.append({(rep, r.idx): r for rep, run in enumerate(runs) for r in run.results
                      if r.status == 200 and (step is None or r.step == step)})
    both = keyed[0].keys() & keyed[1].keys()
    for c in CLASSES:
        for side, rows in zip(("baseline", "candidate"), keyed, strict=True):
            out[f"{side}:{c}"] = percentile([rows[k].latency_s for k in both if rows[k].cls == c], 99)
    return out


def comparison(reports: dict[str, PolicyReport], baseline: str = "leastconn",
               candidate: str = "triscope", raw: dict[str, list[RawRun]] | None = None) -> dict[str, Any]:
    """Baseline/candidate ratios (> 1 means the candidate is better)."""
    if baseline not in reports or candidate not in reports:
        return {}
    b, c = reports[baseline], reports[candidate]
    out = {
        "baseline": baseline, "candidate": candidate,
        "p99_ratio": {k: _ratio(b.p99_s[k], c.p99_s[k]) for k in CLASSES},
        "p99_all_ratio": {k: _ratio(b.p99_all_s[k], c.p99_all_s[k]) for k in CLASSES},
        "error_rate_ratio": _ratio(b.error_rate, c.error_rate),
        "peak_qps_ratio": _ratio(c.peak_qps_held, b.peak_qps_held),
        "sla_attainment_delta": c.sla_attainment - b.sla_attainment,
        "p99_ratio_by_step": [{k: _ratio(sb.p99_s[k], sc.p99_s[k]) for k in CLASSES}
                              for sb, sc in zip(b.steps, c.steps, strict=True)],
        "error_ratio_by_step": [_ratio(sb.error_rate, sc.error_rate) for sb, sc in zip(b.steps, c.steps, strict=True)],
    }
    if raw is not None and raw.get(baseline) and raw.get(candidate):
        cs = common_success_p99(raw[baseline], raw[candidate])
        out["p99_common_ratio"] = {k: _ratio(cs[f"baseline:{k}"], cs[f"candidate:{k}"]) for k in CLASSES}
        out["p99_common_s"] = cs
        by_step = [common_success_p99(raw[baseline], raw[candidate], k) for k in range(len(b.steps))]
        out["p99_common_ratio_by_step"] = [{k: _ratio(cs_k[f"baseline:{k}"], cs_k[f"candidate:{k}"])
                                            for k in CLASSES} for cs_k in by_step]
    return out


def print_report(reports: dict[str, PolicyReport], comps: list[dict[str, Any]], shape: LoadShape,
                 specs: list[BackendSpec]) -> None:
    from rich.console import Console
    from rich.table import Table

    con = Console(width=max(150, Console().width))
    con.print(f"backends: {', '.join(f'{s.name}({s.kv_gib:g}GiB KV, {s.slots} slots, x{s.speed:g})' for s in specs)}")
    con.print(f"load: {shape.steps} steps x {shape.step_s:g}s from {shape.base_qps:g} QPS, x{shape.step_factor:g}/step, "
              f"bursts x{shape.burst_factor:g} for {shape.burst_s:g}s every {shape.burst_period_s:g}s")
    t = Table(title="closed loop: per policy (P99 of successful requests [P99 of all offered, failures = inf]; "
                    "SLA speech 200ms / image 800ms / video 5s)")
    for col in ("policy", "peak QPS held", "P99 speech", "P99 image-text", "P99 video", "errors", "OOM 503",
                "LB 503", "timeouts", "within SLA"):
        t.add_column(col)
    for r in reports.values():
        t.add_row(f"{r.policy} ({r.balance})", f"{r.peak_qps_held:g}",
                  *[f"{_fmt_s(r.p99_s[c])} [{_fmt_inf(r.p99_all_s.get(c, math.nan))}]" for c in CLASSES],
                  f"{r.error_rate:.2%}", f"{r.oom_rate:.2%}", f"{r.lb_reject_rate:.2%}", f"{r.timeout_rate:.2%}",
                  f"{r.sla_attainment:.1%}")
    con.print(t)
    for r in reports.values():
        if r.drain_check:
            d = r.drain_check
            con.print(f"{r.policy} drain check: backend 503s while the feed had that backend drained "
                      f"{d.get('oom_while_drained', 0)}, ready {d.get('oom_while_ready', 0)} "
                      f"(feed KV at those 503s: mean {d.get('feed_kv_at_oom_mean')}); max KV seen by the feed "
                      f"{d.get('max_kv_seen')}; drained samples {d.get('drained_samples')}")
    for r in reports.values():
        e, lb = r.extra.get("error_rate_by_class", {}), r.extra.get("lb_reject_rate_by_class", {})
        con.print(f"{r.policy} errors by class (LB 503 part): " + ", ".join(
            f"{c} {e.get(c, math.nan):.2%} ({lb.get(c, math.nan):.2%})" for c in CLASSES))
    b = Table(title="per backend: share of served requests | OOM 503s | peak memory ratio | HAProxy weight mean (min)")
    b.add_column("policy")
    for spec in specs:
        b.add_column(f"{spec.name} ({spec.kv_gib:g}GiB)")
    for r in reports.values():
        b.add_row(r.policy, *[f"{r.backend_share.get(x.name, 0):.0%} | {r.backend_oom.get(x.name, 0)} | "
                              f"{r.backend_peak_kv.get(x.name, 0):.2f} | {r.weights_mean.get(x.name, 0):g} "
                              f"({r.weights_min.get(x.name, -1)})" for x in specs])
    con.print(b)
    s = Table(title="per step: errors | P99 speech/image/video (* = step held)")
    s.add_column("step QPS")
    for r in reports.values():
        s.add_column(r.policy)
    for k in range(shape.steps):
        row = [f"{shape.step_qps(k):.1f}"]
        for r in reports.values():
            st = r.steps[k]
            row.append(f"{'*' if st.held else ' '} {st.error_rate:.1%} | "
                       + "/".join(_fmt_s(st.p99_s[c]) for c in CLASSES))
        s.add_row(*row)
    con.print(s)
    for comp in comps:
        if not comp:
            continue
        p = comp["p99_ratio"]
        con.print(f"{comp['baseline']} / {comp['candidate']}: P99 speech x{p['realtime_speech']:.2f}, "
                  f"image-text x{p['interactive_image_text']:.2f}, video x{p['offline_video']:.2f}; "
                  f"errors x{comp['error_rate_ratio']:.2f}; peak QPS held x{comp['peak_qps_ratio']:.2f} "
                  f"(candidate/baseline); within-SLA {comp['sla_attainment_delta']:+.1%}")
        if "p99_common_ratio" in comp:
            q = comp["p99_common_ratio"]
            con.print(f"  over requests that succeeded under both: P99 x{q['realtime_speech']:.2f} / "
                      f"x{q['interactive_image_text']:.2f} / x{q['offline_video']:.2f}")
        common = comp.get("p99_common_ratio_by_step") or [None] * len(comp["p99_ratio_by_step"])
        for k, (pr, er, cr) in enumerate(zip(comp["p99_ratio_by_step"], comp["error_ratio_by_step"], common,
                                             strict=True)):
            line = (f"  step {shape.step_qps(k):6.1f} QPS: P99 x{pr['realtime_speech']:.2f} / "
                    f"x{pr['interactive_image_text']:.2f} / x{pr['offline_video']:.2f}, errors x{er:.2f}")
            if cr:
                line += (f"; common successes x{cr['realtime_speech']:.2f} / x{cr['interactive_image_text']:.2f}"
                         f" / x{cr['offline_video']:.2f}")
            con.print(line)
    lag = max(r.send_lag_s for r in reports.values())
    if lag > 0.05:
        con.print(f"[yellow]load generator fell up to {lag * 1000:.0f} ms behind schedule (CPU-bound machine)")


# --------------------------------------------------------------------------- main


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
        from metrics_adapter import run_feed_worker

        run_feed_worker(json.loads(args.feed_backends), weights_overrides(args), args.feed_window_s)
        return 0
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
