"""The query endpoint runs its queries at a lower CPU priority than the writer (``[query] thread_nice``).

On a small machine a dashboard's query and the writer's inserts want the same cores; ClickHouse's
``os_thread_priority`` renices the threads running a query, so the kernel gives the writer the core first.
Checked on the real kernel: while a long query runs through the endpoint, one of this process's threads
runs ``thread_nice`` above the process's own nice value, and none does after it.
"""

from __future__ import annotations

import base64
import http.client
import os
import threading
import time
import urllib.parse
from pathlib import Path
from typing import Any

import pytest

from triscope.errors import ConfigError
from triscope.query_endpoint import QueryConfig, QueryEndpoint

LONG = "SELECT count() FROM numbers(4000000000) WHERE sipHash64(number) % 7 = 1"


def _nices() -> list[int]:
    out = []
    for tid in os.listdir("/proc/self/task"):
        try:
            fields = Path(f"/proc/self/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # the thread ended
        out.append(int(fields[16]))  # field 19 of stat(5), the nice value
    return out


def _ask(port: int, sql: str) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    auth = base64.b64encode(b"triscope:s3cret").decode()
    try:
        conn.request("GET", "/?" + urllib.parse.urlencode({"query": sql}), headers={"Authorization": f"Basic {auth}"})
        conn.getresponse().read()
    finally:
        conn.close()


def test_a_query_runs_at_the_configured_nice_value(store: Any) -> None:
    if os.geteuid() != 0:
        pytest.skip("ClickHouse renices query threads only with CAP_SYS_NICE (root here)")
    nice = min(19, os.nice(0) + 13)  # thread_nice is added to the process's own nice value
    assert nice not in _nices()
    ep = QueryEndpoint(store, QueryConfig.from_config({"query": {
        "port": 0, "password": "s3cret", "max_execution_time_s": 3, "thread_nice": 13}})).start()
    try:
        asking = threading.Thread(target=_ask, args=(ep.port, LONG), daemon=True)
        asking.start()
        seen = False
        deadline = time.monotonic() + 2.5
        while time.monotonic() < deadline and not seen:
            seen = nice in _nices()
            time.sleep(0.05)
        asking.join(timeout=30)
        assert seen, f"no thread at nice {nice} while the query ran: {sorted(set(_nices()))}"
        time.sleep(0.2)
        assert nice not in _nices(), "a thread kept the query's nice value after the query"
    finally:
        ep.close()


def test_thread_nice_out_of_range_is_one_line() -> None:
    with pytest.raises(ConfigError, match="thread_nice"):
        QueryConfig.from_config({"query": {"thread_nice": 25}})
