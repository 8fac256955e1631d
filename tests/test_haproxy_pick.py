"""triscope's per-request picker inside a real HAProxy (``exporters/haproxy_pick.lua``): its table served
by ``[epp]``, polled by the Lua task, and the choices it makes against simulated vLLM backends."""

from __future__ import annotations

import http.server
import json
import math
import subprocess
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
from conftest import free_port, require_binary
from lb_helpers import completion_body as body
from lb_helpers import post_completion as post
from lb_helpers import wait_for
from prometheus_client.parser import text_string_to_metric_families

from triscope.analyzers.routing.model import BREAK, DEGRADE, LIMIT, NORMAL, ClassLevel
from triscope.analyzers.routing.picker import EngineView, HeadroomPicker, LiveSignals, PickerParams, RequestNeed
from triscope.errors import ConfigError
from triscope.exporters.epp import Fallback
from triscope.exporters.epp_service import EppConfig, EppService
from triscope.exporters.haproxy_pick import (
    TABLE_HEADER,
    TABLE_PATH,
    PickLogRecord,
    parse_pick_log_line,
    pick_globals,
    pick_rules,
    pick_settings,
    pick_snippet,
    pick_table,
)
from triscope_bed.engines.backend import BackendSpec
from triscope_bed.engines.engine import GIB
from triscope_bed.fleet.bench_fleet import SimFleet
from triscope_bed.peers.haproxy import HAProxy, PickSetup, Server

NOW = 1000.0


def table_rows(text: bytes) -> dict[str, list[str]]:
    lines = text.decode().splitlines()
    assert lines[0] == TABLE_HEADER
    return {fields[0]: fields[1:] for fields in (line.split() for line in lines[1:]) if fields[0] != "@class"}


def table_levels(text: bytes) -> dict[str, list[str]]:
    return {f[1]: f[2:] for f in (line.split() for line in text.decode().splitlines()[1:]) if f[0] == "@class"}


def test_the_table_says_what_each_scrape_said() -> None:
    picker = HeadroomPicker({"a": "h:1", "b": "h:2", "c": "h:3"}, PickerParams())
    picker.observe("a", LiveSignals(waiting=1, running=2, kv_usage=0.25, kv_capacity_tokens=1000,
                                    updated=NOW - 0.1, requested=NOW - 0.15, preemptions_total=0))
    picker.observe("b", LiveSignals(waiting=0, running=1, kv_usage=0.5, kv_capacity_tokens=2000,
                                    updated=NOW - 0.2, waiting_for_capacity=1))
    picker.set_weights(EngineView({"a": 1.0, "b": 1.0, "c": 1.0}, frozenset({"c"}),
                                  {"speech": {"a": "drain", "b": "ready"}, "bad class!": {"b": "drain"}}))
    rows = table_rows(pick_table(picker, NOW))
    # healthy, drained, fresh left, engine requests, free KV, reserve, short, scrape age, sent age, class drains,
    # refused, waiting
    assert rows["a"] == ["1", "0", "0.9", "3", "750", "50", "0", "0.1", "0.15", "speech", "0", "1"]
    assert rows["b"] == ["1", "0", "0.8", "1", "0", "100", "1", "0.2", "0.2", "-", "0", "0"]  # short: nothing free
    assert rows["c"] == ["0", "1", "-1", "-1", "-1", "0", "0", "-1", "-1", "-", "0", "-1"]  # never scraped; drained
    picker.refused("c")  # its port refused a scrape: gone, whatever answers came before
    assert table_rows(pick_table(picker, NOW))["c"][10] == "1"
    # a drain for KV usage alone is the fit test's to weigh (PickerParams.engine_kv_drains)
    picker.set_weights(EngineView({"a": 1.0}, frozenset({"a"}), {"speech": {"a": "drain"}},
                                  kv_drained=frozenset({"a"})))
    assert table_rows(pick_table(picker, NOW))["a"][1::8] == ["0", "-"]
    assert table_levels(pick_table(picker, NOW)) == {}  # no levels from the engine: no class lines


def test_the_table_carries_each_class_s_admission_level() -> None:
    picker = HeadroomPicker({"a": "h:1"}, PickerParams())
    picker.set_weights(EngineView({"a": 1.0}, class_levels={
        "speech": ClassLevel(NORMAL), "video": ClassLevel(LIMIT, shed_ratio=0.25, admit_ratio=0.5),
        "image-text": ClassLevel(BREAK), "bad class!": ClassLevel(BREAK)}))
    text = pick_table(picker, NOW)
    assert table_levels(text) == {"speech": ["normal", "0", "1"], "video": ["limit", "0.25", "0.5"],
                                  "image-text": ["break", "0", "1"]}  # a name the action cannot match is left out
    assert set(table_rows(text)) == {"a"}


def test_requests_the_python_picker_sent_do_not_shrink_the_published_free_kv() -> None:
    picker = HeadroomPicker({"a": "h:1"}, PickerParams())
    picker.observe("a", LiveSignals(running=0, waiting=0, kv_usage=0.0, kv_capacity_tokens=1000, updated=NOW))
    picker.pick(RequestNeed("", 300.0), NOW + 0.01)  # the Lua action counts its own picks since the scrape
    assert table_rows(pick_table(picker, NOW + 0.02))["a"][4] == "1000"


def test_settings_and_lines_refuse_what_the_lua_action_cannot_do() -> None:
    assert pick_settings(PickerParams(), 4.0, 256.0) == "cpt=4,out=256,ew=1,mp=1,sp=1,vis=0.2,stale=3,size=256,win=10"
    assert "sp=1000000," in pick_settings(PickerParams(short_penalty=1e6), 4.0, 256.0)  # no exponent for Lua
    with pytest.raises(ConfigError, match="work_unit"):
        pick_settings(PickerParams(work_unit="tokens"), 4.0, 256.0)
    with pytest.raises(ConfigError, match="short_penalty must be finite"):
        pick_settings(PickerParams(short_penalty=math.inf), 4.0, 256.0)
    with pytest.raises(ConfigError, match="not a valid HAProxy name"):
        pick_rules(["gpus"], ["b 0"], "cpt=4")
    with pytest.raises(ConfigError, match="single quotes"):
        pick_rules(["gpus"], ["b0"], "cpt=4", Fallback(503, "it's full"))
    with pytest.raises(ConfigError, match="http://"):
        pick_globals("https://x/v1/pick-table")
    with pytest.raises(ConfigError, match="poll period"):
        pick_globals("http://x/v1/pick-table", 1)
    text = pick_snippet("http://127.0.0.1:9003/v1/pick-table", "gpus", ["b0", "b1"], "cpt=4")
    assert "lua.triscope_pick gpus cpt=4" in text and "use-server b1 if { var(txn.triscope_server) -m str b1 }" in text
    with pytest.raises(ConfigError, match="table_port"):
        EppConfig.from_config({"epp": {"table_port": 70000}})


def test_pick_log_lines_read_back() -> None:
    line = ("triscope-pick 1765040000.123 b0 200 0 1 48 51 chat 2010 "
            "b0:2+0:fit:2|b1:1+1:misfit:3|b2:0+0:stale:out")
    record = parse_pick_log_line(line)
    assert record is not None and record.accepted_s == pytest.approx(1765040000.123)
    assert (record.server, record.status, record.queue_ms, record.connect_ms) == ("b0", 200, 0, 1)
    assert (record.response_ms, record.active_ms, record.request_class, record.need_tokens) == (48, 51, "chat", 2010)
    assert record.standings["b1"].external == 1 and record.standings["b1"].score == 3
    assert record.standings["b2"].score is None and record.standings["b2"].fit == "stale"
    # a request no pick chose (another balance, a refusal): empty variables and HAProxy's -1 timers
    bare = parse_pick_log_line("triscope-pick 1765040000.500 b1 503 -1 -1 -1 3 - - -")
    assert bare is not None and bare.standings == {} and bare.request_class == "" and bare.response_ms == -1
    for other in ("[NOTICE] haproxy started", "triscope-pick x b0 200 0 0 1 1 - - -",
                  "triscope-pick 1.0 b0 200 0 0 1 1 - - b0:2:fit:2",
                  "triscope-pick 1.0 b0 200 0 0 1 1 - - b0:a+0:fit:2"):
        assert parse_pick_log_line(other) is None, other


@dataclass
class Bed:
    hap: HAProxy
    service: EppService
    fleet: SimFleet
    specs: list[BackendSpec]


@pytest.fixture(scope="module")
def bed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Bed]:
    require_binary("haproxy")
    specs = [BackendSpec(f"b{i}", free_port(), kv_gib=4.0) for i in range(3)]
    fleet = SimFleet(specs, batch_slowdown=0.8).start()
    cfg = EppConfig.from_config({"epp": {"port": 0, "table_port": 0, "scrape_interval_s": 0.05,
                                         "scrape_budget": 0.0}})
    service = EppService(cfg, {s.name: f"127.0.0.1:{s.port}" for s in specs}, seed=3)
    try:
        service.start()
        wait_for(lambda: service.waiting_for() is None, 10, "every backend scraped once")
        pick = PickSetup(f"http://127.0.0.1:{service.table_port}{TABLE_PATH}",
                         cfg.haproxy_pick_settings(), 20)
        with HAProxy(tmp_path_factory.mktemp("pick"), [Server(s.name, s.port) for s in specs], balance="leastconn",
                     retries=0, pick=pick) as hap:
            wait_for(lambda: hap.pick_stats()["polls"] > 0, 10, "the Lua task's first poll of the table")
            yield Bed(hap, service, fleet, specs)
    finally:
        service.close()
        fleet.stop()


def served_by(raw: bytes) -> str:
    return str(json.loads(raw)["backend"])


def logged_since(hap: HAProxy, start: int, n: int) -> list[PickLogRecord]:
    """The ``n`` request-log records after the first ``start`` (HAProxy writes a line after its answer)."""
    return wait_for(lambda: hap.request_log()[start:start + n] if len(hap.request_log()) >= start + n else None,
                    5, f"{n} requests logged")


def settle(bed: Bed) -> None:
    """No request left on any backend, and a table written after that."""
    bed.fleet.wait_idle(30)
    bed.fleet.reset()
    time.sleep(0.3)  # scrapes (50 ms) and polls (20 ms) after the reset


def test_the_table_is_served_and_polled(bed: Bed) -> None:
    port = bed.service.table_port
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{TABLE_PATH}", timeout=5) as answer:
        rows = table_rows(answer.read())
    assert set(rows) == {"b0", "b1", "b2"} and all(r[0] == "1" for r in rows.values())
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(urllib.request.Request(f"http://127.0.0.1:{port}{TABLE_PATH}", b""), timeout=5)
    assert refused.value.code == 405
    stats = bed.hap.pick_stats()
    assert stats["failed_polls"] == 0 and stats["table_age_s"] < 1.0


def test_concurrent_requests_spread_by_haproxys_own_count(bed: Bed) -> None:
    settle(bed)
    before = bed.hap.pick_stats()["picks"]
    with ThreadPoolExecutor(9) as pool:  # each takes seconds: all nine overlap, picked between two scrapes
        results = list(pool.map(lambda i: post(bed.hap.port, body(100, 1500, f" {i}")), range(9)))
    assert all(status == 200 for status, _ in results)
    assert Counter(served_by(raw) for _, raw in results) == {"b0": 3, "b1": 3, "b2": 3}
    assert bed.hap.pick_stats()["picks"] - before == 9  # the Lua action chose every one


def test_several_haproxy_threads_still_spread_a_burst(tmp_path_factory: pytest.TempPathFactory, bed: Bed) -> None:
    """``lua-load`` runs the action on one shared state, one thread at a time; what is left between two
    threads is the instant between a pick and HAProxy counting its connection. 30 overlapping requests on
    three idle engines with 4 threads: a herd would put far more than a third on one; a rare race may move
    one or two."""
    settle(bed)
    pick = PickSetup(f"http://127.0.0.1:{bed.service.table_port}{TABLE_PATH}",
                     bed.service.cfg.haproxy_pick_settings(), 20)
    with HAProxy(tmp_path_factory.mktemp("threads"), [Server(s.name, s.port) for s in bed.specs],
                 balance="leastconn", retries=0, pick=pick, nbthread=4) as hap:
        wait_for(lambda: hap.pick_stats()["polls"] > 0, 10, "the first poll")
        with ThreadPoolExecutor(30) as pool:
            results = list(pool.map(lambda i: post(hap.port, body(100, 1500, f" t{i}")), range(30)))
        stats = hap.pick_stats()
    assert all(status == 200 for status, _ in results)
    spread = Counter(served_by(raw) for _, raw in results)
    assert set(spread) == {"b0", "b1", "b2"} and max(spread.values()) <= 12, spread
    assert stats["picks"] == 30 and stats["no_table"] == 0, stats


def test_requests_another_client_runs_count_as_work(bed: Bed) -> None:
    settle(bed)
    before = bed.hap.pick_stats()
    logged_before = len(bed.hap.request_log())
    tenant = bed.specs[0]
    with ThreadPoolExecutor(7) as pool:  # three long requests straight to b0, not through HAProxy
        pinned = [pool.submit(post, tenant.port, body(100, 2500, f" t{i}")) for i in range(3)]
        wait_for(lambda: bed.service.picker.explain(time.monotonic())["b0"]["engine_requests"] == 3, 10,
                 "the tenant's requests in b0's scrape")
        time.sleep(0.1)  # a poll of the table after that scrape
        ours = list(pool.map(lambda i: post(bed.hap.port, body(100, 600, f" {i}")), range(4)))
        assert all(f.result()[0] == 200 for f in pinned)
    # leastconn would count b0 empty (HAProxy sent it nothing); the picker counts the tenant's three
    assert Counter(served_by(raw) for _, raw in ours) == {"b1": 2, "b2": 2}
    logged = logged_since(bed.hap, logged_before, 4)  # and logged them as b0's work
    assert all(r.standings["b0"].busy == 0 and r.standings["b0"].external == 3 for r in logged), logged
    after = bed.hap.pick_stats()  # the last two went where HAProxy had more in flight than on b0
    assert after["diverted"] - before["diverted"] == 2 and after["picks"] - before["picks"] == 4


def test_a_request_goes_where_it_fits(bed: Bed) -> None:
    settle(bed)
    bed.fleet.set_pressure("b1", int(3.9 * GIB))  # another process holds most of b1's KV
    try:
        wait_for(lambda: bed.service.picker.explain(time.monotonic())["b1"]["free_kv_tokens"] < 1000, 10,
                 "b1's KV short")
        rows = bed.service.picker.explain(time.monotonic())
        assert rows["b0"]["free_kv_tokens"] - rows["b0"]["reserve_tokens"] > 2000  # fits b0 and b2, not b1
        time.sleep(0.1)
        logged_before = len(bed.hap.request_log())
        served = [served_by(post(bed.hap.port, body(2000, 2, f" {i}"), {"x-triscope-class": "chat a/b"})[1])
                  for i in range(16)]
    finally:
        bed.fleet.set_pressure("b1", 0)
    # one at a time: work ties, the fit decides; ties at random (16 all to one side: 2 in 65,536)
    assert "b1" not in served and set(served) == {"b0", "b2"}
    # HAProxy's log says why, request by request: b1 did not fit and cost one request of work more
    logged = logged_since(bed.hap, logged_before, 16)
    assert [r.server for r in logged] == served
    for record in logged:
        assert record.status == 200 and record.request_class == "chat_a_b" and 2000 < record.need_tokens < 2020
        assert record.active_ms >= record.response_ms >= 0 and record.queue_ms == 0
        assert set(record.standings) == {"b0", "b1", "b2"}
        misfit, chosen = record.standings["b1"], record.standings[record.server]
        assert misfit.fit == "misfit" and chosen.fit == "fit" and (misfit.busy, chosen.busy) == (0, 0)
        assert misfit.score == chosen.score + 1


def test_drains_of_the_weight_engine_hold(bed: Bed) -> None:
    settle(bed)
    excluded = bed.hap.pick_stats()["excluded"]
    picker = bed.service.picker
    picker.set_weights(EngineView({"b0": 1.0, "b1": 1.0, "b2": 1.0}, frozenset({"b2"}),
                                  {"speech": {"b0": "drain"}}))
    try:
        time.sleep(0.3)
        with ThreadPoolExecutor(6) as pool:  # overlapping: HAProxy's counts split them (one at a time, a tie
            # at random each time could send all six to one)
            plain = [served_by(raw) for _, raw in pool.map(lambda i: post(bed.hap.port, body(20, 1500, f" {i}")),
                                                            range(6))]
        speech = [served_by(post(bed.hap.port, body(20, 2, f" s{i}"), {"x-triscope-class": "speech"})[1])
                  for i in range(4)]
        in_body = json.dumps({"prompt": "w" * 80, "prompt_tokens": 20, "max_tokens": 2,
                              "request_class": "speech"}).encode()
        speech += [served_by(post(bed.hap.port, in_body)[1]) for _ in range(4)]
    finally:
        picker.set_weights(None)
    assert Counter(plain) == {"b0": 3, "b1": 3}
    assert speech == ["b1"] * 8  # the class from the header, or from the body's request_class
    assert bed.hap.pick_stats()["excluded"] - excluded == 14


def test_admission_levels_refuse_inside_haproxy(bed: Bed) -> None:
    """The engine's levels, through the table: ``break`` refuses a class outright, ``degrade`` a share of
    it, ``limit`` holds it to a token bucket; the refused get the fallback answer and reach no backend."""
    settle(bed)
    before = bed.hap.pick_stats()
    sent_before = sum(int(row["stot"]) for row in bed.hap.stats() if row["svname"] in ("b0", "b1", "b2"))
    picker = bed.service.picker
    picker.set_weights(EngineView({"b0": 1.0, "b1": 1.0, "b2": 1.0}, class_levels={
        "speech": ClassLevel(NORMAL), "video": ClassLevel(BREAK), "image-text": ClassLevel(DEGRADE, shed_ratio=0.5),
        "bulk": ClassLevel(LIMIT, admit_ratio=0.5)}))

    def send(request_class: str, n: int) -> list[tuple[int, bytes]]:
        return [post(bed.hap.port, body(20, 1, f" {i}"), {"x-triscope-class": request_class}) for i in range(n)]

    try:
        time.sleep(0.3)  # polls of the table with the levels
        video, speech, image = send("video", 5), send("speech", 5), send("image-text", 80)
        started = time.monotonic()
        bulk = send("bulk", 20)
        bulk_s = time.monotonic() - started
    finally:
        picker.set_weights(None)
    assert all(status == 503 and raw.decode() == Fallback.body for status, raw in video)
    assert all(status == 200 for status, _ in speech)
    shed = sum(status == 503 for status, _ in image)
    assert 20 <= shed <= 60 and {status for status, _ in image} == {200, 503}, shed  # 0.5 of 80: 4.5 sd either way
    # the bucket starts full (1 request) and fills at 0.5 x the class's arrival rate over 10 s (< 1 req/s here)
    admitted = sum(status == 200 for status, _ in bulk)
    assert bulk[0][0] == 200 and admitted <= 2 + bulk_s * 1.0, (admitted, bulk_s)
    after = bed.hap.pick_stats()
    assert after["refused_break"] - before["refused_break"] == 5
    assert after["refused_degrade"] - before["refused_degrade"] == shed
    assert after["refused_limit"] - before["refused_limit"] == 20 - admitted
    sent = sum(int(row["stot"]) for row in bed.hap.stats() if row["svname"] in ("b0", "b1", "b2")) - sent_before
    assert sent == 5 + (80 - shed) + admitted  # no refused request reached an engine
    # the same counters for Prometheus, on /metrics of the counters' frontend
    with urllib.request.urlopen(f"http://127.0.0.1:{bed.hap.pick_stats_port}/metrics", timeout=5) as answer:
        families = {f.name: f for f in text_string_to_metric_families(answer.read().decode())}
    refused = {s.labels["level"]: s.value for s in families["triscope_haproxy_pick_refused"].samples}
    assert refused["break"] >= after["refused_break"] and refused["limit"] >= after["refused_limit"]
    assert families["triscope_haproxy_picks"].samples[0].value >= after["picks"]
    assert 0 <= families["triscope_haproxy_pick_table_age_seconds"].samples[0].value < 3
    promtool = require_binary("promtool")
    with urllib.request.urlopen(f"http://127.0.0.1:{bed.hap.pick_stats_port}/metrics", timeout=5) as answer:
        lint = subprocess.run([promtool, "check", "metrics"], input=answer.read().decode(), capture_output=True,
                              text=True, timeout=30)
    assert lint.returncode == 0 and not lint.stdout.strip() and not lint.stderr.strip(), lint.stdout + lint.stderr
    time.sleep(0.3)  # levels gone with the engine's result: every class admitted again
    assert all(status == 200 for status, _ in send("video", 3))


def test_without_its_table_it_picks_by_haproxys_count(tmp_path_factory: pytest.TempPathFactory, bed: Bed) -> None:
    settle(bed)
    nowhere = PickSetup(f"http://127.0.0.1:{free_port()}{TABLE_PATH}", "cpt=4", 20)
    with HAProxy(tmp_path_factory.mktemp("nopick"), [Server(s.name, s.port) for s in bed.specs],
                 balance="leastconn", retries=0, pick=nowhere) as hap:
        wait_for(lambda: hap.pick_stats()["failed_polls"] > 0, 10, "a failed poll")
        with ThreadPoolExecutor(6) as pool:
            results = list(pool.map(lambda i: post(hap.port, body(100, 1500, f" {i}")), range(6)))
        stats = hap.pick_stats()
    assert all(status == 200 for status, _ in results)
    assert Counter(served_by(raw) for _, raw in results) == {"b0": 2, "b1": 2, "b2": 2}
    assert stats["polls"] == 0 and stats["picks"] == stats["no_table"] == 6 and stats["table_age_s"] is None


def test_a_config_with_the_table_port_serves_it(bed: Bed) -> None:
    cfg = replace(bed.service.cfg, port=0, table_port=0)
    other = EppService(cfg, {"b0": f"127.0.0.1:{bed.specs[0].port}"})
    other.start()
    try:
        assert other.table_port > 0
        wait_for(lambda: other.waiting_for() is None, 10, "b0 scraped")
        with urllib.request.urlopen(f"http://127.0.0.1:{other.table_port}{TABLE_PATH}", timeout=5) as answer:
            assert set(table_rows(answer.read())) == {"b0"}
        assert other.stats()["tables_served"] == 1
    finally:
        other.close()


def test_cli_prints_lines_haproxy_accepts(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``triscope weights haproxy-pick``: the table URL from ``[epp]``, the servers named as the backends;
    the lines, placed in a whole config, pass ``haproxy -c``."""
    haproxy = require_binary("haproxy")
    from triscope.cli import main

    cfg = tmp_path / "triscope.toml"
    cfg.write_text('[epp]\ntable_port = 9003\nshort_penalty = 3\n'
                   '[weights.backends."gpu-a:8000"]\naddress = "127.0.0.1:9001"\n'
                   '[weights.backends."gpu-b:8000"]\naddress = "127.0.0.1:9002"\n')
    assert main(["weights", "haproxy-pick", "-c", str(cfg), "--json", "--stats-port", "18405"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["table_url"] == "http://127.0.0.1:9003/v1/pick-table" and "sp=3" in doc["settings"]
    assert doc["servers"] == ["gpu-a:8000", "gpu-b:8000"] and Path(doc["lua_path"]).is_file()
    assert "    bind 127.0.0.1:18405" in doc["config"]  # the counters' frontend, on loopback
    lines = doc["config"].splitlines()
    stats_at = lines.index("frontend triscope_pick_stats")
    lines = lines[:stats_at]  # placed after the servers below
    assert f'#     log-format "{doc["log_format"]}"' in doc["config"].splitlines()  # a comment; used below
    frontend = ["    nbthread 1", "    log stdout format raw local0", "defaults", "    mode http",
                "    timeout connect 1s", "    timeout client 5s", "    timeout server 5s", "frontend fe",
                "    bind 127.0.0.1:18080", "    log global", f'    log-format "{doc["log_format"]}"',
                "    default_backend gpus"]
    full = (lines[:4] + frontend + lines[4:]
            + ["    server gpu-a:8000 127.0.0.1:9001", "    server gpu-b:8000 127.0.0.1:9002"]
            + doc["config"].splitlines()[stats_at:])
    (tmp_path / "h.cfg").write_text("\n".join(full) + "\n")
    check = subprocess.run([haproxy, "-c", "-f", str(tmp_path / "h.cfg")], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr

    bare = tmp_path / "bare.toml"
    bare.write_text('[weights.backends.b0]\naddress = "127.0.0.1:9001"\n')
    assert main(["weights", "haproxy-pick", "-c", str(bare)]) == 2
    assert "[epp] table_port is not set" in capsys.readouterr().err
    tokens = tmp_path / "tokens.toml"
    tokens.write_text('[epp]\nwork_unit = "tokens"\n[weights.backends.b0]\naddress = "127.0.0.1:9001"\n')
    assert main(["weights", "haproxy-pick", "-c", str(tokens), "--table-url", "http://127.0.0.1:1/x"]) == 2
    assert "work_unit must be 'requests'" in capsys.readouterr().err
    assert main(["weights", "haproxy-pick", "--lua-path"]) == 0
    assert capsys.readouterr().out.strip().endswith("haproxy_pick.lua")


@contextmanager
def hand_written_table(rows: Callable[[], str]) -> Iterator[str]:
    """A plain HTTP server answering ``TABLE_HEADER`` and ``rows()`` on every poll; yields its URL."""

    class Table(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            payload = (TABLE_HEADER + "\n" + rows()).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Table)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}{TABLE_PATH}"
    finally:
        server.shutdown()
        server.server_close()


def test_an_engine_that_answers_stays_ready_while_its_scrapes_fail(tmp_path: Path, bed: Bed) -> None:
    """The table says b0 unhealthy (its scrapes time out) but HAProxy saw it answer: it stays a candidate,
    as the Endpoint Picker's answers keep it ready; once its port refused a scrape it is out. The table is
    written by hand here (served by a plain HTTP server) to hold b0's scrapes failing."""
    settle(bed)
    line = "{name} {healthy} 0 -1 -1 -1 0 0 5 5 - {refused}\n"
    state = {"b0": (1, 0)}

    def rows() -> str:
        return "".join(line.format(name=n, healthy=state.get(n, (1, 0))[0], refused=state.get(n, (1, 0))[1])
                       for n in ("b0", "b1", "b2"))

    with hand_written_table(rows) as url:
        setup = PickSetup(url, "cpt=4,stale=3", 20)
        with HAProxy(tmp_path, [Server(s.name, s.port) for s in bed.specs], balance="leastconn", retries=0,
                     pick=setup) as hap:
            wait_for(lambda: hap.pick_stats()["polls"] > 0, 10, "the first poll")
            def six(tag: str) -> Counter[str]:  # overlapping requests: HAProxy's counts spread them
                with ThreadPoolExecutor(6) as pool:
                    return Counter(served_by(raw) for _, raw in pool.map(
                        lambda i: post(hap.port, body(20, 300, f" {tag}{i}")), range(6)))

            first = six("a")  # b0 answers
            state["b0"] = (0, 0)  # its scrapes fail from now on; it answered a moment ago
            time.sleep(0.2)
            still = six("b")
            state["b0"] = (0, 1)  # its port refused a scrape: gone
            time.sleep(0.2)
            gone = six("c")
    assert first == still == {"b0": 2, "b1": 2, "b2": 2} and gone == {"b1": 3, "b2": 3}


def test_the_kv_of_an_answered_request_counts_free_before_the_next_scrape(tmp_path: Path, bed: Bed) -> None:
    """A table whose scrapes (0.5 s old at every poll) left both engines 2,000 tokens free. A long request
    fits either; once it is answered, the KV of its prompt, which those scrapes saw, is free again, so a
    request of 2,067 tokens fits only where it ran. The table's last column says no request was waiting;
    with one waiting the freed KV is the waiting one's, and the request fits nowhere."""
    settle(bed)
    waiting = {"n": 0}

    def rows() -> str:  # NAME HEALTHY DRAINED FRESH_LEFT LOAD FREE RESERVE SHORT AGE SENT_AGE CLASSES REFUSED WAITING
        return "".join(f"{n} 1 0 10 -1 2000 0 0 0.5 0.5 - 0 {waiting['n']}\n" for n in ("b0", "b1"))

    long_body, big_body = body(200, 1500, " long"), body(2050, 2, " big")
    assert 1500 + len(long_body) / 4 < 2000 < 2 + len(big_body) / 4 < 2000 + len(long_body) / 4
    servers = [Server(s.name, s.port) for s in bed.specs[:2]]
    with hand_written_table(rows) as url, HAProxy(tmp_path, servers, balance="leastconn", retries=0,
                                                  pick=PickSetup(url, "cpt=4,vis=0.2,stale=3", 20)) as hap:
        wait_for(lambda: hap.pick_stats()["polls"] > 0, 10, "the first poll")
        for i, expect_credit in enumerate((True, True, False)):
            waiting["n"] = 0 if expect_credit else 1
            time.sleep(0.1)  # a poll of that table
            started = time.monotonic()
            status, raw = post(hap.port, long_body)
            took = time.monotonic() - started
            # picked over a second before the scrape the next pick weighs (0.5 s old, polled every 20 ms)
            assert status == 200 and took > 1.5, took
            assert post(hap.port, big_body)[0] == 200
            ran, big = logged_since(hap, 2 * i, 2)
            assert ran.server == served_by(raw) and ran.standings[ran.server].fit == "fit"
            other = "b1" if ran.server == "b0" else "b0"
            if expect_credit:
                assert big.server == ran.server, big
                assert big.standings[ran.server].fit == "fit" and big.standings[other].fit == "misfit", big
            else:
                assert {s.fit for s in big.standings.values()} == {"nofit"}, big


class _BigTable(http.server.BaseHTTPRequestHandler):
    """Answers every poll with a 20 MB table of a valid header and 550,000 made-up rows."""

    body = (TABLE_HEADER + "\n" + "".join(f"x{i} 1 0 3 0 1000 0 0 0.1 0.1 - 0 0\n" for i in range(550_000))).encode()

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args: object) -> None:
        pass


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def test_an_oversized_table_is_dropped_unparsed_and_haproxy_keeps_answering(
        tmp_path_factory: pytest.TempPathFactory, bed: Bed) -> None:
    """The attack: a 20 MB pick table left 3 of 20 requests unanswered within 5 s and took HAProxy from 16 to
    172 MB for good. Now it is refused before parsing (fail open: HAProxy's own balance) and memory
    stays bounded."""
    settle(bed)
    assert len(_BigTable.body) > 20_000_000
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _BigTable)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        big = PickSetup(f"http://127.0.0.1:{server.server_address[1]}{TABLE_PATH}", "cpt=4", 200)
        with HAProxy(tmp_path_factory.mktemp("bigtable"), [Server(s.name, s.port) for s in bed.specs],
                     balance="leastconn", retries=0, pick=big) as hap:
            assert hap.proc is not None
            wait_for(lambda: hap.pick_stats()["oversized_polls"] >= 3, 20, "three oversized polls")
            t0 = time.monotonic()
            with ThreadPoolExecutor(20) as pool:
                results = list(pool.map(lambda i: post(hap.port, body(50, 16, f" big{i}"), timeout=5), range(20)))
            elapsed = time.monotonic() - t0
            wait_for(lambda: hap.pick_stats()["oversized_polls"] >= 10, 30, "ten oversized polls")
            rss_mib = _rss_kib(hap.proc.pid) / 1024
            stats = hap.pick_stats()
    finally:
        server.shutdown()
    assert all(status == 200 for status, _ in results) and elapsed < 5, (results, elapsed)
    assert stats["polls"] == 0 and stats["failed_polls"] >= stats["oversized_polls"] >= 10
    assert stats["no_table"] == 20  # fail open: the backend's own balance picked
    assert rss_mib < 100, f"HAProxy RSS {rss_mib:.0f} MiB after ten 20 MB answers"
