"""Shared pieces of the real-load-balancer tests (HAProxy, Envoy, Traefik): backends, inputs, polling.

Backends are tiny HTTP servers on 127.0.0.1 answering their own name; the weight feed gets its
engine inputs from :class:`Fleet` (a mutable memory ratio per backend) instead of a store.
"""

from __future__ import annotations

import collections
import contextlib
import http.client
import json
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from conftest import free_port  # noqa: F401 - re-exported for the LB tests

from triscope.analyzers.routing import BackendInputs, WeightParams
from triscope.exporters.feed import WeightFeed

GIB = 1024**3


class _NameHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    wbufsize = 1 << 16  # headers and body in one segment (no Nagle / delayed-ACK stalls)

    def do_GET(self) -> None:
        body = self.server.backend_name.encode()  # type: ignore[attr-defined]
        self.send_response(200)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        pass


@contextlib.contextmanager
def backends(names: list[str]) -> Iterator[dict[str, int]]:
    """Start one HTTP server per name; yields name -> port."""
    servers = []
    try:
        for name in names:
            srv = ThreadingHTTPServer(("127.0.0.1", 0), _NameHandler)
            srv.daemon_threads = True
            srv.backend_name = name  # type: ignore[attr-defined]
            threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True).start()
            servers.append(srv)
        yield {s.backend_name: s.server_address[1] for s in servers}  # type: ignore[attr-defined]
    finally:
        for srv in servers:
            srv.shutdown()
            srv.server_close()


class Fleet:
    """Engine inputs for the feed: fresh samples with a memory ratio set by the test."""

    def __init__(self, ports: dict[str, int]) -> None:
        self.ports = ports
        self.memory = dict.fromkeys(ports, 0.0)
        self._lock = threading.Lock()

    def set(self, **ratios: float) -> None:
        with self._lock:
            self.memory.update(ratios)

    def __call__(self) -> list[BackendInputs]:
        now = time.time()
        with self._lock:
            memory = dict(self.memory)
        return [BackendInputs(name, memory_used_bytes=ratio * 80 * GIB, memory_total_bytes=80 * GIB,
                              sources={"gpu": now, "serving": now}, address=f"127.0.0.1:{self.ports[name]}")
                for name, ratio in memory.items()]


# Envoy 1.40 sends its whole node (with the extension list) in every REST DiscoveryRequest:
# about 77 KB, more than the 64 KiB default of [weights.feed] max_body_bytes.
ENVOY_MAX_BODY_BYTES = 1 << 20


def fast_params(**feed: Any) -> WeightParams:
    """Undamped engine (weights jump to their targets each update) updating every 0.2 s."""
    return WeightParams.from_config({"weights": {
        "interval_s": 0.2, "ewma_down": 1.0, "ewma_up": 1.0, "max_step_down": 1.0, "max_step_up": 1.0,
        "slow_start": False, "history": False,
        "feed": {"port": 0, "agent_port": -1, "max_body_bytes": ENVOY_MAX_BODY_BYTES, **feed}}})


@contextlib.contextmanager
def fed_backends(names: tuple[str, ...] = ("a", "b", "c")) -> Iterator[tuple[dict[str, int], Fleet, WeightFeed]]:
    """Backends answering their names, the :class:`Fleet` over them and a started :func:`fast_params`
    feed reading it (no store); all closed on exit."""
    with backends(list(names)) as ports:
        fleet = Fleet(ports)
        feed = WeightFeed(fast_params(), inputs_fn=fleet).start()
        try:
            yield ports, fleet, feed
        finally:
            feed.close()


@contextlib.contextmanager
def logged_process(argv: list[str], log: Path, cwd: Path | None = None) -> Iterator[subprocess.Popen]:
    """Run ``argv`` with stdout and stderr in ``log``; :func:`stop` it on exit."""
    with log.open("wb") as log_file:
        proc = subprocess.Popen(argv, stdout=log_file, stderr=subprocess.STDOUT, cwd=cwd)
    try:
        yield proc
    finally:
        stop(proc)


def wait_for(predicate: Callable[[], Any], timeout: float, what: str, proc: subprocess.Popen | None = None,
             log: Path | None = None) -> Any:
    """Poll ``predicate`` until it returns a truthy value; fail with ``what`` (and the log tail)."""
    deadline = time.monotonic() + timeout
    last_exc: BaseException | None = None
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"{what}: process exited with {proc.returncode}\n{_tail(log)}")
        try:
            value = predicate()
            if value:
                return value
        except (OSError, http.client.HTTPException, ValueError, KeyError) as exc:
            last_exc = exc
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout:g}s waiting for {what} (last error: {last_exc})\n{_tail(log)}")


def _tail(log: Path | None) -> str:
    if log is None or not log.exists():
        return ""
    return "\n".join(log.read_text(errors="replace").splitlines()[-20:])


def http_get(port: int, path: str, timeout: float = 2.0) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def post_completion(port: int, payload: bytes, headers: dict[str, str] | None = None,
                    timeout: float = 30.0) -> tuple[int, bytes]:
    """``POST /v1/completions`` with a JSON body on 127.0.0.1:``port``: (status, body)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", "/v1/completions", payload, {"Content-Type": "application/json", **(headers or {})})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def completion_body(prompt_tokens: int, max_tokens: int, tag: str = "") -> bytes:
    """A completion for the simulated engines: a prompt of about ``prompt_tokens`` (4 characters each)."""
    return json.dumps({"prompt": "w" * (4 * prompt_tokens) + tag, "prompt_tokens": prompt_tokens,
                       "max_tokens": max_tokens}).encode()


def split(port: int, n: int) -> collections.Counter:
    """Send ``n`` sequential GETs over one keep-alive connection; count the answering backends."""
    counts: collections.Counter = collections.Counter()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5.0)
    try:
        for _ in range(n):
            conn.request("GET", "/")
            resp = conn.getresponse()
            body = resp.read()
            counts[body.decode() if resp.status == 200 else f"HTTP {resp.status}"] += 1
    finally:
        conn.close()
    return counts


def assert_even_split(port: int) -> None:
    """300 requests through the balancer at ``port`` spread evenly over backends a, b and c."""
    even = split(port, 300)
    assert all(80 <= even[n] <= 120 for n in "abc"), even


def assert_split_100_50_25(port: int, balancer: str, lag: float) -> None:
    """350 requests through ``port`` follow weights 100:50:25 of a, b, c (200, 100, 50)."""
    counts = split(port, 350)
    print(f"{balancer}: weights applied {lag:.2f}s after the change; split {dict(counts)}")
    assert sum(counts.values()) == 350 and set(counts) <= {"a", "b", "c"}, counts
    assert abs(counts["a"] - 200) <= 25 and abs(counts["b"] - 100) <= 20 and abs(counts["c"] - 50) <= 15, counts


def stop(proc: subprocess.Popen) -> None:
    """Terminate a process we started (kill after 5 s)."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)
