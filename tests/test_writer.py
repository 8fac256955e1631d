"""The spooling writer against the real embedded ClickHouse (chDB): batching, outages, caps, replay.

Store outages are simulated at the store boundary: :class:`FlakyStore` wraps the real store and
raises StoreError from every call while ``down`` is set (that is what both backends raise when
ClickHouse is unreachable). One test points a real ServerStore at a closed port instead.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
from conftest import free_port

from triscope.errors import ConfigError, InputError, StoreError
from triscope.schema import GPU_SAMPLES, Column, Table, qualified
from triscope.spool import read_frames
from triscope.store.base import Result, Store
from triscope.writer import Writer

TABLE = Table("writer_test", [Column("seq", "UInt64"), Column("ts", "DateTime64(9, 'UTC')"),
                               Column("host", "LowCardinality(String)"), Column("v", "Float64")], order_by="seq")
MISSING = Table("no_such_table", [Column("a", "Int64")], order_by="a")
"""A table the writer is told of that the store does not have: its batches are rejected."""


def make_writer(store: Any, spool_dir: str, **kwargs: Any) -> Writer:
    """A writer that takes rows for the test tables."""
    return Writer(store, spool_dir, tables=[TABLE, MISSING], **kwargs)


class FlakyStore(Store):
    """The real store, but every call raises StoreError while ``down`` is True."""

    def __init__(self, inner: Store) -> None:
        self.inner, self.down = inner, False
        self.database, self.cluster = inner.database, inner.cluster
        self.inserts = 0

    def _check(self) -> None:
        if self.down:
            raise StoreError("cannot reach ClickHouse at 127.0.0.1:9: connection refused")

    def command(self, sql: str, params: Any = None) -> None:
        self._check()
        self.inner.command(sql, params)

    def query(self, sql: str, params: Any = None) -> Result:
        self._check()
        return self.inner.query(sql, params)

    def query_columns(self, sql: str, params: Any = None) -> dict[str, Any]:
        self._check()
        return self.inner.query_columns(sql, params)

    def insert(self, table: str, columns: Any, settings: Any = None) -> int:
        self._check()
        self.inserts += 1
        return self.inner.insert(table, columns, settings=settings)

    def insert_from_json(self, insert_sql: str, structure: str, data: bytes, params: Any = None) -> None:
        self._check()
        self.inner.insert_from_json(insert_sql, structure, data, params)


def make_table(store: Store) -> None:
    store.command(f"CREATE TABLE IF NOT EXISTS {qualified(store, TABLE)} (seq UInt64, "
                  "ts DateTime64(9, 'UTC'), host LowCardinality(String), v Float64) "
                  "ENGINE = MergeTree PARTITION BY toYYYYMMDD(ts) ORDER BY seq")


def rows(start: int, n: int) -> dict[str, list[Any]]:
    """Rows seq start..start+n-1, spread over two days so inserts split into several parts."""
    seqs = list(range(start, start + n))
    return {"seq": seqs, "ts": [f"2026-12-0{1 + s % 2} 10:00:00.{s:09d}" for s in seqs],
            "host": [f"h{s % 3}" for s in seqs], "v": [s * 0.5 for s in seqs]}


def counts(store: Store) -> tuple[int, int, int, int]:
    """count(), uniqExact(seq), min(seq), max(seq) of the test table."""
    r = store.query(f"SELECT count(), uniqExact(seq), min(seq), max(seq) FROM {qualified(store, TABLE)}")
    return tuple(int(x) for x in r.rows[0])  # type: ignore[return-value]


def test_batches_by_rows_and_writes_everything(store: Store, tmp_path: Path) -> None:
    make_table(store)
    w = make_writer(store, str(tmp_path / "spool"), batch_rows=1000, flush_interval_s=60)
    w.start()
    for start in range(0, 5500, 500):
        assert w.submit(TABLE, rows(start, 500)) == 500
    assert w.submit(TABLE, {"seq": []}) == 0
    assert w.flush(timeout_s=30)
    assert counts(store) == (5500, 5500, 0, 5499)
    snap = w.snapshot()
    # 5 full batches sealed by size, the last 500 rows by flush(): 6 inserts.
    assert snap["batches_written"] == 6 and snap["rows_written"] == 5500 and snap["rows_pending"] == 0
    assert w.close()
    assert [p.name for p in (tmp_path / "spool").iterdir() if p.is_file() and p.name != "LOCK"] == []
    ddl = store.query("SELECT create_table_query FROM system.tables WHERE database = {d:String} "
                      "AND name = {t:String}", {"d": store.database, "t": TABLE.name}).scalar()
    assert "non_replicated_deduplication_window = 1000" in ddl


def test_flushes_by_time(store: Store, tmp_path: Path) -> None:
    make_table(store)
    w = make_writer(store, str(tmp_path / "spool"), batch_rows=1_000_000, flush_interval_s=0.2)
    w.start()
    w.submit(TABLE, rows(0, 10))
    import time

    deadline = time.monotonic() + 10
    while counts(store)[0] < 10 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert counts(store) == (10, 10, 0, 9)
    w.close()


def test_bad_input_is_refused_whole(store: Store, tmp_path: Path) -> None:
    make_table(store)
    w = make_writer(store, str(tmp_path / "spool"))
    with pytest.raises(InputError, match="different lengths"):
        w.submit(TABLE, {"seq": [1, 2], "v": [1.0]})
    with pytest.raises(InputError, match="must be submitted with a triscope.schema Table, got str 'x; DROP"):
        w.submit("x; DROP TABLE y", {"seq": [1]})  # type: ignore[arg-type]
    with pytest.raises(InputError, match="'gpu_samples' is not a table of triscope.schema"):
        w.submit(GPU_SAMPLES, {"seq": [1]})  # a schema table, but not one this writer was given
    with pytest.raises(InputError, match="'writer_test' is not a table"):  # a look-alike is not the table
        w.submit(Table("writer_test", TABLE.columns, order_by="seq"), {"seq": [1]})
    assert w.snapshot()["rows_pending"] == 0
    w.close()
    with pytest.raises(ConfigError, match="unknown keys"):
        Writer.from_config({"writer": {"spool_dir": str(tmp_path / "s2"), "batchrows": 5}}, store)


def test_store_down_spools_then_replays_exactly_once(store: Store, tmp_path: Path,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    make_table(store)
    flaky = FlakyStore(store)
    flaky.down = True
    w = make_writer(flaky, str(tmp_path / "spool"), batch_rows=2000, flush_interval_s=0.05, retry_max_s=0.2)
    w.start()
    with caplog.at_level(logging.WARNING, logger="triscope.writer"):
        for start in range(0, 10_000, 1000):
            w.submit(TABLE, rows(start, 1000))
        assert not w.flush(timeout_s=1.0)  # the store is down: nothing can be written
    snap = w.snapshot()
    assert not snap["store_up"] and snap["rows_written"] == 0 and snap["rows_pending"] == 10_000
    assert "connection refused" in snap["last_error"]
    assert any("store unavailable" in r.getMessage() for r in caplog.records)
    spooled = sorted((tmp_path / "spool").glob("*.batch"))
    assert len(spooled) == 5 and sum(read_frames(p)[1] for p in spooled) == 10_000
    flaky.down = False
    assert w.flush(timeout_s=30)
    assert counts(store) == (10_000, 10_000, 0, 9999)
    assert w.snapshot()["store_up"] and w.close()
    assert list((tmp_path / "spool").glob("*.batch")) == []


def test_unreachable_server_spools_and_next_start_replays(store: Store, tmp_path: Path) -> None:
    """A real ServerStore at a closed port: rows wait in the spool; a later writer replays them."""
    from triscope.store.server import ServerStore

    port = free_port()  # closed again when the block ends: nothing listens there
    make_table(store)
    spool = str(tmp_path / "spool")
    w = make_writer(lambda: ServerStore(f"http://127.0.0.1:{port}", connect_timeout_s=0.5), spool,
               batch_rows=500, flush_interval_s=0.05, retry_max_s=0.2)
    w.start()
    w.submit(TABLE, rows(0, 1200))
    assert not w.flush(timeout_s=1.5)
    assert not w.close(timeout_s=0.5)
    assert "cannot reach ClickHouse" in w.snapshot()["last_error"]
    again = make_writer(store, spool)
    assert again.snapshot()["rows_pending"] == 1200
    again.start()
    assert again.flush(timeout_s=30)
    assert again.snapshot()["rows_replayed"] == 1200
    assert counts(store) == (1200, 1200, 0, 1199)
    again.close()


def test_replay_of_already_inserted_batches_is_deduplicated(store: Store, tmp_path: Path) -> None:
    """Crash between insert and spool delete: the replayed batches must not duplicate rows."""
    make_table(store)
    spool = str(tmp_path / "spool")
    w = make_writer(store, spool, batch_rows=3000)
    w.spool.remove = lambda item: None  # type: ignore[method-assign]  # "crash" before every delete
    w.start()
    for start in range(0, 9000, 3000):
        w.submit(TABLE, rows(start, 3000))
    assert w.flush(timeout_s=30)
    w.close()
    assert counts(store) == (9000, 9000, 0, 8999)
    assert len(list(Path(spool).glob("*.batch"))) == 3
    again = make_writer(store, spool)
    again.start()
    assert again.flush(timeout_s=30)
    assert again.snapshot()["rows_replayed"] == 9000  # inserted a second time ...
    assert counts(store) == (9000, 9000, 0, 8999)  # ... and ClickHouse dropped the copies
    again.close()
    # A different batch with the same rows is new data, not a replay: it is kept.
    third = make_writer(store, spool)
    third.submit(TABLE, rows(0, 10))
    third.close()
    assert counts(store)[0] == 9010


def test_memory_is_bounded_while_down(store: Store, tmp_path: Path) -> None:
    make_table(store)
    flaky = FlakyStore(store)
    flaky.down = True
    w = make_writer(flaky, str(tmp_path / "spool"), batch_rows=1000, max_memory_rows=3000, flush_interval_s=0.05,
               retry_max_s=0.2)
    w.start()
    peak = 0
    for start in range(0, 20_000, 1000):
        w.submit(TABLE, rows(start, 1000))
        peak = max(peak, w.snapshot()["memory_rows"])
    w.flush(timeout_s=0.5)
    snap = w.snapshot()
    assert snap["memory_rows"] <= 3000 + 1000  # cap plus the batch being filled
    assert snap["rows_pending"] == 20_000 and snap["rows_dropped"] == 0
    flaky.down = False
    assert w.flush(timeout_s=60)
    assert counts(store) == (20_000, 20_000, 0, 19_999)
    assert w.snapshot()["memory_rows"] == 0
    w.close()


def test_spool_cap_drops_oldest_and_counts(store: Store, tmp_path: Path,
                                           caplog: pytest.LogCaptureFixture) -> None:
    make_table(store)
    flaky = FlakyStore(store)
    flaky.down = True
    w = make_writer(flaky, str(tmp_path / "spool"), batch_rows=1000, flush_interval_s=0.05, retry_max_s=0.2,
               spool_max_bytes=200_000)
    w.start()
    with caplog.at_level(logging.WARNING, logger="triscope.writer"):
        for start in range(0, 10_000, 1000):
            w.submit(TABLE, rows(start, 1000))
        w.flush(timeout_s=0.5)
    snap = w.snapshot()
    assert snap["rows_dropped"] > 0 and snap["rows_dropped"] % 1000 == 0
    assert snap["spool_bytes"] <= 200_000
    assert any("dropped oldest batch" in r.getMessage() for r in caplog.records)
    flaky.down = False
    assert w.flush(timeout_s=30)
    kept = 10_000 - snap["rows_dropped"]
    # The oldest batches went: what is left is the newest rows, each exactly once.
    assert counts(store) == (kept, kept, snap["rows_dropped"], 9999)
    w.close()


def test_rejected_batch_does_not_block_others(store: Store, tmp_path: Path,
                                              caplog: pytest.LogCaptureFixture) -> None:
    make_table(store)
    w = make_writer(store, str(tmp_path / "spool"), batch_rows=100)
    w.start()
    with caplog.at_level(logging.ERROR, logger="triscope.writer"):
        w.submit(TABLE, {"seq": [1], "no_such_column": [2]})
        w.submit(MISSING, {"a": [1]})
        w.submit(TABLE, rows(0, 100))
        assert w.flush(timeout_s=30)
    snap = w.snapshot()
    assert snap["rows_rejected"] == 2 and snap["rows_written"] == 100
    assert counts(store) == (100, 100, 0, 99)
    assert len(list((tmp_path / "spool" / "rejected").glob("*.batch"))) == 2
    assert sum("store refused batch" in r.getMessage() for r in caplog.records) == 2
    w.close()


def test_torn_open_file_is_recovered_to_whole_frames(store: Store, tmp_path: Path) -> None:
    make_table(store)
    spool = tmp_path / "spool"
    w = make_writer(store, str(spool))
    w.submit(TABLE, rows(0, 50))
    w.submit(TABLE, rows(50, 50))
    (open_file,) = spool.glob("*.open")
    w.spool.close()  # simulate a crash: nothing sealed, nothing written
    data = open_file.read_bytes()
    open_file.write_bytes(data + data[:37])  # a third frame, torn mid-write
    again = make_writer(store, str(spool))
    assert again.snapshot()["rows_pending"] == 100
    again.start()
    assert again.flush(timeout_s=30)
    assert counts(store) == (100, 100, 0, 99)
    again.close()


def test_spool_dir_has_one_owner(store: Store, tmp_path: Path) -> None:
    w = make_writer(store, str(tmp_path / "spool"))
    with pytest.raises(StoreError, match="in use by another"):
        make_writer(store, str(tmp_path / "spool"))
    w.close()
