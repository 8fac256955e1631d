"""NCCL / collectives: bus bandwidth, collective time, stragglers, Flight Recorder state.

Stragglers follow :func:`triscope.analyzers.nccl_crossrank.stragglers`: a collective is one
(run, source, communicator, collective, seq, host-side) seen by >= 2 ranks (Kineto and Flight
Recorder rows, no p2p); each rank's arrival is its earliest ``ts`` for it; the straggler is the
last rank to arrive and its lateness is latest - earliest arrival (counted from 1 ms).
"""

from __future__ import annotations

from triscope.dashboards.common import DATABASE, conds, distinct, host_var, t
from triscope.dashboards.model import Board, Variable, bargauge, link, row, sql_target, table, timeseries
from triscope.schema import NCCL_OPS

UID = "triscope-nccl"
STALLS_UID = "triscope-stalls"
OPS = t(NCCL_OPS)
FILTER = conds([("host", "host"), ("run_id", "run_id"), ("collective", "collective")])
MIN_LATENESS_S = 0.001


def _arrivals(extra: str = "") -> str:
    return f"""
SELECT run_id, source, comm_id, collective, seq, host_side,
       argMax(rank, first_ns) AS straggler_rank, argMax(h, first_ns) AS straggler_host,
       (max(first_ns) - min(first_ns)) / 1e9 AS lateness_seconds, count() AS ranks
FROM (
  SELECT toString(run_id) AS run_id, toString(source) AS source, comm_id, toString(collective) AS collective, seq,
         device < 0 AS host_side, rank, any(toString(host)) AS h, min(toUnixTimestamp64Nano(ts)) AS first_ns
  FROM {OPS}
  WHERE $__timeFilter(ts) AND source IN ('kineto', 'flight_recorder') AND seq >= 0 AND is_p2p = 0 AND rank >= 0
    AND {FILTER}{extra}
  GROUP BY run_id, source, comm_id, collective, seq, host_side, rank
)
GROUP BY run_id, source, comm_id, collective, seq, host_side HAVING ranks >= 2"""


def stragglers_sql() -> str:
    """Per (run, straggler rank): times last, total and max lateness."""
    return f"""
SELECT run_id, straggler_rank AS rank, any(straggler_host) AS host, count() AS times_last,
       sum(lateness_seconds) AS total_lateness_seconds, max(lateness_seconds) AS max_lateness_seconds
FROM ({_arrivals()})
WHERE lateness_seconds >= {MIN_LATENESS_S!r}
GROUP BY run_id, rank ORDER BY total_lateness_seconds DESC, rank"""


def board() -> Board:
    """The NCCL dashboard."""
    variables = [
        DATABASE, host_var(NCCL_OPS),
        Variable("run_id", "Run", distinct("run_id", [NCCL_OPS], [("host", "host")])),
        Variable("collective", "Collective", distinct("collective", [NCCL_OPS],
                                                       [("host", "host"), ("run_id", "run_id")])),
    ]
    where = f"$__timeFilter(ts) AND {FILTER}"
    panels = [
        row("Bandwidth and time"),
        timeseries("Bus bandwidth by collective", [sql_target(f"""
SELECT $__timeInterval(ts) AS time, toString(collective) AS collective,
       avgIf(busbw_bytes_per_second, isFinite(busbw_bytes_per_second) AND busbw_bytes_per_second > 0) AS busbw
FROM {OPS} WHERE {where} AND isFinite(busbw_bytes_per_second) AND busbw_bytes_per_second > 0
GROUP BY time, collective ORDER BY time, collective""")],
            "algbw x the nccl-tests bus factor (Kineto kernels, Inspector, nccl-tests)", unit="Bps"),
        timeseries("Collective time p99", [sql_target(f"""
SELECT $__timeInterval(ts) AS time, toString(collective) AS collective,
       quantileIf(0.99)(duration_seconds, isFinite(duration_seconds)) AS p99_duration_seconds
FROM {OPS} WHERE {where} AND isFinite(duration_seconds)
GROUP BY time, collective ORDER BY time, collective""")], "per-rank execution time", unit="s"),
        table("nccl-tests: bus bandwidth by size", [sql_target(f"""
SELECT toString(collective) AS collective, msg_bytes, toString(variant) AS variant, count() AS rows,
       max(busbw_bytes_per_second) AS busbw_max, avg(algbw_bytes_per_second) AS algbw_mean,
       max(wrong_count) AS wrong
FROM {OPS} WHERE {where} AND source = 'nccl_tests'
GROUP BY collective, msg_bytes, variant ORDER BY collective, msg_bytes, variant""", table=True)],
            "one row per message size and variant", column_units={
                "msg_bytes": "bytes", "busbw_max": "Bps", "algbw_mean": "Bps"}, w=12),
        bargauge("Operations per source", [sql_target(f"""
SELECT toString(source) AS source, count() AS ops FROM {OPS} WHERE {where} GROUP BY source ORDER BY ops DESC""",
            table=True)], "Kineto, Inspector, Flight Recorder, nccl-tests rows", unit="short", w=12),
        row("Stragglers (who arrived last at each collective)"),
        table("Straggler ranks", [sql_target(stragglers_sql(), table=True)],
              f"collectives seen by >= 2 ranks; lateness = latest - earliest arrival, from {MIN_LATENESS_S * 1e3:g} ms",
              column_links={"host": [link("Stalls on ${__data.fields.host}", STALLS_UID,
                                          {"host": "${__data.fields.host}"})],
                            "run_id": [link("Only run ${__data.fields.run_id}", UID,
                                            {"run_id": "${__data.fields.run_id}"}, carry=["host", "collective"])]},
              column_units={"total_lateness_seconds": "s", "max_lateness_seconds": "s"}, w=12),
        table("Latest collectives", [sql_target(f"""
SELECT run_id, comm_id, collective, seq, straggler_rank, straggler_host, ranks, lateness_seconds
FROM ({_arrivals()}) ORDER BY lateness_seconds DESC, run_id, seq LIMIT 50""", table=True)],
              "the collectives with the longest wait for their last rank",
              column_units={"lateness_seconds": "s"}, w=12),
        table("Flight Recorder state", [sql_target(f"""
SELECT toString(run_id) AS run_id, comm_id, toString(pg_desc) AS pg_desc, toString(state) AS state, count() AS entries,
       uniqExact(rank) AS ranks, max(seq) AS last_seq
FROM {OPS} WHERE {where} AND source = 'flight_recorder'
GROUP BY run_id, comm_id, pg_desc, state ORDER BY run_id, comm_id, state""", table=True)],
              "entries not 'completed' are pending collectives (a hang's first suspect)", w=24),
    ]
    return Board(UID, "triscope / NCCL", "Collective bandwidth, time and stragglers; drill down by host, run and "
                 "collective.", variables, panels, tags=["nccl"])
