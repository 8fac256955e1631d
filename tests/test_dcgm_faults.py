"""dcgm scraper under hostile targets on real sockets (127.0.0.1): a body trickled
at 1 byte/s, a redirect, a daemon shutdown. The good targets' rows arrive on
time; each bad target is its own error. Expositions: SYNTHETIC values in dcgm-exporter's layout."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from dcgm_samples import node
from scrape_helpers import Route, raw_server

from triscope.collectors.dcgm import NO_GPU, DcgmScraper
from triscope.schema import GPU_SAMPLES

GOOD = node("gpu-node-1", [{"gpu": i, "uuid": f"GPU-{i}", "model": "NVIDIA H200", "DCGM_FI_DEV_FB_USED": 1000 + i,
                            "DCGM_FI_DEV_GPU_UTIL": 50} for i in range(8)])
OTHER = GOOD.replace("gpu-node-1", "gpu-node-2")


def _rows(out: dict[str, Any]) -> list[dict[str, Any]]:
    cols = out[GPU_SAMPLES]
    return [dict(zip(cols, vals, strict=True)) for vals in zip(*cols.values(), strict=True)]


@pytest.mark.parametrize("round_", range(3))
def test_a_trickling_target_costs_only_itself(round_: int) -> None:
    """Before: urlopen's timeout applied per socket read, so 1 byte/s never timed out and held every row."""
    routes = {"/good": Route(body=GOOD.encode()), "/other": Route(body=OTHER.encode()),
              "/slow": Route(body=GOOD.replace("gpu-node-1", "gpu-node-3").encode(), trickle_s=1.0)}
    with raw_server(routes) as s:
        urls = [s.url("/good"), s.url("/slow"), s.url("/other")]
        scraper = DcgmScraper({"dcgm": {"urls": urls, "http": {"timeout_s": 1.0}}})
        try:
            for tick in range(2):  # the second tick too: the slow fetch ended at its deadline
                t0 = time.monotonic()
                rows = _rows(scraper.collect())
                took = time.monotonic() - t0
                assert took < 1.0 + 1.5, took  # one deadline (+ grace), not one per target or per byte
                ok = [(r["host"], r["gpu"]) for r in rows if r["state"] == "ok"]
                assert ok == [("gpu-node-1", i) for i in range(8)] + [("gpu-node-2", i) for i in range(8)], tick
                bad = [r for r in rows if r["state"] != "ok"]
                assert [(r["host"], r["gpu"], r["state"]) for r in bad] == [("127.0.0.1", NO_GPU, "unreachable")]
                assert bad[0]["error"].startswith(f"{urls[1]}: scrape failed: timed out after 1 s (timeout_s: total")
                assert scraper.take_errors() == [bad[0]["error"]]
        finally:
            t1 = time.monotonic()
            scraper.close()
            assert time.monotonic() - t1 < 0.5  # close does not wait for a fetch in flight


def test_redirects_only_when_configured() -> None:
    routes = {"/metrics": Route(status="302 Found", headers=(("Location", "/metrics/"),)),
              "/metrics/": Route(body=GOOD.encode())}
    with raw_server(routes) as s:
        refused = DcgmScraper({"dcgm": {"urls": [s.url("/metrics")]}})
        followed = DcgmScraper({"dcgm": {"urls": [s.url("/metrics")], "http": {"redirects": "same-origin"}}})
        try:
            (row,) = _rows(refused.collect())
            assert (row["state"], row["gpu"]) == ("error", NO_GPU)
            assert "redirects are not allowed" in row["error"]
            assert [r["state"] for r in _rows(followed.collect())] == ["ok"] * 8
        finally:
            refused.close()
            followed.close()


def test_daemon_stops_promptly_with_a_trickling_target(store_path: Path, tmp_path: Path) -> None:
    """The whole run: rows of the good target reach the store; shutdown (a last collect on the main
    thread) is bounded by the fetch deadline."""
    from triscope.daemon import Daemon
    from triscope.store import open_store

    database = f"dcgmfault{int(time.time() * 1000) % 10**8}"
    routes = {"/good": Route(body=GOOD.encode()), "/slow": Route(body=OTHER.encode(), trickle_s=1.0)}
    with raw_server(routes) as s:
        config = {
            "store": {"backend": "embedded", "path": str(store_path), "database": database},
            "run": {"collectors": ["dcgm"], "status_interval_s": 0},
            "writer": {"spool_dir": str(tmp_path / "spool"), "flush_interval_s": 0.2},
            "dcgm": {"interval_s": 0.3, "http": {"timeout_s": 1.0}, "urls": [s.url("/slow"), s.url("/good")]},
        }
        daemon = Daemon(config)
        daemon.start()
        try:
            time.sleep(1.5)
        finally:
            t0 = time.monotonic()
            summary = daemon.shutdown()
            stopping = time.monotonic() - t0
    with open_store(config) as check:
        rows = check.query(f"SELECT host, state, count() FROM {database}.gpu_samples GROUP BY host, state "
                           "ORDER BY host").rows
        check.command(f"DROP DATABASE IF EXISTS {database}")
    counters = summary["collectors"]["dcgm"]
    assert stopping < 1.0 + 1.5 + 1.0, stopping  # the loop's collect, then one bounded last collect
    by_host = {(h, st): n for h, st, n in rows}
    assert by_host[("gpu-node-1", "ok")] >= 16 and by_host[("127.0.0.1", "unreachable")] >= 2
    assert counters["errors"] >= 2 and "timed out" in counters["last_error"]
