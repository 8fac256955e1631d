"""The component contract: every registry entry builds and closes, optional features are protocols,
renamed and removed keys go through ``aliases``, rows travel with their schema Table."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from triscope.collector_loop import CollectorLoop, RowCounter
from triscope.component import (
    Collector,
    ComponentConfig,
    Context,
    Exporter,
    ReportsErrors,
    ReportsGaps,
    ReportsStats,
    RowsAfterClose,
)
from triscope.errors import ConfigError, InputError
from triscope.registry import COLLECTORS, EXPORTERS, resolve
from triscope.schema import IO_LATENCY, Table, known_tables
from triscope.writer import Writer

NEEDS_CONFIG: dict[str, dict[str, Any]] = {
    "dcgm": {"dcgm": {"urls": ["http://127.0.0.1:9/metrics"]}},
    "epp": {"weights": {"backends": {"b": {"address": "127.0.0.1:9"}}}},
}
"""Entries with nothing to do without a target: ``{}`` is a one-line ConfigError naming what to set."""


def _throwaway_context() -> Context:
    def submit(table: Table, rows: Any) -> int:  # pragma: no cover - nothing is started, nothing collected
        raise AssertionError(f"no rows expected, got some for {table.name}")
    return Context(submit=submit)


@pytest.mark.parametrize(("kind", "name"),
                         [("collector", n) for n in COLLECTORS] + [("exporter", n) for n in EXPORTERS])
def test_every_registry_entry_builds_from_an_empty_config_and_closes(kind: str, name: str) -> None:
    registry, protocol = (COLLECTORS, Collector) if kind == "collector" else (EXPORTERS, Exporter)
    factory = resolve(name, registry, kind)
    config: dict[str, Any] = {}
    if name in NEEDS_CONFIG:
        with pytest.raises(ConfigError) as err:
            factory({}, _throwaway_context())
        assert "\n" not in str(err.value) and str(err.value).startswith("[")
        config = NEEDS_CONFIG[name]
    component = factory(config, _throwaway_context())
    assert isinstance(component, protocol)
    component.close()
    component.close()  # safe twice


def test_optional_features_are_the_documented_protocols() -> None:
    from triscope.collectors.blockio import BpftraceCollector, DiskstatsCollector
    from triscope.collectors.dcgm import DcgmScraper
    from triscope.collectors.serving_metrics import ServingMetricsScraper

    bpf = BpftraceCollector({})
    assert isinstance(bpf, RowsAfterClose) and bpf.ROWS_AFTER_CLOSE and isinstance(bpf, ReportsGaps)
    assert not isinstance(DiskstatsCollector({}), RowsAfterClose | ReportsGaps | ReportsErrors)
    assert isinstance(ServingMetricsScraper({}), ReportsErrors)
    assert isinstance(DcgmScraper(NEEDS_CONFIG["dcgm"]), ReportsErrors)
    epp = resolve("epp", EXPORTERS, "exporter")(NEEDS_CONFIG["epp"], Context())
    assert isinstance(epp, ReportsStats) and isinstance(epp.stats(), dict)
    epp.close()


class _Source:
    name, interval_s = "slipped", 1.0

    def __init__(self, key: Any) -> None:
        self.key = key

    def start(self) -> None: ...

    def collect(self) -> dict[Any, dict[str, list[Any]]]:
        return {self.key: {"ts": ["2026-01-01 00:00:00.000000000"], "host": ["h"], "device": ["d"]}}

    def close(self) -> None: ...


def test_rows_keyed_by_a_name_are_refused_with_one_line(tmp_path: Path, store: Any) -> None:
    writer = Writer(store, str(tmp_path / "spool"), flush_interval_s=3600)
    try:
        loop = CollectorLoop(_Source("io_latency"), writer, stop=None)  # type: ignore[arg-type]
        assert loop.collect_once() == 0
        assert loop.last_error == "collect() must key rows by triscope.schema Table, got str 'io_latency'"
        loop = CollectorLoop(_Source(IO_LATENCY), writer, stop=None)  # type: ignore[arg-type]
        assert loop.collect_once() == 1 and loop.counters()["tables"] == {"io_latency": 1}
        with pytest.raises(InputError, match="rows must be submitted with a triscope.schema Table, got str"):
            writer.submit("io_latency", {"ts": []})  # type: ignore[arg-type]
        assert RowCounter(writer.submit).submit(IO_LATENCY, {"ts": []}) == 0
    finally:
        writer.close(timeout_s=1)


def test_known_tables_are_every_schema_domain_table() -> None:
    tables = known_tables()
    assert tables["io_latency"] is IO_LATENCY and "schema_migrations" not in tables
    assert all(isinstance(t, Table) and t.name == name for name, t in tables.items())


@dataclass(frozen=True)
class _Renamed(ComponentConfig):
    # no section: a test class, not one of the configuration's sections (test_config_mistakes)
    aliases = {"intervl_s": "interval_s", "batch_rows": ""}
    interval_s: float = 1.0


def test_renamed_and_removed_keys_go_through_aliases(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="triscope.component"):
        assert _Renamed.from_mapping({"intervl_s": 2, "batch_rows": 5}, "[renamed]").interval_s == 2.0
        assert _Renamed.from_mapping({"intervl_s": 2, "interval_s": 3}, "[renamed]").interval_s == 3.0  # current wins
    text = caplog.text
    assert "[renamed] intervl_s is deprecated; use interval_s" in text
    assert "[renamed] batch_rows is no longer used and is ignored; remove it" in text
    with pytest.raises(ConfigError, match=r"unknown keys: colour \(known: interval_s\)"):
        _Renamed.from_mapping({"colour": 1}, "[renamed]")


@pytest.mark.parametrize(("section", "key", "cls_path"), [
    ("otlp", "buffer_rows", "triscope.collectors.otlp:OtlpConfig"),
    ("otlp", "batch_rows", "triscope.collectors.otlp:OtlpConfig"),
    ("weights", "history_flush_s", "triscope.analyzers.routing.config:WeightsConfig"),
])
def test_removed_product_keys_still_load_with_a_warning(section: str, key: str, cls_path: str,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    import importlib

    module, _, attr = cls_path.partition(":")
    cls = getattr(importlib.import_module(module), attr)
    assert cls.aliases[key] == ""
    with caplog.at_level(logging.WARNING, logger="triscope.component"):
        cls.from_config({section: {key: 10}})
    assert f"[{section}] {key} is no longer used" in caplog.text
