"""Shared fixtures.

chDB allows one data directory per process, so the whole test session shares one embedded
store directory and every test gets a database of its own (``store`` fixture).
Tests that need an external binary call :func:`require_binary`; it skips locally, and fails
when ``TRISCOPE_REQUIRE_ALL=1`` (set by CI) so a missing tool cannot pass unnoticed.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import itertools
import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
# Fixtures write fixed dates (2026-01-01...): stores opened from the environment (CLI runs and their
# subprocesses) keep every row instead of the default 7-day TTL.
os.environ.setdefault("TRISCOPE_STORE__RAW_TTL_DAYS", "0")
os.environ.setdefault("TRISCOPE_STORE__ROLLUP_TTL_DAYS", "0")
SHARED_DATA = REPO.parent / "shared" / "data"
TEST_DATA = Path(__file__).resolve().parent / "data"
REQUIRE_ALL = os.environ.get("TRISCOPE_REQUIRE_ALL") == "1"

_db_counter = itertools.count()


def require(condition: bool, reason: str) -> None:
    """Skip (locally) or fail (under TRISCOPE_REQUIRE_ALL=1) when ``condition`` is false."""
    if condition:
        return
    if REQUIRE_ALL:
        pytest.fail(f"required by TRISCOPE_REQUIRE_ALL=1: {reason}")
    pytest.skip(reason)


def require_binary(name: str) -> str:
    """Path of an executable on PATH, or skip/fail with a clear reason."""
    path = shutil.which(name)
    require(path is not None, f"{name} is not installed (see .ci/apt-packages.txt / README)")
    assert path is not None
    return path


def own_process(test: Callable[..., None]) -> Callable[..., None]:
    """Run ``test`` in a pytest process of its own: for process-global measurements (peak RSS,
    tracemalloc), which whatever the suite left running in the shared process would move."""
    @functools.wraps(test)
    def wrapper(*args: object, **kwargs: object) -> None:
        if os.environ.get("TRISCOPE_OWN_PROCESS") == test.__name__:
            test(*args, **kwargs)
            return
        nodeid = f"{inspect.getfile(test)}::{test.__name__}"
        done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", nodeid],
                              env={**os.environ, "TRISCOPE_OWN_PROCESS": test.__name__}, capture_output=True,
                              text=True, timeout=600, cwd=REPO)
        assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    return wrapper


def free_port() -> int:
    """A 127.0.0.1 TCP port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def shared_data(*parts: str) -> Path:
    """A file of ../shared/data (skips when the checkout has no shared folder)."""
    path = SHARED_DATA.joinpath(*parts)
    require(path.exists(), f"sample data {path} is absent (it ships in ../shared/data)")
    return path


@pytest.fixture(scope="session")
def store_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("chdb-store")


@contextlib.contextmanager
def fresh_database(store_path: Path, database: str) -> Iterator:
    """A migrated embedded store on database ``database`` of the session's chDB directory; the
    database is dropped and the store closed on exit."""
    from triscope.store import open_store

    # fixtures write fixed dates (2026-01-01...): keep every row instead of the default 7-day TTL
    s = open_store({"store": {"backend": "embedded", "path": str(store_path), "database": database,
                              "raw_ttl_days": 0, "rollup_ttl_days": 0}})
    try:
        yield s
    finally:
        try:
            s.command(f"DROP DATABASE IF EXISTS {database}")
        finally:
            s.close()


@pytest.fixture()
def store(store_path: Path) -> Iterator:
    """A migrated embedded store in a fresh database of the session's chDB directory."""
    with fresh_database(store_path, f"t{os.getpid()}_{next(_db_counter)}") as s:
        yield s
