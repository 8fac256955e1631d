"""Shared pieces of the tests that start ``triscope run`` in a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without ``TRISCOPE_*`` settings (``TRISCOPE_REQUIRE_ALL`` kept), plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRISCOPE_") or k == "TRISCOPE_REQUIRE_ALL"}
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


def written_counts(log_lines: list[str]) -> list[int]:
    """The ``written N`` figure of every ``status: written`` line the daemon logged, in order."""
    return [int(x.split("written ")[1].split(",")[0]) for x in log_lines if "status: written" in x]
