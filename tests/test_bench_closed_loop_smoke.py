"""Smoke test of the closed-loop bench: simulated backends behind real HAProxy, tiny run.

The backends are simulated (the test bed, triscope_bed) because there is no GPU here; HAProxy, the
agent-check protocol and triscope's weight engine/feed are the real ones. No timing targets.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import require_binary

pytestmark = pytest.mark.integration


def test_closed_loop_tiny_run_applies_policies(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    require_binary("haproxy")
    from triscope_bed.fleet import closed_loop

    dump = tmp_path / "results.jsonl"
    args = closed_loop.parse_args([
        "--backends", "2", "--kv-gib", "40", "--slots", "8", "--base-qps", "12", "--steps", "2",
        "--step-s", "1.5", "--policies", "leastconn,triscope,triscope-classes", "--pressure", "b1=0.8",
        "--agent-inter-ms", "100", "--capacity-weights", "--class-batch-admission", "offline_video=0.75",
        "--class-lb-gate", "--json", "--dump-results", str(dump)])
    doc = closed_loop.run(args)
    capsys.readouterr()

    assert doc["arrivals"] > 10
    lc, ts = doc["policies"]["leastconn"], doc["policies"]["triscope"]
    for rep in (lc, ts):
        assert rep["requests"] == doc["arrivals"], "every scheduled request got an outcome"
        assert rep["ok"] > 0
        assert set(rep["backend_share"]) == {"b0", "b1"}
        assert len(rep["steps"]) == 2
        assert all(p > 0 for p in rep["p99_s"].values() if p == p)
    # Static policy: HAProxy keeps the configured weights (--capacity-weights: b1 has half the slots).
    assert lc["weights_min"] == {"b0": 100, "b1": 50}
    # triscope: b1 has 80% of its memory pinned, so the feed's agent must have lowered its weight.
    assert ts["weights_mean"]["b1"] < ts["weights_mean"]["b0"]
    assert ts["weights_min"]["b1"] < 50
    assert ts["backend_share"]["b1"] < ts["backend_share"]["b0"]

    # triscope-classes: b1's pinned 80 % KV is above the video limit (0.60), so the feed closes b1 to
    # video in HAProxy's video pool: every video that was served ran on b0; other classes still use b1.
    assert doc["haproxy"]["class_admission"]["offline_video"] == 0.60
    assert doc["haproxy"]["class_lb_gate"] is True  # the gate runs too and honours the agent's drain
    rows = [json.loads(line) for line in dump.read_text().splitlines()]
    served = [r for r in rows if r["policy"] == "triscope-classes" and r["status"] == 200]
    videos = {r["backend"] for r in served if r["cls"] == "offline_video"}
    assert videos == {"b0"}, videos
    assert "b1" in {r["backend"] for r in served if r["cls"] != "offline_video"}
    assert all(0 <= r["engine_queue_s"] <= r["latency_s"] for r in served), "engine queue time of each success"
    assert doc["policies"]["triscope-classes"]["requests"] == doc["arrivals"]


def test_admission_options_are_parsed_and_checked() -> None:
    from triscope_bed.fleet import closed_loop

    assert closed_loop.parse_args([]).class_admission == closed_loop.CLASS_ADMISSION
    assert closed_loop.parse_args(["--class-admission", "none"]).class_admission == {}
    assert closed_loop.parse_args(["--class-admission", "offline_video=0.5"]).class_admission == {"offline_video": 0.5}
    for bad in ("video=0.5", "offline_video", "offline_video=busy"):
        with pytest.raises(SystemExit, match="--class-admission"):
            closed_loop.parse_args(["--class-admission", bad])
        with pytest.raises(SystemExit, match="--class-batch-admission"):
            closed_loop.parse_args(["--class-batch-admission", bad])
    args = closed_loop.parse_args(["--class-batch-admission", "offline_video=0.5"])
    assert args.class_batch_admission == {"offline_video": 0.5}
    assert closed_loop.parse_args([]).class_batch_admission == {}, "no batch limit unless asked"
    for option in ("--class-maxconn", "--class-timeout-queue-ms"):
        with pytest.raises(SystemExit, match=option):
            closed_loop.parse_args([option, "video=1"])
    args = closed_loop.parse_args(["--class-maxconn", "offline_video=0.25", "--class-timeout-queue-ms",
                                   "offline_video=100"])
    assert args.class_maxconn == {"offline_video": 0.25} and args.class_timeout_queue_ms == {"offline_video": 100}
    assert closed_loop.parse_args([]).class_maxconn == {} and not closed_loop.parse_args([]).capacity_weights
    for bad in (["--class-maxconn", "offline_video=0"], ["--class-timeout-queue-ms", "offline_video=-5"]):
        with pytest.raises(SystemExit, match="values"):
            closed_loop.parse_args(bad)


def test_haproxy_applies_pool_caps_queue_timeouts_and_configured_weights(tmp_path: Path) -> None:
    """The per-class cap, queue timeout and configured weight read back from a running HAProxy:
    ``slim`` (the server's session limit) of the capped pool only, ``weight`` of every pool."""
    require_binary("haproxy")
    from triscope_bed.peers.haproxy import HAProxy, Server
    from triscope_bed.ports import free_port

    servers = [Server("big", free_port(), weight=100), Server("small", free_port(), weight=50, maxconn=7)]
    with pytest.raises(ValueError, match="offline_video"):
        HAProxy(tmp_path, servers, class_pools=["realtime_speech"], pool_maxconn={"offline_video": {"big": 1}})
    hap = HAProxy(tmp_path, servers, balance="leastconn", class_pools=["realtime_speech", "offline_video"],
                  timeout_queue_ms=900, pool_maxconn={"offline_video": {"big": 4, "small": 2}},
                  pool_timeout_queue_ms={"offline_video": 100})
    text = hap.config_text()
    assert text.count("timeout queue 100ms") == 1 and text.count("timeout queue 900ms") == 2
    with hap:
        rows = {(r["pxname"], r["svname"]): r for r in hap.stats(None)}
        assert {k: rows[k]["slim"] for k in rows} == {
            ("gpus", "big"): "", ("gpus", "small"): "7",
            ("pool_realtime_speech", "big"): "", ("pool_realtime_speech", "small"): "7",
            ("pool_offline_video", "big"): "4", ("pool_offline_video", "small"): "2"}
        assert {k: rows[k]["weight"] for k in rows if k[1] == "small"} == dict.fromkeys(
            [("gpus", "small"), ("pool_realtime_speech", "small"), ("pool_offline_video", "small")], "50")


def test_closed_loop_gate_needs_batch_limits() -> None:
    from triscope_bed.fleet import closed_loop

    with pytest.raises(SystemExit, match="--class-lb-gate needs --class-batch-admission"):
        closed_loop.parse_args(["--class-lb-gate"])

