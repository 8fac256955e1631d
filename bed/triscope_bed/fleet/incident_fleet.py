"""The fleets of ``bench/incidents.py``: simulated or real vLLM-CPU engines the faults can act on.

``sim``: ``triscope_bed.engines.backend`` engines with the calibrated vLLM-CPU profile, one process each, started
through a small launcher so a fault can make the engine process itself leak memory (SIGUSR1; SIGUSR2
frees it). ``vllm``: real ``vllm serve`` engines (the tiny local model), each pinned to its own core,
sending their own OTLP spans. :func:`cgroup_memory_growth` puts an engine in a memory cgroup of its own.
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
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from triscope_bed.engines.calibration import PROFILES
from triscope_bed.engines.vllm_cpu import SERVED_MODEL, ServerOptions, VllmInstall, VllmServer, make_tiny_model
from triscope_bed.fleet.bench_fleet import read_ready
from triscope_bed.ports import free_port
from triscope_bed.procs import stop_process
from triscope_bed.workloads.vllm_load import CLASSES, RequestClass, send

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
from triscope_bed.engines.backend import main
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


def tree(pid: int) -> list[int]:
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
    pids = [p for top in top_pids for p in tree(top)]
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


def sla_ms(fleet: str, scale: float) -> dict[str, float]:
    """Each class's SLA: the calibrated vLLM-CPU profile's (4x idle latency, :mod:`triscope_bed.engines.calibration`)
    times ``scale``."""
    return {name: round(s * 1000 * scale) for name, s in PROFILES["vllm-cpu"].sla_s.items()}


def make_fleet(kind: str, n: int, workdir: Path) -> Fleet:
    if kind == "sim":
        return SimFleet(n, workdir)
    if kind == "vllm":
        return VllmFleet(n, workdir)
    raise ValueError(f"unknown fleet {kind!r} (sim, vllm)")



__all__ = ["GROW_MIB", "KV_TOKENS", "SLOTS", "Engine", "Fleet", "Recover", "SimFleet", "VllmFleet",
           "cgroup_memory_growth", "make_fleet", "sla_ms", "tree"]
