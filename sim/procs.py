"""Child processes of the test bed (backends, HAProxy, feed workers): stop them without leaks."""

from __future__ import annotations

import subprocess
from typing import Any


def stop_process(proc: subprocess.Popen[Any] | None, grace_s: float = 5.0) -> None:
    """SIGTERM, then SIGKILL after ``grace_s``; reaps the child. Safe on None or an exited child."""
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
