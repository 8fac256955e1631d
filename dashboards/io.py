"""Block IO: read / write p99 latency, queue depth and IOPS per host and device (io_latency)."""

from __future__ import annotations

from triscope.analyzers.stalls import StallsConfig
from triscope.dashboards.common import DATABASE, conds, distinct, host_var, t
from triscope.dashboards.model import Board, Variable, link, row, sql_target, table, timeseries
from triscope.schema import IO_LATENCY

UID = "triscope-io"
STALLS_UID = "triscope-stalls"
IO = t(IO_LATENCY)
FILTER = conds([("host", "host"), ("device", "device")])
P99_MIN = StallsConfig().io_read_p99_min_seconds
QD_MIN = StallsConfig().io_queue_depth_min


def _series(metric: str, alias: str, ops: str) -> str:
    return f"""
SELECT $__timeInterval(ts) AS time, toString(host) AS host, toString(device) AS device, {metric} AS {alias}
FROM {IO} WHERE $__timeFilter(ts) AND op IN ({ops}) AND {FILTER}
GROUP BY time, host, device ORDER BY time, host, device"""


def board() -> Board:
    """The block-IO dashboard."""
    variables = [DATABASE, host_var(IO_LATENCY),
                 Variable("device", "Device", distinct("device", [IO_LATENCY], [("host", "host")]))]
    stall_link = [link("Stalls on ${__field.labels.host}", STALLS_UID, {"host": "${__field.labels.host}"})]
    panels = [
        row("Latency"),
        timeseries("Read p99", [sql_target(_series("max(p99_seconds)", "read_p99_seconds", "'read'"))],
                   f"IO-bound when read p99 > {P99_MIN * 1e6:g} us and queue depth > {QD_MIN:g}", unit="s",
                   thresholds=[(None, "green"), (P99_MIN, "red")], links=stall_link),
        timeseries("Write p99", [sql_target(_series("max(p99_seconds)", "write_p99_seconds", "'write'"))],
                   "write completions", unit="s", links=stall_link),
        timeseries("Queue depth", [sql_target(_series("max(queue_depth)", "queue_depth", "'read', 'write', 'all'"))],
                   "requests in flight (mean over each source window, max over ops)", unit="short",
                   thresholds=[(None, "green"), (QD_MIN, "red")], links=stall_link),
        timeseries("IOPS", [sql_target(f"""
SELECT $__timeInterval(ts) AS time, toString(host) AS host, toString(device) AS device, toString(op) AS op,
       sum(ios) / $__interval_s AS iops
FROM {IO} WHERE $__timeFilter(ts) AND {FILTER} GROUP BY time, host, device, op ORDER BY time, host, device, op""")],
                   "completed requests per second", unit="iops", links=stall_link),
        row("Devices"),
        table("Devices", [sql_target(f"""
SELECT toString(host) AS host, toString(device) AS device, any(toString(source)) AS source,
       maxIf(p99_seconds, op IN ('read', 'all')) AS read_p99_max_seconds,
       maxIf(p99_seconds, op = 'write') AS write_p99_max_seconds, max(queue_depth) AS queue_depth_max,
       avgIf(p99_seconds > {P99_MIN!r} AND queue_depth > {QD_MIN!r}, op IN ('read', 'all')) AS io_bound_share
FROM {IO} WHERE $__timeFilter(ts) AND {FILTER}
GROUP BY host, device ORDER BY io_bound_share DESC, read_p99_max_seconds DESC""", table=True)],
              "share of read windows past both IO thresholds; click a host for its stall breakdown",
              column_links={"host": [link("Stalls on ${__data.fields.host}", STALLS_UID,
                                          {"host": "${__data.fields.host}"})],
                            "device": [link("Only ${__data.fields.device}", UID,
                                            {"host": "${__data.fields.host}", "device": "${__data.fields.device}"})]},
              column_units={"read_p99_max_seconds": "s", "write_p99_max_seconds": "s",
                            "io_bound_share": "percentunit"}),
    ]
    return Board(UID, "triscope / block IO", "Read / write tail latency, queue depth and IOPS per device; drill "
                 "down by host and device.", variables, panels, tags=["io"])
