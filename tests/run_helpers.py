"""Shared pieces of the tests that start ``triscope run`` in a subprocess."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

KEPT = ("TRISCOPE_REQUIRE_ALL", "TRISCOPE_STORE__RAW_TTL_DAYS", "TRISCOPE_STORE__ROLLUP_TTL_DAYS")
"""Kept by :func:`clean_env`: CI's strictness, and the retention conftest sets so that stores written with the
fixtures' fixed dates (2026-01-01...) keep their rows in a daemon too."""


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without ``TRISCOPE_*`` settings (those of :data:`KEPT` kept), plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRISCOPE_") or k in KEPT}
    env.update(extra)
    return env


def start_run(config: str | Path, env: dict[str, str], cwd: Path | None = None
              ) -> tuple[subprocess.Popen[str], list[str], threading.Thread]:
    """``triscope run --config CONFIG --json``: the process, its stderr lines (appended by the
    returned reader thread as they come) and that thread."""
    proc = subprocess.Popen([sys.executable, "-m", "triscope", "run", "--config", str(config), "--json"],
                            cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    log_lines: list[str] = []
    assert proc.stderr is not None
    reader = threading.Thread(target=lambda: log_lines.extend(iter(proc.stderr.readline, "")), daemon=True)
    reader.start()
    return proc, log_lines, reader


@dataclass
class RunningDaemon:
    """A ``triscope run`` subprocess started by :func:`running_daemon`."""

    proc: subprocess.Popen[str]
    log_lines: list[str]
    reader: threading.Thread

    @property
    def log(self) -> str:
        return "".join(self.log_lines)

    def assert_alive(self) -> None:
        assert self.proc.poll() is None, self.log

    def stop(self, timeout_s: float = 60) -> dict[str, Any]:
        """SIGTERM, wait for a clean exit (code 0) and return the JSON summary it printed."""
        self.proc.send_signal(signal.SIGTERM)
        out, _ = self.proc.communicate(timeout=timeout_s)
        self.reader.join(timeout=5)
        assert self.proc.returncode == 0, self.log
        return json.loads(out)


@contextmanager
def running_daemon(config: str | Path, env: dict[str, str], cwd: Path | None = None) -> Iterator[RunningDaemon]:
    """:func:`start_run` whose process is killed on the way out if the test did not stop it."""
    daemon = RunningDaemon(*start_run(config, env, cwd))
    try:
        yield daemon
    finally:
        if daemon.proc.poll() is None:
            daemon.proc.kill()
            daemon.proc.wait(timeout=30)
        daemon.reader.join(timeout=5)


def written_counts(log_lines: list[str]) -> list[int]:
    """The ``written N`` figure of every ``status: written`` line the daemon logged, in order."""
    return [int(x.split("written ")[1].split(",")[0]) for x in log_lines if "status: written" in x]


class LastRowsCollector:
    """A collector like bpftrace's: its ``close()`` yields one last row (the window still open),
    which only a ``collect()`` after ``close()`` returns (``ROWS_AFTER_CLOSE``)."""

    name = "last_rows"
    interval_s = 0.1
    ROWS_AFTER_CLOSE = True

    def __init__(self) -> None:
        self._pending: list[dict[str, Any]] = []

    def start(self) -> None:
        self._pending.append({"ts": "2026-01-01 00:00:00.000000000", "host": "open", "device": "d0", "op": "read"})

    def collect(self) -> dict[Any, dict[str, list[Any]]]:
        from triscope.schema import IO_LATENCY

        rows, self._pending = self._pending, []
        return {IO_LATENCY: IO_LATENCY.columns_of(rows)} if rows else {}

    def close(self) -> None:
        self._pending.append({"ts": "2026-01-01 00:00:01.000000000", "host": "closed", "device": "d0", "op": "read"})


def create_last_rows(config: dict[str, Any], context: Any) -> LastRowsCollector:
    """``run_helpers:create_last_rows``, for ``[run] collectors``."""
    return LastRowsCollector()
