"""The host collector reading PSI and OOM kills from a real prometheus-node-exporter (Debian package).

Users who already run node-exporter point ``[host] node_exporter`` at it; the figures must be the
kernel's own, the host row named by node-exporter's ``nodename``, and a node-exporter that goes away
must leave the host's pressure missing (NaN) for those windows, never zero, until it answers again.
"""

from __future__ import annotations

import math
import os
import subprocess
import time
import urllib.request
from typing import Any

import pytest
from conftest import free_port, require_binary

from triscope.collectors.host import HostCollector, HostConfig, procfs
from triscope.collectors.host.node_exporter import parse_node_page
from triscope.errors import ConfigError, InputError
from triscope.schema import HOST_SAMPLES


def _start_node_exporter(port: int) -> subprocess.Popen[bytes]:
    binary = require_binary("prometheus-node-exporter")
    proc = subprocess.Popen([binary, f"--web.listen-address=127.0.0.1:{port}", "--collector.disable-defaults",
                             "--collector.pressure", "--collector.vmstat", "--collector.uname"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=1) as answer:
                if b"node_pressure_cpu_waiting_seconds_total" in answer.read():
                    return proc
        except OSError:
            time.sleep(0.1)
    proc.kill()
    pytest.fail("prometheus-node-exporter did not serve /metrics within 15 s")


def _host_row(collector: HostCollector) -> dict[str, Any]:
    cols = collector.collect()[HOST_SAMPLES]
    rows = [dict(zip(cols, values, strict=True)) for values in zip(*cols.values(), strict=True)]
    return next(r for r in rows if r["backend"] == "")


def test_node_exporter_gives_the_kernel_s_own_totals_and_the_host_name() -> None:
    if not procfs.psi_totals():
        pytest.skip("this kernel has no /proc/pressure to compare with")
    port = free_port()
    proc = _start_node_exporter(port)
    try:
        url = f"http://127.0.0.1:{port}/metrics"
        before = procfs.psi_totals()
        with urllib.request.urlopen(url, timeout=5) as answer:
            reading = parse_node_page(answer.read().decode())
        after = procfs.psi_totals()
        # Cumulative counters read between two reads of /proc: bracketed exactly.
        assert set(reading.psi) == set(before) - {"cpu_full"}, reading.psi  # node-exporter leaves cpu full out
        for key, value in reading.psi.items():
            assert before[key] - 1e-6 <= value <= after[key] + 1e-6, (key, before[key], value, after[key])
        if math.isfinite(procfs.oom_kills()):
            assert reading.oom_kills == procfs.oom_kills()
        assert reading.nodename == os.uname().nodename
    finally:
        proc.kill()
        proc.wait()


def test_the_host_row_follows_node_exporter_and_is_missing_while_it_is_gone(caplog: Any) -> None:
    port = free_port()
    proc = _start_node_exporter(port)
    collector = HostCollector(HostConfig.from_config(
        {"host": {"interval_s": 0.2, "node_exporter": f"http://127.0.0.1:{port}/metrics"}}), {})
    try:
        collector.start()
        time.sleep(0.3)
        row = _host_row(collector)
        assert row["host"] == os.uname().nodename
        assert row["psi_cpu_some"] >= 0 and math.isfinite(row["psi_io_some"]), row
        assert row["oom_kills"] >= 0, row

        proc.kill()
        proc.wait()
        gone = [_host_row(collector) for _ in range(3)]
        for r in gone:  # missing, not zero: an unread host is not a calm host
            assert math.isnan(r["psi_cpu_some"]) and math.isnan(r["oom_kills"]), r
        assert collector.node_errors == 3
        assert sum("node-exporter scrape failed" in m for m in caplog.messages) == 1  # once per outage

        proc = _start_node_exporter(port)
        _host_row(collector)  # the first window back has no previous total to subtract
        time.sleep(0.2)
        back = _host_row(collector)
        assert math.isfinite(back["psi_cpu_some"]) and back["psi_cpu_some"] >= 0, back
    finally:
        proc.kill()
        proc.wait()


def test_a_page_that_is_not_node_exporter_s_is_one_line_and_bad_urls_are_refused() -> None:
    with pytest.raises(InputError) as err:
        parse_node_page('node_pressure_cpu_waiting_seconds_total{ 12\n', "http://x/metrics")
    assert "\n" not in str(err.value) and "http://x/metrics" in str(err.value)
    assert parse_node_page("# HELP up x\nup 1\n").psi == {}
    with pytest.raises(ConfigError, match="node_exporter"):
        HostConfig.from_config({"host": {"node_exporter": "127.0.0.1:9100"}})
