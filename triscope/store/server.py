"""ClickHouse server backend through clickhouse-connect (HTTP interface).

Parameters use the same ``{name:Type}`` syntax as the embedded backend; clickhouse-connect
sends them as server-side query parameters.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import Any
from urllib.parse import urlparse

import numpy as np

from triscope.errors import StoreError, one_line
from triscope.store.base import Result, Store


class ServerStore(Store):
    """Store backed by a ClickHouse server (single node or a cluster entry point)."""

    def __init__(self, url: str, database: str = "triscope", username: str = "", password: str = "",
                 cluster: str = "", connect_timeout_s: float = 5.0, create_database: bool = True) -> None:
        import clickhouse_connect

        parsed = urlparse(url if "://" in url else f"http://{url}")
        if not parsed.hostname:
            raise StoreError(f"store url {url!r} has no host")
        self.url = url
        self.database = database
        self.cluster = cluster
        self._kwargs: dict[str, Any] = dict(
            host=parsed.hostname,
            port=parsed.port or (8443 if parsed.scheme == "https" else 8123),
            secure=parsed.scheme == "https",
            username=username or parsed.username or "default",
            password=password or parsed.password or "",
            connect_timeout=connect_timeout_s,
        )
        self._connect = clickhouse_connect.get_client
        self._local = threading.local()
        on_cluster = f" ON CLUSTER `{cluster}`" if cluster else ""
        if create_database:  # (a read-only endpoint, such as a daemon's, has it already)
            self._client(database="default").command(f"CREATE DATABASE IF NOT EXISTS {database}{on_cluster}")
        else:
            self._client()

    def _client(self, database: str | None = None) -> Any:
        client = getattr(self._local, "client", None)
        if client is None or database:
            try:
                client = self._connect(database=database or self.database, **self._kwargs)
            except Exception as exc:
                raise StoreError(f"cannot reach ClickHouse at {self.url}: {one_line(exc)}") from None
            if database is None:
                self._local.client = client
        return client

    def command(self, sql: str, params: Mapping[str, Any] | None = None) -> None:
        try:
            self._client().command(sql, parameters=dict(params or {}))
        except StoreError:
            raise
        except Exception as exc:
            raise StoreError(f"query failed: {one_line(exc)}") from None

    def query(self, sql: str, params: Mapping[str, Any] | None = None) -> Result:
        try:
            res = self._client().query(sql, parameters=dict(params or {}))
        except StoreError:
            raise
        except Exception as exc:
            raise StoreError(f"query failed: {one_line(exc)}") from None
        return Result(list(res.column_names), [tuple(r) for r in res.result_rows])

    def query_columns(self, sql: str, params: Mapping[str, Any] | None = None) -> dict[str, Any]:
        try:
            table = self._client().query_arrow(sql, parameters=dict(params or {}))
        except Exception as exc:
            raise StoreError(f"query failed: {one_line(exc)}") from None
        return {name: table.column(name).to_numpy(zero_copy_only=False) for name in table.column_names}

    def insert(self, table: str, columns: Mapping[str, Sequence[Any]],
               settings: Mapping[str, str | int] | None = None) -> int:
        n = self.row_count(columns)
        if n == 0:
            return 0
        names = list(columns)
        data = [v.tolist() if isinstance(v, np.ndarray) else list(v) for v in columns.values()]
        try:
            self._client().insert(table, data, column_names=names, column_oriented=True,
                                 settings=dict(settings or {}))
        except Exception as exc:
            raise StoreError(f"insert into {table} failed: {one_line(exc)}") from None
        return n

    def insert_from_json(self, insert_sql: str, structure: str, data: bytes,
                         params: Mapping[str, Any] | None = None) -> None:
        sql = insert_sql.replace("json_input", f"input('{structure}')")
        settings = {"input_format_json_read_objects_as_strings": 1}
        try:
            self._client().command(f"{sql} FORMAT JSONEachRow", parameters=dict(params or {}), data=data,
                                   settings=settings)
        except Exception as exc:
            raise StoreError(f"insert failed: {one_line(exc)}") from None

    def close(self) -> None:
        client = getattr(self._local, "client", None)
        if client is not None:
            client.close()
        self._local = threading.local()


