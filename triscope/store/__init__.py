"""Storage: one ``Store`` interface, embedded chDB (default) or a ClickHouse server."""

from __future__ import annotations

from typing import Any

from triscope.errors import ConfigError
from triscope.store.base import Result, Store

__all__ = ["Result", "Store", "open_store"]


def open_store(config: dict[str, Any], migrate: bool = True) -> Store:
    """Open the store described by ``config['store']`` and bring its schema up to date."""
    cfg = config.get("store", {})
    backend = cfg.get("backend", "embedded")
    database = cfg.get("database", "triscope")
    cluster = cfg.get("cluster", "")
    store: Store
    if backend == "embedded":
        from triscope.store.embedded import EmbeddedStore

        store = EmbeddedStore(cfg.get("path", "var/triscope-data"), database=database, cluster=cluster)
    elif backend == "server":
        from triscope.store.server import ServerStore

        if not cfg.get("url"):
            raise ConfigError("store.backend = 'server' needs store.url (e.g. http://127.0.0.1:8123)")
        store = ServerStore(cfg["url"], database=database, username=cfg.get("username", ""),
                            password=cfg.get("password", ""), cluster=cluster)
    else:
        raise ConfigError(f"unknown store.backend {backend!r}; use 'embedded' or 'server'")
    if migrate:
        from triscope.schema import migrate as run_migrations

        run_migrations(store)
    return store
