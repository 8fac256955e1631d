"""Child processes of the test bed (backends, HAProxy, feed workers): stop them without leaks, and
give their Unix sockets paths that fit."""

from __future__ import annotations

import hashlib
import os
import subprocess
from pathlib import Path
from typing import Any

SUN_PATH_MAX = 107
"""Longest Unix socket path (``sizeof(sockaddr_un.sun_path)`` less its NUL)."""


def socket_dir(folder: Path, reserve: int, prefix: str = "triscope-sock-") -> Path:
    """``folder`` when a socket name of ``reserve`` bytes (separator included) fits under it, else a short
    private directory under /tmp named after it (the same one on every call, created mode 0700): deep
    work directories, such as pytest's, would make ``bind`` fail."""
    if len(str(folder)) + reserve <= SUN_PATH_MAX:
        return folder
    digest = hashlib.sha256(str(folder).encode()).hexdigest()[:16]
    short = Path("/tmp") / f"{prefix}{digest}"
    short.mkdir(mode=0o700, exist_ok=True)
    if short.stat().st_uid != os.getuid():  # somebody else's directory: never put our sockets there
        raise RuntimeError(f"{short} belongs to another user; use a shorter work directory")
    return short


def stop_process(proc: subprocess.Popen[Any] | None, grace_s: float = 5.0) -> None:
    """SIGTERM, then SIGKILL after ``grace_s``; reaps the child. Safe on None or an exited child."""
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


ProcessTable = dict[int, tuple[int, float]]
"""pid -> (parent pid, CPU seconds so far, user + system)."""


def process_table() -> ProcessTable:
    """Every process of the host now (Linux ``/proc``; empty elsewhere)."""
    table: ProcessTable = {}
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    for entry in Path("/proc").iterdir() if Path("/proc/self/stat").exists() else ():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        table[int(entry.name)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / tick)
    return table


def tree_cpu_seconds(table: ProcessTable, root: int, exclude: set[int]) -> dict[int, float]:
    """CPU seconds of ``root`` and its descendants in ``table``, leaving out every process of ``exclude``
    and its descendants. Used to charge the load-balancing tier of the test bed with what it costs on
    cores it shares with the engines."""
    keep: dict[int, float] = {}
    for pid, (_, seconds) in table.items():
        p = pid
        while p > 1 and p not in exclude and p != root:
            p = table.get(p, (0, 0.0))[0]
        if p == root and root not in exclude:
            keep[pid] = seconds
    return keep
