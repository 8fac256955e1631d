"""PipeInsert: a streaming INSERT fed through a named pipe, including the ways it can end early."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from triscope.collectors.kineto.pipe_insert import PipeInsert
from triscope.errors import StoreError
from triscope.schema import qualified


@pytest.fixture()
def pool():
    with ThreadPoolExecutor(max_workers=1) as executor:
        yield executor


def test_everything_written_reaches_the_reader_and_the_pipe_is_removed(pool):
    got: list[bytes] = []

    def reader(path: Path) -> None:
        with open(path, "rb") as fh:
            got.append(fh.read())

    pipe = PipeInsert(reader, pool)
    chunk = b"x" * (1 << 20)  # far more than a pipe's buffer: the writer waits for the reader
    assert pipe.write(b"[", memoryview(chunk)[:1000], b"]") and pipe.write(chunk)
    assert pipe.finish() is None
    assert got == [b"[" + chunk[:1000] + b"]" + chunk]
    assert not pipe.path.exists() and not pipe.path.parent.exists()


def test_an_insert_that_fails_before_opening_the_pipe_does_not_hang_the_writer(pool):
    def failing(path: Path) -> None:
        raise StoreError("query failed: syntax")

    pipe = PipeInsert(failing, pool)
    assert not pipe.write(b"[{}]") and not pipe.write(b"more"), "nothing written once it failed"
    error = pipe.finish()
    assert isinstance(error, StoreError) and "syntax" in str(error)


def test_an_insert_that_stops_reading_midway_breaks_the_pipe(pool):
    def reads_a_little(path: Path) -> None:
        with open(path, "rb") as fh:
            fh.read(10)
        raise StoreError("query failed: parse error")

    pipe = PipeInsert(reads_a_little, pool)
    chunk = b"y" * (1 << 20)
    results = [pipe.write(chunk) for _ in range(8)]
    assert results[-1] is False and pipe.broken
    assert "parse error" in str(pipe.finish())


def test_finish_without_writing_ends_an_insert_waiting_on_the_pipe(store, pool):
    """A file with no events: the real insert opens the pipe, reads nothing and inserts nothing."""
    table = qualified(store, "pipe_t")
    store.command(f"CREATE TABLE {table} (a Int64) ENGINE = MergeTree ORDER BY a")
    pipe = PipeInsert(lambda p: store.insert_from_json_file(
        f"INSERT INTO {table} SELECT a FROM json_input", "a Int64", p), pool)
    assert pipe.finish() is None
    assert store.query(f"SELECT count() FROM {table}").scalar() == 0


def test_a_real_insert_reads_the_stream_and_reports_a_parse_error(store, pool):
    table = qualified(store, "pipe_t")
    store.command(f"CREATE TABLE {table} (a Int64) ENGINE = MergeTree ORDER BY a")

    def insert(path: Path) -> None:
        store.insert_from_json_file(f"INSERT INTO {table} SELECT a FROM json_input", "a Int64", path,
                                    settings={"min_insert_block_size_rows": 1000})

    pipe = PipeInsert(insert, pool)
    rows = b",".join(b'{"a": %d}' % i for i in range(50_000))
    assert pipe.write(b"[", rows, b"]") and pipe.finish() is None
    assert store.query(f"SELECT count(), sum(a) FROM {table}").rows[0] == (50_000, sum(range(50_000)))
    bad = PipeInsert(insert, pool)
    bad.write(b'[{"a": 1}, {"a": "not a number"}]')
    assert isinstance(bad.finish(), StoreError)
