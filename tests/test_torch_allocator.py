"""torch CUDA allocator collector: values, device selection, the in-process hook into a real store.

This machine has no GPU, so every test but the last replaces ``torch.cuda`` with a stand-in at
the hardware boundary only (``FakeCuda``: is_available / is_initialized / device_count /
current_device / memory_stats). Its ``memory_stats`` returns the full flattened key set the
real ``torch.cuda.memory_stats`` returns (names as documented in torch/cuda/memory.py:
``allocated_bytes.all.current``, ``reserved_bytes.all.current``, ``active_bytes.all.current``,
``inactive_split_bytes.all.current``, ``num_alloc_retries``, ``num_ooms``, ...) with internally
consistent values (allocated <= active <= reserved, pools summing to ``all``). The last tests use
the real torch of this CPU machine and expect the clean "no CUDA" state.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from triscope.collectors.torch_allocator import (
    STAT_KEYS,
    TorchAllocatorCollector,
    install,
    sample_values,
)
from triscope.errors import ConfigError
from triscope.schema import ALLOCATOR_SAMPLES, qualified
from triscope.writer import Writer

MIB = 1 << 20
_STATS = ("allocation", "segment", "active", "inactive_split", "allocated_bytes", "reserved_bytes",
          "active_bytes", "inactive_split_bytes", "requested_bytes")


def memory_stats_dict(allocated: int, reserved: int, active: int, inactive_split: int, retries: int = 0,
                      ooms: int = 0) -> dict[str, Any]:
    """A flattened ``memory_stats()`` dict as torch builds it; small pool takes 1/8 of each figure."""
    totals = {"allocated_bytes": allocated, "reserved_bytes": reserved, "active_bytes": active,
              "inactive_split_bytes": inactive_split, "requested_bytes": allocated - allocated // 64,
              "allocation": allocated // (4 * MIB), "segment": reserved // (20 * MIB),
              "active": active // (4 * MIB), "inactive_split": inactive_split // (2 * MIB)}
    out: dict[str, Any] = {}
    for stat in _STATS:
        cur = totals[stat]
        small = cur // 8
        for pool, value in (("all", cur), ("large_pool", cur - small), ("small_pool", small)):
            out[f"{stat}.{pool}.current"] = value
            out[f"{stat}.{pool}.peak"] = value + value // 4
            out[f"{stat}.{pool}.allocated"] = value * 3
            out[f"{stat}.{pool}.freed"] = value * 2
    for name in ("oversize_allocations", "oversize_segments"):
        for k in ("current", "peak", "allocated", "freed"):
            out[f"{name}.{k}"] = 0
    out.update({"num_alloc_retries": retries, "num_ooms": ooms, "num_sync_all_streams": retries,
                "num_device_alloc": totals["segment"] * 3, "num_device_free": totals["segment"] * 2,
                "max_split_size": -1})
    return dict(sorted(out.items()))


class FakeCuda:
    """Stand-in for ``torch.cuda`` (no GPU here): devices whose allocator figures a test sets."""

    def __init__(self, stats: list[dict[str, Any]], initialized: bool = True, current: int = 0) -> None:
        self.stats, self.initialized, self.current = stats, initialized, current
        self.fail: str = ""

    def is_available(self) -> bool:
        return True

    def is_initialized(self) -> bool:
        return self.initialized

    def device_count(self) -> int:
        return len(self.stats)

    def current_device(self) -> int:
        return self.current

    def memory_stats(self, device: int) -> dict[str, Any]:
        if self.fail:
            raise RuntimeError(self.fail)
        return self.stats[device]


EMPTY = memory_stats_dict(0, 0, 0, 0)


def test_sample_values_from_a_full_stats_dict() -> None:
    s = memory_stats_dict(2560 * MIB, 4096 * MIB, 2600 * MIB, 300 * MIB, retries=2, ooms=1)
    v = sample_values(s)
    assert v == {"allocated_bytes": 2560.0 * MIB, "reserved_bytes": 4096.0 * MIB, "active_bytes": 2600.0 * MIB,
                 "inactive_split_bytes": 300.0 * MIB, "alloc_retries_total": 2, "ooms_total": 1,
                 "fragmentation_ratio": pytest.approx(1 - 2560 / 4096)}
    assert sample_values(EMPTY)["fragmentation_ratio"] == 0.0
    assert sample_values({})["reserved_bytes"] == 0.0  # CUDA not initialised: torch returns {}
    assert set(STAT_KEYS.values()) <= set(s)


@pytest.mark.parametrize(("devices", "expected"), [("used", [0, 2]), ("all", [0, 1, 2]), ([1, 7], [1])])
def test_device_selection(devices: Any, expected: list[int]) -> None:
    cuda = FakeCuda([memory_stats_dict(10 * MIB, 20 * MIB, 10 * MIB, 0), EMPTY,
                     memory_stats_dict(5 * MIB, 40 * MIB, 6 * MIB, 2 * MIB)])
    c = TorchAllocatorCollector({"torch_allocator": {"devices": devices, "host": "h"}}, cuda=cuda)
    c.start()
    rows = c.collect()[ALLOCATOR_SAMPLES]
    assert rows["gpu"] == expected and set(rows["host"]) == {"h"} and c.state == "ok"
    if expected == [0, 2]:
        assert rows["fragmentation_ratio"] == [pytest.approx(0.5), pytest.approx(1 - 5 / 40)]
        assert rows["inactive_split_bytes"] == [0.0, 2.0 * MIB]


def test_waits_for_cuda_initialisation_and_survives_errors() -> None:
    cuda = FakeCuda([memory_stats_dict(10 * MIB, 20 * MIB, 10 * MIB, 0)], initialized=False)
    c = TorchAllocatorCollector(None, cuda=cuda)
    c.start()
    assert c.collect() == {} and c.state == "not_initialized"
    cuda.initialized = True
    assert c.collect()[ALLOCATOR_SAMPLES]["reserved_bytes"] == [20.0 * MIB]
    cuda.fail = "CUDA error: an illegal memory access was encountered\nmore"
    assert c.collect() == {} and c.state == "error" and c.reason.startswith("CUDA error: an illegal")
    cuda.fail = ""
    assert c.collect() and c.state == "ok"


@pytest.mark.parametrize("section", [{"devices": "some"}, {"devices": [-1]}, {"interval_s": 0},
                                     {"interval_s": "fast"}, {"device": 0}])
def test_bad_config_is_one_line(section: dict[str, Any]) -> None:
    with pytest.raises(ConfigError, match=r"^\[torch_allocator\]"):
        TorchAllocatorCollector({"torch_allocator": section})


def test_install_hook_writes_samples_to_the_store(store: Any, tmp_path: Any) -> None:
    """The one-line hook samples in a thread while the 'training loop' allocates; rows reach the store."""
    cuda = FakeCuda([memory_stats_dict(0, 0, 0, 0)])
    handle = install(store, interval_s=0.02, host="trainer", spool_dir=str(tmp_path / "spool"), cuda=cuda)
    time.sleep(0.06)  # samples before the first allocation
    for step in range(1, 6):  # each step grows the cache; retries/OOMs accumulate
        cuda.stats[0] = memory_stats_dict(step * 512 * MIB, step * 1024 * MIB, step * 520 * MIB, step * 8 * MIB,
                                          retries=step - 1, ooms=step // 5)
        time.sleep(0.06)
    assert handle.close() is True and handle.close() is True
    res = store.query(
        f"SELECT count(), uniqExact(reserved_bytes), max(reserved_bytes), max(active_bytes), max(ooms_total), "
        f"max(alloc_retries_total), min(fragmentation_ratio), max(fragmentation_ratio), any(host), any(gpu) "
        f"FROM {qualified(store, 'allocator_samples')}")
    n, distinct, reserved, active, ooms, retries, fmin, fmax, host, gpu = res.rows[0]
    assert n >= 10 and distinct >= 4, (n, distinct)
    assert (reserved, active, ooms, retries, host, gpu) == (5120.0 * MIB, 2600.0 * MIB, 1, 4, "trainer", 0)
    # fragmentation is 0 while nothing is reserved, 1 - 512/1024 afterwards
    assert fmin == pytest.approx(0.0) and fmax == pytest.approx(0.5)
    assert handle.rows == n


def _wait_rows(handle: Any, n: int, timeout_s: float = 10.0) -> None:
    """Until the hook has taken ``n`` samples (a loaded machine can stall its thread for a while)."""
    deadline = time.monotonic() + timeout_s
    while handle.rows < n:
        assert time.monotonic() < deadline, f"only {handle.rows} samples in {timeout_s}s"
        time.sleep(0.02)


def test_install_into_a_callers_writer_leaves_it_open(store: Any, tmp_path: Any) -> None:
    writer = Writer(store, str(tmp_path / "spool"), flush_interval_s=0.05)
    writer.start()
    handle = install(writer, interval_s=0.02, cuda=FakeCuda([memory_stats_dict(MIB, 2 * MIB, MIB, 0)]))
    _wait_rows(handle, 3)
    handle.close()
    assert writer.submit(ALLOCATOR_SAMPLES, {c: [v] for c, v in _one_row().items()}) == 1  # still open
    assert writer.close(timeout_s=10)
    count = store.query(f"SELECT count() FROM {qualified(store, 'allocator_samples')}").scalar()
    assert count == handle.rows + 1 and handle.rows >= 3


def _one_row() -> dict[str, Any]:
    return {"ts": "2026-01-01 00:00:00", "host": "x", "gpu": 0, "pid": 1, "allocated_bytes": 0.0,
            "reserved_bytes": 0.0, "active_bytes": 0.0, "inactive_split_bytes": 0.0, "alloc_retries_total": 0,
            "ooms_total": 0, "fragmentation_ratio": 0.0}


def test_real_torch_without_cuda_is_a_clean_state(store: Any, tmp_path: Any,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    """This CPU machine's real torch: no CUDA -> state unavailable, one log line, no rows, no thread."""
    torch = pytest.importorskip("torch")
    assert not torch.cuda.is_available()
    c = TorchAllocatorCollector(None)
    with caplog.at_level("WARNING"):
        c.start()
    assert c.state == "unavailable" and "CUDA is not available" in c.reason
    assert [r.getMessage() for r in caplog.records] == [f"torch_allocator: {c.reason}; no allocator samples"]
    assert c.collect() == {}
    handle = install(store, interval_s=0.01, spool_dir=str(tmp_path / "spool"))
    time.sleep(0.05)
    assert handle.state == "unavailable" and not handle._thread.is_alive()
    assert handle.close() is True and handle.rows == 0
    assert store.query(f"SELECT count() FROM {qualified(store, 'allocator_samples')}").scalar() == 0


def test_allocator_table_v1_upgrades_with_active_bytes(store: Any) -> None:
    """A store from before gpu migration 3 gains active_bytes; old rows read 0 there."""
    from triscope.schema import create_table_sql, migrate, schema_versions
    from triscope.schema.gpu import ALLOCATOR_SAMPLES

    table = qualified(store, "allocator_samples")
    store.command(f"DROP TABLE {table}")
    for sql in create_table_sql(ALLOCATOR_SAMPLES, store.database, version=1):
        store.command(sql)
    store.insert(table, {"ts": ["2026-01-01 00:00:00"], "host": ["old"], "gpu": [0], "pid": [1],
                         "reserved_bytes": [2.0 * MIB]})
    store.command(f"ALTER TABLE {qualified(store, 'schema_migrations')} DELETE WHERE domain = 'gpu' AND version >= 3 "
                  "SETTINGS mutations_sync = 1")
    assert schema_versions(store)["gpu"] == 2
    assert migrate(store)["gpu"] >= 3
    assert [r[0] for r in store.query(f"DESCRIBE TABLE {table}").rows] == ALLOCATOR_SAMPLES.column_names()
    collector = TorchAllocatorCollector(None, cuda=FakeCuda([EMPTY]))
    collector.start()
    COLUMNS = list(collector.collect()[ALLOCATOR_SAMPLES])  # the columns the collector writes
    assert "active_bytes" in COLUMNS and set(COLUMNS) == set(ALLOCATOR_SAMPLES.column_names())
    assert store.query(f"SELECT host, reserved_bytes, active_bytes FROM {table}").rows == [("old", 2.0 * MIB, 0.0)]


def test_install_from_a_config_mapping(store: Any, tmp_path: Any) -> None:
    """install(config): the hook opens (and on close flushes and closes) a writer and store of its own."""
    config = {"store": {"backend": "embedded", "path": store.path, "database": store.database},
              "writer": {"flush_interval_s": 0.05}}
    cuda = FakeCuda([memory_stats_dict(3 * MIB, 8 * MIB, 3 * MIB, MIB, retries=1)])
    handle = install(config, interval_s=0.02, spool_dir=str(tmp_path / "spool"), cuda=cuda)
    _wait_rows(handle, 3)
    assert handle.owns_writer and handle.close() is True
    res = store.query(f"SELECT count(), max(fragmentation_ratio), max(alloc_retries_total) "
                      f"FROM {qualified(store, 'allocator_samples')}")
    n, frag, retries = res.rows[0]
    assert n == handle.rows >= 3 and frag == pytest.approx(1 - 3 / 8) and retries == 1
    assert list((tmp_path / "spool").glob("*.batch")) == []
    with pytest.raises(ConfigError, match="need a Writer, Store or config mapping"):
        install(42)
