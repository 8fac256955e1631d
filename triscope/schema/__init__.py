"""The storage contract: every table, its columns and units, versioned per domain.

Each module in this package that defines ``DOMAIN`` (a name) and ``MIGRATIONS`` (a list of
:class:`Migration` with versions 1, 2, ...) owns that domain's tables. :func:`migrate`
applies pending steps in order and records them in ``schema_migrations``; it is idempotent
and safe to run at every start.
"""

from __future__ import annotations

import importlib
import pkgutil
from types import ModuleType

from triscope.errors import StoreError
from triscope.schema.gpu import ALLOCATOR_SAMPLES, GPU_PROCESS_MEMORY, GPU_SAMPLES
from triscope.schema.host import HOST_SAMPLES
from triscope.schema.io import IO_LATENCY
from triscope.schema.model import (
    Column,
    Migration,
    Table,
    add_columns,
    create_table_sql,
    create_tables,
    default_for,
    encode_ts,
    qualified,
)
from triscope.schema.nccl import NCCL_OPS
from triscope.schema.requests import REQUESTS, SCRAPE_HEALTH, SERVING_METRICS
from triscope.schema.trace import TRACE_EVENTS, TRACE_RUNS
from triscope.schema.weights import WEIGHTS_HISTORY
from triscope.store.base import Store

__all__ = ["ALLOCATOR_SAMPLES", "GPU_PROCESS_MEMORY", "GPU_SAMPLES", "HOST_SAMPLES", "IO_LATENCY", "NCCL_OPS",
           "REQUESTS",
           "SCRAPE_HEALTH", "SERVING_METRICS", "TRACE_EVENTS", "TRACE_RUNS", "WEIGHTS_HISTORY",
           "Column", "Migration", "Table", "add_columns", "create_table_sql", "create_tables", "default_for",
           "domains", "encode_ts", "known_tables", "migrate", "qualified", "schema_versions"]

_MIGRATIONS_TABLE = Table(
    name="schema_migrations",
    columns=[
        Column("domain", "String"),
        Column("version", "UInt32"),
        Column("description", "String"),
        Column("applied_at", "DateTime64(3, 'UTC')", "when the step ran"),
    ],
    order_by="domain, version",
    engine="ReplacingMergeTree",
)


def domains() -> dict[str, ModuleType]:
    """All schema domain modules, keyed by domain name."""
    found: dict[str, ModuleType] = {}
    for info in pkgutil.iter_modules(__path__):
        if info.name == "model":
            continue
        module = importlib.import_module(f"{__name__}.{info.name}")
        if hasattr(module, "DOMAIN") and hasattr(module, "MIGRATIONS"):
            versions = [m.version for m in module.MIGRATIONS]
            if versions != list(range(1, len(versions) + 1)):
                raise StoreError(f"schema domain {module.DOMAIN}: versions must be 1..N, got {versions}")
            found[module.DOMAIN] = module
    return found


def known_tables() -> dict[str, Table]:
    """Every data table of every domain, by name: what the writer takes rows for."""
    if not _KNOWN:
        _KNOWN.update({t.name: t for module in domains().values() for t in vars(module).values()
                       if isinstance(t, Table)})
    return dict(_KNOWN)


_KNOWN: dict[str, Table] = {}


def schema_versions(store: Store) -> dict[str, int]:
    """Applied version per domain."""
    res = store.query(f"SELECT domain, max(version) FROM {qualified(store, 'schema_migrations')} GROUP BY domain")
    return {d: int(v) for d, v in res.rows}


def migrate(store: Store) -> dict[str, int]:
    """Apply every pending migration; returns the version per domain afterwards."""
    for sql in create_table_sql(_MIGRATIONS_TABLE, store.database, store.cluster):
        store.command(sql)
    applied = schema_versions(store)
    for name, module in sorted(domains().items()):
        current = applied.get(name, 0)
        for step in module.MIGRATIONS:
            if step.version <= current:
                continue
            for sql in step.statements(store.database, store.cluster):
                store.command(sql)
            store.command(
                f"INSERT INTO {qualified(store, 'schema_migrations')} (domain, version, description, applied_at) "
                "VALUES ({domain:String}, {version:UInt32}, {description:String}, now64(3))",
                {"domain": name, "version": step.version, "description": step.description},
            )
            applied[name] = step.version
    return applied
