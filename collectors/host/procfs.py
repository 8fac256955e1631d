"""What the Linux kernel says about a host and its engine processes (/proc), read without dependencies.

PSI (``/proc/pressure/{cpu,memory,io}``: cumulative stall microseconds), the OOM-kill counter
(``/proc/vmstat``), per-thread run and run-queue wait time (``/proc/PID/task/TID/schedstat``), resident
memory (``/proc/PID/status``), and which process listens on a TCP port (``/proc/net/tcp*`` inode ->
``/proc/PID/fd``). Every reader returns what it could read; a vanished process reads as nothing.
"""

from __future__ import annotations

import contextlib
import os
from collections import defaultdict
from pathlib import Path

PROC = Path("/proc")


def psi_totals() -> dict[str, float]:
    """Cumulative stall seconds per ``RESOURCE_some`` / ``RESOURCE_full``; empty without PSI."""
    out: dict[str, float] = {}
    for resource in ("cpu", "memory", "io"):
        with contextlib.suppress(OSError):
            for line in (PROC / "pressure" / resource).read_text().splitlines():
                kind, _, rest = line.partition(" ")
                total = dict(p.split("=", 1) for p in rest.split() if "=" in p).get("total")
                if total is not None:
                    out[f"{resource}_{kind}"] = int(total) / 1e6
    return out


def oom_kills() -> float:
    """The host's OOM-kill counter (NaN where the kernel does not count them)."""
    with contextlib.suppress(OSError):
        for line in (PROC / "vmstat").read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == "oom_kill":
                return float(value)
    return float("nan")


def listening_pid(port: int) -> int | None:
    """The process listening on TCP ``port`` (IPv4 or IPv6), or None."""
    inodes = set()
    for table in ("tcp", "tcp6"):
        with contextlib.suppress(OSError):
            for line in (PROC / "net" / table).read_text().splitlines()[1:]:
                f = line.split()
                if len(f) > 9 and f[3] == "0A" and int(f[1].rsplit(":", 1)[1], 16) == port:
                    inodes.add(f"socket:[{f[9]}]")
    if not inodes:
        return None
    for pid_dir in PROC.iterdir():
        if not pid_dir.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            for fd in (pid_dir / "fd").iterdir():
                with contextlib.suppress(OSError):
                    if os.readlink(fd) in inodes:
                        return int(pid_dir.name)
    return None


def children_map() -> dict[int, list[int]]:
    """Parent PID -> child PIDs of every process now."""
    out: dict[int, list[int]] = defaultdict(list)
    for pid_dir in PROC.iterdir():
        if not pid_dir.name.isdigit():
            continue
        with contextlib.suppress(OSError, ValueError, IndexError):
            stat = (pid_dir / "stat").read_text()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            out[ppid].append(int(pid_dir.name))
    return out


def tree(pid: int, children: dict[int, list[int]]) -> list[int]:
    """``pid`` and its descendants."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


def run_and_wait_seconds(pids: list[int]) -> tuple[float, float]:
    """Cumulative (run, run-queue wait) seconds of every thread of ``pids`` (threads that ended are gone)."""
    run = wait = 0.0
    for pid in pids:
        with contextlib.suppress(OSError):
            for task in (PROC / str(pid) / "task").iterdir():
                with contextlib.suppress(OSError, ValueError):
                    fields = (task / "schedstat").read_text().split()
                    run += int(fields[0]) / 1e9
                    wait += int(fields[1]) / 1e9
    return run, wait


def rss_bytes(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        with contextlib.suppress(OSError, ValueError):
            for line in (PROC / str(pid) / "status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
                    break
    return total


def alive(pid: int) -> bool:
    return (PROC / str(pid)).exists()


__all__ = ["alive", "children_map", "listening_pid", "oom_kills", "psi_totals", "rss_bytes", "run_and_wait_seconds",
           "tree"]
