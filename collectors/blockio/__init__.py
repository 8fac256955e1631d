"""Block-IO latency collectors for ``io_latency``: bpftrace (tracepoints), /proc/diskstats, ebpf_exporter.

Registry names (triscope/registry.py): ``blockio`` / ``blockio_bpftrace`` -> :func:`create`
(bpftrace as root, else the diskstats fallback), ``blockio_diskstats`` -> :func:`create_diskstats`,
``blockio_ebpf_exporter`` -> :func:`create_ebpf_exporter`; config section ``[blockio]``
(:class:`BlockioConfig`). What each source measures and how it is checked: docs/blockio.md.
"""

from __future__ import annotations

import logging
from typing import Any

from triscope.collectors.blockio.assembler import WindowAssembler, hist_row
from triscope.collectors.blockio.bpftrace import (
    BpftraceCollector,
    bpf_recursion_misses,
    bpftrace_unavailable_reason,
    has_tracepoint,
    mount_tracefs,
)
from triscope.collectors.blockio.config import BlockioConfig, BlockioConfigError
from triscope.collectors.blockio.devices import device_for_path, device_name
from triscope.collectors.blockio.diskstats import DiskstatsCollector
from triscope.collectors.blockio.ebpf_exporter import EbpfExporterCollector
from triscope.collectors.blockio.program import AHEAD, BUFFERS, CONTROL_MAGIC_BASE, MAP_KEYS_MAX, bpftrace_program
from triscope.component import Context

__all__ = ["AHEAD", "BUFFERS", "CONTROL_MAGIC_BASE", "MAP_KEYS_MAX", "RESTART_AT_MAP_KEYS", "BlockioConfig",
           "BlockioConfigError", "BpftraceCollector", "DiskstatsCollector", "EbpfExporterCollector",
           "WindowAssembler", "bpf_recursion_misses", "bpftrace_program", "bpftrace_unavailable_reason", "create",
           "create_diskstats", "create_ebpf_exporter", "device_for_path", "device_name", "has_tracepoint",
           "hist_row", "mount_tracefs"]

log = logging.getLogger(__name__)

RESTART_AT_MAP_KEYS = BlockioConfig.restart_at_map_keys
"""Default ``[blockio] restart_at_map_keys``."""


def create(config: dict[str, Any], context: Context) -> BpftraceCollector | DiskstatsCollector:
    """The bpftrace collector, or the diskstats fallback with a one-line log saying why."""
    cfg = BlockioConfig.from_config(config)
    reason = bpftrace_unavailable_reason()
    if reason:
        log.warning("blockio: %s; falling back to /proc/diskstats (mean latency only, no p50/p99)", reason)
        return DiskstatsCollector(cfg)
    return BpftraceCollector(cfg)


def create_diskstats(config: dict[str, Any], context: Context) -> DiskstatsCollector:
    """The /proc/diskstats collector."""
    return DiskstatsCollector(BlockioConfig.from_config(config))


def create_ebpf_exporter(config: dict[str, Any], context: Context) -> EbpfExporterCollector:
    """The ebpf_exporter scrape collector (``[blockio] url``)."""
    return EbpfExporterCollector(BlockioConfig.from_config(config))
