"""The benches' helper processes: the simulated backends and triscope's weight feed, one subprocess each."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import threading
import time
import urllib.request
from typing import Any

from triscope_bed.engines.backend import BackendSpec
from triscope_bed.procs import stop_process

PYTHON = sys.executable

# [weights] overrides for a feed that must follow sub-second bursts (every key a regular config key);
# docs/closed_loop.md has the runs that chose them.
BENCH_WEIGHTS: dict[str, Any] = {
    "interval_s": 0.1,
    "queue_weight": 1.0,
    "window_s": 5.0,
    "stale_after_s": 5.0,
    "ewma_down": 0.3,
    "max_step_down": 0.2,
    "ewma_up": 0.3,
    "max_step_up": 0.2,
}


def http_json(url: str, method: str = "GET", timeout: float = 2.0) -> Any:
    req = urllib.request.Request(url, method=method, data=b"" if method == "POST" else None)
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def read_ready(proc: subprocess.Popen[bytes], what: str, timeout_s: float = 30.0) -> Any:
    """Wait for the ``{"ready": ...}`` line a helper process prints on stdout."""
    stdout = proc.stdout
    assert stdout is not None
    result: dict[str, Any] = {}

    def reader() -> None:
        for line in stdout:
            with contextlib.suppress(ValueError):
                doc = json.loads(line)
                if isinstance(doc, dict) and "ready" in doc:
                    result.update(doc)
                    return

    t = threading.Thread(target=reader, daemon=True)
    t.start()
    t.join(timeout_s)
    if not result:
        proc.kill()
        err = proc.stderr.read().decode(errors="replace")[-2000:] if proc.stderr else ""
        raise RuntimeError(f"{what} did not become ready: {err.strip()}")
    return result["ready"]


class SimFleet:
    """The simulated backends, one subprocess serving all of them."""

    def __init__(self, specs: list[BackendSpec], batch_slowdown: float) -> None:
        self.specs = specs
        self.batch_slowdown = batch_slowdown
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> SimFleet:
        cmd = [PYTHON, "-m", "triscope_bed.engines.backend", "--batch-slowdown", str(self.batch_slowdown)]
        for s in self.specs:
            cmd += ["--backend", s.to_arg()]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        read_ready(self.proc, "simulated backends")
        return self

    def url(self, spec: BackendSpec) -> str:
        return f"http://127.0.0.1:{spec.port}"

    def reset(self) -> None:
        for s in self.specs:
            http_json(self.url(s) + "/sim/reset", "POST")

    def states(self) -> dict[str, dict[str, Any]]:
        return {s.name: http_json(self.url(s) + "/sim/state") for s in self.specs}

    def set_pressure(self, name: str, nbytes: int) -> None:
        spec = next(s for s in self.specs if s.name == name)
        http_json(self.url(spec) + f"/sim/pressure?bytes={int(nbytes)}", "POST")

    def wait_idle(self, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if all(st["running"] + st["waiting"] == 0 for st in self.states().values()):
                return
            time.sleep(0.2)

    def stop(self) -> None:
        stop_process(self.proc)
        self.proc = None


class FeedWorker:
    """triscope's weight feed in its own process (:mod:`triscope_bed.fleet.feed_worker`), scraping the backends."""

    def __init__(self, backends: dict[str, str], overrides: dict[str, Any], window_s: float) -> None:
        self.backends = backends
        self.overrides = overrides
        self.window_s = window_s
        self.proc: subprocess.Popen[bytes] | None = None
        self.info: dict[str, Any] = {}

    def start(self) -> FeedWorker:
        cmd = [PYTHON, "-m", "triscope_bed.fleet.feed_worker", "--backends", json.dumps(self.backends),
               "--weights", json.dumps({**BENCH_WEIGHTS, **self.overrides}), "--window-s", str(self.window_s)]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self.info = read_ready(self.proc, "triscope weight feed")
        return self

    @property
    def agent_port(self) -> int:
        return int(self.info["agent_port"])

    def weights_doc(self) -> Any:
        return http_json(f"http://127.0.0.1:{self.info['http_port']}/v1/weights")

    def stop(self) -> None:
        stop_process(self.proc)
        self.proc = None
