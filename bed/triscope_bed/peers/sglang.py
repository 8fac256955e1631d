"""sglang-router 0.3.2 (a Rust load balancer shipped in a PyPI wheel) as a real peer LB for the benches.

``tools/setup_sglang_router.sh`` installs it in a virtualenv of its own (``$TRISCOPE_SGLANG_ROUTER_VENV``
or ``var/sglang-router-venv``); :func:`venv_python` finds it and :class:`SglangRouter` runs
``python -m sglang_router.launch_router`` on 127.0.0.1 in front of the simulated backends, which serve
the worker endpoints it calls (:mod:`triscope_bed.engines.backend`). Flags, endpoints and limits: docs/peers.md.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

from triscope_bed.engines.backend import MAX_BODY_BYTES
from triscope_bed.paths import REPO
from triscope_bed.ports import free_port
from triscope_bed.procs import stop_process

ROUTER_VERSION = "0.3.2"
SETUP_SCRIPT = "tools/setup_sglang_router.sh"
POLICIES = ("power_of_two", "cache_aware", "round_robin", "random")
LOAD_POLL_S = 30.0
"""How often 0.3.2 asks each worker for ``GET /get_load`` (power_of_two only; fixed, not a flag)."""
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


class SglangRouterError(RuntimeError):
    """The router is not installed, did not start, or did not become ready."""


def venv_dir() -> Path:
    """``$TRISCOPE_SGLANG_ROUTER_VENV`` (relative to the repository root) or ``var/sglang-router-venv``."""
    path = Path(os.environ.get("TRISCOPE_SGLANG_ROUTER_VENV") or "var/sglang-router-venv")
    return path if path.is_absolute() else REPO / path


def venv_python() -> Path | None:
    """The router venv's python when the setup script finished there (its stamp), else None; imports nothing."""
    venv = venv_dir()
    python = venv / "bin" / "python"
    if python.exists() and (venv / f".triscope-sglang-router-{ROUTER_VERSION}").exists():
        return python
    return None


def missing_message() -> str:
    """One line for a missing install: where it was looked for and what makes it."""
    return f"sglang-router {ROUTER_VERSION} is not installed in {venv_dir()} (run {SETUP_SCRIPT})"


class SglangRouter:
    """One sglang-router process on 127.0.0.1 (router and Prometheus ports), started and stopped here.

    ``retries`` False (the default) passes ``--disable-retries`` (one attempt per request), so a
    backend's 503 reaches the client as it does through the other LBs of the bench; True keeps the
    router's default of 5 retries with backoff. ``circuit_breaker`` False passes
    ``--disable-circuit-breaker`` (default on: a worker is skipped for 60 s after 10 failures).
    Request bodies are capped at the simulated backends' limit (``--max-payload-size``).
    """

    def __init__(self, worker_urls: Sequence[str], policy: str = "power_of_two", *, retries: bool = False,
                 circuit_breaker: bool = True, port: int | None = None, prometheus_port: int | None = None,
                 workdir: Path | None = None, python: Path | None = None, log_level: str = "warn",
                 max_payload_bytes: int = MAX_BODY_BYTES) -> None:
        if policy not in POLICIES:
            raise ValueError(f"policy {policy!r}: expected one of {', '.join(POLICIES)}")
        if not worker_urls:
            raise ValueError("sglang-router needs at least one worker URL")
        self.worker_urls = list(worker_urls)
        self.policy = policy
        self.retries = retries
        self.circuit_breaker = circuit_breaker
        self.port = port or free_port()
        self.prometheus_port = prometheus_port or free_port()
        self.workdir = Path(workdir) if workdir is not None else Path(tempfile.mkdtemp(prefix="sglang-router-"))
        self.python = python or venv_python()
        self.log_level = log_level
        self.max_payload_bytes = max_payload_bytes
        self.proc: subprocess.Popen[bytes] | None = None
        self.ready_after_s: float | None = None
        self._hub_block: socket.socket | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.prometheus_port}/metrics"

    @property
    def log_path(self) -> Path:
        return self.workdir / "sglang-router.log"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def argv(self) -> list[str]:
        # Both hosts are passed: 0.3.2 binds the router and its metrics to 0.0.0.0 by default.
        args = [str(self.python), "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(self.port),
                "--worker-urls", *self.worker_urls, "--policy", self.policy,
                "--prometheus-host", "127.0.0.1", "--prometheus-port", str(self.prometheus_port),
                "--max-payload-size", str(self.max_payload_bytes), "--log-level", self.log_level,
                # stop() should not wait the default 180 s for in-flight requests
                "--shutdown-grace-period-secs", "1"]
        if not self.retries:
            args.append("--disable-retries")
        if not self.circuit_breaker:
            args.append("--disable-circuit-breaker")
        return args

    def env(self, hub_port: int) -> dict[str, str]:
        # At registration the router loads a tokenizer for the workers' model path from the Hugging Face
        # hub. The simulated model does not exist: point the hub at a local port that refuses
        # connections, so nothing leaves the machine and the attempt fails at once (a logged warning).
        return {**os.environ, "HF_ENDPOINT": f"http://127.0.0.1:{hub_port}", "HF_HUB_OFFLINE": "1",
                "HF_HOME": str(self.workdir / "hf"), "NO_COLOR": "1"}

    def start(self, timeout_s: float = 30.0) -> SglangRouter:
        """Launch and wait until every worker is registered and healthy (bounded)."""
        if self.python is None or not Path(self.python).exists():
            raise SglangRouterError(missing_message())
        self.workdir.mkdir(parents=True, exist_ok=True)
        # A bound socket that never listens: connecting to its port is refused (see env()).
        self._hub_block = socket.socket()
        self._hub_block.bind(("127.0.0.1", 0))
        hub_port = self._hub_block.getsockname()[1]
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(self.argv(), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env=self.env(hub_port), cwd=self.workdir, start_new_session=True)
        started = time.monotonic()
        try:
            self._wait_ready(started + timeout_s)
        except BaseException:
            self.stop()
            raise
        self.ready_after_s = time.monotonic() - started
        return self

    def _wait_ready(self, deadline: float) -> None:
        want = len(self.worker_urls)
        last = "no answer"
        while time.monotonic() < deadline:
            if self.proc is None or self.proc.poll() is not None:
                code = self.proc.returncode if self.proc is not None else None
                raise SglangRouterError(f"sglang-router exited ({code}):\n{self.log_tail()}")
            try:
                doc = self.get_json("/readiness", timeout_s=1.0)
                last = json.dumps(doc)
                if int(doc.get("healthy_workers", 0)) >= want:
                    return
            except (OSError, ValueError, AttributeError) as exc:
                last = str(exc)
            time.sleep(0.1)
        raise SglangRouterError(f"sglang-router not ready with {want} workers ({last}):\n{self.log_tail()}")

    def get_json(self, path: str, timeout_s: float = 2.0) -> Any:
        """GET one of the router's own JSON endpoints (``/readiness``, ``/workers``, ``/get_loads``)."""
        with urllib.request.urlopen(self.url + path, timeout=timeout_s) as resp:
            return json.loads(resp.read(1 << 20))

    def loads(self) -> dict[str, int]:
        """Worker URL -> ``num_tokens`` as the router reads them now. Note: ``/get_loads`` asks the
        workers afresh and does not update what power_of_two decides on (its own 30 s poll)."""
        doc = self.get_json("/get_loads")
        return {w["worker"]: int(w["load"]) for w in doc.get("workers", [])}

    def metrics(self) -> str:
        with urllib.request.urlopen(self.metrics_url, timeout=2.0) as resp:
            return str(resp.read(4 << 20).decode())

    def log_tail(self, lines: int = 30) -> str:
        """The last log lines, colour codes removed (it writes them even to a file)."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(_ANSI.sub("", line) for line in text.splitlines()[-lines:])

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, grace_s: float = 5.0) -> None:
        """SIGTERM, then SIGKILL after ``grace_s``; reaps the process. Safe to call twice."""
        proc, self.proc = self.proc, None
        stop_process(proc, grace_s)
        if self._hub_block is not None:
            self._hub_block.close()
            self._hub_block = None

    def __enter__(self) -> SglangRouter:
        return self.start() if self.proc is None else self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()


def post_completion(url: str, prompt: str, prompt_tokens: int = 100, max_tokens: int = 5,
                    model: str = "sim/llava-onevision-7b", timeout_s: float = 30.0,
                    **extra: Any) -> tuple[int, str, dict[str, Any]]:
    """POST an OpenAI-style ``/v1/completions`` through a router: (status, X-Backend header, JSON body).

    The router needs ``model`` and reads ``prompt`` (cache_aware matches on its text); the simulated
    backend costs the request from ``prompt_tokens`` and ``max_tokens``, which the router forwards as is.
    """
    body = json.dumps({"model": model, "prompt": prompt, "prompt_tokens": prompt_tokens,
                       "max_tokens": max_tokens, **extra}).encode()
    req = urllib.request.Request(url + "/v1/completions", data=body, method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            status, backend, data = resp.status, resp.headers.get("X-Backend", ""), resp.read(1 << 20)
    except urllib.error.HTTPError as exc:
        status, backend, data = exc.code, exc.headers.get("X-Backend", ""), exc.read(1 << 20)
    try:
        doc = json.loads(data) if data else {}
    except ValueError:
        doc = {"text": data.decode(errors="replace")}
    return status, backend, doc if isinstance(doc, dict) else {"value": doc}
