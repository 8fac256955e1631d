"""The faults of ``bench/incidents.py`` (fault injection with ground truth), a registry.

A :class:`Fault` is a name, the cause ``diagnose`` should give, which backends it hits (one victim or the
whole fleet) and an ``inject(bed, victim)`` that returns its ``recover()``. :data:`FAULTS` is the registry:
:func:`register` adds one, so a fault this module does not know plugs in with a few lines. The bed
(:class:`Bed`) is what a fault may touch: the fleet's engines and processes (:mod:`.incident_fleet`) and
the load generator (:mod:`.incident_load`).
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from triscope_bed.fleet.incident_fleet import GROW_MIB, Engine, Fleet, Recover, tree
from triscope_bed.fleet.incident_load import LoadGen

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
    """A tenant with long documents whose sessions stick to one engine: 70 % of its requests turn into long
    prompts and the tenant adds 40 % to its requests (1.4x its fair share, inside an LB's usual spread and
    under ``imbalance``): several times the tokens at about the same request rate."""
    assert victim is not None
    bed.load.long_to = (victim.address, 0.7, 0.4)

    def recover() -> None:
        bed.load.long_to = None
    return recover


SAFETY_S = 900
"""Hogs and allocators end by themselves after this, should the bench die before it recovers them."""
HOG = f"import time\nend = time.time() + {SAFETY_S}\nwhile time.time() < end:\n    pass\n"


def _cpu_hog(bed: Bed, victim: Engine | None) -> Recover:
    """Busy processes pinned to the engine's core, each started with ``setsid`` into an autogroup of its own:
    with the kernel's autogroups on, the scheduler shares a core between autogroups, not processes (as between
    containers), so the engine's autogroup gets a third of its core and its threads wait on the run queue. On
    a fleet whose engines float, the engine is pinned to the last core for the fault (its affinity restored
    after)."""
    assert victim is not None
    pids = [p for top in bed.fleet.pids(victim) for p in tree(top)]
    core = victim.core if victim.core is not None else (os.cpu_count() or 1) - 1
    saved: dict[int, set[int]] = {}
    for p in pids:
        for task in _tasks(p):
            with contextlib.suppress(OSError):
                saved[task] = os.sched_getaffinity(task)
                os.sched_setaffinity(task, {core})

    def setup() -> None:
        os.sched_setaffinity(0, {core})

    # A nice value only ranks processes inside one autogroup: hogs in the bench's autogroup would split the core
    # with the engine's autogroup 50/50 whatever their nice, which doubled a vLLM engine's P99 and no more.
    hogs = [subprocess.Popen([sys.executable, "-c", HOG], preexec_fn=setup, start_new_session=True)
            for _ in range(2)]

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
          doc="70 % of one engine's requests become 420-token prompts, +40 % more of them (1.4x its share)"),
    Fault("cpu_hog", "host_cpu", "one", _cpu_hog,
          doc="2 busy processes pinned to the engine's core, each in an autogroup of its own (setsid)"),
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


__all__ = ["FAULTS", "HOG", "SAFETY_S", "Bed", "Fault", "register"]
