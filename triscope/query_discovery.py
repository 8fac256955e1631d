"""Where a running ``triscope run`` serves its embedded store, for the CLI to find.

The daemon writes ``.triscope-query.json`` beside the store's lock (mode 0600: it holds the
endpoint's token) and removes it when it stops. A reader trusts it only when the process it names is
alive, the path it names is the store asked for, and the store's lock is held (the daemon holds it):
a file left by a daemon that was killed is stale, and the store is opened directly.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

FILE_NAME = ".triscope-query.json"
LOCK_NAME = ".triscope.lock"


@dataclass(frozen=True)
class Endpoint:
    """A live daemon's query endpoint."""

    pid: int
    host: str
    port: int
    path: str
    database: str
    username: str
    token: str

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"


def publish(endpoint: Endpoint) -> Path:
    """Write the discovery file (0600) atomically; returns its path."""
    target = Path(endpoint.path) / FILE_NAME
    tmp = target.with_suffix(f".{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        json.dump(asdict(endpoint), fh)
    os.replace(tmp, target)
    return target


def withdraw(path: str) -> None:
    """Remove the discovery file of the store at ``path`` (when it is this process's)."""
    target = Path(path) / FILE_NAME
    with contextlib.suppress(OSError, ValueError):
        if json.loads(target.read_text()).get("pid") == os.getpid():
            target.unlink()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _lock_held(path: Path) -> bool:
    """Whether another process holds the store's flock (trying to take it does not keep it)."""
    try:
        fh = open(path / LOCK_NAME, "a+")  # noqa: SIM115 - closed below in every case
    except OSError:
        return False
    try:
        fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    else:
        fcntl.flock(fh, fcntl.LOCK_UN)
        return False
    finally:
        fh.close()


def find(path: str | os.PathLike[str]) -> Endpoint | None:
    """The live endpoint serving the store at ``path``, or None (no file, a stale one, another store)."""
    store = Path(path).resolve()
    try:
        doc = json.loads((store / FILE_NAME).read_text())
        endpoint = Endpoint(**{k: doc[k] for k in Endpoint.__dataclass_fields__})
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if Path(endpoint.path).resolve() != store or not _alive(int(endpoint.pid)) or not _lock_held(store):
        return None
    return endpoint


__all__ = ["FILE_NAME", "Endpoint", "find", "publish", "withdraw"]
