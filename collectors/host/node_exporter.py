"""The host's pressure and OOM kills from a prometheus-node-exporter, where users already run one.

node-exporter's ``pressure`` collector exports the same PSI totals as ``/proc/pressure`` (seconds:
``node_pressure_cpu_waiting_seconds_total`` is ``cpu some``, ``..._stalled_...`` is ``full``) and its
``vmstat`` collector the kernel's ``oom_kill`` counter; ``node_uname_info`` names the host. Reading
them from node-exporter lets a daemon that cannot see the host's ``/proc`` (a container, another
machine) still say when the host was under pressure.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from triscope.http_client import HttpClientConfig
from triscope.prom_text import parse_exposition

# node-exporter family -> the key procfs.psi_totals() uses for the same total.
PSI_FAMILIES = {
    "node_pressure_cpu_waiting_seconds_total": "cpu_some",
    "node_pressure_memory_waiting_seconds_total": "memory_some",
    "node_pressure_memory_stalled_seconds_total": "memory_full",
    "node_pressure_io_waiting_seconds_total": "io_some",
    "node_pressure_io_stalled_seconds_total": "io_full",
}
OOM_FAMILY = "node_vmstat_oom_kill"
UNAME_FAMILY = "node_uname_info"


@dataclass
class NodeReading:
    """One scrape: cumulative PSI seconds, the OOM-kill counter (NaN when not exported), the host name."""
    psi: dict[str, float] = field(default_factory=dict)
    oom_kills: float = math.nan
    nodename: str = ""


def parse_node_page(text: str, source: str = "node-exporter") -> NodeReading:
    """The PSI totals, OOM kills and node name of a node-exporter page (InputError when it is not one)."""
    wanted = [*PSI_FAMILIES, OOM_FAMILY, UNAME_FAMILY]
    series = parse_exposition(text, source, wanted)
    reading = NodeReading()
    for family, key in PSI_FAMILIES.items():
        samples = series.get(family)
        if samples:
            reading.psi[key] = samples[0][1]
    if series.get(OOM_FAMILY):
        reading.oom_kills = series[OOM_FAMILY][0][1]
    if series.get(UNAME_FAMILY):
        reading.nodename = series[UNAME_FAMILY][0][0].get("nodename", "")
    return reading


def scrape(url: str, http: HttpClientConfig) -> NodeReading:
    """GET (the scraper client ``http``) and parse ``url``; InputError (one line) on any failure."""
    body = http.get(url)
    return parse_node_page(body.decode("utf-8", "replace"), url)


__all__ = ["NodeReading", "parse_node_page", "scrape"]
