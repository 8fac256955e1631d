"""The weight engine on stored rows: span-only backends no LB
can know, sleeping engines, preempting engines. Rows go into a real embedded store (chDB) through
the schema; values are synthetic, shaped like vLLM's metrics and an OTel SDK's spans."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

from triscope.analyzers.routing import NAN, BackendInputs, WeightParams, compute_weights, read_inputs, with_address
from triscope.exporters.envoy_eds import cluster_load_assignment
from triscope.exporters.haproxy_agent import agent_reply
from triscope.exporters.traefik_provider import render as render_traefik
from triscope.schema import REQUESTS, SCRAPE_HEALTH, SERVING_METRICS, encode_ts, qualified

A, B, C = "127.0.0.1:9001", "127.0.0.1:9002", "127.0.0.1:9003"
UUID = "5f0c9a3e-8d2b-4c1e-9a77-3b1f2e6d4c80"  # what the OTel SDK's service.instance.id looks like


def _rows(store: Any, table: Any, rows: list[dict[str, Any]]) -> None:
    for r in rows:
        r["ts"] = encode_ts(int(r["ts"] * 1e9))
    store.insert(qualified(store, table), table.columns_of(rows))


def _serving(store: Any, now: float, backend: str, kv: float = 0.0, **cols: list[float]) -> None:
    """Scrapes of ``backend`` at ``now - 30`` .. ``now - 1``; ``cols`` give one value per scrape."""
    times = [now - 30, now - 10, now - 1]
    _rows(store, SERVING_METRICS, [{"ts": t, "backend": backend, "host": "h", "server": "vllm", "model": "llama",
                                    "kv_cache_usage_ratio": kv, **{k: v[i] for k, v in cols.items()}}
                                   for i, t in enumerate(times)])


def _weigh(store: Any, now: float, params: WeightParams | None = None):
    params = params or WeightParams()
    inputs = [with_address(i, params) for i in read_inputs(store, params, now)]
    return compute_weights(inputs, None, params, now)[0]


def test_span_only_backend_counts_neither_for_staleness_nor_normalisation(store: Any) -> None:
    now = time.time()
    _serving(store, now, A, kv=0.5)  # KV penalty 2
    _serving(store, now, B, kv=0.2)  # KV penalty 1.25
    alone = _weigh(store, now)
    # vLLM-shaped llm_request spans under a random instance id: no address, no scrape, the newest 20 s
    # old (past stale_after_s = 15 s), no KV and no memory (penalty 1, better than every real backend)
    _rows(store, REQUESTS, [{"ts": now - 40 + i, "backend": UUID, "model": "llama", "span_name": "llm_request",
                             "latency_seconds": 0.3, "status": "ok"} for i in range(21)])
    result = _weigh(store, now)
    assert result.unknown_backends == (UUID,) and UUID not in result.backends
    assert result.stale is False and result.stale_backends == ()
    assert result.backends[B].target == 1.0 and result.backends[A].target == pytest.approx(0.625)
    assert {n: b.lb_weight for n, b in result.backends.items()} == {n: b.lb_weight for n, b in alone.backends.items()}
    assert result.to_dict()["unknown_backends"] == [UUID]
    # a gateway's spans naming a host:port that nothing scrapes: still unknown, the fleet stays as it was
    _rows(store, REQUESTS, [{"ts": now - 20 + i, "backend": C, "latency_seconds": 0.3} for i in range(2)])
    result = _weigh(store, now)
    assert result.unknown_backends == (C, UUID) and C not in result.backends and not result.stale
    assert {n: b.lb_weight for n, b in result.backends.items()} == {n: b.lb_weight for n, b in alone.backends.items()}
    traefik = json.loads(render_traefik(result, WeightParams(), b"")[2])
    assert C not in json.dumps(traefik) and len(traefik["http"]["services"]["triscope"]["weighted"]["services"]) == 2
    # configured, it is the fleet's: published (its inputs late: stale on its own)
    configured = WeightParams.from_config({"weights": {"backends": {C: {"address": C}}}})
    result = _weigh(store, now, configured)
    assert C in result.backends and not result.stale and result.stale_backends == (C,)


def _health(store: Any, backend: str, rows: list[tuple[float, int]]) -> None:
    _rows(store, SCRAPE_HEALTH, [{"ts": t, "backend": backend, "host": "h", "target": f"http://{backend}/metrics",
                                  "up": up, "error": "" if up else f"http://{backend}/metrics: scrape failed: "
                                  "[Errno 111] Connection refused"} for t, up in rows])


def test_a_refused_scrape_puts_the_backend_down_everywhere_until_it_answers(store: Any) -> None:
    """What a SIGKILLed engine leaves in the store: its serving rows stop, its scrapes fail. It is down
    at once (not stale, not eased to equal weights) in every LB format; the other keeps its weight."""
    now = time.time()
    _serving(store, now, A, kv=0.5)
    _serving(store, now, B, kv=0.2)
    _health(store, A, [(now - 30, 1), (now - 10, 1), (now - 1, 1)])
    _health(store, B, [(now - 30, 1), (now - 10, 1), (now - 1, 0)])
    params = WeightParams()
    inputs = [with_address(i, params) for i in read_inputs(store, params, now)]
    by = {i.backend: i for i in inputs}
    assert by[A].scrape_up == 1 and by[B].scrape_up == 0 and "Connection refused" in by[B].scrape_error
    result, state = compute_weights(inputs, None, params, now)
    b = result.backends[B]
    assert b.state == "down" and b.reasons == ("scrape_failed",) and b.weight == 0 and b.lb_weight == 0
    assert result.down_backends == (B,) and not result.stale and result.backends[A].target == 1.0
    assert result.to_dict()["backends"][B]["down"] is True
    assert agent_reply(result, B) == "down\n" and agent_reply(result, A).startswith("up ready ")
    eds = {e["metadata"]["filter_metadata"]["triscope"]["backend"]: e["health_status"]
           for e in cluster_load_assignment(result, params)["endpoints"][0]["lb_endpoints"]}
    assert eds == {A: "HEALTHY", B: "UNHEALTHY"}
    services = json.loads(render_traefik(result, params, b"")[2])["http"]["services"]
    weighted = [services[w["name"]]["loadBalancer"]["servers"][0]["url"]
                for w in services["triscope"]["weighted"]["services"]]
    assert weighted == [f"http://{A}"]
    # still down a minute later, however stale its last numbers: a dead engine never gets equal weights
    _health(store, A, [(now + 59, 1)])
    _serving(store, now + 60, A, kv=0.5)
    _health(store, B, [(now + 59, 0)])
    inputs = [with_address(i, params) for i in read_inputs(store, params, now + 60)]
    result, state = compute_weights(inputs, state, params, now + 60)
    assert result.backends[B].state == "down" and not result.stale
    # it answers again: ready, through slow start
    _health(store, B, [(now + 60.5, 1)])
    _serving(store, now + 61, B, kv=0.2)
    inputs = [with_address(i, params) for i in read_inputs(store, params, now + 61)]
    result, _ = compute_weights(inputs, state, params, now + 61)
    assert result.backends[B].state == "ready" and result.backends[B].weight == params.floor
    assert result.down_backends == ()


def test_failing_requests_put_a_backend_down(store: Any) -> None:
    now = time.time()
    _serving(store, now, A)
    _serving(store, now, B)
    for backend, statuses in ((A, ["ok"] * 6 + ["error"] * 4), (B, ["ok"] * 6 + ["error"] * 5)):
        _rows(store, REQUESTS, [{"ts": now - 9 + 0.5 * k, "backend": backend, "status": st, "latency_seconds": 0.1}
                                for k, st in enumerate(statuses)])
    params = WeightParams()
    inputs = {i.backend: i for i in read_inputs(store, params, now)}
    assert (inputs[A].trailing_errors, inputs[B].trailing_errors) == (4, 5)
    assert (inputs[A].span_count, inputs[B].span_count) == (10, 11)
    result = _weigh(store, now)
    assert result.backends[A].state == "ready"  # 4 in a row: not yet (Envoy's outlier default is 5)
    assert result.backends[B].state == "down" and result.backends[B].reasons == ("requests_failing",)


def test_sleeping_engine_is_drained_and_comes_back_awake(store: Any) -> None:
    now = time.time()
    _serving(store, now, A, sleep_state=[0.0, 0.0, 1.0])  # vllm:engine_sleep_state, level 1
    _serving(store, now, B, sleep_state=[0.0, 0.0, 0.0])
    _serving(store, now, C)  # an engine that does not export it: NaN, never drained for it
    _rows(store, SERVING_METRICS, [{"ts": now - 0.5, "backend": C, "sleep_state": NAN}])
    params = WeightParams()
    inputs = [with_address(i, params) for i in read_inputs(store, params, now)]
    by = {i.backend: i for i in inputs}
    assert by[A].sleep_state == 1.0 and by[B].sleep_state == 0.0 and by[C].sleep_state != by[C].sleep_state
    result, state = compute_weights(inputs, None, params, now)
    assert result.backends[A].state == "drain" and result.backends[A].reasons == ("sleep",)
    assert result.backends[B].state == result.backends[C].state == "ready"
    _rows(store, SERVING_METRICS, [{"ts": now + 0.5, "backend": A, "sleep_state": 0.0}])  # woken up
    inputs = [with_address(i, params) for i in read_inputs(store, params, now + 1)]
    result, _ = compute_weights(inputs, state, params, now + 1)
    assert result.backends[A].state == "ready" and result.backends[A].weight == params.floor  # slow start


def test_rising_preemptions_counter_is_penalised(store: Any) -> None:
    now = time.time()
    _serving(store, now, A, preemptions_total=[3.0, 3.0, 5.0])  # 2 preemptions within the last 60 s
    _serving(store, now, B, preemptions_total=[7.0, 7.0, 7.0])  # none
    # C preempted 90 s ago, outside preemption_lookback_s: no longer penalised
    _rows(store, SERVING_METRICS, [{"ts": now - 90, "backend": C, "preemptions_total": 1.0}])
    _serving(store, now, C, preemptions_total=[4.0, 4.0, 4.0])
    result = _weigh(store, now)
    f = {n: b.factors.get("preemption") for n, b in result.backends.items()}
    assert f == {A: 2.0, B: 1.0, C: 1.0}
    assert result.backends[A].target == pytest.approx(0.5) and result.backends[B].target == 1.0
    assert result.backends[A].inputs.preemptions == 2.0
    # an engine restart resets the counter: what it counted since is the rise
    _rows(store, SERVING_METRICS, [{"ts": now - 0.5, "backend": B, "preemptions_total": 0.0}])
    assert _weigh(store, now).backends[B].factors["preemption"] == 1.0
    off = WeightParams.from_config({"weights": {"preemption_penalty": 1.0}})
    assert _weigh(store, now, off).backends[A].target == 1.0


def test_engine_keeps_known_backends_and_drops_unknown_ones() -> None:
    """The pure engine: absent backends kept (all silent: equal weights), unknown ones never published."""
    p = WeightParams()
    now = 1_800_000_000.0
    fresh = [BackendInputs(n, kv_cache_usage_ratio=kv, sources={"serving": now}) for n, kv in ((A, 0.0), (B, 0.5))]
    r, s = compute_weights(fresh, None, p, now)
    r, s = compute_weights([], s, p, now + 400)
    assert r.stale and r.absent_backends == (A, B) and {b.lb_weight for b in r.backends.values()} == {100}
    assert r.backends[A].inputs.address == "" and r.backends[A].reasons == ("absent",)
    r, s = compute_weights([BackendInputs("web-7", sources={"requests": now + 401})], s, p, now + 401)
    assert r.unknown_backends == ("web-7",) and set(r.backends) == {A, B}


def test_a_scrape_timing_out_is_down_only_once_it_has_failed_for_stale_after_s(store: Any) -> None:
    now = time.time()
    _serving(store, now, A)
    _rows(store, SCRAPE_HEALTH, [{"ts": t, "backend": B, "host": "h", "target": f"http://{B}/metrics", "up": up,
                                  "error": "" if up else f"http://{B}/metrics: no complete answer within 3 s "
                                  "(total deadline)"} for t, up in ((now - 40, 1), (now - 10, 1), (now - 1, 0))])
    params = WeightParams()
    by = {i.backend: i for i in read_inputs(store, params, now)}
    assert by[B].scrape_up == 0 and by[B].scrape_failing_s == pytest.approx(10, abs=0.01)
    assert _weigh(store, now).backends[B].state != "down"  # slow, maybe overloaded: not yet down
    later = now + 10  # its scrapes went on failing: 20 s since the last answer
    _serving(store, later, A)
    _rows(store, SCRAPE_HEALTH, [{"ts": later - 1, "backend": B, "host": "h", "target": f"http://{B}/metrics",
                                  "up": 0, "error": "timed out"}])
    assert _weigh(store, later).backends[B].state == "down"
