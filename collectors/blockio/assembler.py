"""Turns the bpftrace program's output (text or json lines) into ``io_latency`` rows, per kernel-clock window."""

from __future__ import annotations

import json
import logging
import math
import re
import time
from collections import defaultdict, deque
from collections.abc import Iterable, Mapping
from typing import Any

from triscope.collectors.blockio.devices import device_name
from triscope.collectors.blockio.parse import (
    _BT_HEAD,
    _BT_SCALAR,
    Bucket,
    bpftrace_text_bucket,
    mean_estimate,
    op_from_rwbs,
    parse_bpftrace_json_record,
    percentile,
)
from triscope.collectors.blockio.program import (
    AHEAD,
    BUFFERS,
    MARKS,
    WINDOW_FINAL_MARK,
    WINDOW_LIVE_MARK,
    WINDOW_MARK,
    WINDOW_START_MARK,
    WINDOW_STOP_MARK,
)
from triscope.errors import InputError
from triscope.schema import IO_LATENCY, encode_ts

log = logging.getLogger(__name__)


def extend_rows(cols: dict[str, list[Any]], rows: Iterable[Mapping[str, Any]]) -> None:
    """Append row dicts to an ``io_latency`` column batch (an unknown key raises)."""
    for name, values in IO_LATENCY.columns_of(rows).items():
        cols[name].extend(values)


def hist_row(ts_ns: int, host: str, source: str, device: str, op: str, window_s: float, buckets: list[Bucket],
             mean_s: float = math.nan, qd: float = math.nan) -> dict[str, Any]:
    """One io_latency row from a microsecond histogram (mean estimated from it unless given)."""
    if math.isnan(mean_s):
        mean_s = mean_estimate(buckets) / 1e6
    return {"ts": encode_ts(ts_ns), "host": host, "device": device, "source": source, "op": op,
            "window_seconds": window_s, "ios": float(sum(b.count for b in buckets)),
            "p50_seconds": percentile(buckets, 0.5) / 1e6, "p99_seconds": percentile(buckets, 0.99) / 1e6,
            "mean_seconds": mean_s, "queue_depth": qd}


class _Window:
    """One window's maps: histograms and latency sums per (major, minor, rwbs), residence per device."""

    def __init__(self) -> None:
        self.hists: dict[tuple[int, int, str], list[Bucket]] = defaultdict(list)
        self.lat: dict[tuple[int, int, str], int] = defaultdict(int)
        self.qd: dict[tuple[int, int], int] = defaultdict(int)
        self.raced = False  # printed while still counting (see WindowAssembler.raced)


_MAP = re.compile(r"@(usecs|lat_ns|qd_ns)(?:_\d+)?")
_KEY_WIDTH = {"usecs": 3, "lat_ns": 3, "qd_ns": 2}


def _text_key(key: str | None) -> list[str]:
    return [p.strip() for p in (key or "").split(",")]


class WindowAssembler:
    """Rows from the program's output.

    The maps carry the kernel-clock window index as the first key part; a window becomes rows
    at the first ``triscope-window-end <nsecs>`` mark past its end; one printed before its own
    interval ended was read while still counting, and one whose map set a mark read late may
    have cleared after it began: both are counted in ``raced`` (``feed``'s ``read_ns`` gives the
    read time). Maps without the index (older programs, and a bare mark) make one window ending
    at the mark. A bad line is logged (one line) and counted in ``errors``; the rest of the
    window is kept."""

    def __init__(self, host: str, fmt: str, interval_s: float) -> None:
        self.host, self.fmt, self.interval_s = host, fmt, interval_s
        self.window_ns = max(100, round(interval_s * 1000)) * 1_000_000
        self.rows = IO_LATENCY.empty_columns()
        self.errors = 0
        self._wins: dict[int | None, _Window] = defaultdict(_Window)  # None: maps without a window key
        self._cur: tuple[int | None, int, int, str] | None = None
        self._window_start = time.time_ns()
        self._mark_start: int | None = None  # wall ns of the previous mark (or of BEGIN)
        self._live_from: int | None = None  # wall ns when counting started (clips the first window)
        self.clock_offset_ns = time.time_ns() - time.monotonic_ns()  # bpftrace nsecs -> wall clock
        self._stopped_at: int | None = None  # kernel ns of the stop mark: the last window ends there
        self.raced = 0
        """Windows made into rows that may miss requests: bpftrace's user space ran more than
        :data:`AHEAD` windows late, and printed the window while it was counting or cleared its
        map set after it began (the clear drops what was counted since the print)."""
        self.raced_windows: deque[int] = deque(maxlen=1024)
        """The latest such windows' indexes (``start // window_ns`` on the kernel clock)."""
        self._late: list[tuple[int, int]] = []  # (window of a mark's interval, window it was read in)
        self._read_ns: int | None = None
        self.live_seen = False
        """Whether the live mark of the running program has been read."""
        self.key_counts: dict[int, int] = {}
        """The running program's ``@keys`` counts as last printed (see :attr:`map_keys_held`)."""

    @property
    def stop_seen(self) -> bool:
        """Whether the stop mark has been read (and END's final mark not yet)."""
        return self._stopped_at is not None

    @property
    def map_keys_held(self) -> int:
        """Entries of the fuller request-start map (``@start`` or ``@acct``) at the last interval.

        The four counts are read one after another while the probes run, so the figure can be
        off by the requests of that instant; never below 0."""
        c = self.key_counts
        return max(0, c.get(0, 0) - c.get(1, 0), c.get(2, 0) - c.get(3, 0))

    def feed(self, line: str, now_ns: int | None = None, read_ns: int | None = None) -> None:
        """Consume one output line; ``read_ns``: when it was read (CLOCK_MONOTONIC), which bounds
        when bpftrace ran the clears before it (None: not known, e.g. a saved file)."""
        self._read_ns = read_ns
        try:
            if self.fmt == "json":
                self._feed_json(line, now_ns)
            else:
                self._feed_text(line, now_ns)
        except (InputError, ValueError, KeyError, TypeError, IndexError) as exc:
            self.errors += 1
            log.warning("blockio: bad bpftrace line (%s): %r", type(exc).__name__, line.strip()[:120])

    def drain(self) -> dict[str, list[Any]]:
        """The rows made so far (every io_latency column), and a fresh batch."""
        rows, self.rows = self.rows, IO_LATENCY.empty_columns()
        return rows

    def _feed_json(self, line: str, now_ns: int | None) -> None:
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

    def _feed_text(self, line: str, now_ns: int | None) -> None:
        s = line.strip()
        if not s:
            self._cur = None
            return
        if s.startswith(MARKS):
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
                self._wins[w].hists[(int(k[0]), int(k[1]), k[2])]  # an empty histogram is a window too
                return
        if m := _BT_SCALAR.match(s):
            self._store("@" + m["name"], _text_key(m["key"]), int(m["v"]))
            return
        if s.startswith(("Attaching", "ERROR: Unknown error -1: couldn't set RLIMIT_MEMLOCK")):
            return
        raise InputError("unrecognised line")

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

    def _mark(self, text: str, now_ns: int | None) -> None:
        """A window mark: ``triscope-window-<kind> [nsecs]`` (nsecs: CLOCK_MONOTONIC)."""
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
            self._stopped_at, self.live_seen, self._late = None, False, []
        else:
            raise InputError(f"unexpected printf {text[:60]!r}")

    def _close(self, now_ns: int | None, mono: int | None, final: bool = False) -> None:
        """Rows for every window complete at this mark (``final``: every window, the last one ending at the mark)."""
        now = now_ns if now_ns is not None else time.time_ns()
        end = now if mono is None else mono + self.clock_offset_ns
        cur = None if mono is None or final else mono // self.window_ns
        if cur is not None:
            self._check_not_live(cur)
            if self._read_ns is not None and self._read_ns // self.window_ns > cur + AHEAD:
                self._late.append((cur, self._read_ns // self.window_ns))
            # windows this old are printed by now (three ticks each, then their set's next turn)
            self._late = [(c, read_in) for c, read_in in self._late if read_in >= cur - 2 * BUFFERS]
        for w in sorted(k for k in self._wins if k is not None and (cur is None or k < cur)):
            start = w * self.window_ns + self.clock_offset_ns
            stop = start + self.window_ns
            if final and end < stop:
                stop = max(end, start + 1)
            if self._stopped_at is not None:  # counting stopped there; bpftrace's ticks go on a while
                stop = max(min(stop, self._stopped_at + self.clock_offset_ns), start + 1)
            if self._live_from is not None and self._live_from > start:
                start = min(self._live_from, stop - 1)  # the first window: only since counting started
            win = self._wins.pop(w)
            if win.raced or self._cleared_late(w):
                self._count_raced(w)
            self._emit(win, start, (stop - start) / 1e9)
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
        rows = []
        for (ma, mi, op), bs in sorted(per.items()):
            n = sum(b.count for b in bs)
            mean = lat[(ma, mi, op)] / n / 1e9 if n and lat[(ma, mi, op)] else math.nan
            if (ma, mi) in win.qd:
                qd = win.qd[(ma, mi)] / 1e9 / window_s
            else:  # Little's law over every request type of the device (flushes occupy the queue too)
                qd = sum(v for (a, b, _), v in win.lat.items() if (a, b) == (ma, mi)) / 1e9 / window_s
            rows.append(hist_row(start_ns, self.host, "bpftrace", device_name(ma, mi), op, window_s, bs, mean, qd))
        extend_rows(self.rows, rows)

    def _check_not_live(self, cur: int) -> None:
        """At the mark of an interval that fired in window ``cur``: the maps printed before it
        should only hold earlier windows; one at or after ``cur`` was read while counting."""
        for w, win in self._wins.items():
            if w is not None and w >= cur:
                win.raced = True

    def _cleared_late(self, w: int) -> bool:
        """Whether an interval's clears may have hit window ``w`` while it counted: the interval
        (window ``cur``) cleared the sets windows ``cur + AHEAD + 1 .. cur + BUFFERS - 1`` count
        into next (and every BUFFERS windows after), and ran before its mark was read. A print
        just before the window began and a clear just after it (bpftrace preempted or blocked on
        a full pipe between them) lose counts that no print shows."""
        return any(cur < w <= read_in and (w - cur) % BUFFERS > AHEAD for cur, read_in in self._late)

    def _count_raced(self, w: int) -> None:
        self.raced += 1
        self.raced_windows.append(w)
        if self.raced in (1, 10) or self.raced % 100 == 0:
            log.warning("blockio: window %d may miss requests: bpftrace's output ran more than %d windows "
                        "late, so it printed or cleared the window while it was counting (%d such windows "
                        "so far)", w, AHEAD, self.raced)
