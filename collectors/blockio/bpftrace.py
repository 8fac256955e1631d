"""The bpftrace collector: runs the embedded program as root and assembles its per-window output."""

from __future__ import annotations

import contextlib
import logging
import os
import random
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Mapping
from typing import Any

from triscope.collectors.blockio.assembler import WindowAssembler
from triscope.collectors.blockio.config import BlockioConfig, blockio_config
from triscope.collectors.blockio.program import CONTROL_MAGIC_BASE, MAP_KEYS_MAX, bpftrace_program
from triscope.errors import TriscopeError
from triscope.schema import IO_LATENCY, Table

log = logging.getLogger(__name__)


def bpf_recursion_misses(pid: int) -> int | None:
    """Probe runs the kernel skipped (``recursion_misses``, summed over the BPF programs process
    ``pid`` holds open); None when /proc does not show them (process gone, kernel < 5.12)."""
    total, seen = 0, False
    try:
        fds = os.listdir(f"/proc/{pid}/fdinfo")
    except OSError:
        return None
    for fd in fds:
        try:
            with open(f"/proc/{pid}/fdinfo/{fd}") as fh:
                info = fh.read()
        except OSError:
            continue
        if "prog_type:" not in info:
            continue
        for line in info.splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "recursion_misses" and value.strip().isdigit():
                total, seen = total + int(value), True
    return total if seen else None


def has_tracepoint(system: str, event: str) -> bool:
    """Whether the kernel offers tracepoint ``system:event`` (tracefs or the debugfs copy)."""
    return any(os.path.isdir(f"{root}/events/{system}/{event}")
               for root in ("/sys/kernel/tracing", "/sys/kernel/debug/tracing"))


def mount_tracefs() -> None:
    """Mount tracefs at /sys/kernel/tracing unless it already is (idempotent; needs root)."""
    if os.path.ismount("/sys/kernel/tracing"):
        return
    subprocess.run(["mount", "-t", "tracefs", "nodev", "/sys/kernel/tracing"], check=False,
                   capture_output=True, timeout=10)


def bpftrace_unavailable_reason() -> str:
    """Why the bpftrace collector cannot run here ("" when it can)."""
    if shutil.which("bpftrace") is None:
        return "bpftrace is not installed"
    if os.geteuid() != 0:
        return "not running as root"
    return ""


class BpftraceCollector:
    """Runs the embedded bpftrace program and parses its per-window output continuously.

    ``config``: a :class:`BlockioConfig` or the whole configuration (its ``[blockio]`` section)."""

    name = "blockio_bpftrace"
    ROWS_AFTER_CLOSE = True
    """close() yields the windows END prints (the one open at close): the daemon collects once more."""

    def __init__(self, config: Mapping[str, Any] | BlockioConfig | None = None) -> None:
        cfg = blockio_config(config)
        self.interval_s = cfg.interval_s
        self.fmt = cfg.format
        self.host = cfg.host or socket.gethostname()
        self.restart_at_keys = cfg.restart_at_map_keys
        self.restarts = 0
        self._magic = (CONTROL_MAGIC_BASE + 2 * random.randrange(50_000_000)
                       if has_tracepoint("syscalls", "sys_enter_getpgid") else 0)
        self._missed_done = 0  # skipped runs of bpftrace processes already replaced
        self._missed_now = 0  # ... of the running one
        self._missed_logged = 0
        self.binary = shutil.which("bpftrace")
        self.asm = WindowAssembler(self.host, self.fmt, self.interval_s)
        self._proc: subprocess.Popen[str] | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self.stderr = ""

    def program(self) -> str:
        """The bpftrace program for this kernel (IO-accounting probes only when it has them)."""
        return bpftrace_program(self.interval_s, has_tracepoint("block", "block_io_start"),
                                control_magic=self._magic)

    def start(self) -> None:
        if not self.binary:
            raise TriscopeError("blockio: bpftrace is not installed")
        mount_tracefs()
        if not self.restarts:  # one wall/kernel clock mapping for every process of this collector
            self.asm.clock_offset_ns = time.time_ns() - time.monotonic_ns()
        self.asm.key_counts = {}  # a new process starts with empty maps
        args = [self.binary] + (["-f", "json"] if self.fmt == "json" else []) + ["-e", self.program()]
        self._proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                      bufsize=1, env={**os.environ, "BPFTRACE_STRLEN": "16",
                                                      "BPFTRACE_MAP_KEYS_MAX": str(MAP_KEYS_MAX)})
        self._thread = threading.Thread(target=self._read, name="blockio-bpftrace", daemon=True)
        self._thread.start()
        threading.Thread(target=self._read_err, daemon=True).start()
        if self._magic:
            threading.Thread(target=self._go_live, args=(self._proc,), name="blockio-live", daemon=True).start()

    def _go_live(self, proc: subprocess.Popen[str]) -> None:
        """Poke the control probe until it answers: counting starts once every probe is attached."""
        deadline = time.monotonic() + 120
        while not self.asm.live_seen and proc.poll() is None and time.monotonic() < deadline:
            with contextlib.suppress(OSError):
                os.getpgid(self._magic)
            time.sleep(0.005)

    def _read(self) -> None:
        assert self._proc and self._proc.stdout
        for line in self._proc.stdout:
            read_ns = time.monotonic_ns()  # after bpftrace wrote it: bounds when its clears ran
            with self._lock:
                self.asm.feed(line, read_ns=read_ns)

    def _read_err(self) -> None:
        assert self._proc and self._proc.stderr
        for line in self._proc.stderr:
            if "RLIMIT_MEMLOCK" not in line:
                self.stderr = (self.stderr + line)[-4000:]

    def collect(self) -> dict[Table, dict[str, list[Any]]]:
        if self._proc is not None and self._proc.poll() is not None and self.stderr:
            log.warning("blockio: bpftrace exited %s: %s", self._proc.returncode,
                        self.stderr.strip().splitlines()[-1])
        self._count_misses()
        self._restart_if_maps_may_fill()
        with self._lock:
            rows = self.asm.drain()
        return {IO_LATENCY: rows} if rows["ts"] else {}

    def gaps(self) -> dict[str, int]:
        """Where the rows fall short: probe runs the kernel skipped (requests not counted) and
        windows that may miss requests (bpftrace's output ran late, ``WindowAssembler.raced``)."""
        return {"missed_probe_runs": self.missed_probe_runs, "late_windows": self.asm.raced}

    @property
    def missed_probe_runs(self) -> int:
        """Probe runs the kernel skipped so far (BPF recursion), every bpftrace process of this
        collector together: requests missing from the counts."""
        return self._missed_done + self._missed_now

    def _count_misses(self) -> None:
        """Update :attr:`missed_probe_runs`; log it when it first grows and at every 10x."""
        if self._proc is None or self._proc.poll() is not None:
            return
        missed = bpf_recursion_misses(self._proc.pid)
        if missed is None or missed <= self._missed_now:
            return
        self._missed_now = missed
        total = self.missed_probe_runs
        if total >= max(1, 10 * self._missed_logged):
            self._missed_logged = total
            log.warning("blockio: the kernel skipped %d block-IO probe runs so far (BPF recursion: an "
                        "interrupt arrived while another BPF program ran); those requests are not counted", total)

    def _restart_if_maps_may_fill(self) -> None:
        with self._lock:
            held = self.asm.map_keys_held
        if held < self.restart_at_keys or self._proc is None or self._proc.poll() is not None:
            return
        log.warning("blockio: a request-start map of bpftrace holds %d of its %d keys (requests in flight and "
                    "leftovers of %d skipped completions); replacing the process to empty its maps (requests "
                    "completing while the new one attaches are not counted)", held, MAP_KEYS_MAX, self._missed_now)
        self.restart()

    def restart(self) -> None:
        """Replace the bpftrace process (its maps start empty). Windows stay exact: the old
        process's last window ends at its stop mark, the new one's first starts at its live mark."""
        self.close()
        self.restarts += 1
        self.start()

    def close(self) -> None:
        self._count_misses()  # the programs' counters go with the process
        self._missed_done += self._missed_now
        self._missed_now = 0
        if self._proc is not None and self._proc.poll() is None:
            if self._magic:  # the last window ends now, not when bpftrace gets to detach
                with contextlib.suppress(OSError):
                    os.getpgid(self._magic + 1)
                deadline = time.monotonic() + 2.0  # the mark must be read before END's
                while not self.asm.stop_seen and time.monotonic() < deadline and self._proc.poll() is None:
                    time.sleep(0.005)
            self._proc.terminate()
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        if self._thread is not None:
            self._thread.join(timeout=5)
