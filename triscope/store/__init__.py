"""Storage: one ``Store`` interface, embedded chDB (default) or a ClickHouse server."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from triscope.component import ComponentConfig
from triscope.errors import ConfigError, StoreError
from triscope.store.base import Result, Store

__all__ = ["Result", "Store", "StoreConfig", "open_store"]

_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


@dataclass(frozen=True)
class StoreConfig(ComponentConfig):
    """``[store]``: which ClickHouse and where (docs/run.md)."""

    section = "store"
    backend: str = "embedded"
    """``embedded`` (chDB in ``path``) or ``server`` (clickhouse-connect to ``url``)."""
    path: str = "var/triscope-data"
    url: str = ""
    database: str = "triscope"
    username: str = ""
    password: str = ""
    cluster: str = ""
    """Cluster name: ON CLUSTER DDL, ReplicatedMergeTree + Distributed tables."""
    raw_ttl_days: int = 7
    """Days the raw time-series tables keep rows (samples, scrapes, spans, IO, weights); 0 = keep."""
    rollup_ttl_days: int = 90
    """Days the 10 s / 1 min rollup tables keep rows; 0 = keep."""

    def validate(self, where: str) -> None:
        if self.backend not in ("embedded", "server"):
            raise ConfigError(f"unknown store.backend {self.backend!r}; use 'embedded' or 'server'")
        if self.backend == "embedded" and not self.path.strip():
            raise ConfigError(f"{where} path must not be empty")
        if self.backend == "server" and not self.url:
            raise ConfigError("store.backend = 'server' needs store.url (e.g. http://127.0.0.1:8123)")
        for key in ("raw_ttl_days", "rollup_ttl_days"):
            if getattr(self, key) < 0:
                raise ConfigError(f"{where} {key} must be >= 0 (0 = keep), got {getattr(self, key)}")
        if not _IDENTIFIER.fullmatch(self.database):
            raise ConfigError(f"{where} database must be a plain identifier, got {self.database!r}")


def open_store(config: Mapping[str, Any], migrate: bool = True) -> Store:
    """Open the store described by ``config['store']`` and bring its schema up to date."""
    cfg = StoreConfig.from_config(config)
    store: Store
    if cfg.backend == "embedded":
        from triscope.store.embedded import EmbeddedStore

        try:
            store = EmbeddedStore(cfg.path, database=cfg.database, cluster=cfg.cluster)
        except StoreError as exc:
            served = _served_by_daemon(cfg, exc)
            if served is None:
                raise
            return served  # the daemon migrated it; its endpoint is read-only
    else:
        from triscope.store.server import ServerStore

        store = ServerStore(cfg.url, database=cfg.database, username=cfg.username,
                            password=cfg.password, cluster=cfg.cluster)
    if migrate:
        from triscope.schema import domains
        from triscope.schema import migrate as run_migrations
        from triscope.schema.latest import Latest
        from triscope.schema.model import Table, apply_retention
        from triscope.schema.rollup import Rollup

        run_migrations(store)
        tables = [t.table if isinstance(t, (Rollup, Latest)) else t for m in domains().values()
                  for t in vars(m).values() if isinstance(t, (Table, Rollup, Latest))]
        apply_retention(store, tables, {"raw": cfg.raw_ttl_days, "rollup": cfg.rollup_ttl_days})
    return store


def _served_by_daemon(cfg: StoreConfig, refused: StoreError) -> Store | None:
    """A store talking to the query endpoint of the live ``triscope run`` that holds ``cfg.path``
    (docs/query.md), or None when no live daemon serves it (a stale discovery file included)."""
    if "in use by another process" not in str(refused):
        return None
    from triscope.query_discovery import find
    from triscope.store.served import ServedStore

    endpoint = find(cfg.path)
    if endpoint is None or endpoint.database != cfg.database:
        return None
    try:
        return ServedStore(endpoint)
    except StoreError as exc:
        raise StoreError(f"embedded store {cfg.path} is held by triscope run (pid {endpoint.pid}), whose query "
                         f"endpoint {endpoint.url} did not answer: {exc}") from None
