"""The store served by a daemon (triscope/store/served.py): what a query command gets on a store held by
``triscope run``, read through the real query endpoint over the test's own embedded store, must be what the
direct open gets, value for value and dtype for dtype; errors stay one line and writes are refused."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from typing import Any

import pytest

from triscope.errors import StoreError
from triscope.query_discovery import Endpoint
from triscope.query_endpoint import QueryConfig, QueryEndpoint
from triscope.schema import SERVING_METRICS, encode_ts, qualified
from triscope.store.served import ServedStore

T0 = 1_767_225_600  # 2026-01-01


@pytest.fixture()
def served(store: Any) -> Iterator[tuple[ServedStore, QueryEndpoint]]:
    rows = [{"ts": encode_ts((T0 + i) * 10**9), "backend": f"b{i % 3}:8000", "model": "m",
             "kv_cache_usage_ratio": i / 100, "queue_length": float(i)} for i in range(60)]
    store.insert(qualified(store, SERVING_METRICS), SERVING_METRICS.columns_of(rows))
    ep = QueryEndpoint(store, QueryConfig.from_config({"query": {"port": 0, "password": "s3cret"}})).start()
    remote = ServedStore(Endpoint(os.getpid(), "127.0.0.1", ep.port, str(getattr(store, "path", "")),
                                  store.database, ep.username, ep.token))
    try:
        yield remote, ep
    finally:
        remote.close()
        ep.close()


SQL = ("SELECT backend, model, count() AS n, round(avg(kv_cache_usage_ratio), 6) AS kv, max(ts) AS last, "
       "groupArray(toUInt32(queue_length)) AS queues FROM {table} "
       "WHERE ts >= fromUnixTimestamp64Nano({{since:Int64}}) AND backend IN {{backends:Array(String)}} "
       "AND model = {{model:String}} GROUP BY backend, model ORDER BY backend")


def test_rows_columns_and_raw_bytes_are_the_direct_open_s(served: tuple[ServedStore, QueryEndpoint],
                                                          store: Any) -> None:
    remote, _ = served
    sql = SQL.format(table=qualified(store, SERVING_METRICS))
    params = {"since": (T0 + 10) * 10**9, "backends": ["b0:8000", "b2:8000"], "model": "m"}
    direct = store.query(sql, params)
    assert [r[0] for r in direct.rows] == ["b0:8000", "b2:8000"]
    assert remote.query(sql, params) == direct
    want, got = store.query_columns(sql, params), remote.query_columns(sql, params)
    assert list(got) == list(want)
    for name in want:
        assert got[name].dtype == want[name].dtype, name
        assert [repr(v) for v in got[name]] == [repr(v) for v in want[name]], name
    assert remote.query_raw(sql, "TabSeparatedWithNames", params) == store.query_raw(sql, "TabSeparatedWithNames",
                                                                                    params)
    assert remote.query("SELECT 1 WHERE 0") == store.query("SELECT 1 WHERE 0")
    assert remote.query_columns("SELECT 1 AS x WHERE 0").keys() == store.query_columns("SELECT 1 AS x WHERE 0").keys()


def test_errors_are_one_line_and_writes_are_refused(served: tuple[ServedStore, QueryEndpoint], store: Any) -> None:
    remote, ep = served
    with pytest.raises(StoreError, match=r"^query failed: Code: \d+\. .*no_such_table") as bad:
        remote.query("SELECT * FROM no_such_table")
    assert "\n" not in str(bad.value)
    with pytest.raises(StoreError, match="readonly"):
        remote.command(f"TRUNCATE TABLE {qualified(store, SERVING_METRICS)}")
    with pytest.raises(StoreError, match="read-only: stop it to write"):
        remote.insert(qualified(store, SERVING_METRICS), {"backend": ["x"]})
    assert store.query(f"SELECT count() FROM {qualified(store, SERVING_METRICS)}").scalar() == 60
    wrong = Endpoint(os.getpid(), "127.0.0.1", ep.port, "", store.database, ep.username, "wrong")
    with pytest.raises(StoreError, match="Authentication failed"):
        ServedStore(wrong)


def test_a_connection_the_daemon_dropped_is_opened_again(served: tuple[ServedStore, QueryEndpoint]) -> None:
    remote, _ = served
    assert remote.query("SELECT 41 + 1").rows == [(42,)]
    conn = remote._local.conn
    assert conn.sock is not None
    conn.sock.shutdown(socket.SHUT_RDWR)  # as when the daemon closes an idle kept-alive connection
    assert remote.query("SELECT 43").rows == [(43,)]
    assert remote._local.conn is not conn


def test_a_stopped_daemon_is_a_one_line_error(store: Any) -> None:
    ep = QueryEndpoint(store, QueryConfig.from_config({"query": {"port": 0}})).start()
    remote = ServedStore(Endpoint(os.getpid(), "127.0.0.1", ep.port, "", store.database, ep.username, ep.token))
    ep.close()
    with pytest.raises(StoreError, match=r"did not answer|closed the connection") as gone:
        remote.query("SELECT 1")
    assert "\n" not in str(gone.value)
