"""The daemon's query endpoint (triscope/query_endpoint.py): ClickHouse's HTTP interface over the embedded
store, for real clients (clickhouse-connect) and raw HTTP, with its bounds. In-process here: the endpoint
serves the test's own store; tests/test_query_live.py runs it inside ``triscope run``."""

from __future__ import annotations

import base64
import http.client
import json
import urllib.parse
from collections.abc import Iterator
from typing import Any

import clickhouse_connect
import pytest
from clickhouse_connect.driver.exceptions import DatabaseError
from conftest import REPO, require

from triscope.query_endpoint import QueryConfig, QueryEndpoint, statement_kind, with_settings
from triscope.schema import SERVING_METRICS, encode_ts, qualified

T0 = 1_767_225_600  # 2026-01-01


@pytest.fixture()
def endpoint(store: Any) -> Iterator[QueryEndpoint]:
    rows = [{"ts": encode_ts((T0 + i) * 10**9), "backend": f"b{i % 3}:8000", "model": "m",
             "kv_cache_usage_ratio": i / 100, "queue_length": float(i)} for i in range(60)]
    store.insert(qualified(store, SERVING_METRICS), SERVING_METRICS.columns_of(rows))
    ep = QueryEndpoint(store, QueryConfig.from_config({"query": {
        "port": 0, "password": "s3cret", "max_execution_time_s": 2, "max_memory_bytes": 200_000_000,
        "max_query_bytes": 4096}})).start()
    try:
        yield ep
    finally:
        ep.close()


def client(ep: QueryEndpoint, **kw: Any) -> Any:
    return clickhouse_connect.get_client(host="127.0.0.1", port=ep.port, username="triscope", password="s3cret",
                                         database=ep.store.database, **kw)


def raw(ep: QueryEndpoint, method: str, query: str = "", body: bytes = b"", auth: str | None = "triscope:s3cret",
        **params: str) -> tuple[int, dict[str, str], bytes]:
    args = {**({"query": query} if query else {}), **params}
    conn = http.client.HTTPConnection("127.0.0.1", ep.port, timeout=20)
    headers = {"Authorization": "Basic " + base64.b64encode(auth.encode()).decode()} if auth else {}
    try:
        conn.request(method, "/?" + urllib.parse.urlencode(args), body=body or None, headers=headers)
        resp = conn.getresponse()
        return resp.status, dict(resp.getheaders()), resp.read()
    finally:
        conn.close()


def test_clickhouse_connect_gets_the_rows_a_direct_open_gets(endpoint: QueryEndpoint, store: Any) -> None:
    sql = ("SELECT backend, count() AS n, round(avg(kv_cache_usage_ratio), 6) AS kv, max(ts) AS last "
           f"FROM {qualified(store, SERVING_METRICS)} WHERE ts >= fromUnixTimestamp64Nano({{since:Int64}}) "
           "GROUP BY backend ORDER BY backend")
    params = {"since": (T0 + 10) * 10**9}
    direct = store.query(sql, params)
    c = client(endpoint)
    got = c.query(sql, parameters=params)
    assert list(got.column_names) == direct.columns
    assert [(r[0], r[1], r[2]) for r in got.result_rows] == [(r[0], int(r[1]), float(r[2])) for r in direct.rows]
    assert [r[3].replace(tzinfo=None).isoformat(sep=" ") for r in got.result_rows] == [
        str(r[3])[:26].rstrip("0").rstrip(".") for r in direct.rows]
    arrow = c.query_arrow("SELECT backend FROM serving_metrics ORDER BY ts LIMIT 3")  # unqualified: the database
    assert arrow.column("backend").to_pylist() == ["b0:8000", "b1:8000", "b2:8000"]
    assert c.query("SELECT {x:UInt32} + 1", parameters={"x": 41}).result_rows == [(42,)]


@pytest.mark.parametrize("fmt", ["JSON", "JSONCompact", "TabSeparatedWithNames", "CSVWithNames",
                                 "RowBinaryWithNamesAndTypes", "Native", "Arrow", "Parquet"])
def test_every_format_is_served_as_the_engine_writes_it(endpoint: QueryEndpoint, store: Any, fmt: str) -> None:
    sql = f"SELECT backend, queue_length FROM {qualified(store, SERVING_METRICS)} ORDER BY ts LIMIT 5"
    def same(answer: bytes) -> Any:
        if fmt.startswith("JSON"):  # they carry the query's elapsed time
            return {k: v for k, v in json.loads(answer).items() if k != "statistics"}
        if fmt == "Arrow":  # the store's own connection asks for LowCardinality as dictionaries, a server does not
            import pyarrow as pa

            return pa.ipc.open_file(pa.py_buffer(answer)).read_all().to_pylist()
        return answer

    status, headers, body = raw(endpoint, "GET", sql, default_format=fmt)
    assert status == 200 and headers["X-ClickHouse-Format"] == fmt
    assert same(body) == same(store.query_raw(sql, fmt))
    status, headers, body2 = raw(endpoint, "POST", body=f"{sql} FORMAT {fmt}".encode())  # POST, FORMAT clause
    assert status == 200 and headers["X-ClickHouse-Format"] == fmt and same(body2) == same(body)


def test_writes_and_raised_bounds_are_refused_and_collection_goes_on(endpoint: QueryEndpoint, store: Any) -> None:
    c = client(endpoint)
    table = qualified(store, SERVING_METRICS)
    before = store.query(f"SELECT count() FROM {table}").scalar()
    for sql, words in [(f"INSERT INTO {table} (backend) VALUES ('x')", "readonly"),
                       (f"ALTER TABLE {table} DELETE WHERE 1", "readonly"),
                       ("CREATE TABLE evil (a UInt8) ENGINE = Memory", "readonly"),
                       ("SELECT 1 SETTINGS readonly = 0", r"fixed by \[query\]"),
                       ("SELECT 1 SETTINGS max_execution_time = 1000 FORMAT JSON", r"fixed by \[query\]"),
                       ("SELECT 1 SETTINGS os_thread_priority = -20", r"fixed by \[query\]"),
                       (f"WITH 1 AS a INSERT INTO {table} (backend) SELECT 'x'", "readonly")]:
        with pytest.raises(DatabaseError, match=words):
            c.command(sql)
    store.insert(table, SERVING_METRICS.columns_of([{"ts": encode_ts(T0 * 10**9), "backend": "w:1"}]))  # writer
    assert store.query(f"SELECT count() FROM {table}").scalar() == before + 1


def test_time_and_memory_bounds_hold(endpoint: QueryEndpoint) -> None:
    c = client(endpoint)
    with pytest.raises(DatabaseError, match=r"TIMEOUT_EXCEEDED|Timeout exceeded"):
        c.query("SELECT count() FROM numbers(100000000000) WHERE sipHash64(number) = 1",
                settings={"max_execution_time": 1000})  # asked for more: the endpoint's 2 s hold
    with pytest.raises(DatabaseError, match=r"MEMORY_LIMIT_EXCEEDED|memory limit"):
        c.query("SELECT groupArray(number) FROM numbers(100000000)")
    assert c.query("SELECT 1").result_rows == [(1,)]  # the endpoint still answers


def test_bad_requests_are_clear_errors(endpoint: QueryEndpoint) -> None:
    status, headers, body = raw(endpoint, "GET", "SELECT 1", auth="triscope:wrong")
    assert status == 401 and headers["X-ClickHouse-Exception-Code"] == "516" and b"Authentication failed" in body
    status, _, body = raw(endpoint, "GET", "SELECT 1", auth=None)
    assert status == 401
    status, _, body = raw(endpoint, "POST", body=b"SELECT '" + b"x" * 5000 + b"'")
    assert status == 413 and body.startswith(b"Code: 241.")
    status, _, body = raw(endpoint, "GET", "SELECT 1", database="other")
    assert status == 404 and b"Database other does not exist here" in body
    status, _, body = raw(endpoint, "GET", "SELECT FROM WHERE")
    assert status == 500 and body.startswith(b"Code: 62.") and body.count(b"\n") == 1
    status, _, body = raw(endpoint, "GET", "", body=b"")
    assert status == 200 and body == b"Ok.\n"  # GET / is ClickHouse's health answer


def test_statement_kinds_and_settings_clauses() -> None:
    assert statement_kind("-- why\n/* a */ (SELECT 1)") == "SELECT"
    assert statement_kind("  with x as (select 1) select * from x") == "WITH"
    assert statement_kind("INSERT INTO t VALUES") == "INSERT"
    assert with_settings("SELECT 1 FORMAT JSON", {"a": "1"}) == "SELECT 1 SETTINGS a = 1 FORMAT JSON"
    assert with_settings("SELECT 1 SETTINGS b = 2", {"a": "x'y"}) == "SELECT 1 SETTINGS b = 2, a = 'x\\'y'"


def test_the_discovery_file_is_the_owner_s_and_goes_with_the_endpoint(store: Any, tmp_path: Any) -> None:
    import os
    import stat

    from triscope.query_discovery import FILE_NAME

    ep = QueryEndpoint(store, QueryConfig.from_config({"query": {"port": 0}})).start()
    path = os.path.join(store.path, FILE_NAME)
    try:
        with open(path) as fh:
            doc = json.loads(fh.read())
        assert doc["port"] == ep.port and doc["pid"] == os.getpid() and len(doc["token"]) >= 24
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    finally:
        ep.close()
    assert not os.path.exists(path)


def test_the_grafana_plugin_s_request_shapes(endpoint: QueryEndpoint, store: Any) -> None:
    """What the Grafana ClickHouse plugin's Go client (clickhouse-go v2, HTTP protocol) sends, read from its
    source (conn_http.go): POST to ``/?database=DB&default_format=Native&<settings>`` with the query as the
    body and Basic auth from the URL's user info; ``SELECT timeZone()`` when it connects, ``SELECT 1`` to
    ping; settings from the data source (a query timeout) as URL parameters."""
    table = qualified(store, SERVING_METRICS)
    params = {"database": store.database, "default_format": "Native", "max_execution_time": "60",
              "query_id": "grafana-1"}
    for sql in ("SELECT timeZone()", "SELECT 1",
                f"SELECT $__t AS time, backend, avg(kv_cache_usage_ratio) FROM {table} GROUP BY time, backend "
                "ORDER BY time, backend".replace("$__t", "toStartOfMinute(ts)")):
        status, headers, body = raw(endpoint, "POST", body=sql.encode(), **params)
        assert status == 200 and headers["X-ClickHouse-Format"] == "Native", body[:200]
        assert headers["X-ClickHouse-Query-Id"] == "grafana-1"
        assert body == store.query_raw(sql, "Native") or sql == "SELECT timeZone()"
    status, _, body = raw(endpoint, "POST", body=b"SELECT timeZone() FORMAT TSV", database=store.database)
    assert body.strip() in (b"UTC", b"Etc/UTC")  # a zone Go's time.LoadLocation knows


NODE_CLIENT = REPO / "var" / "node-clickhouse" / "node_modules" / "@clickhouse" / "client"
NODE_SCRIPT = r"""
const { createClient } = require(process.argv[2]);
(async () => {
  const [url, password, database, sql, params] = process.argv.slice(3);
  const client = createClient({ url, username: 'triscope', password, database });
  const rs = await client.query({ query: sql, format: 'JSONEachRow', query_params: JSON.parse(params) });
  console.log(JSON.stringify(await rs.json()));
  try {
    await client.command({ query: 'CREATE TABLE js_evil (a UInt8) ENGINE = Memory' });
    console.log('"write allowed"');
  } catch (e) { console.log(JSON.stringify(e.message.split('\n')[0])); }
  await client.close();
})().catch((e) => { console.error(e.message); process.exit(1); });
"""


def test_the_official_javascript_client_gets_the_rows_a_direct_open_gets(endpoint: QueryEndpoint, store: Any,
                                                                          tmp_path: Any) -> None:
    """``@clickhouse/client`` (npm, Node.js 20) against the endpoint: a parameterized board-style query's rows
    equal the direct open's, and a write is refused with ClickHouse's error."""
    import shutil
    import subprocess

    node = shutil.which("node")
    require(node is not None and NODE_CLIENT.exists(),
            "node or @clickhouse/client is missing (run tools/setup_node_clickhouse.sh)")
    script = tmp_path / "query.js"
    script.write_text(NODE_SCRIPT)
    table = qualified(store, SERVING_METRICS)
    sql = (f"SELECT backend, count() AS n, round(avg(kv_cache_usage_ratio), 6) AS kv FROM {table} "
           "WHERE ts >= fromUnixTimestamp64Nano({since:Int64}) GROUP BY backend ORDER BY backend")
    since = (T0 + 10) * 10**9
    done = subprocess.run([str(node), str(script), str(NODE_CLIENT), endpoint.url, "s3cret", store.database, sql,
                           json.dumps({"since": since})], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    rows_line, write_line = done.stdout.strip().splitlines()
    got = [(r["backend"], int(r["n"]), float(r["kv"])) for r in json.loads(rows_line)]
    assert got == [(r[0], int(r[1]), float(r[2])) for r in store.query(sql, {"since": since}).rows]
    assert "readonly" in json.loads(write_line)


def test_chunked_bodies_are_read_within_the_bound(endpoint: QueryEndpoint) -> None:
    import socket

    auth = base64.b64encode(b"triscope:s3cret").decode()

    def send(chunks: list[bytes]) -> bytes:
        body = b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in chunks) + b"0\r\n\r\n"
        with socket.create_connection(("127.0.0.1", endpoint.port), timeout=10) as s:
            s.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n"
                      b"Authorization: Basic " + auth.encode() + b"\r\n\r\n" + body)
            out = b""
            while chunk := s.recv(65536):
                out += chunk
        return out

    ok = send([b"SELECT 40 ", b"+ 2"])
    assert ok.startswith(b"HTTP/1.1 200") and ok.endswith(b"\r\n\r\n42\n")
    too_big = send([b"SELECT '" + b"x" * 3000, b"y" * 3000 + b"'"])  # 6 KB in chunks, bound 4 KB
    assert too_big.startswith(b"HTTP/1.1 413") and b"Code: 241." in too_big


def test_queries_past_the_running_and_waiting_bound_get_503_at_once(store: Any) -> None:
    import threading
    import time

    ep = QueryEndpoint(store, QueryConfig.from_config({"query": {
        "port": 0, "password": "s3cret", "max_execution_time_s": 2, "max_concurrent": 1, "max_queued": 0}})).start()
    try:
        long = threading.Thread(target=raw, args=(ep, "GET", "SELECT count() FROM numbers(100000000000) "
                                                              "WHERE sipHash64(number) = 1"), daemon=True)
        long.start()
        deadline = time.monotonic() + 5
        while ep.stats()["running_or_waiting"] == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        status, headers, body = raw(ep, "GET", "SELECT 1")
        assert status == 503 and headers["X-ClickHouse-Exception-Code"] == "202" and b"max_concurrent" in body
        assert long.is_alive()  # refused at once, not queued behind the long query
        long.join(timeout=30)
        assert raw(ep, "GET", "SELECT 1")[2] == b"1\n" and ep.stats()["refused_total"] == 1
    finally:
        ep.close()
