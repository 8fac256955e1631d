"""Block-IO latency collectors for ``io_latency``: bpftrace (tracepoints), ebpf_exporter, /proc/diskstats.

Load from ``triscope run`` as ``triscope.collectors.blockio:bpftrace_factory`` (falls back to
diskstats when bpftrace is missing or we are not root), ``:ebpf_exporter_factory`` or
``:diskstats_factory``. Config section ``[blockio]``: interval_s, format ("text"|"json"), url, host,
restart_at_map_keys (bpftrace).
What each source measures (queue depth semantics, window bounds) and how it is checked: docs/blockio.md.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import random
import re
import shutil
import socket
import subprocess
import threading
import time
import urllib.request
from collections import defaultdict
from pathlib import Path
from typing import Any

from triscope.collectors.blockio_parse import (
    Bucket,
    Hist,
    diskstats_delta,
    mean_estimate,
    op_from_rwbs,
    parse_bpftrace_json_record,
    parse_diskstats,
    parse_ebpf_exporter,
    percentile,
)
from triscope.errors import InputError, TriscopeError
from triscope.schema import encode_ts

log = logging.getLogger(__name__)
TABLE = "io_latency"
COLUMNS = ["ts", "host", "device", "source", "op", "window_seconds", "ios", "p50_seconds",
           "p99_seconds", "mean_seconds", "queue_depth"]
MAP_KEYS_MAX = 4096
"""Keys per bpftrace map (``BPFTRACE_MAP_KEYS_MAX``, set for the program): a full request-start
map takes no new requests, which then go uncounted."""
RESTART_AT_MAP_KEYS = 3072
"""Default ``[blockio] restart_at_map_keys``: entries one of the request-start maps may hold before
the bpftrace process is replaced (they are the requests in flight plus the leftovers of skipped
completions, see :data:`PROGRAM_DOC`)."""
DEFAULTS: dict[str, Any] = {"interval_s": 1.0, "format": "json", "url": "http://127.0.0.1:9435/metrics",
                            "host": "", "max_body_bytes": 16 << 20, "restart_at_map_keys": RESTART_AT_MAP_KEYS}
WINDOW_MARK = "triscope-window-end"
"""printf of the interval probe: ``triscope-window-end <nsecs>`` (kernel CLOCK_MONOTONIC)."""
WINDOW_START_MARK = "triscope-window-start"
"""printf of BEGIN: ``triscope-window-start <nsecs>`` (bpftrace may still be attaching probes;
the window start only without the control probe)."""
WINDOW_FINAL_MARK = "triscope-window-final"
"""printf of END (bpftrace stopping): ``triscope-window-final <nsecs>``, after every map set."""
WINDOW_LIVE_MARK = "triscope-window-live"
"""printf of the control probe: ``triscope-window-live <nsecs>``, counting starts (every probe
attached)."""
WINDOW_STOP_MARK = "triscope-window-stop"
"""printf of the control probe: ``triscope-window-stop <nsecs>``, the instant counting stopped."""
CONTROL_MAGIC_BASE = 2_000_000_000
"""The collector drives its program with ``getpgid(magic)`` calls (no such pid: they fail
harmlessly), ``magic`` = this + a random even offset per collector: ``magic`` starts the
counting, ``magic + 1`` stops it. bpftrace fires BEGIN while it still attaches its probes,
detaches them some 0.1 s after SIGTERM and runs END later still, so neither BEGIN nor END is a
window bound; these two instants are. The control probe is the program's last, so it fires
only once every probe before it is attached."""
BUFFERS = 6
"""Map sets the completion probe rotates through, one per window (see :data:`PROGRAM_DOC`)."""
AHEAD = 2
"""Map sets after the current one that an interval leaves alone: its print and clear run later,
in bpftrace's user space, by which time the next window may be counting into them."""

_PROGRAM_HEAD = r"""
BEGIN
{
  printf("triscope-window-start %llu\n", nsecs);
}

tracepoint:block:block_io_start  // acct
{  // acct
  if (@acct[args->dev, args->sector] == 0) { @keys[2] = count(); }  // acct
  @acct[args->dev, args->sector] = nsecs;  // acct
}  // acct

tracepoint:block:block_rq_merge  // acct
{  // acct
  if (@acct[args->dev, args->sector] > 0) { @keys[3] = count(); }  // acct
  delete(@acct[args->dev, args->sector]);  // acct
}  // acct

tracepoint:block:block_rq_issue
{
  if (@start[args->dev, args->sector] == 0) { @keys[0] = count(); }
  @start[args->dev, args->sector] = nsecs;
}

tracepoint:block:block_rq_complete
/@start[args->dev, args->sector] > 0__WHILE_LIVE__/
{
  $d = args->dev;
  $ma = $d >> 20;
  $mi = $d & 0xfffff;
  $n = nsecs;
  $s = @start[$d, args->sector];
  $lat = $n - $s;
  $q = $s;
  $a = @acct[$d, args->sector];  // acct
  if ($a > 0 && $a <= $s) { $q = $a; }  // acct
  if ($a > 0) { @keys[3] = count(); }  // acct
  delete(@acct[$d, args->sector]);  // acct
  delete(@start[$d, args->sector]);
  @keys[1] = count();
  $w = $n / __WINDOW_NS__;
  $b = $w % __BUFFERS__;
__STORES__
}

tracepoint:block:block_rq_requeue
{
  if (@start[args->dev, args->sector] > 0) { @keys[1] = count(); }
  delete(@start[args->dev, args->sector]);
}

interval:ms:__INTERVAL_MS__
{
  $cur = (nsecs / __WINDOW_NS__) % __BUFFERS__;
__FLUSHES__
  print(@keys);
  printf("triscope-window-end %llu\n", nsecs);
}

tracepoint:syscalls:sys_enter_getpgid  // ctl
/args->pid == __LIVE_MAGIC__ || args->pid == __STOP_MAGIC__/  // ctl
{  // ctl
  if (args->pid == __LIVE_MAGIC__) {  // ctl
    if (@state == 0) { @state = 1; printf("triscope-window-live %llu\n", nsecs); }  // ctl
  } else {  // ctl
    @state = 2;  // ctl
    printf("triscope-window-stop %llu\n", nsecs);  // ctl
  }  // ctl
}  // ctl

END
{
__FINAL__
  clear(@start);
  clear(@keys);
  clear(@acct);  // acct
  clear(@state);  // ctl
  printf("triscope-window-final %llu\n", nsecs);
}
"""

_STORE = ("  if ($b == {i}) {{ @usecs_{i}[$w, $ma, $mi, args->rwbs] = hist($lat / 1000);"
          " @lat_ns_{i}[$w, $ma, $mi, args->rwbs] = sum($lat); @qd_ns_{i}[$w, $ma, $mi] = sum($n - $q); }}")
_FLUSH = ("  if (({i} + __BUFFERS__ - $cur) % __BUFFERS__ > __AHEAD__) {{ print(@usecs_{i}); print(@lat_ns_{i}); print(@qd_ns_{i});"
          " clear(@usecs_{i}); clear(@lat_ns_{i}); clear(@qd_ns_{i}); }}")
_FINAL = ("  print(@usecs_{i}); print(@lat_ns_{i}); print(@qd_ns_{i});"
          " clear(@usecs_{i}); clear(@lat_ns_{i}); clear(@qd_ns_{i});")

PROGRAM_DOC = """What the program measures, per window ``w = nsecs // window`` of the kernel clock:

- ``@usecs_B[w, major, minor, rwbs]``: log2 histogram of device latency, driver issue ->
  completion (``block_rq_issue`` -> ``block_rq_complete``), and ``@lat_ns_B`` its exact sum.
- ``@qd_ns_B[w, major, minor]``: summed queue residence of the requests completing in ``w``,
  from the kernel's IO-accounting start (``block_io_start``, kernel >= 6.5) to completion. By
  Little's law ``qd_ns / window`` is the mean number of requests queued or in flight: for reads
  and plain writes the same quantity as /proc/diskstats' weighted time (iostat ``aqu-sz``), which
  counts from the request's ``start_time_ns``. It reads lower under fsync load: diskstats also
  adds each cache flush's own time beside the waiting request's, and counts every fsync waiting
  on one flush, where the (dev, sector) keys below see one (empty flushes carry sector 0).
  Without ``block_io_start`` (older kernels) residence counts from driver issue: in-flight depth
  only. (Not a counter updated in the probes: ``@n = @n + 1`` is not
  atomic across CPUs; ``hist()``/``sum()`` are per-CPU aggregations.)

Windows are fixed by the kernel clock, not by when output is read: bpftrace runs ``print()``
and ``clear()`` in user space, so on a busy machine a map printed "at the interval" holds
whatever arrived until bpftrace got the CPU. Here a completion writes to map set
``B = w % BUFFERS`` with ``w`` in the key; each interval prints and clears the sets of the
``BUFFERS - 1 - AHEAD`` windows before the current one and leaves the current set and the
``AHEAD`` after it alone. (It once cleared every set but the current one: when bpftrace's user
space ran that clear after the next window had begun, it deleted what had been counted into
that set since its print read it.) Each window is printed whole as long as bpftrace's user
space is less than ``AHEAD`` windows late, and a missed timer tick only delays it. A print that
holds a window not yet ended at its interval shows that this bound was broken (the clear may
then have dropped requests): the assembler counts it (``WindowAssembler.raced``) and logs it.
Counting runs from the
control probe's live mark to its stop mark (:data:`CONTROL_MAGIC_BASE`); when bpftrace stops,
END prints every set and the last window ends at the stop mark (at ``triscope-window-final``
without the control probe).

Requests are keyed by (dev, sector). Two requests in flight on the same sector at once (rare:
concurrent flushes, the same block read twice) collide: the first completion takes the later
start and the second is not counted, so ``ios`` can only undercount. A requeued request restarts
its device latency at re-issue; a request merged into another is dropped from ``@acct``.

The kernel skips a probe run when it would nest in another BPF program on the same CPU (a
completion interrupt arriving while the issue probe runs): that request is not counted either.
The collector reads the programs' ``recursion_misses`` (/proc/PID/fdinfo) and logs them (71 of
~230k reads, 0.03 %, at 57k IOPS on 2 busy CPUs here). A skipped completion leaves its
``@start``/``@acct`` entry behind until the same sector is issued again; with random IO over a
large disk such entries could fill bpftrace's maps (4096 keys), after which new requests go
untimed. So the probes count the keys they add to and remove from each map (``@keys``, per-CPU
``count()`` aggregations, printed every interval), and once either map holds
``restart_at_map_keys`` entries (default :data:`RESTART_AT_MAP_KEYS` of :data:`MAP_KEYS_MAX`)
the collector replaces the bpftrace process, which starts with empty maps: they cannot be
emptied while the probes run (bpftrace 0.17 aborts when ``clear()`` races a probe's
``delete``). Leftovers of sectors that are read or written again are overwritten, not added (an
earlier collector restarted after 2048 skipped runs: every ~3 s beside fsync loops, while the
maps held at most 71 entries). Windows stay exact across the swap: the old process's last window
ends at its stop mark, the new one's first starts at its live mark; requests completing in between (the new
program's load and attach time, ~1 s) are not counted, and the swap is logged."""



def device_name(major: int, minor: int) -> str:
    """Kernel name of a block device number (``vda``), or ``major:minor`` when /sys does not know it."""
    link = Path(f"/sys/dev/block/{major}:{minor}")
    try:
        return os.path.basename(os.readlink(link))
    except OSError:
        return f"{major}:{minor}"


def device_for_path(path: str | os.PathLike[str]) -> str:
    """Whole-disk block device backing ``path`` (via /proc/self/mountinfo and /sys/class/block)."""
    dev = os.stat(path).st_dev
    name = device_name(os.major(dev), os.minor(dev))
    real = os.path.realpath(f"/sys/class/block/{name}")
    if os.path.exists(os.path.join(real, "partition")):
        name = os.path.basename(os.path.dirname(real))
    return name


def _rows() -> dict[str, list[Any]]:
    return {c: [] for c in COLUMNS}


def _append(rows: dict[str, list[Any]], **values: Any) -> None:
    for c in COLUMNS:
        rows[c].append(values[c])


def hist_row(rows: dict[str, list[Any]], ts_ns: int, host: str, source: str, device: str, op: str,
             window_s: float, buckets: list[Bucket], mean_s: float = math.nan, qd: float = math.nan) -> None:
    """Append one io_latency row from a microsecond histogram."""
    ios = float(sum(b.count for b in buckets))
    if math.isnan(mean_s):
        mean_s = mean_estimate(buckets) / 1e6
    _append(rows, ts=encode_ts(ts_ns), host=host, device=device, source=source, op=op,
            window_seconds=window_s, ios=ios, p50_seconds=percentile(buckets, 0.5) / 1e6,
            p99_seconds=percentile(buckets, 0.99) / 1e6, mean_seconds=mean_s, queue_depth=qd)


class _Window:
    """One window's maps: histograms and latency sums per (major, minor, rwbs), residence per device."""

    def __init__(self) -> None:
        self.hists: dict[tuple[int, int, str], list[Bucket]] = defaultdict(list)
        self.lat: dict[tuple[int, int, str], int] = defaultdict(int)
        self.qd: dict[tuple[int, int], int] = defaultdict(int)
        self.raced = False  # printed while still counting (see WindowAssembler.raced)


_MAP = re.compile(r"@(usecs|lat_ns|qd_ns)(?:_\d+)?")
_KEY_WIDTH = {"usecs": 3, "lat_ns": 3, "qd_ns": 2}


class WindowAssembler:
    """Turns the bpftrace program's output (text or json lines) into io_latency rows.

    The program's maps carry the kernel-clock window index as the first key part; a window
    becomes rows at the first ``triscope-window-end <nsecs>`` mark past its end (its maps are
    printed by then, see :data:`PROGRAM_DOC`); a window printed before its own interval ended
    was read while still counting and is counted in ``raced``. Maps without the index (older
    programs, and a bare mark) make one window ending at the mark. A bad line is logged (one
    line) and counted in ``errors``; the rest of the window is kept."""

    def __init__(self, host: str, fmt: str, interval_s: float) -> None:
        self.host, self.fmt, self.interval_s = host, fmt, interval_s
        self.window_ns = max(100, round(interval_s * 1000)) * 1_000_000
        self.rows = _rows()
        self.errors = 0
        self._wins: dict[int | None, _Window] = defaultdict(_Window)  # None: maps without a window key
        self._cur: tuple[int | None, int, int, str] | None = None
        self._window_start = time.time_ns()
        self._mark_start: int | None = None  # wall ns of the previous mark (or of BEGIN)
        self._live_from: int | None = None  # wall ns when counting started (clips the first window)
        self.clock_offset_ns = time.time_ns() - time.monotonic_ns()  # bpftrace nsecs -> wall clock
        self._stopped_at: int | None = None  # kernel ns of the stop mark: the last window ends there
        self.raced = 0
        """Windows printed while they were still being counted (bpftrace's user space ran more
        than :data:`AHEAD` windows late): their clear may have dropped requests."""
        self.live_seen = False
        """Whether the live mark of the running program has been read."""
        self.key_counts: dict[int, int] = {}
        """The running program's ``@keys`` counts as last printed (see :attr:`map_keys_held`)."""

    @property
    def stop_seen(self) -> bool:
        """Whether the stop mark has been read (and END's final mark not yet)."""
        return self._stopped_at is not None

    def _bad(self, msg: str) -> None:
        self.errors += 1
        log.warning("blockio: %s", msg)

    def feed(self, line: str, now_ns: int | None = None) -> None:
        """Consume one output line."""
        try:
            if self.fmt == "json":
                self._feed_json(line, now_ns)
            else:
                self._feed_text(line, now_ns)
        except (InputError, ValueError, KeyError, TypeError, IndexError) as exc:
            self._bad(f"bad bpftrace line ({type(exc).__name__}): {line.strip()[:120]!r}")

    def _feed_json(self, line: str, now_ns: int | None) -> None:
        import json

        s = line.strip()
        if not s:
            return
        record = json.loads(s)
        kind, maps = parse_bpftrace_json_record(record)
        if kind == "printf":
            self._mark(str(record.get("data", "")).strip(), now_ns)
            return
        for name, keyed in maps.items():
            for key, value in keyed.items():
                self._store(name, [p.strip() for p in key.split(",")], value)

    def _split_key(self, name: str, key: list[str]) -> tuple[str, int | None, list[str]] | None:
        m = _MAP.fullmatch(name)
        if m is None:
            return None
        width = _KEY_WIDTH[m[1]]
        if len(key) == width + 1:
            return m[1], int(key[0]), key[1:]
        if len(key) == width:
            return m[1], None, key
        raise InputError(f"{name}: key {key} has {len(key)} parts")

    @property
    def map_keys_held(self) -> int:
        """Entries of the fuller request-start map (``@start`` or ``@acct``) at the last interval:
        requests in flight plus the leftovers of skipped completions. The four counts are read one
        after another while the probes run, so the figure can be off by the requests of that
        instant (seen: -61 while ~40 were in flight); never below 0."""
        c = self.key_counts
        return max(0, c.get(0, 0) - c.get(1, 0), c.get(2, 0) - c.get(3, 0))

    def _store(self, name: str, key: list[str], value: Any) -> None:
        if name == "@keys":  # keys added to / removed from @start (0 / 1) and @acct (2 / 3)
            self.key_counts[int(key[0])] = int(value)
            return
        split = self._split_key(name, key)
        if split is None:
            return
        base, w, k = split
        win = self._wins[w]
        if base == "usecs":
            win.hists[(int(k[0]), int(k[1]), k[2])].extend(value)
        elif base == "lat_ns":
            win.lat[(int(k[0]), int(k[1]), k[2])] += int(value)
        else:
            win.qd[(int(k[0]), int(k[1]))] += int(value)

    def _feed_text(self, line: str, now_ns: int | None) -> None:
        from triscope.collectors.blockio_parse import _BT_HEAD, _BT_SCALAR, bpftrace_text_bucket

        s = line.strip()
        if not s:
            self._cur = None
            return
        if s.startswith((WINDOW_MARK, WINDOW_START_MARK, WINDOW_LIVE_MARK, WINDOW_FINAL_MARK, WINDOW_STOP_MARK)):
            self._mark(s, now_ns)
            return
        if self._cur is not None and (b := bpftrace_text_bucket(s)) is not None:
            w, ma, mi, rwbs = self._cur
            self._wins[w].hists[(ma, mi, rwbs)].append(b)
            return
        self._cur = None
        if (m := _BT_HEAD.match(s)) and (split := self._split_key("@" + m["name"], _text_key(m["key"]))):
            base, w, k = split
            if base == "usecs":
                self._cur = (w, int(k[0]), int(k[1]), k[2])
                self._wins[w].hists[(int(k[0]), int(k[1]), k[2])]
                return
        if m := _BT_SCALAR.match(s):
            self._store("@" + m["name"], _text_key(m["key"]), int(m["v"]))
            return
        if s.startswith(("Attaching", "ERROR: Unknown error -1: couldn't set RLIMIT_MEMLOCK")):
            return
        raise InputError("unrecognised line")

    def _mark(self, text: str, now_ns: int | None) -> None:
        """A window mark: ``triscope-window-start|end [nsecs]`` (nsecs: CLOCK_MONOTONIC)."""
        name, _, value = text.partition(" ")
        mono = int(value) if value.strip() else None
        if name in (WINDOW_START_MARK, WINDOW_LIVE_MARK) and mono is not None:
            self._mark_start = self._live_from = mono + self.clock_offset_ns
            self.live_seen = self.live_seen or name == WINDOW_LIVE_MARK
        elif name == WINDOW_MARK:
            self._close(now_ns, mono)
        elif name == WINDOW_STOP_MARK and mono is not None:
            self._stopped_at = mono
        elif name == WINDOW_FINAL_MARK and mono is not None:
            stopped = mono if self._stopped_at is None else min(mono, self._stopped_at)
            self._close(now_ns, stopped, final=True)
            self._stopped_at, self.live_seen = None, False
        else:
            raise InputError(f"unexpected printf {text[:60]!r}")

    def _close(self, now_ns: int | None, mono: int | None, final: bool = False) -> None:
        """Rows for every window that is complete at this mark (``final``: every window, the last
        one ending at the mark)."""
        now = now_ns if now_ns is not None else time.time_ns()
        end = now if mono is None else mono + self.clock_offset_ns
        cur = None if mono is None or final else mono // self.window_ns
        if cur is not None:
            self._check_not_live(cur)
        for w in sorted(k for k in self._wins if k is not None and (cur is None or k < cur)):
            start = w * self.window_ns + self.clock_offset_ns
            stop = start + self.window_ns
            if final and end < stop:
                stop = max(end, start + 1)
            if self._stopped_at is not None:  # counting stopped there; bpftrace's ticks go on a while
                stop = max(min(stop, self._stopped_at + self.clock_offset_ns), start + 1)
            if self._live_from is not None and self._live_from > start:
                start = min(self._live_from, stop - 1)  # the first window: only since counting started
            self._emit(self._wins.pop(w), start, (stop - start) / 1e9)
        legacy = self._wins.pop(None, None)
        if legacy is not None:  # maps without a window key: one window ending at this mark
            if mono is None:
                start, window = self._window_start, self.interval_s
            else:
                start = self._mark_start if self._mark_start is not None else end - round(self.interval_s * 1e9)
                window = (end - start) / 1e9 if end > start else self.interval_s
            self._emit(legacy, start, window)
        self._cur = None
        self._window_start = now if mono is None else end
        self._mark_start = end

    def _emit(self, win: _Window, start_ns: int, window_s: float) -> None:
        per: dict[tuple[int, int, str], list[Bucket]] = defaultdict(list)
        lat: dict[tuple[int, int, str], int] = defaultdict(int)
        for (ma, mi, rwbs), bs in win.hists.items():
            op = op_from_rwbs(rwbs)
            if op in ("read", "write"):
                per[(ma, mi, op)].extend(bs)
                lat[(ma, mi, op)] += win.lat.get((ma, mi, rwbs), 0)
        for (ma, mi, op), bs in sorted(per.items()):
            n = sum(b.count for b in bs)
            mean = lat[(ma, mi, op)] / n / 1e9 if n and lat[(ma, mi, op)] else math.nan
            if (ma, mi) in win.qd:
                qd = win.qd[(ma, mi)] / 1e9 / window_s
            else:  # Little's law over every request type of the device (flushes occupy the queue too)
                qd = sum(v for (a, b, _), v in win.lat.items() if (a, b) == (ma, mi)) / 1e9 / window_s
            hist_row(self.rows, start_ns, self.host, "bpftrace", device_name(ma, mi), op, window_s, bs, mean, qd)

    def _check_not_live(self, cur: int) -> None:
        """At the mark of an interval that fired in window ``cur``: the maps printed before it
        should only hold earlier windows; one at or after ``cur`` was read while counting."""
        for w, win in self._wins.items():
            if w is None or w < cur or win.raced:
                continue
            win.raced = True
            self.raced += 1
            log.warning("blockio: bpftrace printed window %d while it was still counting (its output "
                        "ran more than %d windows late); that window may miss requests", w, AHEAD)

    def drain(self) -> dict[str, list[Any]]:
        rows, self.rows = self.rows, _rows()
        return rows


def _text_key(key: str | None) -> list[str]:
    return [p.strip() for p in (key or "").split(",")]


def bpftrace_program(interval_s: float, accounting: bool, buffers: int = BUFFERS, control_magic: int = 0) -> str:
    """The program for windows of ``interval_s`` (whole ms, at least 100); the IO-accounting
    probes (lines tagged ``// acct``) only with ``accounting``; the control probe (``// ctl``,
    see :data:`CONTROL_MAGIC_BASE`) and the live gate on completions only with a ``control_magic``."""
    ms = max(100, round(interval_s * 1000))
    text = (_PROGRAM_HEAD.replace("__STORES__", "\n".join(_STORE.format(i=i) for i in range(buffers)))
            .replace("__FLUSHES__", "\n".join(_FLUSH.format(i=i) for i in range(buffers)))
            .replace("__FINAL__", "\n".join(_FINAL.format(i=i) for i in range(buffers)))
            .replace("__WINDOW_NS__", str(ms * 1_000_000)).replace("__BUFFERS__", str(buffers))
            .replace("__AHEAD__", str(AHEAD))
            .replace("__INTERVAL_MS__", str(ms))
            .replace("__WHILE_LIVE__", " && @state == 1" if control_magic else "")
            .replace("__LIVE_MAGIC__", str(control_magic)).replace("__STOP_MAGIC__", str(control_magic + 1)))
    kept = [ln for ln in text.splitlines()
            if (accounting or "// acct" not in ln) and (control_magic or "// ctl" not in ln)]
    return "\n".join(ln.split("  // acct")[0].split("  // ctl")[0] for ln in kept) + "\n"


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


class BpftraceCollector:
    """Runs the embedded bpftrace program and parses its per-window output continuously."""

    name = "blockio_bpftrace"

    def __init__(self, config: dict[str, Any] | None = None) -> None:
        cfg = {**DEFAULTS, **((config or {}).get("blockio", {}))}
        self.interval_s = float(cfg["interval_s"])
        self.fmt = str(cfg["format"])
        if self.fmt not in ("text", "json"):
            raise InputError(f"blockio: format must be text or json, not {self.fmt!r}")
        self.host = cfg["host"] or socket.gethostname()
        try:
            self.restart_at_keys = int(cfg["restart_at_map_keys"])
        except (TypeError, ValueError):
            raise InputError("blockio: restart_at_map_keys must be an integer, "
                             f"not {cfg['restart_at_map_keys']!r}") from None
        if not 1 <= self.restart_at_keys <= MAP_KEYS_MAX:
            raise InputError(f"blockio: restart_at_map_keys must be within 1..{MAP_KEYS_MAX}")
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
            with self._lock:
                self.asm.feed(line)

    def _read_err(self) -> None:
        assert self._proc and self._proc.stderr
        for line in self._proc.stderr:
            if "RLIMIT_MEMLOCK" not in line:
                self.stderr = (self.stderr + line)[-4000:]

    @property
    def buffer(self) -> WindowAssembler:
        """Rows arrive after close() too (END prints the last windows): the daemon collects once more."""
        return self.asm

    def collect(self) -> dict[str, dict[str, list[Any]]]:
        if self._proc is not None and self._proc.poll() is not None and self.stderr:
            log.warning("blockio: bpftrace exited %s: %s", self._proc.returncode,
                        self.stderr.strip().splitlines()[-1])
        self._count_misses()
        self._restart_if_maps_may_fill()
        with self._lock:
            rows = self.asm.drain()
        return {TABLE: rows} if rows["ts"] else {}

    @property
    def missed_probe_runs(self) -> int:
        """Probe runs the kernel skipped so far, every bpftrace process of this collector together
        (BPF recursion): requests missing from the counts."""
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


class DiskstatsCollector:
    """Average latency and queue depth per device from successive /proc/diskstats snapshots."""

    name = "blockio_diskstats"

    def __init__(self, config: dict[str, Any] | None = None, path: str = "/proc/diskstats") -> None:
        cfg = {**DEFAULTS, **((config or {}).get("blockio", {}))}
        self.interval_s = float(cfg["interval_s"])
        self.host = cfg["host"] or socket.gethostname()
        self.path = path
        self._prev: tuple[int, dict] | None = None

    def _snap(self) -> tuple[int, dict]:
        return time.time_ns(), parse_diskstats(Path(self.path).read_text())

    def start(self) -> None:
        self._prev = self._snap()

    def collect(self) -> dict[str, dict[str, list[Any]]]:
        try:
            now = self._snap()
        except (InputError, OSError) as exc:
            log.warning("blockio: %s", exc)
            return {}
        if self._prev is None:
            self._prev = now
            return {}
        (t0, before), (t1, after) = self._prev, now
        self._prev = now
        window = (t1 - t0) / 1e9
        rows = _rows()
        for d in diskstats_delta(before, after, window):
            if d.ios == 0 and d.queue_depth == 0:
                continue
            _append(rows, ts=encode_ts(t0), host=self.host, device=d.device, source="diskstats", op=d.op,
                    window_seconds=window, ios=d.ios, p50_seconds=math.nan, p99_seconds=math.nan,
                    mean_seconds=d.mean_seconds, queue_depth=d.queue_depth)
        return {TABLE: rows} if rows["ts"] else {}

    def close(self) -> None:
        self._prev = None


class EbpfExporterCollector:
    """Scrapes ebpf_exporter's bio latency histograms; rows from bucket deltas between scrapes."""

    name = "blockio_ebpf_exporter"

    def __init__(self, config: dict[str, Any] | None = None) -> None:
        cfg = {**DEFAULTS, **((config or {}).get("blockio", {}))}
        self.interval_s = float(cfg["interval_s"])
        self.url = str(cfg["url"])
        self.max_body_bytes = int(cfg["max_body_bytes"])
        self.host = cfg["host"] or socket.gethostname()
        self._prev: tuple[int, dict[tuple[str, str], list[Bucket]]] | None = None

    def start(self) -> None:
        """Nothing held: each collect() is one GET."""

    def fetch(self) -> str:
        try:
            with urllib.request.urlopen(self.url, timeout=5) as resp:
                body = resp.read(self.max_body_bytes + 1)
        except (OSError, ValueError) as exc:
            raise InputError(f"{self.url}: scrape failed: {getattr(exc, 'reason', exc)}") from None
        if len(body) > self.max_body_bytes:
            raise InputError(f"{self.url}: response exceeds {self.max_body_bytes} bytes")
        return body.decode("utf-8", errors="replace")

    def rows_from_text(self, text: str, ts_ns: int) -> dict[str, list[Any]]:
        """Rows for the window since the previous scrape (none on the first one)."""
        cur = {(h.device, h.op): h.buckets for h in parse_ebpf_exporter(text)}
        rows = _rows()
        if self._prev is not None:
            t0, prev = self._prev
            for (dev, op), bs in cur.items():
                old = {(b.lo, b.hi): b.count for b in prev.get((dev, op), [])}
                delta = [Bucket(b.lo, b.hi, max(b.count - old.get((b.lo, b.hi), 0.0), 0.0)) for b in bs]
                if sum(b.count for b in delta) > 0:
                    hist_row(rows, t0, self.host, "ebpf_exporter", dev, op, (ts_ns - t0) / 1e9, delta)
        self._prev = (ts_ns, cur)
        return rows

    def collect(self) -> dict[str, dict[str, list[Any]]]:
        try:
            rows = self.rows_from_text(self.fetch(), time.time_ns())
        except InputError as exc:
            log.warning("%s", exc)
            return {}
        return {TABLE: rows} if rows["ts"] else {}

    def close(self) -> None:
        self._prev = None


def bpftrace_unavailable_reason() -> str:
    """Why the bpftrace collector cannot run here ("" when it can)."""
    if shutil.which("bpftrace") is None:
        return "bpftrace is not installed"
    if os.geteuid() != 0:
        return "not running as root"
    return ""


def bpftrace_factory(config: dict[str, Any]) -> BpftraceCollector | DiskstatsCollector:
    """bpftrace collector, or the diskstats fallback with a one-line log saying why."""
    reason = bpftrace_unavailable_reason()
    if reason:
        log.warning("blockio: %s; falling back to /proc/diskstats (mean latency only, no p50/p99)", reason)
        return DiskstatsCollector(config)
    return BpftraceCollector(config)


def diskstats_factory(config: dict[str, Any]) -> DiskstatsCollector:
    """/proc/diskstats collector."""
    return DiskstatsCollector(config)


def ebpf_exporter_factory(config: dict[str, Any]) -> EbpfExporterCollector:
    """ebpf_exporter scrape collector (``[blockio] url``)."""
    return EbpfExporterCollector(config)


factory = bpftrace_factory
_ = Hist
