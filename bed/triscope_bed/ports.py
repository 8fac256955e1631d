"""Local TCP ports for the bed's processes: a free one, and waiting until one listens."""

from __future__ import annotations

import socket
import subprocess
import time


def free_port() -> int:
    """An unused TCP port on 127.0.0.1 (small race, fine for a bench)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port: int, timeout_s: float = 10.0, host: str = "127.0.0.1",
              proc: subprocess.Popen | None = None) -> None:
    """Block until ``host:port`` accepts TCP connections (fail early if ``proc`` exits)."""
    deadline = time.monotonic() + timeout_s
    while True:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with status {proc.returncode}")
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"nothing listens on {host}:{port} after {timeout_s}s") from None
            time.sleep(0.05)
