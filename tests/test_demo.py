"""``triscope demo`` (the README's main job) end to end in a subprocess with its own embedded store."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

from kineto_helpers import complete_events, load_json

from triscope.commands.demo import EXAMPLES


def _demo(store_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "TRISCOPE_STORE__PATH": str(store_path)}
    return subprocess.run([sys.executable, "-m", "triscope", "demo", "--json", *args], env=env,
                          capture_output=True, text=True, timeout=300)


def _stored_events(store_path: Path, run_id: str) -> int:
    code = ("import sys; from triscope.config import load_config; from triscope.store import open_store; "
            "from triscope.schema import qualified; s = open_store(load_config(None)); "
            "print(s.query(f\"SELECT count() FROM {qualified(s, 'trace_events')} WHERE run_id = {{r:String}}\", "
            "{'r': sys.argv[1]}).scalar())")
    env = {**os.environ, "TRISCOPE_STORE__PATH": str(store_path)}
    out = subprocess.run([sys.executable, "-c", code, run_id], env=env, capture_output=True, text=True, check=True)
    return int(out.stdout.strip())


def _store_query(store_path: Path, queries: dict[str, tuple[str, dict]]) -> dict[str, list[list]]:
    """Rows of each ``{name: (sql, params)}`` from the store, in a fresh process (chDB: one per data path).

    ``{db}`` in the SQL stands for the database name."""
    code = ("import json, sys; from triscope.config import load_config; from triscope.store import open_store; "
            "s = open_store(load_config(None)); q = json.loads(sys.argv[1]); "
            "print(json.dumps({k: [list(r) for r in s.query(sql.replace('{db}', s.database), p).rows] "
            "for k, (sql, p) in q.items()}))")
    env = {**os.environ, "TRISCOPE_STORE__PATH": str(store_path)}
    out = subprocess.run([sys.executable, "-c", code, json.dumps(queries)], env=env, capture_output=True,
                         text=True, check=True)
    return json.loads(out.stdout)


def test_demo_ingests_examples_and_a_live_capture_and_reruns_without_duplicates(tmp_path: Path):
    first = _demo(tmp_path / "store", "--no-fleet")
    assert first.returncode == 0, first.stderr
    assert first.stdout.startswith("{"), first.stdout[:500] + first.stderr[-2000:]
    report = json.loads(first.stdout)
    assert report["errors"] == [] and report["store"] == "embedded" and report["fleet"] is None
    runs = {r["run_id"]: r for r in report["runs"]}
    assert "demo-torch-cpu" in runs and runs["demo-torch-cpu"]["events"] > 0
    for trace in sorted(EXAMPLES.glob("*.json.gz")):
        run_id = "demo-" + trace.name.removesuffix(".json.gz")
        expected = len(complete_events(load_json(trace)))
        assert runs[run_id]["events"] == expected, run_id
        whole = runs[run_id]["breakdown"]["ranks"][0]["whole"]
        assert whole["compute_ns"] + whole["non_compute_ns"] + whole["idle_ns"] == whole["span_ns"]
        assert runs[run_id]["stall_shares"]
    # a one-kernel trace gets no stall verdict: its breakdown (one kernel, 100 % busy) judges nothing
    assert runs["demo-triton_single_kernel"]["stall_shares"].startswith("no verdict: too short to judge")
    assert runs["demo-triton_single_kernel"]["stalls"] is None
    # A second run replaces the demo runs instead of appending to them.
    again = _demo(tmp_path / "store", "--no-capture", "--no-fleet")
    assert again.returncode == 0, again.stderr
    v100 = "demo-v100_resnet_ns_resolution_rank0"
    assert _stored_events(tmp_path / "store", v100) == runs[v100]["events"]


def test_demo_reports_a_corrupt_trace_and_keeps_the_others(tmp_path: Path):
    bad = tmp_path / "broken.json"
    bad.write_text('{"traceEvents": [{"ph": "X", "name": "k", "ts": 1, "dur": 2}, {"ph": ')
    good = EXAMPLES / "triton_single_kernel.json.gz"
    done = _demo(tmp_path / "store", "--no-capture", "--no-fleet", "--traces", str(bad), str(good))
    assert done.returncode == 1
    report = json.loads(done.stdout)
    assert len(report["errors"]) == 1 and "broken.json" in report["errors"][0]
    assert "\n" not in report["errors"][0]
    assert [r["run_id"] for r in report["runs"]] == ["demo-triton_single_kernel"]


def test_demo_fleet_stores_every_request_scrapes_every_backend_and_weights_the_small_one_lowest(tmp_path: Path):
    """The fleet part, 6 s of load (3 s sometimes ends before the small backend breaks its SLO): the
    backends and their GPU memory are the demo's simulators
    (no GPU here; that is the hardware boundary), everything after them is the real pipeline."""
    png = tmp_path / "out" / "heatmap.png"
    done = _demo(tmp_path / "store", "--no-capture", "--traces", str(EXAMPLES / "triton_single_kernel.json.gz"),
                 "--fleet-seconds", "6", "--fleet-png", str(png))
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert report["errors"] == []
    fleet = report["fleet"]
    backends = {b["name"]: b for b in fleet["backends"]}
    assert set(backends) == {"sim-a", "sim-b", "sim-small"}
    sent = fleet["requests_sent"]
    assert sent == sum(b["requests_sent"] for b in backends.values()) and sent > 30
    addresses = [b["address"] for b in backends.values()]
    window = {"t0": fleet["window"]["start_ns"], "t1": fleet["window"]["end_ns"] + 1, "b": addresses}
    in_window = ("ts >= fromUnixTimestamp64Nano({t0:Int64}) AND ts < fromUnixTimestamp64Nano({t1:Int64}) "
                 "AND backend IN {b:Array(String)}")
    got = _store_query(tmp_path / "store", {
        "spans": ("SELECT count(), uniqExact(request_id), countIf(status = 'ok'), "
                  f"countIf(span_name LIKE 'chat %' AND model != '' AND prompt_tokens > 0) FROM {{db}}.requests "
                  f"WHERE {in_window}", window),
        "per_backend": (f"SELECT backend, count() FROM {{db}}.requests WHERE {in_window} GROUP BY backend", window),
        "latencies": (f"SELECT latency_seconds FROM {{db}}.requests WHERE {in_window}", window),
        "scrapes": ("SELECT backend, count(), max(kv_cache_usage_ratio), countIf(isFinite(latency_p99_seconds)) "
                    f"FROM {{db}}.serving_metrics WHERE {in_window} GROUP BY backend", window),
        "gpu": ("SELECT host, count(), max(memory_used_bytes), any(memory_total_bytes) FROM {db}.gpu_samples "
                "WHERE source = 'demo-sim' GROUP BY host", {}),
    })
    # Every request sent is one span in `requests`, once, with its gen_ai attributes where it succeeded.
    count, unique_ids, ok, with_attrs = got["spans"][0]
    assert count == unique_ids == sent == fleet["spans_stored"]
    assert ok == with_attrs == sum(b["requests_ok"] for b in backends.values())
    assert dict(got["per_backend"]) == {b["address"]: b["requests_sent"] for b in backends.values()}
    # The real serving-metrics collector scraped all three backends, with KV usage and latency quantiles.
    scrapes = {r[0]: r for r in got["scrapes"]}
    assert set(scrapes) == set(addresses)
    for b in backends.values():
        assert scrapes[b["address"]][1] >= 4 and scrapes[b["address"]][3] >= 1, scrapes
    # Simulated GPU memory: the small GPU has half the memory and the fullest KV pool.
    gpu = {r[0]: r for r in got["gpu"]}
    assert gpu["demo-sim-small"][3] == gpu["demo-sim-a"][3] / 2
    assert scrapes[backends["sim-small"]["address"]][2] > max(scrapes[backends[n]["address"]][2]
                                                              for n in ("sim-a", "sim-b"))
    # The weight engine, replayed over the stored rows, gives the small backend the lowest weight.
    weights = fleet["weights"]["backends"]
    assert not fleet["weights"]["stale"]
    small = weights[backends["sim-small"]["address"]]
    others = [weights[backends[n]["address"]] for n in ("sim-a", "sim-b")]
    assert small["weight"] < min(w["weight"] for w in others)
    assert small["factors"]["memory"] > max(w["factors"]["memory"] for w in others)
    # Heatmap: every stored request matched a (simulated) memory sample; its latency marginal is the
    # 10 ms histogram of the stored latencies (last bin clamped).
    heat = fleet["heatmap"]
    assert heat["unmatched_requests"] == 0 and heat["tensor_sum"] == heat["requests"] == count
    bins = heat["shape"][2]
    expected = [0] * bins
    for (lat,) in got["latencies"]:
        assert math.isfinite(lat)
        expected[min(int(math.floor(lat / 0.010)), bins - 1)] += 1
    assert heat["latency_marginal"] == expected
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    # Why the fleet fell over: the small backend's KV pool, named with its figures, not "unclassified".
    incidents = fleet["incidents"]["incidents"]
    small_addr = backends["sim-small"]["address"]
    assert incidents and all(i["cause"]["cause"] != "unknown" for i in incidents), incidents
    assert any(i["cause"]["cause"] == "kv_pressure" and small_addr in i["backends"]
               and any(small_addr in e for e in i["cause"]["evidence"]) for i in incidents), incidents


def test_demo_fleet_error_is_one_line_and_keeps_the_trace_results(tmp_path: Path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("x")
    done = _demo(tmp_path / "store", "--no-capture", "--traces", str(EXAMPLES / "triton_single_kernel.json.gz"),
                 "--fleet-seconds", "3", "--fleet-png", str(blocker / "heatmap.png"))
    assert done.returncode == 1
    report = json.loads(done.stdout)
    assert report["fleet"] is None and [r["run_id"] for r in report["runs"]] == ["demo-triton_single_kernel"]
    assert len(report["errors"]) == 1 and report["errors"][0].startswith("fleet: ") and "\n" not in report["errors"][0]
    bad = _demo(tmp_path / "store2", "--no-capture", "--fleet-seconds", "0")
    assert bad.returncode != 0 and "--fleet-seconds" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1


def test_demo_without_the_test_bed_says_how_to_install_it_in_one_line(tmp_path: Path):
    """The fleet is the test bed's (a package of its own): without it, one line and a non-zero exit, before any work."""
    code = ("import sys; sys.modules['triscope_bed'] = None; from triscope.cli import main; "
            "sys.exit(main(['demo', '--no-capture']))")
    env = {**os.environ, "TRISCOPE_STORE__PATH": str(tmp_path / "store")}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "pip install -e ./bed" in lines[0] and "--no-fleet" in lines[0], done.stderr
    assert done.stdout == "" and not (tmp_path / "store").exists()
