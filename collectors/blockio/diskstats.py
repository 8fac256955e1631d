"""The /proc/diskstats collector: mean latency per op and queue depth per device, from successive snapshots."""

from __future__ import annotations

import logging
import math
import socket
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from triscope.collectors.blockio.config import BlockioConfig, blockio_config
from triscope.collectors.blockio.diskstats_parse import DiskStat, diskstats_delta, parse_diskstats
from triscope.schema import IO_LATENCY, Table, encode_ts

log = logging.getLogger(__name__)


class DiskstatsCollector:
    """Average latency and queue depth per device from successive /proc/diskstats snapshots (no p50/p99)."""

    name = "blockio_diskstats"

    def __init__(self, config: Mapping[str, Any] | BlockioConfig | None = None,
                 path: str = "/proc/diskstats") -> None:
        cfg = blockio_config(config)
        self.interval_s = cfg.interval_s
        self.host = cfg.host or socket.gethostname()
        self.path = path
        self._prev: tuple[int, dict[str, DiskStat]] | None = None

    def _snap(self) -> tuple[int, dict[str, DiskStat]]:
        return time.time_ns(), parse_diskstats(Path(self.path).read_text())

    def start(self) -> None:
        self._prev = self._snap()

    def collect(self) -> dict[Table, dict[str, list[Any]]]:
        """Rows of the window since the last read. A failed read (EMFILE, a malformed file) raises: the
        collector loop counts every one and logs each new message once."""
        now = self._snap()
        if self._prev is None:
            self._prev = now
            return {}
        (t0, before), (t1, after) = self._prev, now
        self._prev = now
        window = (t1 - t0) / 1e9
        ts = encode_ts(t0)
        rows = [{"ts": ts, "host": self.host, "device": d.device, "source": "diskstats", "op": d.op,
                 "window_seconds": window, "ios": d.ios, "p50_seconds": math.nan, "p99_seconds": math.nan,
                 "mean_seconds": d.mean_seconds, "queue_depth": d.queue_depth}
                for d in diskstats_delta(before, after, window) if d.ios or d.queue_depth]
        return {IO_LATENCY: IO_LATENCY.columns_of(rows)} if rows else {}

    def close(self) -> None:
        self._prev = None
