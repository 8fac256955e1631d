"""Repeated test bed rounds summed up (``reports.testbed_repeat``): orders, spreads, paired ratios and CIs."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path
from typing import Any

import pytest

from triscope_bed.engines.engine import CLASSES
from triscope_bed.reports.testbed_repeat import (
    at_peer_break,
    best_peer,
    paired_ratio,
    peer_break,
    rotated,
    spread,
    summarize,
    t_quantile,
    tail_spread,
    verdict_rows,
)
from triscope_bed.reports.testbed_report import print_tables

_spec = importlib.util.spec_from_file_location("testbed_ratios", Path(__file__).parents[1] / "bench/testbed_ratios.py")
assert _spec is not None and _spec.loader is not None
_ratios = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_ratios)
ratios_main = _ratios.main


def _bucket(offered: float, goodput: float, held: bool, requests: int = 10) -> dict[str, Any]:
    return {"offered_qps": offered, "goodput_qps": goodput, "held": held, "requests": requests}


def _doc(goodput: float, held: float, p99: Any = 0.5, errors: int = 0, preemptions: int = 3,
         buckets: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """A judged run; by default one window, held at ``held`` QPS, with 10 % of the offered lost."""
    return {"goodput_qps": goodput, "peak_qps_held": held, "offered_qps": goodput * 1.1, "errors": {"timeout": errors},
            "preemptions": preemptions, "classes": {c: {"p99_all_s": p99} for c in CLASSES},
            "buckets": buckets if buckets is not None else [_bucket(held, goodput, True)]}


def test_each_policy_leads_a_round_in_turn() -> None:
    orders = [rotated(["a", "b", "c"], k) for k in range(4)]
    assert orders == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"], ["a", "b", "c"]]
    assert rotated([], 3) == []


def test_t_quantiles_shrink_toward_the_normal() -> None:
    assert t_quantile(1) == pytest.approx(12.706)
    assert t_quantile(4) == pytest.approx(2.776)
    assert t_quantile(1000) == pytest.approx(1.96)
    assert all(t_quantile(d) > t_quantile(d + 1) for d in range(1, 30))
    with pytest.raises(ValueError):
        t_quantile(0)


def test_paired_ratio_is_a_geometric_mean_with_a_t_interval() -> None:
    ours, theirs = [11.0, 9.0, 12.0], [10.0, 10.0, 10.0]
    r = paired_ratio(ours, theirs)
    logs = [math.log(1.1), math.log(0.9), math.log(1.2)]
    mean = sum(logs) / 3
    sd = math.sqrt(sum((x - mean) ** 2 for x in logs) / 2)
    half = 4.303 * sd / math.sqrt(3)
    assert r["per_round"] == [1.1, 0.9, 1.2] and r["dropped"] == 0
    assert r["geo_mean"] == pytest.approx(math.exp(mean))
    assert r["ci95"] == pytest.approx([math.exp(mean - half), math.exp(mean + half)])
    assert r["ci95"][0] < r["geo_mean"] < r["ci95"][1]


def test_identical_rounds_give_a_zero_width_interval_and_a_lone_round_none() -> None:
    same = paired_ratio([12.0, 12.0], [10.0, 10.0])
    assert same["ci95"] == pytest.approx([1.2, 1.2])
    lone = paired_ratio([12.0], [10.0])
    assert lone["geo_mean"] == pytest.approx(1.2) and "ci95" not in lone


def test_rounds_where_a_ratio_is_undefined_are_dropped_and_counted() -> None:
    r = paired_ratio([5.0, 0.0, 6.0, math.nan], [5.0, 4.0, 0.0, 3.0])
    assert r["per_round"] == [1.0] and r["dropped"] == 3
    assert paired_ratio([0.0], [1.0]) == {"per_round": [], "dropped": 1}


def test_spread_keeps_infinite_values_out_of_the_mean_and_counts_them() -> None:
    s = spread([1.0, 3.0, math.inf])
    assert s == {"n": 2, "non_finite": 1, "mean": 2.0, "sd": pytest.approx(math.sqrt(2)), "min": 1.0, "max": 3.0}
    assert spread([]) == {"n": 0, "non_finite": 0}
    assert spread([4.0])["sd"] is None


def test_a_failed_request_makes_a_tail_infinite_not_missing() -> None:
    assert tail_spread([0.2, "inf", 0.4]) == {"n": 3, "median": 0.4, "min": 0.2, "max": "inf"}
    assert tail_spread(["inf", "inf"])["median"] == "inf"
    assert tail_spread([None]) == {"n": 0}


def test_summary_pairs_every_triscope_policy_with_every_peer_by_round() -> None:
    rounds = [
        {"haproxy-leastconn": _doc(10.0, 7.0), "triscope-haproxy": _doc(11.0, 7.0, errors=1),
         "gie-epp": _doc(8.0, 0.0)},
        {"triscope-haproxy": _doc(9.0, 7.0, p99="inf"), "gie-epp": _doc(10.0, 7.0),
         "haproxy-leastconn": _doc(9.0, 14.0)},
    ]
    orders = [["haproxy-leastconn", "triscope-haproxy", "gie-epp"],
              ["triscope-haproxy", "gie-epp", "haproxy-leastconn"]]
    rep = summarize(rounds, orders)
    assert rep["rounds"] == 2 and rep["orders"] == orders
    mine = rep["policies"]["triscope-haproxy"]
    assert mine["rounds"] == 2 and mine["goodput_qps"]["mean"] == pytest.approx(10.0)
    assert mine["errors"]["mean"] == pytest.approx(0.5)
    assert all(mine["p99_all_s"][c]["max"] == "inf" for c in CLASSES)
    assert set(rep["ratios"]) == {"triscope-haproxy/haproxy-leastconn", "triscope-haproxy/gie-epp"}
    lc = rep["ratios"]["triscope-haproxy/haproxy-leastconn"]
    assert lc["goodput_qps"]["per_round"] == [1.1, 1.0]
    assert lc["peak_qps_held"]["per_round"] == [1.0, 0.5]
    gie = rep["ratios"]["triscope-haproxy/gie-epp"]
    assert gie["peak_qps_held"]["dropped"] == 1  # gie held nothing in round 1: no ratio there


def test_without_a_triscope_policy_there_are_no_pairs() -> None:
    rep = summarize([{"haproxy-rr": _doc(1.0, 1.0), "haproxy-leastconn": _doc(2.0, 2.0)}], [["haproxy-rr"]])
    assert rep["ratios"] == {} and set(rep["policies"]) == {"haproxy-rr", "haproxy-leastconn"}


def _repeated_doc() -> dict[str, Any]:
    rounds = [
        {"haproxy-rr": _doc(8.0, 5.0), "haproxy-leastconn": _doc(10.0, 7.0), "triscope-haproxy": _doc(10.5, 7.0)},
        {"haproxy-rr": _doc(7.0, 5.0), "haproxy-leastconn": _doc(11.0, 7.0, errors=4),
         "triscope-haproxy": _doc(10.0, 7.0, errors=1)},
    ]
    rep = summarize(rounds, [list(rounds[0]), list(rounds[1])])
    return {"workload": "flash-crowd", "scenario": "none", "seed": 9,
            "fleets": {"vllm": {"policies": rounds[0], "rounds": rounds, "repeat": rep}}}


def test_the_verdict_weighs_triscope_against_the_peer_with_the_best_mean_goodput() -> None:
    doc = _repeated_doc()
    rep = doc["fleets"]["vllm"]["repeat"]
    assert best_peer(rep, "triscope-haproxy") == "haproxy-leastconn"
    (row,) = verdict_rows([doc])
    assert row["label"] == "flash-crowd/none" and row["rounds"] == 2 and row["best_peer"] == "haproxy-leastconn"
    assert row["vs_best_peer"]["goodput_qps"]["per_round"] == pytest.approx([1.05, 10 / 11], abs=1e-4)
    assert row["vs_best_peer"]["peer_held_every_window"] == 2
    assert row["errors"]["mean"] == pytest.approx(0.5) and row["peer_errors"]["mean"] == pytest.approx(2.0)
    assert row["vs_round_robin"]["goodput_qps"]["per_round"] == pytest.approx([10.5 / 8, 10 / 7], abs=1e-4)
    assert verdict_rows([{"fleets": {"sim": {"policies": {}}}}]) == []  # nothing ran, no verdict


def test_single_runs_of_the_same_arrivals_add_up_as_rounds() -> None:
    def single(seed: int, lc: float, ours: float) -> dict[str, Any]:
        return {"workload": "step", "scenario": "none", "seed": seed, "params": {"steps": 3},
                "fleets": {"vllm": {"policies": {"haproxy-leastconn": _doc(lc, 5.0),
                                                 "triscope-haproxy": _doc(ours, 5.0)}}}}

    assert verdict_rows([single(1, 10.0, 11.0)]) == []  # one round: no interval
    (row,) = verdict_rows([single(1, 10.0, 11.0), single(2, 10.0, 9.0), single(1, 10.0, 10.0)])
    assert row["seed"] == 1 and row["rounds"] == 2  # seed 2 is other arrivals: a group of its own, of one
    assert row["vs_best_peer"]["goodput_qps"]["per_round"] == [1.1, 1.0]
    # labelled runs (FILE=LABEL on the command line) pool only with runs of the same label
    before, after = single(1, 10.0, 11.0), single(1, 10.0, 10.0)
    assert verdict_rows([{**before, "label": "old"}, {**after, "label": "new"}]) == []
    (row,) = verdict_rows([{**before, "label": "new"}, {**after, "label": "new"}])
    assert row["label"] == "step/none, new" and row["rounds"] == 2


def test_ratios_cli_prints_the_verdict_draws_it_and_names_bad_files(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good = tmp_path / "run.json"
    good.write_text(json.dumps(_repeated_doc()))
    single = tmp_path / "single.json"
    single.write_text(json.dumps({"fleets": {"sim": {"policies": {}}}}))
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    png = tmp_path / "ratios.png"
    assert ratios_main([str(good), "--png", str(png)]) == 0
    out = capsys.readouterr().out
    assert "vllm flash-crowd/none seed 9 x2: triscope-haproxy / haproxy-leastconn: goodput 0.98 [" in out
    assert "(ceiling 1.10)" in out and "held every window in 2 of 2" in out
    assert "/ haproxy-rr: goodput 1.37 [" in out
    assert png.stat().st_size > 10_000
    assert ratios_main([str(good), str(broken), "--json"]) == 1  # the good file still reported
    captured = capsys.readouterr()
    assert len(json.loads(captured.out)) == 1
    (error,) = captured.err.strip().splitlines()
    assert "broken.json: not a test-bed document" in error
    assert ratios_main([f"{good}=first", f"{good}=second", "--json"]) == 0  # two groups of two rounds
    assert [r["label"] for r in json.loads(capsys.readouterr().out)] == ["flash-crowd/none, first",
                                                                         "flash-crowd/none, second"]
    assert ratios_main([str(single)]) == 1
    assert "no two rounds of the same arrivals" in capsys.readouterr().err


def test_the_peers_break_is_its_least_offered_unheld_window() -> None:
    peer = _doc(3.0, 2.0, buckets=[_bucket(2.0, 2.0, True), _bucket(4.0, 3.5, False), _bucket(6.0, 3.0, False)])
    ours = _doc(3.3, 4.0, buckets=[_bucket(2.0, 2.0, True), _bucket(4.0, 3.9, True), _bucket(6.0, 4.0, False)])
    assert peer_break(ours, peer) == (3.9, 3.5, 4.0)
    # a flash crowd's windows are not in offered order: the quietest one lost is the break
    flash = _doc(3.0, 2.0, buckets=[_bucket(3.0, 3.0, True), _bucket(8.0, 5.0, False), _bucket(3.5, 3.0, False)])
    assert peer_break(ours, flash) == (4.0, 3.0, 3.5)
    assert peer_break(ours, _doc(3.0, 6.0, buckets=[_bucket(6.0, 6.0, True), _bucket(0.0, 0.0, False, 0)])) is None


def test_ceilings_say_how_far_any_router_could_beat_the_peer_at_this_load() -> None:
    peers = [_doc(3.0, 2.0, buckets=[_bucket(2.0, 2.0, True), _bucket(4.0, 3.5, False), _bucket(6.0, 3.0, False)]),
             _doc(5.0, 6.0, buckets=[_bucket(2.0, 2.0, True), _bucket(6.0, 6.0, True)])]
    ours = [_doc(3.3, 4.0, buckets=[_bucket(2.0, 2.0, True), _bucket(4.0, 3.9, True), _bucket(6.0, 4.0, False)]),
            _doc(5.0, 6.0, buckets=[_bucket(2.0, 2.0, True), _bucket(6.0, 6.0, True)])]
    out = at_peer_break(ours, peers)
    assert out["peer_held_every_window"] == 1
    assert out["goodput_at_peer_break"]["per_round"] == [round(3.9 / 3.5, 4)]
    assert out["ceiling_at_peer_break"]["mean"] == pytest.approx(4.0 / 3.5)
    assert out["ceiling_goodput"]["mean"] == pytest.approx(1.1)  # offered = 1.1 x goodput in both rounds
    # the first peer held 2 of a top window of 6 QPS (3x room); the second held the top window (none)
    assert (out["ceiling_held"]["min"], out["ceiling_held"]["max"]) == (pytest.approx(1.0), pytest.approx(3.0))


def test_the_table_names_the_policies_that_held_every_window(capsys: pytest.CaptureFixture[str]) -> None:
    held = _doc(5.0, 6.0, buckets=[_bucket(2.0, 2.0, True), _bucket(6.0, 6.0, True), _bucket(0.0, 0.0, False, 0)])
    broke = _doc(4.0, 2.0, buckets=[_bucket(2.0, 2.0, True), _bucket(6.0, 5.0, False)])
    doc = {"workload": "step", "scenario": "none", "seed": 1, "sla_s": {c: 1.0 for c in CLASSES},
           "fleets": {"sim": {"backends": 2, "arrivals": 10, "bucket_s": 20.0,
                              "policies": {"haproxy-leastconn": {**held, "error_rate": 0.0},
                                           "haproxy-rr": {**broke, "error_rate": 0.0}}}}}
    print_tables(doc)
    out = capsys.readouterr().out
    assert "held every window: haproxy-leastconn;" in out and "raise --qps-per-backend" in out
    doc["fleets"]["sim"]["policies"].pop("haproxy-leastconn")
    print_tables(doc)
    assert "held every window" not in capsys.readouterr().out
