"""Shared fixtures.

chDB allows one data directory per process, so every test of a pytest run shares one embedded
store directory and every test gets a database of its own (``store`` fixture): migrated, holding no rows,
and no other test's while it runs (emptied databases are handed on; see ``store``).
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
from typing import Any

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


def _open(store_path: Path, database: str) -> Any:
    """The embedded store on ``database`` of the run's chDB directory, migrated."""
    from triscope.store import open_store

    # fixtures write fixed dates (2026-01-01...): keep every row instead of the default 7-day TTL
    return open_store({"store": {"backend": "embedded", "path": str(store_path), "database": database,
                                 "raw_ttl_days": 0, "rollup_ttl_days": 0}})


@contextlib.contextmanager
def fresh_database(store_path: Path, database: str) -> Iterator:
    """A migrated embedded store on database ``database`` of the run's chDB directory; the
    database is dropped and the store closed on exit."""
    s = _open(store_path, database)
    try:
        yield s
    finally:
        try:
            s.command(f"DROP DATABASE IF EXISTS {database}")
        finally:
            s.close()


# Databases a finished test left with the schema it was given, every table emptied: migrating a new
# database runs ~200 DDL statements (about 1.5 s of CPU), emptying one ~20 TRUNCATEs (about 0.1 s).
_emptied: list[str] = []


def _schema_of(s: Any) -> tuple[list, list]:
    """Tables with their full definitions (columns, codecs, TTLs, views), and the applied migrations."""
    tables = s.query("SELECT name, create_table_query FROM system.tables WHERE database = {db:String} "
                     "ORDER BY name", {"db": s.database}).rows
    return tables, s.query(f"SELECT domain, version, description FROM {s.database}.schema_migrations "
                            "ORDER BY domain, version").rows


def _holds_rows(s: Any) -> bool:
    return bool(s.query("SELECT count() FROM system.parts WHERE database = {db:String} AND active "
                        "AND table != 'schema_migrations' AND rows > 0", {"db": s.database}).rows[0][0])


def _empty_for_reuse(s: Any, schema: tuple[list, list]) -> bool:
    """Truncate every data table of ``s`` when its schema is still ``schema``; False (nothing done) when the
    test changed the schema or the database is gone."""
    try:
        if _schema_of(s) != schema:
            return False
        for name, query in schema[0]:
            if "MergeTree" in query and name != "schema_migrations":
                s.command(f"TRUNCATE TABLE {s.database}.{name}")
        return not _holds_rows(s)
    except Exception:  # a test that dropped its database or broke its store: drop it as before
        return False


@pytest.fixture()
def store(store_path: Path) -> Iterator:
    """A migrated embedded store in a database of the run's chDB directory that holds no rows: a fresh
    one, or one an earlier test emptied without changing its schema (it is dropped otherwise)."""
    database = _emptied.pop() if _emptied else f"t{os.getpid()}_{next(_db_counter)}"
    s = _open(store_path, database)
    try:
        if _holds_rows(s):  # written to after it was emptied: never hand rows to a test
            s.command(f"DROP DATABASE IF EXISTS {database}")
            s.close()
            database = f"t{os.getpid()}_{next(_db_counter)}"
            s = _open(store_path, database)
        schema = _schema_of(s)
        yield s
        if _empty_for_reuse(s, schema):
            _emptied.append(database)
        else:
            s.command(f"DROP DATABASE IF EXISTS {database}")
    finally:
        s.close()
