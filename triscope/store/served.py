"""The embedded store read through the query endpoint of the ``triscope run`` holding it.

A query command on a store held by a live daemon (:mod:`triscope.query_discovery`) asks the daemon's
endpoint for the very formats it would ask chDB for, and reads them with the embedded backend's own
decoders: ``JSONCompact`` for rows, Arrow for columns. Its answers are the direct open's, and the client's
share of a query is one HTTP round trip on a kept-alive connection, not a general client's parsing
(clickhouse-connect's Native decoding costs ~0.7 ms of CPU per board query; docs/query.md).
"""

from __future__ import annotations

import http.client
import threading
from collections.abc import Mapping, Sequence
from typing import Any
from urllib.parse import urlencode

from triscope.errors import StoreError, one_line
from triscope.query_discovery import Endpoint
from triscope.store.base import Result, Store
from triscope.store.codec import column_to_numpy, param_text, rows_of_json_compact

MAX_ANSWER_BYTES = 1 << 30
"""A larger answer is refused unread (the daemon bounds each query's memory below this already)."""

_RETRY_ON = (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError, http.client.CannotSendRequest)
"""A kept-alive connection the daemon closed while idle: the request is sent once more on a new one."""


class ServedStore(Store):
    """Read-only :class:`Store` on a live daemon's query endpoint; one kept-alive connection per thread."""

    def __init__(self, endpoint: Endpoint, timeout_s: float = 300.0) -> None:
        self.endpoint = endpoint
        self.database = endpoint.database
        self.path = endpoint.path
        self.timeout_s = timeout_s
        self._headers = {"X-ClickHouse-User": endpoint.username, "X-ClickHouse-Key": endpoint.token,
                         "Content-Type": "text/plain; charset=utf-8"}
        self._local = threading.local()
        self._request("SELECT 1", "TabSeparated", None)

    def _connection(self, fresh: bool = False) -> http.client.HTTPConnection:
        conn: http.client.HTTPConnection | None = getattr(self._local, "conn", None)
        if conn is None or fresh:
            if conn is not None:
                conn.close()
            conn = http.client.HTTPConnection(self.endpoint.host, self.endpoint.port, timeout=self.timeout_s)
            self._local.conn = conn
        return conn

    def _request(self, sql: str, fmt: str, params: Mapping[str, Any] | None) -> bytes:
        args = {"database": self.database, "default_format": fmt}
        args.update({f"param_{k}": str(param_text(v)) for k, v in (params or {}).items()})
        target = "/?" + urlencode(args)
        body = sql.encode()
        for attempt in (0, 1):
            conn = self._connection(fresh=attempt > 0)
            try:
                conn.request("POST", target, body=body, headers=self._headers)
                resp = conn.getresponse()
                size = int(resp.getheader("Content-Length") or 0)
                if size > MAX_ANSWER_BYTES:
                    conn.close()
                    raise StoreError(f"query failed: the answer ({size} bytes) is over {MAX_ANSWER_BYTES} bytes")
                data = resp.read()
            except _RETRY_ON:
                if attempt == 0:
                    continue
                raise StoreError(f"query endpoint {self.endpoint.url} of triscope run (pid {self.endpoint.pid}) "
                                 "closed the connection") from None
            except OSError as exc:
                raise StoreError(f"query endpoint {self.endpoint.url} of triscope run (pid {self.endpoint.pid}) "
                                 f"did not answer: {one_line(exc)}") from None
            if resp.status != 200:
                lines = data.decode("utf-8", errors="replace").strip().splitlines()
                raise StoreError(f"query failed: {lines[0] if lines else f'HTTP {resp.status}'}")
            return data
        raise AssertionError("unreachable")

    def command(self, sql: str, params: Mapping[str, Any] | None = None) -> None:
        self._request(sql, "TabSeparated", params)

    def query(self, sql: str, params: Mapping[str, Any] | None = None) -> Result:
        return rows_of_json_compact(self._request(sql, "JSONCompact", params))

    def query_raw(self, sql: str, fmt: str, params: Mapping[str, Any] | None = None) -> bytes:
        """The answer as the daemon's chDB writes it in ``fmt``."""
        return self._request(sql, fmt, params)

    def query_columns(self, sql: str, params: Mapping[str, Any] | None = None) -> dict[str, Any]:
        import pyarrow as pa

        raw = self._request(sql, "Arrow", params)
        if not raw:
            return {}
        table = pa.ipc.open_file(pa.py_buffer(raw)).read_all()
        return {name: column_to_numpy(table.column(name)) for name in table.column_names}

    def _read_only(self) -> StoreError:
        return StoreError(f"embedded store {self.path} is held by triscope run (pid {self.endpoint.pid}), whose "
                          "query endpoint is read-only: stop it to write")

    def insert(self, table: str, columns: Mapping[str, Sequence[Any]],
               settings: Mapping[str, str | int] | None = None) -> int:
        raise self._read_only()

    def insert_from_json(self, insert_sql: str, structure: str, data: bytes,
                         params: Mapping[str, Any] | None = None) -> None:
        raise self._read_only()

    def close(self) -> None:
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()
            self._local.conn = None


__all__ = ["MAX_ANSWER_BYTES", "ServedStore"]
