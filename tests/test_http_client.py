"""The one scraper client config (``[<section>.http]``) and the one target pool."""

from __future__ import annotations

import logging
import threading
import time

import pytest

from triscope.collectors.blockio.config import BlockioConfig
from triscope.collectors.dcgm.config import DcgmConfig
from triscope.collectors.serving_metrics.targets import ServingMetricsConfig
from triscope.errors import ConfigError
from triscope.target_pool import GRACE_S, TargetPool

URLS = ["http://a:9400/metrics"]


def test_every_scraper_reads_its_http_sub_table_with_its_own_defaults() -> None:
    assert (DcgmConfig.from_config({"dcgm": {"urls": URLS}}).http.timeout_s,
            ServingMetricsConfig.from_config({}).http.timeout_s, BlockioConfig.from_config({}).http.timeout_s) \
        == (2.0, 3.0, 5.0)
    cfg = DcgmConfig.from_config({"dcgm": {"urls": URLS, "http": {"timeout_s": 0.5, "redirects": "any"}}})
    assert (cfg.http.timeout_s, cfg.http.max_body_bytes, cfg.http.allow_redirects) == (0.5, 8 << 20, "any")
    assert BlockioConfig.from_config({"blockio": {"http": {"max_body_bytes": 1024}}}).http.max_body_bytes == 1024


@pytest.mark.parametrize(("section", "message"), [
    ({"http": {"timout_s": 1}}, r"^\[dcgm.http\] has unknown keys: timout_s \(known: max_body_bytes, max_parallel, "
                                r"redirects, timeout_s\)$"),
    ({"http": {"timeout_s": "fast"}}, r"^\[dcgm.http\] has a bad value for timeout_s: must be a number, got 'fast'$"),
    ({"http": {"timeout_s": 0}}, r"^\[dcgm.http\] timeout_s must be > 0, got 0.0$"),
    ({"http": ["x"]}, r"^\[dcgm.http\] must be a table"),
])
def test_http_mistakes_are_one_line_naming_the_sub_table(section: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        DcgmConfig.from_config({"dcgm": {"urls": URLS, **section}})


def test_the_old_flat_keys_still_work_with_a_warning_and_the_sub_table_wins(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        cfg = ServingMetricsConfig.from_config({"serving_metrics": {"timeout_s": 1.5, "max_parallel": 4,
                                                                    "http": {"max_parallel": 2}}})
        blockio = BlockioConfig.from_config({"blockio": {"max_body_bytes": 4096}})
    assert (cfg.http.timeout_s, cfg.http.max_parallel, blockio.http.max_body_bytes) == (1.5, 2, 4096)
    assert "[serving_metrics] timeout_s is deprecated; use [serving_metrics.http] timeout_s" in caplog.text
    assert "[blockio] max_body_bytes is deprecated; use [blockio.http] max_body_bytes" in caplog.text


def test_the_pool_bounds_a_collect_and_never_fetches_a_busy_target_twice() -> None:
    release = threading.Event()
    calls: list[str] = []

    def fetch(key: str) -> str:
        calls.append(key)
        if key == "slow":
            release.wait(10)
        return key

    pool: TargetPool[str] = TargetPool("test", max_parallel=2, timeout_s=0.2)
    try:
        t0 = time.monotonic()
        first = pool.run({k: (lambda k=k: fetch(k)) for k in ("slow", "good")})
        assert time.monotonic() - t0 < 0.2 + GRACE_S + 0.5
        assert first["good"] is not None and first["good"].result() == "good"
        assert first["slow"] is not None and not first["slow"].done()
        second = pool.run({k: (lambda k=k: fetch(k)) for k in ("slow", "good")})
        assert second["slow"] is None and second["good"] is not None
        assert calls.count("slow") == 1 and calls.count("good") == 2
    finally:
        release.set()
        pool.close()
