"""The ``[epp]`` exporter's parts that need no Envoy: its config, the live signals it reads from a
``/metrics`` page, its scrapes of real sockets, and the engine view it reads from the feed's
``/v1/weights`` (tests/test_epp_run.py runs the whole of it behind a real Envoy)."""

from __future__ import annotations

import math
import socket
import time

import pytest
from lb_helpers import wait_for
from scrape_helpers import Route, raw_server

from triscope.analyzers.routing import WeightParams
from triscope.analyzers.routing.live import live_signals
from triscope.analyzers.routing.picker import EngineView, HeadroomPicker, LiveSignals, PickerParams, RequestNeed
from triscope.component import Context
from triscope.errors import ConfigError, InputError
from triscope.exporters.epp_service import EppConfig, ScrapePace, create, default_weights_url, picker_backends

VLLM_PAGE = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 1.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 2.0
vllm:num_requests_waiting{engine="1",model_name="m"} 0.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.25
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="101"} 1.0
vllm:cache_config_info{block_size="16",engine="1",num_gpu_blocks="101"} 1.0
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{engine="0",model_name="m"} 5.0
vllm:num_preemptions_total{engine="1",model_name="m"} 2.0
# TYPE vllm:num_requests_waiting_by_reason gauge
vllm:num_requests_waiting_by_reason{engine="0",model_name="m",reason="capacity"} 1.0
vllm:num_requests_waiting_by_reason{engine="0",model_name="m",reason="deferred"} 1.0
vllm:num_requests_waiting_by_reason{engine="1",model_name="m",reason="capacity"} 0.0
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{engine="0",model_name="m"} 12345.0
"""

SGLANG_PAGE = """\
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="m"} 4.0
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name="m"} 1.0
# TYPE sglang:token_usage gauge
sglang:token_usage{model_name="m"} 0.75
# TYPE sglang:max_total_num_tokens gauge
sglang:max_total_num_tokens{model_name="m"} 8192.0
"""


def test_live_signals_from_a_data_parallel_vllm_page() -> None:
    s = live_signals(VLLM_PAGE, 5.0)
    assert (s.running, s.waiting, s.updated) == (4.0, 2.0, 5.0)
    assert s.kv_usage == pytest.approx(0.375)  # the engines' mean
    assert s.kv_capacity_tokens == 2 * 100 * 16  # block 0 of each engine is vLLM's null block
    assert s.preemptions_total == 7.0 and s.waiting_for_capacity == 1.0


def test_live_signals_from_sglang_and_pages_without_them() -> None:
    s = live_signals(SGLANG_PAGE, 1.0)
    assert (s.running, s.waiting, s.kv_usage, s.kv_capacity_tokens) == (4.0, 1.0, 0.75, 8192.0)
    partial = live_signals("# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 2\n", 1.0)
    assert partial.running == 2 and math.isnan(partial.waiting) and math.isnan(partial.kv_capacity_tokens)
    with pytest.raises(InputError, match="none of vLLM's or SGLang's"):
        live_signals("# TYPE up gauge\nup 1\n", 1.0, "http://x/metrics")
    with pytest.raises(InputError, match="not Prometheus text"):
        live_signals("vllm:num_requests_running{ 1\n", 1.0)


def test_engine_view_from_the_feed_document_drives_the_picker() -> None:
    doc = {"version": 7, "backends": {"a": {"weight": 1.0, "state": "ready"}, "b": {"weight": 0.5, "state": "ready"},
                                      "c": {"weight": None, "state": "drain"}},
           "class_admission": {"offline_video": {"backends": {"a": "drain", "b": "ready", "c": "drain"}}}}
    view = EngineView.from_document(doc)
    assert view.version == 7 and view.drained == {"c"} and view.class_state("a", "offline_video") == "drain"
    picker = HeadroomPicker({n: f"127.0.0.1:{9000 + i}" for i, n in enumerate("abc")},
                            PickerParams(seed=3, engine_weights=True))
    for n in "abc":
        picker.observe(n, LiveSignals(0, 0, 0.0, 10_000.0, 100.0))
    picker.set_weights(view)
    assert {picker.pick(RequestNeed("offline_video", 10), 100.0).backend for _ in range(5)} == {"b"}
    rows = picker.explain(100.0, "realtime_speech")
    assert rows["b"]["weight"] == 0.5 and not rows["c"]["eligible"] and rows["a"]["eligible"]
    # by default the weights stay out of the work (the ledger counts that load already); drains hold still
    plain = HeadroomPicker({n: f"127.0.0.1:{9000 + i}" for i, n in enumerate("abc")}, PickerParams(seed=3))
    for n in "abc":
        plain.observe(n, LiveSignals(0, 0, 0.0, 10_000.0, 100.0))
    plain.set_weights(view)
    rows = plain.explain(100.0, "realtime_speech")
    assert rows["b"]["weight"] == 1.0 and not rows["c"]["eligible"] and rows["a"]["eligible"]
    picker.set_weights(None)
    assert picker.explain(100.0, "offline_video")["c"]["eligible"]
    for bad in ({}, {"backends": []}, {"backends": {"a": 3}}):
        with pytest.raises(ValueError, match="not a /v1/weights document"):
            EngineView.from_document(bad)


def _config(**epp: object) -> dict[str, object]:
    return {"weights": {"backends": {"v0": {"address": "127.0.0.1:8001"}, "v1": {"address": "127.0.0.1:8002"},
                                     "noaddr": {"host": "h"}}},
            "epp": epp}


def test_config_backends_and_the_feed_url() -> None:
    cfg = EppConfig.from_config(_config())
    weights = WeightParams.from_config(_config())
    assert picker_backends(cfg, weights) == {"v0": "127.0.0.1:8001", "v1": "127.0.0.1:8002"}
    only = EppConfig.from_config(_config(backends=["v1"]))
    assert picker_backends(only, weights) == {"v1": "127.0.0.1:8002"}
    with pytest.raises(ConfigError, match=r"\[epp\] backends noaddr have no"):
        picker_backends(EppConfig.from_config(_config(backends=["noaddr"])), weights)
    with pytest.raises(ConfigError, match="needs backends"):
        picker_backends(cfg, WeightParams.from_config({}))
    assert default_weights_url({}, weights) == ""
    assert default_weights_url({"run": {"exporters": ["weights_feed", "epp"]}}, weights) == (
        "http://127.0.0.1:9470/v1/weights")
    service = create({**_config(), "run": {"exporters": ["epp"]}}, Context())
    assert service.weights_url == "" and set(service.picker.backends) == {"v0", "v1"}
    assert service.picker.params.misfit_penalty == 1.0
    strict = create(_config(misfit_penalty=1000.0), Context())  # only where it fits, short of 1,000 queued
    assert strict.picker.params.misfit_penalty == 1000.0
    assert (service.picker.params.engine_weights, service.picker.params.early_signals) == (False, True)
    assert service.picker.params.short_penalty == 1.0
    other = create(_config(engine_weights=True, early_signals=False, short_penalty=1e9), Context())
    assert (other.picker.params.engine_weights, other.picker.params.early_signals) == (True, False)
    assert other.picker.params.short_penalty == 1e9


@pytest.mark.parametrize(("key", "value", "message"), [
    ("port", 70000, "port must be a port"),
    ("scrape_interval_s", 0, "scrape_interval_s must be > 0"),
    ("work_unit", "bytes", "work_unit must be"),
    ("kv_reserve_ratio", 1.0, "kv_reserve_ratio must be in"),
    ("metrics_path", "metrics", "metrics_path must start with"),
    ("weights_url", "ftp://x", "weights_url must be an http"),
    ("chars_per_token", 0, "chars_per_token must be > 0"),
    ("misfit_penalty", -1.0, "misfit_penalty must be >= 0"),
    ("scrape_budget", 1.5, "scrape_budget must be in"),
    ("max_scrape_interval_s", 0.1, "max_scrape_interval_s must be between"),
    ("max_scrape_interval_s", 5.0, "max_scrape_interval_s must be between"),
    ("colour", "red", "unknown keys: colour"),
])
def test_bad_config_is_one_line(key: str, value: object, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as err:
        EppConfig.from_config({"epp": {key: value}})
    assert "\n" not in str(err.value)


def test_the_picker_keys_are_written_flat_and_held_as_picker_params() -> None:
    cfg = EppConfig.from_config({"epp": {"unready_after_s": 5.0, "work_unit": "tokens", "early_signals": False,
                                         "max_scrape_interval_s": 4.0}})
    assert cfg.picker == PickerParams(unready_after_s=5.0, work_unit="tokens", early_signals=False)
    assert EppConfig().picker == PickerParams()
    with pytest.raises(ConfigError, match=r"unknown keys: picker, seed \(known: .*unready_after_s") as err:
        EppConfig.from_config({"epp": {"picker": {"seed": 1}, "seed": 2}})  # flat only, the seed is the picker's
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="bad value for short_penalty: must be a number"):
        EppConfig.from_config({"epp": {"short_penalty": "big"}})


def test_a_port_in_use_is_a_one_line_error() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        taken = sock.getsockname()[1]
        service = create(_config(port=taken), Context())
        with pytest.raises(ConfigError, match=f"cannot listen on 127.0.0.1:{taken}"):
            service.start()
        service.close()


def test_a_backend_that_stops_listening_leaves_at_its_next_scrape() -> None:
    with raw_server({"/metrics": Route(body=VLLM_PAGE.encode())}) as v0, \
            raw_server({"/metrics": Route(body=VLLM_PAGE.encode())}) as v1:
        config = {"weights": {"backends": {"v0": {"address": f"127.0.0.1:{v0.port}"},
                                           "v1": {"address": f"127.0.0.1:{v1.port}"}}},
                  "epp": {"port": 0, "scrape_interval_s": 0.05}}
        service = create(config, Context())
        service.start()
        try:
            wait_for(lambda: service.waiting_for() is None, 5.0, "both backends scraped")
            assert all(r["healthy"] for r in service.picker.explain(time.monotonic()).values())
            v1.close()  # the engine's process is gone: its port refuses connections
            wait_for(lambda: service.picker.explain(time.monotonic())["v1"]["refused"], 5.0, "v1's scrape refused")
            row = service.picker.explain(time.monotonic())["v1"]
            # out because nothing listens, not because its last answer is old (that takes unready_after_s, 3 s)
            assert not row["healthy"] and row["scrape_age_s"] < PickerParams().unready_after_s
            picks = {service.picker.pick(RequestNeed("speech", 10), time.monotonic()).backend for _ in range(6)}
            assert picks == {"v0"} and "v1" in service.stats()["scrape_errors"]
        finally:
            service.close()



def test_waiting_for_names_the_backends_not_scraped_yet() -> None:
    with raw_server({"/metrics": Route(body=VLLM_PAGE.encode())}) as v0:
        with socket.socket() as probe:  # nothing listens here
            probe.bind(("127.0.0.1", 0))
            gone = probe.getsockname()[1]
        config = {"weights": {"backends": {"v0": {"address": f"127.0.0.1:{v0.port}"},
                                           "v1": {"address": f"127.0.0.1:{gone}"}}},
                  "epp": {"port": 0, "scrape_interval_s": 0.05}}
        service = create(config, Context())
        assert service.waiting_for() == "epp: no scrape of v0, v1 yet"
        service.start()
        try:
            # v0 answers, v1 refuses: in either order, then only v1 is missing, with its error
            missing = wait_for(lambda: (m := service.waiting_for()) and "refused" in m.lower() and "v0" not in m
                               and m, 5.0, "v0 scraped and v1's refused scrape")
            assert missing.startswith("epp: no scrape of v1 yet (")
        finally:
            service.close()


def test_scrape_pace_spends_the_budget_within_its_bounds() -> None:
    pace = ScrapePace(0.25, 1.0, 0.02)
    assert pace.after(0.002) == 0.25  # a cheap page: the shortest period
    for _ in range(20):
        period = pace.after(0.010)
    assert period == pytest.approx(0.5, rel=0.01)  # 10 ms a scrape, 2 % of the time
    assert pace.after(1.0) == 1.0  # a timed-out scrape: the longest period at once
    assert ScrapePace(0.25, 1.0, 0.0).after(1.0) == 0.25  # no budget: fixed period


def test_a_slow_metrics_page_is_scraped_less_often() -> None:
    def slow() -> Route:  # an engine whose /metrics takes 50 ms to render
        time.sleep(0.05)
        return Route(body=VLLM_PAGE.encode())

    with raw_server({"/metrics": Route(body=VLLM_PAGE.encode())}) as fast, raw_server({"/metrics": slow}) as v1:
        config = {"weights": {"backends": {"v0": {"address": f"127.0.0.1:{fast.port}"},
                                           "v1": {"address": f"127.0.0.1:{v1.port}"}}},
                  "epp": {"port": 0, "scrape_interval_s": 0.05, "scrape_budget": 0.1, "max_scrape_interval_s": 1.0}}
        service = create(config, Context())
        service.start()
        try:
            wait_for(lambda: service.scrapes_total >= 12, 10.0, "a dozen scrapes")
            periods = service.stats()["scrape_periods_s"]
            # v1 takes >= 50 ms a scrape: >= 0.5 s apart at a 10 % budget; v0 answers in about a millisecond
            assert periods["v1"] >= 0.45 and periods["v0"] < periods["v1"], periods
            row = service.picker.explain(time.monotonic())["v1"]
            assert row["fresh"] and row["healthy"]  # fresh for two of its own periods
        finally:
            service.close()


def test_the_scrape_client_is_epp_http_and_the_old_key_still_reads(caplog: pytest.LogCaptureFixture) -> None:
    """The picker's scrapes use the one scraper client config (``[epp.http]``); ``[epp] scrape_timeout_s``
    from an older config lands there with a warning."""
    cfg = EppConfig.from_config({"epp": {"http": {"timeout_s": 0.4, "max_body_bytes": 1000}}})
    assert cfg.http.timeout_s == 0.4 and cfg.http.max_body_bytes == 1000 and cfg.http.redirects == "none"
    old = EppConfig.from_config({"epp": {"scrape_timeout_s": 0.7}})
    assert old.http.timeout_s == 0.7 and any("scrape_timeout_s" in m for m in caplog.messages)
    with pytest.raises(ConfigError, match=r"\[epp.http\] has unknown keys: timeout"):
        EppConfig.from_config({"epp": {"http": {"timeout": 1}}})
