"""One cause per incident, with the runners-up, the evidence in figures and the lead times.

Each rule scores 0..1 from the windows of the incident's backends and of the fleet, over the
incident and the ``baseline_s`` before its first breach (docs/diagnose.md, "Incidents", has the table).
The highest score under 0.3 is no cause: ``unknown``, with the signals that were missing.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from triscope.analyzers.incidents.config import IncidentsConfig
from triscope.analyzers.incidents.model import UNKNOWN, Cause
from triscope.analyzers.incidents.series import HostWindow, IoWindow, Window

MIN_SCORE = 0.3
KV_LEAD = 0.8
"""KV usage whose first crossing is reported as a lead indicator."""
SHARE_WINDOWS = 6
"""A backend's share of the requests is judged over the incident's first this many windows (from two before
its onset)."""


class BreachLike(Protocol):
    @property
    def backend(self) -> str: ...

    @property
    def start_s(self) -> float: ...


@dataclass
class Explanation:
    cause: Cause
    runners_up: list[Cause]
    lead_times_s: dict[str, float] = field(default_factory=dict)
    missing: list[str] = field(default_factory=list)
    completed_drop_ratio: float = math.nan
    kv_at_breach: float = math.nan
    p99_growth: float = math.nan


def _in(series: Mapping[float, Window], lo: float, hi: float) -> list[Window]:
    return [w for t, w in sorted(series.items()) if lo <= t < hi]


def _fleet_rates(windows: Mapping[str, Mapping[float, Window]], window_s: float) -> dict[float, float]:
    """Completed requests per second of the whole fleet per window: spans, else the engines' counters."""
    rates: dict[float, float] = {}
    for series in windows.values():
        ordered = sorted(series.items())
        spans = any(w.classes for _, w in ordered)
        prev = math.nan
        for t, w in ordered:
            if spans:
                rate = w.requests / window_s
            else:
                rate = (w.finished_total - prev) / window_s if math.isfinite(prev) and w.finished_total >= prev else 0
                prev = w.finished_total if math.isfinite(w.finished_total) else prev
            rates[t] = rates.get(t, 0.0) + rate
    return rates


def _first(items: Iterable[tuple[float, bool]]) -> float:
    return next((t for t, hit in sorted(items) if hit), math.nan)


def explain(breaches: Sequence[BreachLike], windows: Mapping[str, Mapping[float, Window]], io: Mapping[float, IoWindow],
            cfg: IncidentsConfig, host: Mapping[float, HostWindow] | None = None) -> Explanation:
    onset = min(b.start_s for b in breaches)
    end = max(b.start_s for b in breaches) + cfg.window_s
    hit = sorted({b.backend for b in breaches})
    fleet = sorted(windows)
    lo = onset - cfg.baseline_s
    near = onset - 2 * cfg.window_s
    rates = _fleet_rates(windows, cfg.window_s)
    base = [r for t, r in sorted(rates.items()) if lo <= t < onset - 2 * cfg.window_s]
    # a step that began inside the look-back raises its median: the median of its first half is the floor
    baseline = min(statistics.median(base), statistics.median(base[:max(1, len(base) // 2)])) if base else math.nan
    during = [r for t, r in rates.items() if onset <= t < end]
    drop = 1 - statistics.mean(during) / baseline if during and baseline and math.isfinite(baseline) else math.nan
    leads: dict[str, float] = {}
    high = (1 + cfg.qps_jump) * baseline
    # sustained: a window over it and its mean with the next over it too (one noisy window of a small fleet is
    # no jump, and a real +50 % step on 2 engines' ~45 requests a window falls under +30 % in one window of
    # two by Poisson noise alone); up to two windows after the onset, since a step lands in the window it
    # starts in and can breach there at once, and no later: a burst a minute into an incident (clients
    # retrying, held arrivals let go) is its effect, not its cause
    jump_at = (_first((t, r >= high and (r + rates.get(t + cfg.window_s, 0.0)) / 2 >= high)
                      for t, r in rates.items() if lo <= t < min(end, onset + 3 * cfg.window_s))
               if math.isfinite(baseline) and baseline > 0 else math.nan)
    since = min(onset, jump_at) if math.isfinite(jump_at) else onset
    rising = _load_rising(windows, lo, min(near, since), since, end, cfg.qps_jump)
    # the fleet's offered load jumped and most engines hold more requests since: the fleet is short of capacity,
    # however few of its backends breached first
    load_rose = math.isfinite(jump_at) and len(rising) >= max(2, math.ceil(len(windows) / 2))
    mine = {b: _in(windows.get(b, {}), lo, end) for b in hit}
    kv_at = _first((w.start_s, w.kv_usage >= min(KV_LEAD, cfg.kv_high)) for ws in mine.values() for w in ws)
    pre_at = _first((w.start_s, w.preemptions > 0) for ws in mine.values() for w in ws)
    wait_at = _first((w.start_s, w.waiting_capacity > 0 or (w.queue > 0 and w.queue > w.running))
                     for ws in mine.values() for w in ws)
    down_at = _first((w.start_s, w.scrape_up == 0) for ws in mine.values() for w in ws)
    io_at = _first((t, _io_trouble(w, cfg)) for t, w in io.items() if lo <= t < end)
    host = host or {}
    cpu_at = _first((w.start_s, w.cpu_wait_ratio >= cfg.cpu_wait) for ws in mine.values() for w in ws)
    oom_at = _first((t, h.oom_kills > 0) for t, h in host.items() if lo <= t < end)
    for name, t in (("qps_jump", jump_at), ("kv_usage", kv_at), ("preemptions", pre_at), ("waiting", wait_at),
                    ("scrape_failed", down_at), ("io_latency", io_at), ("cpu_wait", cpu_at), ("oom_kill", oom_at)):
        if math.isfinite(t):
            leads[name] = onset - t
    # a disk in trouble from before the breach (or its first window): the rules below defer to it
    disk_first = leads.get("io_latency", -1.0) >= 0
    starved = {b: w for b in hit if (w := _cpu_starved(mine[b], near, cfg)) is not None}

    causes: list[Cause] = []
    missing: list[str] = []
    share = len(hit) / max(1, len(fleet))
    # backend down: its scrape failed, its requests all failed, or its spans stopped while the others' went on
    for b in hit:
        ws = _in(windows.get(b, {}), near, end)
        failed = [w for w in ws if w.scrape_up == 0]
        if failed:  # (an OOM kill that took it is the cause behind the outage)
            causes.append(Cause("backend_down", 0.95 if "oom_kill" in leads else 1.0,
                                (f"{b}: scrape failed from {failed[0].start_s:.0f} "
                                                      f"({failed[0].scrape_error or 'no answer'})",)))
            break
        every = [w for w in ws if w.requests and w.failed == w.requests]
        if len(every) >= 2:
            causes.append(Cause("backend_down", 0.9, (f"{b}: every request failed in {len(every)} windows "
                                                      f"({sum(w.failed for w in every)} requests)",)))
            break
    # load beyond capacity: the fleet breaches together, or its offered load jumped and most engines filled up
    if share >= cfg.fleet_share or load_rose:
        score, evidence = 0.5, [f"{len(hit)} of {len(fleet)} backends breached together"]
        if "qps_jump" in leads:
            score += 0.4
            evidence.append(f"fleet requests {baseline:.1f} -> {max(during or [0]):.1f} req/s "
                            f"(+{(max(during or [0]) / baseline - 1):.0%}), "
                            + (f"{leads['qps_jump']:.0f} s before" if leads["qps_jump"] >= 0 else
                               f"{-leads['qps_jump']:.0f} s after the first breach"))
        queued = [b for b in hit if any(w.queue > 0 for w in _in(windows.get(b, {}), onset, end))]
        if len(queued) >= cfg.fleet_share * len(fleet) or load_rose:
            score += 0.1
            evidence.append(f"requests queued on {len(queued)} backends" if not load_rose else
                            f"requests in the engines up {cfg.qps_jump:.0%} or more on {len(rising)} of "
                            f"{len(windows)} backends")
        causes.append(Cause("load_beyond_capacity", min(score, 1.0), tuple(evidence)))
    # KV / memory pressure on the backends hit
    kv_seen = any(math.isfinite(w.kv_usage) for ws in mine.values() for w in ws)
    if not kv_seen:
        missing.append("KV usage (no serving-metrics scrape of the backends hit)")
    # a backend hit that got `imbalance` times its fair share of the requests while part of the fleet breached
    # (over the incident's first windows: the share that broke it, not the even one its backlog drains under)
    early = min(end, onset + SHARE_WINDOWS * cfg.window_s)
    totals = {b: sum(w.requests for w in _in(windows.get(b, {}), near, early)) for b in fleet}
    total = sum(totals.values())
    # (part of the fleet breached in those first windows: a skewed engine's backlog spills onto the others
    # as it drains, and on a small fleet that makes every backend part of the incident)
    early_share = len({b.backend for b in breaches if b.start_s < early}) / max(1, len(fleet))
    over_served = [b for b in hit if early_share < cfg.fleet_share and len(fleet) > 1 and total
                   and totals[b] / total >= cfg.imbalance / len(fleet)]
    pressed: dict[str, str] = {}
    for b, ws in mine.items():
        kv = max((w.kv_usage for w in ws if math.isfinite(w.kv_usage)), default=math.nan)
        pre = sum(w.preemptions for w in ws if math.isfinite(w.preemptions))
        wait = max((w.waiting_capacity for w in ws if math.isfinite(w.waiting_capacity)), default=0.0)
        if kv >= cfg.kv_high or pre > 0 or wait > 0:
            pressed[b] = (f"{b}: KV {kv:.0%}" + (f", {pre:.0f} preemptions" if pre > 0 else "")
                          + (f", {wait:.0f} waiting for KV/batch" if wait > 0 else ""))
    if pressed:
        # Pressure is the backend's own only without the fleet's offered load rising (else it is the load's
        # doing) and where most of the incident's breached windows are on backends at a fair share (pressure on
        # one that got far more than its share is the routing's doing, below).
        own = [b for b in pressed if b not in over_served]
        per = Counter(b.backend for b in breaches)
        own_windows = sum(per[b] for b in own)
        skewed_windows = sum(per[b] for b in pressed if b in over_served)
        # (and with nothing outside the engine slowing it: a disk or CPU hog fills its KV by slowing it down)
        mine_alone = share < cfg.fleet_share and own_windows > skewed_windows and not math.isfinite(jump_at) \
            and not disk_first and not any(b in starved for b in own)
        score = 0.55 + (0.3 if mine_alone else 0.0) + (0.1 if "preemptions" in leads else 0.0)
        causes.append(Cause("kv_pressure", min(score, 0.95), tuple(pressed.values())))
    # block IO on the hosts: slow, or a disk saturated from before the breach and still during it
    if not io:
        missing.append("block IO latency (no io_latency rows)")
    elif disk_first and any(_io_trouble(w, cfg) for t, w in io.items() if near <= t < end):
        worst = max((w for t, w in io.items() if lo <= t < end), key=lambda w: _nan0(w.queue_depth))
        slow = max(_nan0(w.latency_s) for t, w in io.items() if lo <= t < end)
        before = [w.queue_depth for t, w in io.items() if t < io_at and math.isfinite(w.queue_depth)]
        causes.append(Cause("io", 0.85, (
            (f"disk {worst.device}: queue depth {worst.queue_depth:.0f} (before: "
             f"{statistics.median(before or [0.0]):.1f}), {worst.ios_per_s:,.0f} IO/s, " if worst.device else "")
            + f"block-IO read latency {slow * 1e3:.1f} ms, {leads['io_latency']:.0f} s before the breach",)))
    # routing imbalance: a few backends hit while getting more than their share
    # (its KV or batch pressure, when it has some, is what the extra share did to it: +0.2)
    for b in over_served:
        weights = [w.weight for w in _in(windows.get(b, {}), near, end) if math.isfinite(w.weight)]
        causes.append(Cause("routing_imbalance", 0.8 if b in pressed else 0.6, (
            f"{b} got {totals[b] / total:.0%} of the requests (fair share {1 / len(fleet):.0%})"
            + (f", LB weight {statistics.mean(weights):.2f}" if weights else "")
            + (f"; under it {pressed[b].split(': ', 1)[1]}" if b in pressed else ""),)))
        break
    # the host: an engine starved of CPU, or memory (OOM kills, RSS growth under memory pressure)
    host_seen = bool(host) or any(math.isfinite(w.cpu_wait_ratio) for ws in mine.values() for w in ws)
    if not host_seen:
        missing.append("host CPU and memory (no host collector: run queue, PSI, RSS, OOM kills)")
    elif host and not any(math.isfinite(h.psi_memory_some) or math.isfinite(h.oom_kills)
                          for t, h in host.items() if near <= t < end):
        missing.append("host pressure and OOM kills (no PSI or OOM reading in the incident: node-exporter or /proc)")
    for b, (peak, usual, ran) in starved.items():
        psi = max((h.psi_cpu_some for t, h in host.items() if near <= t < end and math.isfinite(h.psi_cpu_some)),
                  default=math.nan)
        # an engine sent far more than its share waits for CPU under its own extra work: the routing's doing;
        # one waiting while the host's disk saturated waits behind the IO hog's own CPU (its syscalls and
        # interrupts): the disk's doing
        score = 0.55 if b in over_served else 0.6 if disk_first else 0.8 + (0.1 if share < cfg.fleet_share else 0.0)
        causes.append(Cause("host_cpu", score, (
            f"{b}: its threads waited on the run queue {peak:.0%} of the time (before: {usual:.0%}){ran}"
            + (f"; host CPU pressure {psi:.0%}" if math.isfinite(psi) else "")
            + ("; it got more than its share of the requests" if b in over_served else "")
            + ("; the host's disk saturated at the same time" if disk_first else ""),)))
        break
    if "oom_kill" in leads:
        kills = sum(h.oom_kills for t, h in host.items() if lo <= t < end and math.isfinite(h.oom_kills))
        causes.append(Cause("host_memory", 0.98, (f"{kills:.0f} OOM kill(s) on the host "
                                                  f"{leads['oom_kill']:.0f} s before the breach",)))
    else:
        for b, ws in mine.items():
            rss_before = [w.rss_bytes for w in ws if w.start_s < near and math.isfinite(w.rss_bytes)]
            rss_now = [w.rss_bytes for w in ws if w.start_s >= near and math.isfinite(w.rss_bytes)]
            pressure = max((h.psi_memory_some for t, h in host.items()
                            if near <= t < end and math.isfinite(h.psi_memory_some)), default=0.0)
            if rss_before and rss_now and max(rss_now) >= (1 + cfg.rss_growth) * statistics.median(rss_before) \
                    and pressure >= cfg.psi_memory:
                causes.append(Cause("host_memory", 0.7, (
                    f"{b}: RSS {statistics.median(rss_before) / 2**30:.1f} -> {max(rss_now) / 2**30:.1f} GiB, "
                    f"host memory pressure {pressure:.0%}",)))
                break
    causes.sort(key=lambda c: -c.score)
    best = causes[0] if causes and causes[0].score >= MIN_SCORE else Cause(UNKNOWN, 0.0, ())
    runners = [c for c in causes if c is not best]
    return Explanation(best, runners, leads, missing, drop, *_at_breach(mine, onset, near, end, cfg))


def _cpu_starved(ws: Sequence[Window], near: float, cfg: IncidentsConfig) -> tuple[float, float, str] | None:
    """(peak, usual) share of the time the engine's threads waited runnable, and how its running changed, when
    from ``near`` on the wait reached ``cpu_wait`` and twice its usual (the median before), or 1.5x its usual
    while the engine ran half as much as usually or less (runnable but not running: an engine whose threads
    wait even when calm, as vLLM's do, cannot double its wait); None otherwise."""
    after = [w for w in ws if math.isfinite(w.cpu_wait_ratio) and w.start_s >= near]
    before = [w for w in ws if math.isfinite(w.cpu_wait_ratio) and w.start_s < near]
    if not after:
        return None
    peak = max(after, key=lambda w: w.cpu_wait_ratio)
    if peak.cpu_wait_ratio < cfg.cpu_wait:
        return None
    usual = statistics.median([w.cpu_wait_ratio for w in before] or [0.0])
    runs = [w.cpu_run_ratio for w in before if math.isfinite(w.cpu_run_ratio)]
    usual_run = statistics.median(runs) if runs else math.nan
    measured = math.isfinite(usual_run) and math.isfinite(peak.cpu_run_ratio)
    if peak.cpu_wait_ratio >= 2 * usual or (peak.cpu_wait_ratio >= 1.5 * usual and measured
                                            and peak.cpu_run_ratio <= 0.5 * usual_run):
        ran = f"; it ran {peak.cpu_run_ratio:.0%} of a core (before: {usual_run:.0%})" if measured else ""
        return peak.cpu_wait_ratio, usual, ran
    return None


def _io_trouble(w: IoWindow, cfg: IncidentsConfig) -> bool:
    return _nan0(w.latency_s) >= cfg.io_p99_s or _nan0(w.queue_depth) >= cfg.io_queue_depth


def _nan0(value: float) -> float:
    return value if math.isfinite(value) else 0.0


def _load_rising(windows: Mapping[str, Mapping[float, Window]], lo: float, near: float, since: float, end: float,
                 jump: float) -> list[str]:
    """Backends whose requests in the engine (running + queued, from its scrape) averaged ``jump`` more from
    ``since`` to ``end`` than in the baseline [lo, near)."""
    out = []
    for b, series in windows.items():
        before, after = _held(series, lo, near), _held(series, since, end)
        if before and after:
            mean_after = statistics.mean(after)
            if mean_after > 0 and mean_after >= (1 + jump) * statistics.mean(before):
                out.append(b)
    return sorted(out)


def _held(series: Mapping[float, Window], start: float, end: float) -> list[float]:
    """Requests in the engine (running + queued) per window of ``series`` in [start, end)."""
    return [w.running + (w.queue if math.isfinite(w.queue) else 0.0) for w in _in(series, start, end)
            if math.isfinite(w.running)]


def _p99(w: Window) -> float:
    spans = [c.p99_seconds for c in w.classes.values() if math.isfinite(c.p99_seconds)]
    return max(spans) if spans else w.engine_p99_seconds


def _at_breach(mine: Mapping[str, list[Window]], onset: float, near: float, end: float,
               cfg: IncidentsConfig) -> tuple[float, float]:
    """(KV usage in the first breached window, P99 growth over the baseline) of the backends hit."""
    first = [w.kv_usage for ws in mine.values() for w in ws
             if onset <= w.start_s < onset + cfg.window_s and math.isfinite(w.kv_usage)]
    before = [_p99(w) for ws in mine.values() for w in ws if w.start_s < near and math.isfinite(_p99(w))]
    during = [_p99(w) for ws in mine.values() for w in ws if onset <= w.start_s < end and math.isfinite(_p99(w))]
    growth = max(during) / statistics.median(before) - 1 if before and during and statistics.median(before) > 0 \
        else math.nan
    return (max(first) if first else math.nan), growth


__all__ = ["Explanation", "explain"]
