"""``bench/fleet_day.py``'s bytes per value count a table's projections: a projection (here the time-sorted
copy of ``serving_metrics``' window columns that stores made before the ``*_recent`` tables had) is stored
in every part, so it is part of what the table costs (``system.parts_columns`` lists the parent part's
columns only)."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

import pytest
from conftest import REPO

from triscope.schema import SERVING_METRICS, migrate, qualified
from triscope.schema.latest import add_projection_sql
from triscope.schema.requests import SERVING_BY_TIME
from triscope.store.embedded import EmbeddedStore


def _load(name: str, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, REPO / "bench" / f"{name}.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, module)  # fleet_day imports its siblings by bare name
    spec.loader.exec_module(module)
    return module


def test_sizes_count_the_projection_bytes(store_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for sibling in ("fleet_day_data", "fleet_day_codecs", "fleet_day_panels"):
        _load(sibling, monkeypatch)
    bench = _load("fleet_day", monkeypatch)
    # the run's chDB directory (one data path per process), in a database of its own: the test drops a
    # projection, which no other test may inherit
    store = EmbeddedStore(store_path, database=f"fleetday_bytes_{os.getpid()}")
    try:
        migrate(store)
        table = qualified(store, SERVING_METRICS)
        for sql in add_projection_sql(SERVING_BY_TIME, store.database):
            store.command(sql)
        f = bench.fleet_of(0.016, 600 / 86400, 1_700_000_000.0)
        for batch in bench.data.serving_chunks(f, 600):
            store.insert(table, batch)
        store.command(f"OPTIMIZE TABLE {table} FINAL")
        with_projection = bench.sizes(store, (SERVING_METRICS,))["serving_metrics"]
        store.command(f"ALTER TABLE {table} DROP PROJECTION by_time SETTINGS mutations_sync = 2")
        without = bench.sizes(store, (SERVING_METRICS,))["serving_metrics"]
    finally:
        store.command(f"DROP DATABASE IF EXISTS {store.database}")
        store.close()
    projection = with_projection["projections"]["by_time"]
    assert with_projection["rows"] == without["rows"] == 600 * f.backends
    assert projection > 0 and without["projections"] == {}
    assert with_projection["columns_bytes"] == without["columns_bytes"] == without["bytes"]
    assert with_projection["bytes"] == without["bytes"] + projection
    values = without["rows"] * len(SERVING_METRICS.columns)
    assert with_projection["bytes_per_value"] == pytest.approx((without["bytes"] + projection) / values)
    assert with_projection["bytes_per_value"] > without["bytes_per_value"]
