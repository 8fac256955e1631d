"""Block-IO latency collectors for ``io_latency``: bpftrace (tracepoints), ebpf_exporter, /proc/diskstats.

Load from ``triscope run`` as ``triscope.collectors.blockio:bpftrace_factory`` (falls back to
diskstats when bpftrace is missing or we are not root), ``:ebpf_exporter_factory`` or
``:diskstats_factory``. Config section ``[blockio]``: interval_s, format ("text"|"json"), url, host.
"""

from __future__ import annotations

import logging
import math
import os
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
from triscope.collectors.span_mapping import ns_to_ts_text
from triscope.errors import InputError, TriscopeError

log = logging.getLogger(__name__)
TABLE = "io_latency"
COLUMNS = ["ts", "host", "device", "source", "op", "window_seconds", "ios", "p50_seconds",
           "p99_seconds", "mean_seconds", "queue_depth"]
DEFAULTS: dict[str, Any] = {"interval_s": 1.0, "format": "json", "url": "http://127.0.0.1:9435/metrics",
                            "host": "", "max_body_bytes": 16 << 20}
WINDOW_MARK = "triscope-window-end"

WINDOW_START_MARK = "triscope-window-start"

BPFTRACE_PROGRAM = r"""
BEGIN
{
  printf("triscope-window-start %llu\n", nsecs);
}

tracepoint:block:block_io_start  // acct
{  // acct
  @acct[args->dev, args->sector] = nsecs;  // acct
}  // acct

tracepoint:block:block_rq_merge  // acct
{  // acct
  delete(@acct[args->dev, args->sector]);  // acct
}  // acct

tracepoint:block:block_rq_issue
{
  @start[args->dev, args->sector] = nsecs;
}

tracepoint:block:block_rq_complete
/@start[args->dev, args->sector] > 0/
{
  $d = args->dev;
  $n = nsecs;
  $s = @start[$d, args->sector];
  $lat = $n - $s;
  @usecs[$d >> 20, $d & 0xfffff, args->rwbs] = hist($lat / 1000);
  @lat_ns[$d >> 20, $d & 0xfffff, args->rwbs] = sum($lat);
  $q = $s;
  $a = @acct[$d, args->sector];  // acct
  if ($a > 0 && $a <= $s) { $q = $a; }  // acct
  delete(@acct[$d, args->sector]);  // acct
  @qd_ns[$d >> 20, $d & 0xfffff] = sum($n - $q);
  delete(@start[$d, args->sector]);
}

tracepoint:block:block_rq_requeue
{
  delete(@start[args->dev, args->sector]);
}

interval:s:__INTERVAL__
{
  print(@usecs);
  print(@lat_ns);
  print(@qd_ns);
  clear(@usecs);
  clear(@lat_ns);
  clear(@qd_ns);
  printf("triscope-window-end %llu\n", nsecs);
}

END
{
  clear(@start); clear(@usecs); clear(@lat_ns); clear(@qd_ns);
  clear(@acct);  // acct
}
"""
"""Per window (``nsecs`` is CLOCK_MONOTONIC; the marks carry the window bounds):

- ``@usecs[major, minor, rwbs]``: log2 histogram of device latency, driver issue -> completion
  (``block_rq_issue`` -> ``block_rq_complete``), and ``@lat_ns`` its exact sum (mean latency).
- ``@qd_ns[major, minor]``: summed queue residence of the requests completing in the window, from
  the kernel's IO-accounting start (``block_io_start``, kernel >= 6.5) to completion. By Little's
  law ``qd_ns / window`` is the mean number of requests queued or in flight: the same quantity as
  /proc/diskstats' weighted time (iostat ``aqu-sz``), which counts from the request's
  ``start_time_ns``, so the bpftrace and diskstats collectors report one ``queue_depth``. Without
  ``block_io_start`` (older kernels) residence counts from driver issue: in-flight depth only.
  (Not a counter incremented in the probes: ``@n = @n + 1`` is not atomic across CPUs, lost
  updates make it drift; ``hist()``/``sum()`` are per-CPU aggregations.)

Requests are keyed by (dev, sector). Two requests in flight on the same sector at once (rare:
concurrent flushes, the same block read twice) collide: the first completion takes the later
start and the second is not counted, so ``ios`` can only undercount. A requeued request restarts
its device latency at re-issue; a request merged into another is dropped from ``@acct``."""


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
    _append(rows, ts=ns_to_ts_text(ts_ns), host=host, device=device, source=source, op=op,
            window_seconds=window_s, ios=ios, p50_seconds=percentile(buckets, 0.5) / 1e6,
            p99_seconds=percentile(buckets, 0.99) / 1e6, mean_seconds=mean_s, queue_depth=qd)


class WindowAssembler:
    """Turns the bpftrace program's per-window output (text or json lines) into io_latency rows.

    Feed lines with :meth:`feed`; a window closes at the ``triscope-window-end`` marker. A bad line
    is logged (one line) and counted in ``errors``; the rest of the window is kept."""

    def __init__(self, host: str, fmt: str, interval_s: float) -> None:
        self.host, self.fmt, self.interval_s = host, fmt, interval_s
        self.rows = _rows()
        self.errors = 0
        self._hists: dict[tuple[int, int, str], list[Bucket]] = defaultdict(list)
        self._lat: dict[tuple[int, int, str], int] = defaultdict(int)
        self._qd: dict[tuple[int, int], int] = defaultdict(int)
        self._cur: tuple[int, int, str] | None = None
        self._window_start = time.time_ns()
        self._mark_start: int | None = None  # wall ns of the window start, from the program's marks
        self.clock_offset_ns = time.time_ns() - time.monotonic_ns()  # bpftrace nsecs -> wall clock

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
                self._store(name, [int(p) if p.lstrip("-").isdigit() else p for p in key.split(",")], value)

    def _store(self, name: str, key: list[Any], value: Any) -> None:
        if name == "@usecs":
            self._hists[(int(key[0]), int(key[1]), str(key[2]))].extend(value)
        elif name == "@lat_ns":
            self._lat[(int(key[0]), int(key[1]), str(key[2]))] += int(value)
        elif name == "@qd_ns":
            self._qd[(int(key[0]), int(key[1]))] += int(value)

    def _feed_text(self, line: str, now_ns: int | None) -> None:
        from triscope.collectors.blockio_parse import _BT_HEAD, _BT_SCALAR, bpftrace_text_bucket

        s = line.strip()
        if not s:
            self._cur = None
            return
        if s.startswith((WINDOW_MARK, WINDOW_START_MARK)):
            self._mark(s, now_ns)
            return
        if self._cur is not None and (b := bpftrace_text_bucket(s)) is not None:
            self._hists[self._cur].append(b)
            return
        self._cur = None
        if (m := _BT_HEAD.match(s)) and m["name"] == "usecs":
            k = [p.strip() for p in (m["key"] or "").split(",")]
            self._cur = (int(k[0]), int(k[1]), k[2])
            self._hists[self._cur]  # noqa: B018 - create the entry
            return
        if m := _BT_SCALAR.match(s):
            self._store("@" + m["name"], [p.strip() for p in (m["key"] or "").split(",")], int(m["v"]))
            return
        if s.startswith(("Attaching", "ERROR: Unknown error -1: couldn't set RLIMIT_MEMLOCK")):
            return
        raise InputError("unrecognised line")

    def _mark(self, text: str, now_ns: int | None) -> None:
        """A window mark: ``triscope-window-start|end [nsecs]`` (nsecs: CLOCK_MONOTONIC)."""
        name, _, value = text.partition(" ")
        mono = int(value) if value.strip() else None
        if name == WINDOW_START_MARK and mono is not None:
            self._mark_start = mono + self.clock_offset_ns
        elif name == WINDOW_MARK:
            self._close(now_ns, None if mono is None else mono + self.clock_offset_ns)
        else:
            raise InputError(f"unexpected printf {text[:60]!r}")

    def _close(self, now_ns: int | None, end_ns: int | None = None) -> None:
        """Rows for the window ending now. With the program's marks the window is exactly
        [previous mark, this mark] on the kernel clock; a bare mark means one interval ending now."""
        now = now_ns if now_ns is not None else time.time_ns()
        window = self.interval_s
        if end_ns is not None:
            start = self._mark_start if self._mark_start is not None else end_ns - round(window * 1e9)
            if end_ns > start:
                window = (end_ns - start) / 1e9
            self._window_start, self._mark_start, now = start, end_ns, end_ns
        per: dict[tuple[int, int, str], list[Bucket]] = defaultdict(list)
        lat: dict[tuple[int, int, str], int] = defaultdict(int)
        for (ma, mi, rwbs), bs in self._hists.items():
            op = op_from_rwbs(rwbs)
            if op in ("read", "write"):
                per[(ma, mi, op)].extend(bs)
                lat[(ma, mi, op)] += self._lat.get((ma, mi, rwbs), 0)
        for (ma, mi, op), bs in sorted(per.items()):
            n = sum(b.count for b in bs)
            mean = lat[(ma, mi, op)] / n / 1e9 if n and lat[(ma, mi, op)] else math.nan
            if (ma, mi) in self._qd:
                qd = self._qd[(ma, mi)] / 1e9 / window
            else:  # Little's law over every request type of the device (flushes occupy the queue too)
                qd = sum(v for (a, b, _), v in self._lat.items() if (a, b) == (ma, mi)) / 1e9 / window
            hist_row(self.rows, self._window_start, self.host, "bpftrace", device_name(ma, mi), op, window,
                     bs, mean, qd)
        self._hists.clear()
        self._lat.clear()
        self._qd.clear()
        self._cur = None
        self._window_start = now

    def drain(self) -> dict[str, list[Any]]:
        rows, self.rows = self.rows, _rows()
        return rows


def bpftrace_program(interval_s: float, accounting: bool) -> str:
    """The program with a whole-second interval; lines tagged ``// acct`` only with ``accounting``."""
    lines = BPFTRACE_PROGRAM.replace("__INTERVAL__", str(max(1, round(interval_s)))).splitlines()
    return "\n".join(ln.split("  // acct")[0] for ln in lines if accounting or "// acct" not in ln) + "\n"


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
        self.binary = shutil.which("bpftrace")
        self.asm = WindowAssembler(self.host, self.fmt, self.interval_s)
        self._proc: subprocess.Popen[str] | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self.stderr = ""

    def program(self) -> str:
        """The bpftrace program for this kernel (IO-accounting probes only when it has them)."""
        return bpftrace_program(self.interval_s, has_tracepoint("block", "block_io_start"))

    def start(self) -> None:
        if not self.binary:
            raise TriscopeError("blockio: bpftrace is not installed")
        mount_tracefs()
        self.asm.clock_offset_ns = time.time_ns() - time.monotonic_ns()
        args = [self.binary] + (["-f", "json"] if self.fmt == "json" else []) + ["-e", self.program()]
        self._proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                      bufsize=1, env={**os.environ, "BPFTRACE_STRLEN": "16"})
        self._thread = threading.Thread(target=self._read, name="blockio-bpftrace", daemon=True)
        self._thread.start()
        threading.Thread(target=self._read_err, daemon=True).start()

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

    def collect(self) -> dict[str, dict[str, list[Any]]]:
        if self._proc is not None and self._proc.poll() is not None and self.stderr:
            log.warning("blockio: bpftrace exited %s: %s", self._proc.returncode,
                        self.stderr.strip().splitlines()[-1])
        with self._lock:
            rows = self.asm.drain()
        return {TABLE: rows} if rows["ts"] else {}

    def close(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
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
            _append(rows, ts=ns_to_ts_text(t0), host=self.host, device=d.device, source="diskstats", op=d.op,
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
            with urllib.request.urlopen(self.url, timeout=5) as resp:  # noqa: S310
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
