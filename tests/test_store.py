"""Store backends, parameter binding, schema migrations and cluster DDL on the real chDB engine."""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import free_port

from triscope.config import _deep_merge, deep_merge, env_overrides, load_config
from triscope.errors import ConfigError, StoreError
from triscope.schema import domains, migrate, qualified, schema_versions
from triscope.schema.model import Column, Table, add_column_sql, create_table_sql
from triscope.store import open_store


def test_parameters_are_bound_not_spliced(store):
    hostile = "x'); DROP TABLE trace_events; --"
    row = store.query("SELECT {s:String} AS s, {n:Int64} + 1 AS n, {a:Array(String)} AS a",
                      {"s": hostile, "n": 41, "a": ["it's", "b\\c"]}).rows[0]
    assert row == (hostile, 42, ["it's", "b\\c"])
    assert store.query(f"EXISTS TABLE {qualified(store, 'trace_events')}").scalar() == 1


def test_insert_and_read_back_columns(store):
    table = qualified(store, "io_latency")
    n = store.insert(table, {"ts": [1.5, 2.5], "host": ["a", "b"], "device": ["sda", "sdb"], "source": ["t", "t"],
                             "op": ["read", "write"], "window_seconds": [1.0, 1.0], "ios": [3.0, 4.0],
                             "p50_seconds": [0.001, 0.002], "p99_seconds": [0.01, 0.02], "mean_seconds": [0.0, 0.0],
                             "queue_depth": [1.0, 2.0]})
    assert n == 2
    cols = store.query_columns(f"SELECT host, ios FROM {table} ORDER BY host")
    assert list(cols["host"]) == ["a", "b"]
    assert cols["ios"].tolist() == [3.0, 4.0]


def test_query_columns_decodes_text_of_every_shape(store):
    """LowCardinality text (dictionary-encoded Arrow, with and without NULLs), plain text below
    and above the to_pylist limit, empty results and numbers all come back as numpy arrays."""
    sql = ("SELECT toLowCardinality(toString(number % 3)) AS lc, "
           "if(number % 2 = 1, NULL, toLowCardinality(toString(number))) AS lc_null, "
           "toString(number) AS plain, number * 2 AS twice FROM numbers({n:UInt64}) ORDER BY number")
    cols = store.query_columns(sql, {"n": 5})
    assert cols["lc"].tolist() == ["0", "1", "2", "0", "1"]
    assert cols["lc_null"].tolist() == ["0", None, "2", None, "4"]
    assert cols["plain"].tolist() == ["0", "1", "2", "3", "4"]
    assert cols["twice"].tolist() == [0, 2, 4, 6, 8] and cols["twice"].dtype.kind == "u"
    big = store.query_columns(sql, {"n": 300_000})  # past the to_pylist limit: dictionary path
    assert big["plain"][[0, 123_456, 299_999]].tolist() == ["0", "123456", "299999"]
    assert big["lc"][-3:].tolist() == [str(n % 3) for n in range(299_997, 300_000)]
    empty = store.query_columns(sql.replace("numbers({n:UInt64})", "numbers(3) WHERE 0"), {})
    assert all(len(values) == 0 for values in empty.values())


def test_short_column_query_does_not_import_pyarrow_compute(store_path):
    """pyarrow.compute costs ~0.1 s to import: the columns of a short CLI query must not need it."""
    code = (
        "import sys, tempfile; from triscope.store import open_store\n"
        "s = open_store({'store': {'path': tempfile.mkdtemp()}})\n"
        "c = s.query_columns(\"SELECT toLowCardinality(toString(number % 2)) AS k, toString(number) AS t, "
        "number AS n FROM numbers(10)\")\n"
        "assert c['k'].tolist()[:3] == ['0', '1', '0'], c\n"
        "print('pyarrow.compute' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "False"


def test_insert_rejects_ragged_columns(store):
    with pytest.raises(ValueError, match="different lengths"):
        store.insert(qualified(store, "trace_runs"), {"run_id": ["a", "b"], "rank": [1]})


def test_insert_from_json_parses_in_clickhouse(store):
    store.command(f"CREATE TABLE {qualified(store, 'j')} (a Int64, b String, o String) ENGINE = MergeTree ORDER BY a")
    sql = f"INSERT INTO {qualified(store, 'j')} (a, b, o) SELECT a, b, o FROM json_input"
    store.insert_from_json(sql, "a Int64, b String, o String",
                           b'[{"a": 1, "b": "x", "o": {"k": [1]}}, {"a": 2, "b": "y\'q"}]')
    assert store.query(f"SELECT a, b, o FROM {qualified(store, 'j')} ORDER BY a").rows == [
        (1, "x", '{"k": [1]}'), (2, "y'q", "")]
    with pytest.raises(StoreError):
        store.insert_from_json(sql, "a Int64, b String, o String", b'[{"a": 3, "b": "z"}, {"a": "oops" ')


def test_query_errors_are_one_line(store):
    with pytest.raises(StoreError) as info:
        store.query("SELECT no_such_column FROM system.one")
    assert "\n" not in str(info.value)


def test_migrations_are_recorded_and_idempotent(store):
    first = schema_versions(store)
    assert set(first) == set(domains())
    assert all(v >= 1 for v in first.values())
    assert migrate(store) == first
    count = store.query(f"SELECT count() FROM {qualified(store, 'schema_migrations')} FINAL").scalar()
    assert count == sum(first.values())


def test_cluster_ddl_uses_replicated_and_distributed():
    table = Table("t", [Column("a", "Int64")], order_by="a", engine="ReplacingMergeTree(a)")
    local, dist = create_table_sql(table, "db", cluster="c1")
    assert local.startswith("CREATE TABLE IF NOT EXISTS db.t_local ON CLUSTER `c1`")
    assert "ReplicatedReplacingMergeTree('/clickhouse/tables/{shard}/{database}/t_local', '{replica}', a)" in local
    assert dist.startswith("CREATE TABLE IF NOT EXISTS db.t ON CLUSTER `c1` AS db.t_local")
    assert "Distributed(`c1`, db, t_local, rand())" in dist
    alters = add_column_sql("t", Column("b", "String"), "db", cluster="c1")
    assert [a.split()[2] for a in alters] == ["db.t_local", "db.t"]
    assert create_table_sql(table, "db") == [
        "CREATE TABLE IF NOT EXISTS db.t (\n  `a` Int64\n)\nENGINE = ReplacingMergeTree(a)\nORDER BY (a)"]


def test_single_node_ddl_runs_on_the_engine(store):
    table = Table("ddl_check", [Column("ts", "DateTime64(9, 'UTC')", "it's a comment"), Column("v", "Float64")],
                  order_by="ts", partition_by="toYYYYMMDD(ts)", ttl="toDateTime(ts) + INTERVAL 1 DAY")
    for sql in create_table_sql(table, store.database):
        store.command(sql)
    assert store.query(f"EXISTS TABLE {qualified(store, 'ddl_check')}").scalar() == 1


def test_unreachable_server_store_gives_a_clear_error():
    port = free_port()  # closed again before connecting: nothing listens there
    with pytest.raises(StoreError) as info:
        open_store({"store": {"backend": "server", "url": f"http://127.0.0.1:{port}"}})
    assert "cannot reach ClickHouse" in str(info.value) or "query failed" in str(info.value)
    assert "\n" not in str(info.value)


def test_config_file_and_environment_overrides(tmp_path):
    cfg = tmp_path / "t.toml"
    cfg.write_text('[store]\npath = "from-file"\n[analysis]\nwindow_ms = 250\n')
    conf = load_config(cfg, environ={"TRISCOPE_STORE__BACKEND": "server", "TRISCOPE_ANALYSIS__WINDOW_MS": "50",
                                     "TRISCOPE_REQUIRE_ALL": "1"})
    assert conf["store"]["path"] == "from-file"
    assert conf["store"]["backend"] == "server"
    assert conf["analysis"]["window_ms"] == 50
    assert env_overrides({"TRISCOPE_X__Y": "true"}) == {"x": {"y": True}}
    bad = tmp_path / "bad.toml"
    bad.write_text("[store\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(bad, environ={})
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.toml", environ={})


def test_deep_merge_merges_tables_and_copies():
    from types import MappingProxyType

    base = {"a": {"x": 1, "y": [1]}, "b": 2}
    extra = {"a": MappingProxyType({"y": [2], "z": {"k": 1}}), "b": {"c": 3}}
    out = deep_merge(base, extra)
    assert out == {"a": {"x": 1, "y": [2], "z": {"k": 1}}, "b": {"c": 3}}
    out["a"]["z"]["k"] = 9
    out["a"]["y"].append(3)
    assert base == {"a": {"x": 1, "y": [1]}, "b": 2} and extra["a"]["z"] == {"k": 1} and extra["a"]["y"] == [2]
    assert _deep_merge is deep_merge


def test_credentials_from_the_environment_arrive_verbatim():
    env = {"TRISCOPE_STORE__PASSWORD": "123456", "TRISCOPE_STORE__USERNAME": '"ops"',
           "TRISCOPE_WEIGHTS__FEED__BEARER_TOKEN": "0x1f", "TRISCOPE_STORE__CLUSTER": "42"}
    config = load_config(None, environ=env)
    assert config["store"]["password"] == "123456" and config["store"]["username"] == '"ops"'
    assert config["weights"]["feed"]["bearer_token"] == "0x1f"
    assert config["store"]["cluster"] == 42  # other keys still parse as TOML scalars


def test_unknown_backend_is_a_config_error():
    with pytest.raises(ConfigError, match="unknown store.backend"):
        open_store({"store": {"backend": "sqlite"}})


def _rss_anon_mb() -> float:
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith("RssAnon:")) / 1024


def test_releasing_memory_hands_freed_engine_memory_back_to_the_os(store):
    """An array of 3M strings frees ~140 MB inside chDB; jemalloc keeps those pages for seconds
    unless purged. Inside ``releasing_memory`` they go back to the OS within a few periods."""
    heavy = "SELECT length(groupArray(toString(number))) FROM numbers(3000000)"
    store.query(heavy)
    kept = _rss_anon_mb()
    with store.releasing_memory(period_s=0.02, after_s=0.02):
        import time

        time.sleep(0.3)
        released = _rss_anon_mb()
    assert kept - released > 60, (kept, released)
    store.query("SELECT 1")  # the store still works after the purging thread stopped
