"""``bench/incidents.py``: the fault registry and the scoring on synthetic ``diagnose --json`` documents (pure),
and one short live run on the simulated fleet (``triscope run`` collecting, one engine SIGKILLed) that must
produce a scored document. The live run checks the bench works, not the diagnosis's hit rate (that is the
bench's own output, docs/diagnose.md "How it is judged")."""

from __future__ import annotations

import json
import subprocess
import sys
from math import inf
from pathlib import Path
from typing import Any

import pytest
from conftest import REPO

from triscope_bed.fleet.incident_capacity import judge_step, probe_capacity
from triscope_bed.fleet.incident_faults import FAULTS, Bed, Fault, register
from triscope_bed.fleet.incident_fleet import SimFleet
from triscope_bed.fleet.incident_load import LoadGen
from triscope_bed.fleet.incident_stretch import restart_stuck, wait_client_calm
from triscope_bed.reports.incident_score import (
    CALM,
    FLEET,
    NO_INCIDENT,
    Injection,
    Sent,
    client_breach_starts,
    client_breaches,
    draw_png,
    matrix_text,
    report_text,
    score_injection,
    summarise,
)

A, B, C = "127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"
FLEET3 = [A, B, C]
CAUSES = {"backend_down", "load_beyond_capacity", "kv_pressure", "io", "routing_imbalance", "host_cpu", "host_memory"}
T = 1_800_000_000.0


def _doc(*incidents: tuple[float, float, list[str], str]) -> dict[str, Any]:
    return {"incidents": {"incidents": [
        {"start_s": s, "end_s": e, "backends": b, "cause": {"cause": c, "score": 0.9, "evidence": [f"{c} seen"]},
         "runners_up": [{"cause": "unknown", "score": 0.1}]} for s, e, b, c in incidents]}}


def _inj(fault: str, cause: str | None, backends: list[str], **kw: Any) -> Injection:
    base = {"injected_s": T, "effect_s": T, "recovered_s": T + 30, "until_s": T + 55, "from_s": T - 30}
    base.update(kw)
    return Injection(fault, 0, cause, backends, **base)


def test_the_registry_names_every_fault_of_the_issue_with_a_cause_diagnose_knows() -> None:
    assert {"calm", "load_up_50", "load_x3", "long_prompts", "cpu_hog", "memory_growth", "io_hog", "sigkill",
            "sigstop", "lb_skew"} <= set(FAULTS)
    for f in FAULTS.values():
        assert f.expected_cause is None or f.expected_cause in CAUSES, f
        assert f.hits in ("one", "fleet", "none") and f.doc
    assert FAULTS["calm"].expected_cause is None and FAULTS["sigstop"].expected_cause == "backend_down"


def test_a_new_fault_plugs_in() -> None:
    fault = Fault("test_only_noop", "io", "fleet", lambda bed, victim: lambda: None, doc="nothing")
    try:
        assert register(fault) is fault and FAULTS["test_only_noop"] is fault
    finally:
        FAULTS.pop("test_only_noop")


def test_right_cause_and_backend_with_onset_and_report_delay() -> None:
    inj = _inj("sigkill", "backend_down", [B], first_report_s=T + 7)
    s = score_injection(inj, _doc((T - 5 + 10 - 5, T + 40, [B], "backend_down")), FLEET3)
    assert (s.outcome, s.cause_right, s.backends_right) == ("right", True, True)
    assert s.onset_error_s == 0.0 and s.report_delay_s == 7.0 and s.evidence == ["backend_down seen"]


def test_the_fleet_s_backends_and_a_wrong_set_or_cause() -> None:
    load = _inj("load_x3", "load_beyond_capacity", [FLEET])
    assert score_injection(load, _doc((T + 5, T + 35, [A, B, C], "load_beyond_capacity")), FLEET3).outcome == "right"
    s = score_injection(load, _doc((T + 5, T + 35, [A, B], "load_beyond_capacity")), FLEET3)
    assert (s.outcome, s.cause_right, s.backends_right) == ("wrong", True, False)
    # the client saw A and B breach, C held its SLA: the fleet-wide fault's backends are A and B
    seen = _inj("load_up_50", "load_beyond_capacity", [FLEET], client_breached=[A, B])
    assert score_injection(seen, _doc((T + 5, T + 35, [A, B], "load_beyond_capacity")), FLEET3).outcome == "right"
    s = score_injection(seen, _doc((T + 5, T + 35, [A, B, C], "load_beyond_capacity")), FLEET3)
    assert (s.outcome, s.expected_backends) == ("wrong", [A, B])
    # B killed while the client saw A breach too: an incident on A and B is right, noted; on B alone it is not
    kill = _inj("sigkill", "backend_down", [B], client_breached=[A, B])
    s = score_injection(kill, _doc((T, T + 30, [A, B], "backend_down")), FLEET3)
    assert s.outcome == "right" and s.expected_backends == [A, B] and "saw 127.0.0.1:1 breach too" in s.notes[0]
    assert score_injection(kill, _doc((T, T + 30, [B], "backend_down")), FLEET3).outcome == "wrong"
    # a backend the client did not see breach is wrong in the set
    s = score_injection(_inj("sigkill", "backend_down", [B], client_breached=[B]),
                        _doc((T, T + 30, [B, C], "backend_down")), FLEET3)
    assert (s.outcome, s.backends_right) == ("wrong", False)
    s = score_injection(_inj("lb_skew", "routing_imbalance", [C]), _doc((T, T + 30, [C], "kv_pressure")), FLEET3)
    assert (s.outcome, s.diagnosed_cause, s.backends_right) == ("wrong", "kv_pressure", True)


def test_no_incident_is_a_miss_only_when_the_client_saw_a_breach() -> None:
    missed = score_injection(_inj("cpu_hog", "host_cpu", [A], client_breached=[A]), _doc(), FLEET3)
    calm_fault = score_injection(_inj("cpu_hog", "host_cpu", [A], client_breached=[]), _doc(), FLEET3)
    assert (missed.outcome, missed.cause_right, missed.diagnosed_cause) == ("missed", False, NO_INCIDENT)
    assert (calm_fault.outcome, calm_fault.cause_right) == ("no breach", None)
    unmeasured = score_injection(_inj("load_up_50", "load_beyond_capacity", [FLEET], needs_breach=True), _doc(),
                                 FLEET3)
    assert unmeasured.outcome == "no breach"


def test_a_fault_whose_victim_never_breached_is_no_breach_whatever_a_bystander_did() -> None:
    """Long prompts on A, which held its SLA; the client saw B breach once after the recovery: nothing of the
    fault's to diagnose, so neither right nor wrong, whatever diagnose said of B."""
    inj = _inj("long_prompts", "kv_pressure", [A], client_breached=[B])
    s = score_injection(inj, _doc((T + 35, T + 40, [B], "kv_pressure")), FLEET3)
    assert (s.outcome, s.cause_right, s.backends_right, s.diagnosed_backends) == ("no breach", None, None, [B])
    assert any("not the fault's victim" in n for n in s.notes)
    both = score_injection(_inj("long_prompts", "kv_pressure", [A], client_breached=[A, B]),
                           _doc((T + 5, T + 40, [A], "kv_pressure")), FLEET3)
    assert (both.outcome, both.expected_backends) == ("wrong", [A, B])  # the victim breached: judged as before


def test_a_fault_injected_while_the_client_still_saw_a_breach_is_not_judged() -> None:
    # an earlier fault's backlog breached B before this injection: the incident open then is no verdict on it,
    # right or wrong, and the summary says how many landed so
    doc = _doc((T - 25, T + 40, [B], "kv_pressure"))
    landed = score_injection(_inj("cpu_hog", "host_cpu", [B], client_breached=[B], lead_breached=[B]), doc, FLEET3)
    assert (landed.outcome, landed.cause_right, landed.diagnosed_cause) == ("not calm before", None, "kv_pressure")
    judged = score_injection(_inj("cpu_hog", "host_cpu", [B], client_breached=[B], lead_breached=[]), doc, FLEET3)
    assert judged.outcome == "wrong"
    summary = summarise([landed, judged])
    assert summary["overall"]["not_calm_before"] == 1 and summary["overall"]["breached_and_judged"] == 1
    assert "not calm before" not in summary["confusion"].get("host_cpu", {}) and \
        sum(summary["confusion"]["host_cpu"].values()) == 1


def test_incidents_outside_the_injection_are_counted_and_calm_stretches_judged() -> None:
    # one in the lead-in (before the effect), the injection's own, one in another stretch
    doc = _doc((T - 25, T - 15, [A], "host_cpu"), (T + 5, T + 20, [B], "backend_down"), (T + 90, T + 95, [A], "io"))
    s = score_injection(_inj("sigstop", "backend_down", [B]), doc, FLEET3)
    assert s.outcome == "right" and s.other_incidents == 1
    already = score_injection(_inj("sigkill", "backend_down", [B], first_report_s=T + 2),
                              _doc((T - 20, T + 30, [B], "backend_down")), FLEET3)
    assert already.onset_error_s == -20 and already.report_delay_s is None and already.notes
    calm = score_injection(_inj("calm", None, []), _doc(), FLEET3)
    assert (calm.outcome, calm.expected_cause, calm.diagnosed_cause) == ("calm", CALM, NO_INCIDENT)
    false = score_injection(_inj("calm", None, []), _doc((T - 10, T, [A], "host_cpu")), FLEET3)
    assert (false.outcome, false.diagnosed_cause) == ("false", "host_cpu")
    real = score_injection(_inj("calm", None, [], client_breached=[A]), _doc((T - 10, T, [A], "host_cpu")), FLEET3)
    assert real.outcome == "calm breached"
    doc = summarise([false, real], calm_minutes=2)["overall"]
    assert (doc["false_incidents_in_calm"], doc["calm_stretches_breached"]) == (1, 1)


def test_client_breaches_follow_diagnose_s_rule() -> None:
    sla = {"realtime_speech": 0.5}
    sent = [Sent(T + 0.1 * i, A, "realtime_speech", 0.2, True) for i in range(20)]
    sent += [Sent(T + 0.1 * i, B, "realtime_speech", 0.9 if i == 5 else 0.2, True) for i in range(20)]
    sent += [Sent(T + 0.1 * i, C, "realtime_speech", 0.2, i % 4 != 0) for i in range(20)]
    assert client_breaches(sent, T, T + 10, sla) == [B, C]
    assert client_breaches(sent[:20], T, T + 10, sla) == []
    late = [Sent(T + 6 + 0.1 * i, A, "realtime_speech", 0.9, True) for i in range(10)]  # from the second window
    assert client_breach_starts(sent[:20] + late, T, T + 10, sla) == {A: T + 5}


def test_a_probe_step_breaches_on_the_client_s_p99_from_arrival_or_on_unanswered_requests() -> None:
    sla = {"realtime_speech": 0.5, "offline_video": 4.0}
    arrivals = [(T + 0.05 * i, "realtime_speech") for i in range(200)] + [(T + 1.0, "offline_video")] * 3
    # answered 0.2 s after the arrival; the worker picked them up 0.1 s after it
    sent = [Sent(t + 0.1, A, c, 0.1, True, t) for t, c in arrivals]
    step = judge_step(1.0, arrivals, sent, T, T + 10, sla)
    assert not step.breached and step.requests == 203 and step.unanswered == 0
    assert step.p99_over_sla == {"realtime_speech": pytest.approx(0.4)}  # 3 videos: too few to judge
    # one speech request waited 0.6 s for a worker: the open-loop client waited it, the span did not
    slow = [Sent(s.arrival_s + 0.6, A, s.request_class, 0.1, True, s.arrival_s) for s in sent[:2]]
    assert judge_step(1.0, arrivals, slow + sent[2:], T, T + 10, sla).breached
    # one of 200 unanswered is within the P99 (ClickHouse's rank floor(0.99 n), as diagnose takes it); two are not
    assert not judge_step(1.0, arrivals, sent[1:], T, T + 10, sla).breached
    unanswered = judge_step(1.0, arrivals, sent[2:], T, T + 10, sla)
    assert unanswered.breached and unanswered.unanswered == 2 and unanswered.p99_over_sla["realtime_speech"] == inf
    failed = [Sent(t, A, c, 0.01, i % 10 != 0, t) for i, (t, c) in enumerate(arrivals)]
    assert judge_step(1.0, arrivals, failed, T, T + 10, sla).breached  # 10 % failed
    assert not judge_step(1.0, arrivals, sent, T + 20, T + 30, sla).breached  # nothing in the step


def test_summary_matrix_and_png(tmp_path: Path) -> None:
    scores = [
        score_injection(_inj("sigkill", "backend_down", [A]), _doc((T, T + 20, [A], "backend_down")), FLEET3),
        score_injection(_inj("lb_skew", "routing_imbalance", [B]), _doc((T, T + 20, [B], "kv_pressure")), FLEET3),
        score_injection(_inj("load_up_50", "load_beyond_capacity", [FLEET], client_breached=[]), _doc(), FLEET3),
        score_injection(_inj("calm", None, []), _doc(), FLEET3),
    ]
    doc = summarise(scores, calm_minutes=1.4)
    o = doc["overall"]
    assert (o["injected"], o["breached_and_judged"], o["no_breach"]) == (3, 2, 1)
    assert o["cause_and_backends_right"] == 0.5 and o["backends_right"] == 1.0 and not o["meets_target"]
    assert o["false_incidents_in_calm"] == 0 and o["calm_minutes"] == 1.4
    assert doc["confusion"] == {"backend_down": {"backend_down": 1}, "routing_imbalance": {"kv_pressure": 1},
                                CALM: {NO_INCIDENT: 1}}
    assert doc["confusion_columns"] == ["backend_down", "routing_imbalance", "kv_pressure", NO_INCIDENT]
    assert doc["faults"]["load_up_50"]["outcomes"] == {"no breach": 1}
    assert "routing_imbalance" in matrix_text(doc["confusion"]) and "target met: no" in report_text(doc)
    json.dumps(doc)
    draw_png(doc, tmp_path / "m.png")
    assert (tmp_path / "m.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
@pytest.mark.integration
def test_a_short_live_run_on_the_simulated_fleet_is_scored(tmp_path: Path) -> None:
    """Two simulated engines, ``triscope run`` collecting, one SIGKILLed for 10 s: a scored document, its
    JSON and PNG (about 45 s)."""
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "bench/incidents.py", "--fleet", "sim", "--backends", "2", "--faults",
                           "sigkill", "--rounds", "1", "--lead-s", "10", "--hold-s", "10", "--gap-s", "8",
                           "--warmup-s", "5", "--poll-s", "0", "--seed", "7", "--rate", "1.0", "--out-dir", str(out),
                           "--work-dir", str(tmp_path / "work"), "--json"],
                          capture_output=True, text=True, cwd=REPO, timeout=150)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(proc.stdout)
    (score,) = doc["scores"]
    assert score["fault"] == "sigkill" and score["expected_cause"] == "backend_down"
    assert score["outcome"] in ("right", "wrong", "missed", "no breach") and len(score["expected_backends"]) == 1
    assert doc["run"]["seed"] == 7 and "--seed 7" in doc["run"]["rerun"] and doc["run"]["load"]["sent"] > 20
    assert "seed 7; rerun: python bench/incidents.py" in proc.stderr
    assert json.loads((out / "incidents.json").read_text())["overall"]["injected"] == 1
    assert (out / "incidents.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the run's answers scored again from its diagnose.json: the same scores, the run's settings kept
    again = subprocess.run([sys.executable, "bench/incidents.py", "--rescore", str(out)], capture_output=True,
                           text=True, cwd=REPO, timeout=60)
    assert again.returncode == 0, again.stderr[-2000:]
    rescored = json.loads((out / "incidents.json").read_text())
    assert rescored["scores"] == doc["scores"] and rescored["run"]["seed"] == 7 and "overall:" in again.stdout
    # asked again of diagnose on the kept store (the daemon stopped, the store opened directly): same answers
    before = json.loads((out / "diagnose.json").read_text())
    again = subprocess.run([sys.executable, "bench/incidents.py", "--rescore", str(out), "--rediagnose",
                            str(tmp_path / "work" / "triscope.toml")], capture_output=True, text=True, cwd=REPO,
                           timeout=120)
    assert again.returncode == 0, again.stderr[-2000:]
    after = json.loads((out / "diagnose.json").read_text())
    assert [d["diagnose"]["incidents"]["incidents"] for d in after] == \
        [d["diagnose"]["incidents"]["incidents"] for d in before]
    assert json.loads((out / "incidents.json").read_text())["scores"] == doc["scores"]


@pytest.mark.slow
@pytest.mark.integration
def test_a_stuck_fleet_is_restarted_and_its_calm_awaited(tmp_path: Path) -> None:
    """Two simulated engines under a light load: while the client sees every request over its SLA (an SLA no
    request meets stands for a fleet stuck breaching), the calm wait runs out; ``restart_stuck`` starts fresh engine
    processes, and under the real SLA the client then sees calm (about 30 s)."""
    import random
    import time

    fleet = SimFleet(2, tmp_path)
    fleet.start("http://127.0.0.1:9/v1/traces")  # the simulated engines send no spans
    load = LoadGen(fleet, 4.0, 7).start()
    try:
        bed = Bed(fleet, load, tmp_path, random.Random(7))
        time.sleep(12)
        never = dict.fromkeys(("realtime_speech", "interactive_image_text", "offline_video"), 1e-6)
        assert wait_client_calm(bed, never, time.time(), time.time() + 6) == inf
        before = {e.name: fleet.pids(e) for e in fleet.engines}
        sla = {"realtime_speech": 0.64, "interactive_image_text": 3.4, "offline_video": 4.4}
        assert restart_stuck(bed, sla, 60)
        after = {e.name: fleet.pids(e) for e in fleet.engines}
        assert all(after[n] and after[n] != before[n] for n in before) and all(fleet.alive(e) for e in fleet.engines)
    finally:
        load.stop()
        fleet.stop()


@pytest.mark.slow
@pytest.mark.integration
def test_the_capacity_probe_finds_where_two_simulated_engines_break_their_sla(tmp_path: Path) -> None:
    """Two simulated engines, the probe's ramp doubling from 1 req/s per backend in 5 s steps: it stops at the
    first rate the client saw over an SLA in a step and in its repeat, steps up after every calm step, and
    leaves no load running (about 60 s)."""
    fleet = SimFleet(2, tmp_path)
    fleet.start("http://127.0.0.1:9/v1/traces")  # the simulated engines send no spans
    try:
        sla = {"realtime_speech": 0.64, "interactive_image_text": 3.4, "offline_video": 4.4}
        cap = probe_capacity(fleet, sla, 7, start=1.0, ratio=2.0, step_s=5.0, max_steps=8, say=lambda _: None)
    finally:
        fleet.stop()
    assert not cap.capped and cap.steps[-1].breached and cap.steps[-2].breached
    assert cap.rate_per_backend == cap.steps[-1].rate_per_backend == cap.steps[-2].rate_per_backend > 1.0
    for before, after in zip(cap.steps, cap.steps[1:], strict=False):
        # a breached step is repeated at its rate (once), a calm one doubles it
        assert after.rate_per_backend == before.rate_per_backend * (1.0 if before.breached else 2.0)
    assert cap.to_dict()["steps"][-1]["breached"] is True
