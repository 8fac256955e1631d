"""The ebpf_exporter collector: scrapes its bio latency histograms; rows from bucket deltas between scrapes."""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Mapping
from typing import Any

from triscope.collectors.blockio.assembler import hist_row
from triscope.collectors.blockio.config import BlockioConfig, blockio_config
from triscope.collectors.blockio.parse import Bucket, parse_ebpf_exporter
from triscope.schema import IO_LATENCY, Table

log = logging.getLogger(__name__)


class EbpfExporterCollector:
    """Scrapes ``[blockio] url`` (ebpf_exporter's ``bio_latency_seconds`` histograms) every interval."""

    name = "blockio_ebpf_exporter"

    def __init__(self, config: Mapping[str, Any] | BlockioConfig | None = None) -> None:
        cfg = blockio_config(config)
        self.interval_s = cfg.interval_s
        self.url = cfg.url
        self.http = cfg.http
        self.host = cfg.host or socket.gethostname()
        self._prev: tuple[int, dict[tuple[str, str], list[Bucket]]] | None = None

    def start(self) -> None:
        """Nothing held: each collect() is one GET."""

    def fetch(self) -> str:
        """The exposition within ``[blockio.http]`` timeout_s (5 s) in total and max_body_bytes; InputError
        (one line) otherwise."""
        return self.http.get(self.url).decode("utf-8", errors="replace")

    def rows_from_text(self, text: str, ts_ns: int) -> dict[str, list[Any]]:
        """Rows (every io_latency column) for the window since the previous scrape; none on the first one."""
        cur = {(h.device, h.op): h.buckets for h in parse_ebpf_exporter(text)}
        rows = []
        if self._prev is not None:
            t0, prev = self._prev
            for (dev, op), bs in cur.items():
                old = {(b.lo, b.hi): b.count for b in prev.get((dev, op), [])}
                delta = [Bucket(b.lo, b.hi, max(b.count - old.get((b.lo, b.hi), 0.0), 0.0)) for b in bs]
                if sum(b.count for b in delta) > 0:
                    rows.append(hist_row(t0, self.host, "ebpf_exporter", dev, op, (ts_ns - t0) / 1e9, delta))
        self._prev = (ts_ns, cur)
        return IO_LATENCY.columns_of(rows)

    def collect(self) -> dict[Table, dict[str, list[Any]]]:
        """One scrape's rows; a failure raises (one line) for the collector loop to count and log once."""
        rows = self.rows_from_text(self.fetch(), time.time_ns())
        return {IO_LATENCY: rows} if rows["ts"] else {}

    def close(self) -> None:
        self._prev = None
