"""Faults under the pipeline's loops: the disk fills up, then space returns.

The spool sits on a real 20 MiB tmpfs (mounted here; needs root, which CI has) and a filler
file takes the space, so every write fails with the kernel's own ENOSPC. The source is a small
collector of this test (no hardware is simulated).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import require
from triscope.collector_loop import CollectorLoop
from triscope.schema import IO_LATENCY, Table, encode_ts, qualified
from triscope.writer import Writer


@contextlib.contextmanager
def small_tmpfs(path: Path, size: str = "20m") -> Iterator[Path]:
    require(os.geteuid() == 0, "mounting a tmpfs needs root (CI runs as root)")
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def fill(path: Path) -> Path:
    """Take every free byte of the filesystem holding ``path``."""
    filler = path / "filler"
    with open(filler, "wb", buffering=0) as f:
        for chunk in (1 << 20, 4096, 1):  # big writes, then the last partial blocks
            with contextlib.suppress(OSError):
                while f.write(b"\0" * chunk):
                    pass
    return filler


class CountingSource:
    """A collector producing ``rows_per_tick`` io_latency rows with increasing ``ios``."""

    name = "counting"
    interval_s = 0.05

    def __init__(self, rows_per_tick: int = 200) -> None:
        self.rows_per_tick = rows_per_tick
        self.produced = 0

    def start(self) -> None:
        pass

    def collect(self) -> dict[Table, Any]:
        now = time.time_ns()
        rows = [{"ts": encode_ts(now + i), "host": "fault-test", "device": "sda", "source": "test", "op": "read",
                 "ios": self.produced + i} for i in range(self.rows_per_tick)]
        self.produced += len(rows)
        return {IO_LATENCY: IO_LATENCY.columns_of(rows)}

    def close(self) -> None:
        pass


def _wait(condition: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


@pytest.mark.slow
def test_disk_full_then_space_returns_nothing_lost_nothing_stalled(store: Any, tmp_path: Path) -> None:
    with small_tmpfs(tmp_path / "spool") as spool_dir:
        writer = Writer(store, str(spool_dir), flush_interval_s=0.1, retry_max_s=0.5)
        writer.start()
        stop = threading.Event()
        source = CountingSource()
        loop = CollectorLoop(source, writer, stop, max_pending_rows=1_000_000, retry_max_s=0.3)
        loop.start()
        try:
            _wait(lambda: writer.snapshot()["rows_written"] > 0, 30, "the first rows in the store")
            filler = fill(spool_dir)
            _wait(lambda: loop.errors > 0 and loop.pending_rows > 0, 30, "the loop to notice the full disk")
            time.sleep(1.0)  # several ticks on a full disk
            assert loop.is_alive() and writer._thread is not None and writer._thread.is_alive()
            assert "No space left" in loop.last_error
            snap = writer.snapshot()
            assert snap["spool_failures"] > 0 and "No space left" in snap["spool_error"]
            filler.unlink()  # space returns
            _wait(lambda: loop.pending_rows == 0, 30, "the held rows to reach the spool")
            assert writer.snapshot()["spool_error"] == ""
        finally:
            stop.set()
            loop.join(10)
        assert writer.close(timeout_s=30)
        assert loop.rows_dropped == 0
        table = qualified(store, IO_LATENCY)
        count, distinct = store.query(f"SELECT count(), uniqExact(ios) FROM {table} WHERE host = 'fault-test'").rows[0]
        assert count == distinct == source.produced  # nothing lost, nothing written twice


def test_a_full_disk_with_a_small_bound_drops_oldest_and_counts_them(store: Any, tmp_path: Path) -> None:
    with small_tmpfs(tmp_path / "spool", size="2m") as spool_dir:
        writer = Writer(store, str(spool_dir), flush_interval_s=0.1)
        source = CountingSource(rows_per_tick=100)
        loop = CollectorLoop(source, writer, threading.Event(), max_pending_rows=250, retry_max_s=0.01)
        filler = fill(spool_dir)
        for _ in range(6):
            loop.collect_once()
            time.sleep(0.02)
        assert loop.pending_rows <= 250 + 100 and loop.rows_dropped >= 300
        assert loop.rows_dropped + loop.pending_rows == source.produced
        assert "rows dropped" in loop.last_error or "No space left" in loop.last_error
        filler.unlink()
        time.sleep(0.05)
        loop.collect_once()
        assert loop.pending_rows == 0
        assert writer.close(timeout_s=30)
        table = qualified(store, IO_LATENCY)
        written = store.query(f"SELECT count() FROM {table} WHERE host = 'fault-test'").scalar()
        assert written == source.produced - loop.rows_dropped


def _three_frame_batch(spool_dir: Path) -> tuple[Path, list[int]]:
    from triscope.spool import Spool

    spool = Spool(spool_dir, fsync=False)
    batch = spool.open_batch(IO_LATENCY.name)
    sizes = []
    for start in (0, 100, 200):
        rows = [{"ts": encode_ts(1_700_000_000_000_000_000 + i), "host": "spool-test", "device": "sda",
                 "source": "test", "op": "read", "ios": start + i} for i in range(100)]
        sizes.append(batch.append(IO_LATENCY.columns_of(rows), 100))
    item = batch.seal(fsync=False)
    spool.close()
    return item.path, sizes


@pytest.mark.parametrize("damage", ["payload", "length"])
def test_mid_file_spool_damage_keeps_the_later_good_frames(store: Any, tmp_path: Path, damage: str) -> None:
    """A damaged middle frame costs its own rows only: frames after it are still written."""
    path, sizes = _three_frame_batch(tmp_path / "spool")
    data = bytearray(path.read_bytes())
    middle = sizes[0]
    if damage == "payload":
        for i in range(middle + 20, middle + 60):
            data[i] ^= 0xFF
    else:
        data[middle:middle + 4] = (10**9).to_bytes(4, "little")  # a length past the end of the file
    path.write_bytes(bytes(data))

    writer = Writer(store, str(tmp_path / "spool"), flush_interval_s=0.1)  # recovers the batch
    assert writer.flush(timeout_s=30)
    snap = writer.snapshot()
    assert writer.close(timeout_s=10)
    table = qualified(store, IO_LATENCY)
    ios = [r[0] for r in store.query(f"SELECT ios FROM {table} WHERE host = 'spool-test' ORDER BY ios").rows]
    assert ios == list(range(0, 100)) + list(range(200, 300))
    assert snap["rows_written"] == 200 and snap["rows_rejected"] == 100
    assert list((tmp_path / "spool" / "rejected").glob("damaged-*"))  # the damaged file is kept for a look


def create_counting(config: Any, context: Any) -> CountingSource:
    """``[run] collectors = ["tests.test_faults:create_counting"]``: a daemon's CountingSource."""
    return CountingSource(rows_per_tick=500)


@pytest.mark.slow
def test_sigterm_just_after_space_returns_loses_nothing(store_path: Path, tmp_path: Path) -> None:
    """The attack that lost 135,000 rows: the disk fills under a running daemon, space returns, SIGTERM
    comes 0.5 s later, inside the old 30 s backoff. Held rows reach the spool within 2 s of space
    returning, the shutdown hands over whatever is still held, the status line never says "spool ok"
    while rows wait, and every row produced is stored or counted."""
    from triscope.daemon import Daemon
    from triscope.store import open_store

    database = f"faults{int(time.time() * 1000) % 10**8}"
    with small_tmpfs(tmp_path / "spool") as spool_dir:
        config = {"store": {"backend": "embedded", "path": str(store_path), "database": database},
                  "run": {"collectors": ["tests.test_faults:create_counting"], "status_interval_s": 0},
                  "writer": {"spool_dir": str(spool_dir), "flush_interval_s": 0.1}}
        daemon = Daemon(config)
        daemon.start()
        loop = daemon.loops[0]
        source = loop.collector
        assert daemon.writer is not None
        try:
            _wait(lambda: daemon.writer is not None and daemon.writer.snapshot()["rows_written"] > 0, 30,
                  "the first rows in the store")
            filler = fill(spool_dir)
            _wait(lambda: loop.pending_rows > 20_000, 60, "rows held on the full disk")
            line = daemon.status_line()
            assert "spool ok" not in line and "No space left" in line, line
            filler.unlink()
            back = time.monotonic()
            _wait(lambda: loop.pending_rows == 0, 5, "the held rows to reach the spool")
            assert time.monotonic() - back < 2.0
            filler = fill(spool_dir)  # full again, and SIGTERM inside the backoff
            _wait(lambda: loop.pending_rows > 0, 30, "rows held again")
            filler.unlink()
            time.sleep(0.5)
        finally:
            summary = daemon.shutdown()
    produced = source.produced
    with open_store(config) as check:
        stored = check.query(f"SELECT count() FROM {database}.io_latency WHERE host = 'fault-test'").scalar()
        check.command(f"DROP DATABASE IF EXISTS {database}")
    lost = summary["lost"].get("counting", 0)
    assert stored + lost == produced and lost == 0, (stored, lost, produced)
