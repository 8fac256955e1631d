"""Shared fixtures.

chDB allows one data directory per process, so the whole test session shares one embedded
store directory and every test gets a database of its own (``store`` fixture).
Tests that need an external binary call :func:`require_binary`; it skips locally, and fails
when ``TRISCOPE_REQUIRE_ALL=1`` (set by CI) so a missing tool cannot pass unnoticed.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
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

    s = open_store({"store": {"backend": "embedded", "path": str(store_path), "database": database}})
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
