"""The fleets, the load and the faults of ``bench/incidents.py`` (fault injection with ground truth).

A :class:`Fault` is a name, the cause ``diagnose`` should give, which backends it hits (one victim or the
whole fleet) and an ``inject(bed, victim)`` that returns its ``recover()``. :data:`FAULTS` is the registry:
:func:`register` adds one, so a fault this module does not know plugs in with a few lines. The bed
(:class:`Bed`) is what a fault may touch: the fleet's backends and processes, and the load generator.

Two fleets: ``sim`` (``triscope.sim.backend`` engines with the calibrated vLLM-CPU profile, one process
each; the load generator sends each request's OpenTelemetry span to the daemon like a gateway) and
``vllm`` (real vLLM-CPU engines, each on its own core, sending their own spans). The load is open-loop
(Poisson arrivals) with the three request classes of the vLLM test bed.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from triscope.sim.bench_fleet import read_ready
from triscope.sim.calibration import PROFILES
from triscope.sim.haproxy import free_port
from triscope.sim.incident_score import Sent
from triscope.sim.procs import stop_process
from triscope.sim.vllm_cpu import SERVED_MODEL, ServerOptions, VllmInstall, VllmServer, make_tiny_model
from triscope.sim.vllm_load import CLASSES, RequestClass, send

MIX = {"realtime_speech": 0.5, "interactive_image_text": 0.35, "offline_video": 0.15}
"""Share of each request class in the load (the routing classes of docs/weights.md)."""
LONG_PROMPT = RequestClass("offline_video", "long-document", text_tokens=420, media_tokens=0, output_tokens=64)
"""A long prompt that still fits ``--max-model-len 512``: four of them fill a 1,024-token KV cache twice over."""
KV_TOKENS = 1024
SLOTS = 8

Recover = Callable[[], None]


# ---------------------------------------------------------------- the fleets


@dataclass
class Engine:
    name: str
    port: int
    core: int | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"


# The simulated engine's launcher: SIGUSR1 makes the engine itself grow its memory (a leak in the engine
# process: 32 MiB every 0.25 s, touched so it is resident, up to GROW_MIB), SIGUSR2 frees it; then the
# simulator's own main.
GROW_MIB = int(os.environ.get("TRISCOPE_BENCH_GROW_MIB", "1024"))
_SIM_LAUNCHER = r"""
import signal, sys, threading, time
held, growing = [], threading.Event()
def leak():
    while growing.is_set() and len(held) < int(sys.argv[1]) // 32:
        b = bytearray(32 << 20)
        for i in range(0, len(b), 4096):
            b[i] = 1
        held.append(b)
        time.sleep(0.25)
def grow(*_):
    growing.set()
    threading.Thread(target=leak, daemon=True).start()
def shrink(*_):
    growing.clear()
    held.clear()
signal.signal(signal.SIGUSR1, grow)
signal.signal(signal.SIGUSR2, shrink)
from triscope.sim.backend import main
sys.exit(main(sys.argv[2:]))
"""
_ALLOCATOR = f"""
import time
held = []
for _ in range({GROW_MIB} // 32):  # 32 MiB every 0.25 s, touched so it is resident, then held
    b = bytearray(32 << 20)
    for i in range(0, len(b), 4096):
        b[i] = 1
    held.append(b)
    time.sleep(0.25)
time.sleep(900)
"""


class Fleet:
    """What the bench and the faults need of a fleet."""

    kind = ""
    spans_from_client = False
    """True: the engines send no spans; the load generator sends one per request (as a gateway would)."""

    def __init__(self, n: int, workdir: Path) -> None:
        self.engines = [Engine(f"b{i}", free_port()) for i in range(n)]
        self.workdir = workdir

    def by_address(self, address: str) -> Engine:
        return next(e for e in self.engines if e.address == address)

    def start(self, otlp_url: str) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def pids(self, e: Engine) -> list[int]:
        """The engine's top process (its descendants are the engine too)."""
        raise NotImplementedError

    def restart(self, e: Engine) -> None:
        raise NotImplementedError

    def alive(self, e: Engine) -> bool:
        raise NotImplementedError

    def request(self, e: Engine, cls: RequestClass, rng: random.Random) -> tuple[bool, str]:
        raise NotImplementedError

    def grow_memory(self, e: Engine) -> Recover:
        """A process in the engine's process tree (or cgroup) allocating memory; returns its end."""
        raise NotImplementedError


class SimFleet(Fleet):
    kind = "sim"
    spans_from_client = True

    def __init__(self, n: int, workdir: Path, profile: str = "vllm-cpu") -> None:
        super().__init__(n, workdir)
        self.profile = profile
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def _start_one(self, e: Engine) -> None:
        spec = f"{e.name}:{e.port}:{KV_TOKENS / 1024}:{SLOTS}:1.0"
        proc = subprocess.Popen([sys.executable, "-c", _SIM_LAUNCHER, str(GROW_MIB), "--profile", self.profile,
                                 "--backend", spec], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        read_ready(proc, f"simulated engine {e.name}")
        self.procs[e.name] = proc

    def start(self, otlp_url: str) -> None:
        for e in self.engines:
            self._start_one(e)

    def stop(self) -> None:
        for name, proc in list(self.procs.items()):
            # a stopped engine must be continued to hear its SIGTERM
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGCONT)
                os.kill(proc.pid, signal.SIGUSR2)
            stop_process(proc)
            self.procs.pop(name, None)

    def pids(self, e: Engine) -> list[int]:
        proc = self.procs.get(e.name)
        return [proc.pid] if proc is not None and proc.poll() is None else []

    def alive(self, e: Engine) -> bool:
        return bool(self.pids(e))

    def restart(self, e: Engine) -> None:
        old = self.procs.pop(e.name, None)
        if old is not None:
            stop_process(old)
        self._start_one(e)

    def request(self, e: Engine, cls: RequestClass, rng: random.Random) -> tuple[bool, str]:
        body = {"model": SERVED_MODEL, "request_class": cls.name, "prompt_tokens": cls.prompt_tokens,
                "max_tokens": cls.output_tokens}
        conn = http.client.HTTPConnection("127.0.0.1", e.port, timeout=30)
        try:
            conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
            resp = conn.getresponse()
            data = resp.read(1 << 16)
            return resp.status == 200, "" if resp.status == 200 else f"HTTP {resp.status}: {data[:200]!r}"
        except (OSError, http.client.HTTPException) as exc:
            return False, str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        finally:
            conn.close()

    def grow_memory(self, e: Engine) -> Recover:
        """The engine process itself leaks, inside a memory cgroup of its own."""
        (pid,) = self.pids(e)

        def start() -> Recover:
            os.kill(pid, signal.SIGUSR1)

            def stop() -> None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGUSR2)
            return stop

        end = cgroup_memory_growth([pid], e.name, start)

        def recover() -> None:
            end()
            if not self.alive(e):  # the OOM killer took it: a fresh engine, as its supervisor would start
                self.restart(e)
        return recover


class VllmFleet(Fleet):
    """Real ``vllm serve`` engines (the tiny local model), engine i on core i mod cores, whole tree."""

    kind = "vllm"

    def __init__(self, n: int, workdir: Path) -> None:
        super().__init__(n, workdir)
        self.install = VllmInstall.default()
        self.servers: dict[str, VllmServer] = {}
        self.model: Path | None = None
        self.otlp_url = ""
        cores = os.cpu_count() or 1
        for i, e in enumerate(self.engines):
            e.core = i % cores

    def _server(self, e: Engine) -> VllmServer:
        opts = ServerOptions(max_num_seqs=SLOTS, kv_cache_tokens=KV_TOKENS, otlp_endpoint=self.otlp_url,
                             own_core=True)
        assert self.model is not None
        return VllmServer(self.install, self.model, self.workdir / e.name, name=e.name, port=e.port, cpu=e.core or 0,
                          options=opts)

    def start(self, otlp_url: str) -> None:
        why = self.install.missing()
        if why:
            raise RuntimeError(why)
        self.otlp_url = otlp_url
        self.model = make_tiny_model(self.install, self.install.model_dir)
        for e in self.engines:
            self.servers[e.name] = self._server(e).start()
        for s in self.servers.values():
            s.wait_healthy(300)
        for e in self.engines:  # the first requests after start-up are slow (warm-up), as on any fresh engine
            for _ in range(3):
                self.request(e, CLASSES["realtime_speech"], random.Random(0))

    def stop(self) -> None:
        for e in self.engines:
            s = self.servers.pop(e.name, None)
            if s is not None and s.proc is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(s.proc.pid, signal.SIGCONT)
            if s is not None:
                s.stop()

    def pids(self, e: Engine) -> list[int]:
        s = self.servers.get(e.name)
        return [s.proc.pid] if s is not None and s.proc is not None and s.proc.poll() is None else []

    def alive(self, e: Engine) -> bool:
        return bool(self.pids(e))

    def restart(self, e: Engine) -> None:
        s = self.servers.pop(e.name, None)
        if s is not None:
            s.stop()
        self.servers[e.name] = self._server(e).start()
        self.servers[e.name].wait_healthy(300)
        for _ in range(3):
            self.request(e, CLASSES["realtime_speech"], random.Random(0))

    def request(self, e: Engine, cls: RequestClass, rng: random.Random) -> tuple[bool, str]:
        sent = send(e.port, cls, rng, timeout_s=60)
        return sent.ok, getattr(sent, "error", "") or ""

    def grow_memory(self, e: Engine) -> Recover:
        """vLLM's process tree is its own: an allocator joins the engine's memory cgroup instead."""
        holder: list[subprocess.Popen[bytes]] = []

        def start() -> Recover:
            alloc = subprocess.Popen([sys.executable, "-c", _ALLOCATOR])
            holder.append(alloc)

            def stop() -> None:
                alloc.kill()
                alloc.wait()
            return stop

        end = cgroup_memory_growth(self.pids(e), e.name, start, lambda: [p.pid for p in holder])

        def recover() -> None:
            end()
            if not self.alive(e):
                self.restart(e)
        return recover


def _tree(pid: int) -> list[int]:
    """``pid`` and its descendants (from /proc)."""
    parents: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
                parents.setdefault(ppid, []).append(int(d.name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += parents.get(p, [])
    return out


def _memcg(pid: int) -> Path | None:
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
            _, ctrl, path = line.split(":", 2)
            if "memory" in ctrl.split(","):
                return Path("/sys/fs/cgroup/memory") / path.lstrip("/")
    return None


def cgroup_memory_growth(top_pids: list[int], name: str, start: Callable[[], Recover],
                         joiners: Callable[[], list[int]] = list) -> Recover:
    """The engine's process tree moved into a memory cgroup of its own (cgroup v1) whose limit is its usage
    (the charge moved with it where the kernel allows) plus half of ``GROW_MIB``, then ``start()`` makes it
    grow by ``GROW_MIB`` (the processes of ``joiners()`` join the cgroup): the cgroup runs out, as a container
    over its memory limit does, and the kernel reclaims and OOM-kills in it. Without root or cgroup v1 only
    the growth happens."""
    pids = [p for top in top_pids for p in _tree(top)]
    home = _memcg(pids[0]) if pids else None
    cg = home / f"triscope-bench-{name}" if home is not None else None
    moved: list[int] = []
    if cg is not None:
        with contextlib.suppress(OSError):
            cg.mkdir(exist_ok=True)
        with contextlib.suppress(OSError):  # (newer kernels refuse it: the charge stays behind, the limit holds)
            (cg / "memory.move_charge_at_immigrate").write_text("3")
        for p in pids:
            with contextlib.suppress(OSError):
                (cg / "cgroup.procs").write_text(str(p))
                moved.append(p)
        with contextlib.suppress(OSError, ValueError):
            usage = int((cg / "memory.usage_in_bytes").read_text())
            (cg / "memory.limit_in_bytes").write_text(str(usage + (GROW_MIB << 20) // 2))
    stop = start()
    if cg is not None and moved:
        for p in joiners():
            with contextlib.suppress(OSError):
                (cg / "cgroup.procs").write_text(str(p))

    def recover() -> None:
        stop()
        if cg is not None and home is not None:
            with contextlib.suppress(OSError):
                for p in (cg / "cgroup.procs").read_text().split():
                    with contextlib.suppress(OSError):
                        (home / "cgroup.procs").write_text(p)
            with contextlib.suppress(OSError):
                cg.rmdir()
    return recover


# ---------------------------------------------------------------- the load


@dataclass
class Tally:
    sent: int = 0
    ok: int = 0
    failed: int = 0
    errors: dict[str, int] = field(default_factory=dict)


class LoadGen:
    """Open-loop load: Poisson arrivals at ``rate`` x ``factor`` requests/s over the fleet, classes from
    :data:`MIX`, backends uniformly at random, or ``skew`` of it to one backend; ``long_to`` turns a share of
    one backend's requests into long prompts. With ``tracer`` each request's span (a gateway's CLIENT span
    naming the backend, ``triscope.request_class``, failure status) goes to the daemon."""

    def __init__(self, fleet: Fleet, rate: float, seed: int, tracer: Any = None, workers: int = 96) -> None:
        self.fleet, self.rate, self.tracer = fleet, rate, tracer
        self.factor = 1.0
        self.skew: tuple[str, float] | None = None
        self.long_to: tuple[str, float] | None = None
        """(backend, share): that share of the requests routed to the backend are :data:`LONG_PROMPT`."""
        self.sent: list[Sent] = []
        self.rng = random.Random(seed)
        self.stop_event = threading.Event()
        self.pool = ThreadPoolExecutor(workers, thread_name_prefix="load")
        self.tally = Tally()
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self._run, daemon=True, name="load-arrivals")

    def start(self) -> LoadGen:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.stop_event.set()
        self.thread.join(timeout=10)
        self.pool.shutdown(wait=True, cancel_futures=True)

    def _pick(self) -> Engine:
        engines = self.fleet.engines
        if self.skew is not None and self.rng.random() < self.skew[1]:
            return self.fleet.by_address(self.skew[0])
        if self.skew is not None:
            others = [e for e in engines if e.address != self.skew[0]]
            return self.rng.choice(others or engines)
        return self.rng.choice(engines)

    def _run(self) -> None:
        names, weights = list(MIX), list(MIX.values())
        nxt = time.monotonic()
        while not self.stop_event.is_set():
            nxt += self.rng.expovariate(self.rate * self.factor)
            delay = nxt - time.monotonic()
            if delay > 0:
                self.stop_event.wait(delay)
            cls = CLASSES[self.rng.choices(names, weights)[0]]
            e = self._pick()
            if self.long_to is not None and e.address == self.long_to[0] and self.rng.random() < self.long_to[1]:
                cls = LONG_PROMPT
            self.pool.submit(self._one, e, cls, random.Random(self.rng.random()))

    def _one(self, e: Engine, cls: RequestClass, rng: random.Random) -> None:
        start = time.time_ns()
        ok, err = self.fleet.request(e, cls, rng)
        end = time.time_ns()
        with self.lock:
            self.sent.append(Sent(start / 1e9, e.address, cls.name, (end - start) / 1e9, ok))
            self.tally.sent += 1
            if ok:
                self.tally.ok += 1
            else:
                self.tally.failed += 1
                key = err[:60]
                self.tally.errors[key] = self.tally.errors.get(key, 0) + 1
        if self.tracer is not None:
            from opentelemetry.trace import SpanKind, Status, StatusCode

            attrs = {"gen_ai.operation.name": "text_completion", "gen_ai.request.model": SERVED_MODEL,
                     "triscope.request_class": cls.name, "server.address": "127.0.0.1", "server.port": e.port,
                     "gen_ai.usage.input_tokens": cls.prompt_tokens, "gen_ai.usage.output_tokens": cls.output_tokens}
            span = self.tracer.start_span(f"text_completion {SERVED_MODEL}", kind=SpanKind.CLIENT, start_time=start,
                                          attributes=attrs)
            if not ok:
                span.set_status(Status(StatusCode.ERROR, err[:200]))
            span.end(end_time=end)


def client_tracer(otlp_url: str) -> tuple[Any, Callable[[], None]]:
    """A tracer whose spans go to ``otlp_url`` over OTLP/HTTP, and its shutdown."""
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider(resource=Resource.create({"service.name": "bench-gateway"}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=otlp_url, timeout=5),
                                                   max_queue_size=1 << 15, schedule_delay_millis=500))
    return provider.get_tracer("triscope.bench.incidents"), provider.shutdown


# ---------------------------------------------------------------- the faults


@dataclass
class Bed:
    """What a fault may act on."""

    fleet: Fleet
    load: LoadGen
    workdir: Path
    rng: random.Random
    procs: list[subprocess.Popen[Any]] = field(default_factory=list)


@dataclass(frozen=True)
class Fault:
    name: str
    expected_cause: str | None
    """What ``diagnose`` should name (``None``: nothing, a calm stretch)."""
    hits: str
    """``one``: a victim backend (the expected backends are it); ``fleet``: every backend; ``none``."""
    inject: Callable[[Bed, Engine | None], Recover]
    needs_breach: bool = False
    """Only an incident when it really breaches (a load step); otherwise scored ``no breach``."""
    collectors: tuple[str, ...] = ()
    """Extra collectors ``triscope run`` needs for this fault's signal."""
    fleets: tuple[str, ...] = ("sim", "vllm")
    doc: str = ""


FAULTS: dict[str, Fault] = {}


def register(fault: Fault) -> Fault:
    FAULTS[fault.name] = fault
    return fault


def _nothing() -> None:
    return None


def _load_step(factor: float) -> Callable[[Bed, Engine | None], Recover]:
    def inject(bed: Bed, _victim: Engine | None) -> Recover:
        bed.load.factor = factor

        def recover() -> None:
            bed.load.factor = 1.0
        return recover
    return inject


def _long_prompts(bed: Bed, victim: Engine | None) -> Recover:
    """Most of one engine's requests turn into long prompts (a tenant with long documents whose sessions stick
    to it): the same request rate, several times the tokens."""
    assert victim is not None
    bed.load.long_to = (victim.address, 0.7)

    def recover() -> None:
        bed.load.long_to = None
    return recover


SAFETY_S = 900
"""Hogs and allocators end by themselves after this, should the bench die before it recovers them."""
HOG = f"import time\nend = time.time() + {SAFETY_S}\nwhile time.time() < end:\n    pass\n"


def _cpu_hog(bed: Bed, victim: Engine | None) -> Recover:
    """Busy processes pinned to the engine's core at a higher priority (nice -10 against the engine's 0): the
    engine's threads wait on the run queue. On a fleet whose engines float, the engine is pinned to the last
    core for the fault (its affinity restored after)."""
    assert victim is not None
    pids = [p for top in bed.fleet.pids(victim) for p in _tree(top)]
    core = victim.core if victim.core is not None else (os.cpu_count() or 1) - 1
    saved: dict[int, set[int]] = {}
    for p in pids:
        for task in _tasks(p):
            with contextlib.suppress(OSError):
                saved[task] = os.sched_getaffinity(task)
                os.sched_setaffinity(task, {core})

    def setup() -> None:
        os.sched_setaffinity(0, {core})
        os.nice(-10)

    hogs = [subprocess.Popen([sys.executable, "-c", HOG], preexec_fn=setup) for _ in range(2)]

    def recover() -> None:
        for h in hogs:
            h.kill()
            h.wait()
        for task, cpus in saved.items():
            with contextlib.suppress(OSError):
                os.sched_setaffinity(task, cpus)
    return recover


def _tasks(pid: int) -> list[int]:
    with contextlib.suppress(OSError):
        return [int(t.name) for t in Path(f"/proc/{pid}/task").iterdir()]
    return []


def _memory(bed: Bed, victim: Engine | None) -> Recover:
    assert victim is not None
    return bed.fleet.grow_memory(victim)


def _io_hog(bed: Bed, _victim: Engine | None) -> Recover:
    """fio random reads and writes with direct IO on the disk under the work directory (the store's and the
    engines' disk), 4 jobs at queue depth 32."""
    target = bed.workdir / "fio"
    target.mkdir(exist_ok=True)
    proc = subprocess.Popen(["fio", "--name=hog", f"--directory={target}", "--rw=randrw", "--bs=4k", "--direct=1",
                             "--ioengine=libaio", "--iodepth=32", "--numjobs=4", "--size=256m", "--time_based",
                             f"--runtime={SAFETY_S}", "--group_reporting"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)

    def recover() -> None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        for f in target.iterdir():
            with contextlib.suppress(OSError):
                f.unlink()
    return recover


def _sigkill(bed: Bed, victim: Engine | None) -> Recover:
    assert victim is not None
    for p in bed.fleet.pids(victim):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p, signal.SIGKILL) if bed.fleet.kind == "vllm" else os.kill(p, signal.SIGKILL)

    def recover() -> None:
        bed.fleet.restart(victim)
    return recover


def _sigstop(bed: Bed, victim: Engine | None) -> Recover:
    assert victim is not None
    pids = bed.fleet.pids(victim)
    for p in pids:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p, signal.SIGSTOP) if bed.fleet.kind == "vllm" else os.kill(p, signal.SIGSTOP)

    def recover() -> None:
        for p in pids:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p, signal.SIGCONT) if bed.fleet.kind == "vllm" else os.kill(p, signal.SIGCONT)
    return recover


def _lb_skew(bed: Bed, victim: Engine | None) -> Recover:
    assert victim is not None
    bed.load.skew = (victim.address, 0.9)

    def recover() -> None:
        bed.load.skew = None
    return recover


for _f in (
    Fault("calm", None, "none", lambda bed, v: _nothing, doc="nothing injected: no incident expected"),
    Fault("load_up_50", "load_beyond_capacity", "fleet", _load_step(1.5), needs_breach=True,
          doc="the load generator's rate +50 %"),
    Fault("load_x3", "load_beyond_capacity", "fleet", _load_step(3.0), needs_breach=True,
          doc="the load generator's rate x3"),
    Fault("long_prompts", "kv_pressure", "one", _long_prompts,
          doc="70 % of one engine's requests become 420-token prompts (its request rate unchanged)"),
    Fault("cpu_hog", "host_cpu", "one", _cpu_hog, doc="2 busy processes at nice -10 pinned to the engine's core"),
    Fault("memory_growth", "host_memory", "one", _memory,
          doc=f"the engine (sim) or a process in its memory cgroup (vLLM) grows by {GROW_MIB} MiB; the cgroup's "
              "limit is its usage + half of that"),
    Fault("io_hog", "io", "fleet", _io_hog, needs_breach=True, collectors=("blockio_diskstats",),
          doc="fio randrw 4k, direct IO, 4 jobs x iodepth 32, on the work directory's disk"),
    Fault("sigkill", "backend_down", "one", _sigkill, doc="the engine SIGKILLed (restarted at recovery)"),
    Fault("sigstop", "backend_down", "one", _sigstop, doc="the engine SIGSTOPped (SIGCONT at recovery)"),
    Fault("lb_skew", "routing_imbalance", "one", _lb_skew, doc="90 % of the load to one backend"),
):
    register(_f)


def sla_ms(fleet: str, scale: float) -> dict[str, float]:
    """Each class's SLA: the calibrated vLLM-CPU profile's (4x idle latency, :mod:`triscope.sim.calibration`)
    times ``scale``."""
    return {name: round(s * 1000 * scale) for name, s in PROFILES["vllm-cpu"].sla_s.items()}


def make_fleet(kind: str, n: int, workdir: Path) -> Fleet:
    if kind == "sim":
        return SimFleet(n, workdir)
    if kind == "vllm":
        return VllmFleet(n, workdir)
    raise ValueError(f"unknown fleet {kind!r} (sim, vllm)")


__all__ = ["FAULTS", "LONG_PROMPT", "MIX", "Bed", "Engine", "Fault", "Fleet", "LoadGen", "SimFleet", "VllmFleet",
           "client_tracer", "make_fleet", "register", "sla_ms"]
