"""Stall breakdown: compute-, IO- and comm-bound shares of windows, with their evidence.

Windows are 100 ms while the panel's interval (``$__interval_s``) is at most 1 s and the interval
rounded up to a multiple of 10 s beyond (:func:`~triscope.dashboards.rollup_sql.window_ns`): a rule
holds for a window when it holds for the window's means, so a wider window is a coarser resolution
of the same rule, whose GPU means come from the 10 s or 1 min rollup (equal to the raw means; only
the range's first and last windows may hold part of a bucket outside the range).

The rules and thresholds are the stall classifier's defaults (:class:`StallsConfig`), evaluated
in SQL per window so Grafana can chart them:

* compute: GPU-sample window with mean SM activity > 95% and the measured L2 / DRAM bandwidth
  ratios < 60% (a bandwidth the GPU does not report is not held against it);
* IO: the window's host has a block device whose read p99 > 1200 us and queue depth > 64 in an
  ``io_latency`` row covering the window (``op`` read, or all);
* comm: a traced rank's window in which NCCL / collective kernel time (kernel_class = comm,
  each kernel split over the windows it spans) is > 85% of the window.

Each share has its own denominator (GPU-sample windows; GPU-sample windows of hosts with IO data;
traced windows with GPU work). ``triscope diagnose`` gives the single verdict per window
(precedence comm > compute > io > host > idle) with host-bound and idle classes as well.
"""

from __future__ import annotations

from triscope.analyzers.stalls import StallsConfig
from triscope.dashboards.common import DATABASE, GPU_FILTER, cond, gpu_var, host_var, t
from triscope.dashboards.model import Board, bargauge, link, row, sql_target, table, text, timeseries
from triscope.dashboards.rollup_sql import gauge_windows, window_bucket, window_ns
from triscope.schema import GPU_SAMPLES, IO_LATENCY, NCCL_OPS, TRACE_EVENTS, TRACE_RUNS
from triscope.schema.gpu import GPU_SAMPLES_1M, GPU_SAMPLES_10S

UID = "triscope-stalls"
IO_UID = "triscope-io"
NCCL_UID = "triscope-nccl"
FLEET_UID = "triscope-fleet"
HEATMAP_UID = "triscope-heatmap"
C = StallsConfig()
WINDOW_MS = 100
FINE_NS = WINDOW_MS * 1_000_000
WNS = window_ns(FINE_NS)
"""The window width (SQL): 100 ms while the panel's interval is at most 1 s, else the interval rounded up
to a multiple of 10 s."""


def _g(x: float) -> str:
    return repr(float(x))


def _wtime(col: str = "w") -> str:
    """The time a window is plotted at (grouped by the interval when finer than it)."""
    return window_bucket(col, FINE_NS)


GPU_WINDOWS = f"""
  gpu_w AS (
    SELECT host, gpu, w, sm, dram, l2,
           isFinite(sm) AND sm > {_g(C.compute_sm_active_min)}
             AND (NOT isFinite(l2) OR l2 < {_g(C.compute_bandwidth_max)})
             AND (NOT isFinite(dram) OR dram < {_g(C.compute_bandwidth_max)}) AS compute_bound
    FROM ({gauge_windows((GPU_SAMPLES_10S, GPU_SAMPLES_1M), {"host": "toString(host)", "gpu": "gpu"},
                         {"sm": "sm_active_ratio", "dram": "dram_active_ratio", "l2": "l2_bandwidth_ratio"},
                         GPU_FILTER, FINE_NS)})
  )"""

IO_WINDOWS = f"""
  io_rows AS (
    SELECT toString(host) AS host, toString(device) AS device, toUnixTimestamp64Nano(ts) AS t0,
           t0 + toInt64(round(greatest(window_seconds, 0) * 1e6)) * 1000 AS t1,
           p99_seconds > {_g(C.io_read_p99_min_seconds)} AND queue_depth > {_g(C.io_queue_depth_min)} AS bound
    FROM {t(IO_LATENCY)}
    WHERE ts >= $__fromTime - INTERVAL 1 HOUR AND ts <= $__toTime AND op IN ('read', 'all')
      AND {cond('host', 'host')}
  ),
  io_w AS (
    SELECT host, w, max(bound) AS io_bound FROM (
      SELECT host, bound, arrayJoin(range(intDiv(t0, {WNS}), intDiv(greatest(t1, t0 + 1) - 1, {WNS}) + 1)) AS w
      FROM io_rows)
    GROUP BY host, w
  )"""

COMM_WINDOWS = f"""
  runs AS (
    SELECT run_id, rank, argMax(host, ingested_at) AS host, argMax(base_time_ns, ingested_at) AS base
    FROM {t(TRACE_RUNS)} GROUP BY run_id, rank
  ),
  kernels AS (
    SELECT toString(e.run_id) AS run_id, e.rank AS rank, r.host AS host,
           e.ts_ns + r.base AS k0, e.ts_ns + e.dur_ns + r.base AS k1, e.kernel_class = 'comm' AS is_comm
    FROM {t(TRACE_EVENTS)} AS e INNER JOIN runs AS r ON toString(e.run_id) = r.run_id AND e.rank = r.rank
    WHERE e.kind IN ('kernel', 'memcpy', 'memset') AND e.dur_ns > 0
      AND e.ts_ns + e.dur_ns + r.base >= toInt64(toUnixTimestamp($__fromTime)) * 1000000000
      AND e.ts_ns + r.base <= toInt64(toUnixTimestamp($__toTime)) * 1000000000
      AND {cond('r.host', 'host')} AND {cond('toString(e.device)', 'gpu')}
  ),
  comm_w AS (
    SELECT run_id, rank, any(host) AS host, w,
           least(1.0, sumIf(least(k1, (w + 1) * {WNS}) - greatest(k0, w * {WNS}), is_comm) / {WNS}) AS comm_share,
           comm_share > {_g(C.comm_share_min)} AS comm_bound
    FROM (SELECT *, arrayJoin(range(intDiv(k0, {WNS}), intDiv(k1 - 1, {WNS}) + 1)) AS w FROM kernels)
    GROUP BY run_id, rank, w
  )"""


def _with(*ctes: str) -> str:
    return "WITH" + ",".join(ctes) + "\n"


def shares_sql() -> str:
    """One row per signal: its share over the time range (bar gauge). compute and io in one pass over
    the GPU windows (io over those whose host had an IO window: window numbers are positive)."""
    return _with(GPU_WINDOWS, IO_WINDOWS, COMM_WINDOWS) + """
SELECT signal, share FROM (
  SELECT signal, share, o FROM (
    SELECT avg(compute_bound) AS compute, avgIf(io_w.io_bound, io_w.w > 0) AS io
    FROM gpu_w LEFT JOIN io_w ON gpu_w.host = io_w.host AND gpu_w.w = io_w.w)
  ARRAY JOIN ['compute', 'io'] AS signal, [compute, io] AS share, [1, 2] AS o
  UNION ALL
  SELECT 'comm' AS signal, avg(comm_bound) AS share, 3 AS o FROM comm_w
) ORDER BY o"""


def board() -> Board:
    """The stall-breakdown dashboard."""
    variables = [DATABASE, host_var(GPU_SAMPLES, IO_LATENCY, NCCL_OPS), gpu_var()]
    panels = [
        text("Rules", f"Windows of {WINDOW_MS} ms while the panel's interval is at most 1 s, else of the "
             "interval rounded up to a multiple of 10 s (GPU means from the 10 s / 1 min rollup). "
             f"**compute**: SM active > {C.compute_sm_active_min:.0%} with "
             f"L2 / DRAM bandwidth < {C.compute_bandwidth_max:.0%} of peak. **IO**: block-IO read p99 > "
             f"{C.io_read_p99_min_seconds * 1e6:g} us and queue depth > {C.io_queue_depth_min:g}. **comm**: "
             f"collective kernel time > {C.comm_share_min:.0%} of the window. Exact per-window verdicts with "
             "evidence: `triscope diagnose --since 10m`.", h=2),
        row("Shares"),
        bargauge("Stall shares over the range", [sql_target(shares_sql(), table=True)],
                 "compute: of GPU-sample windows; io: of GPU-sample windows on hosts with IO data; "
                 "comm: of traced windows with GPU work", unit="percentunit",
                 thresholds=[(None, "green"), (0.25, "orange"), (0.5, "red")], w=8),
        timeseries("Compute-bound share", [sql_target(_with(GPU_WINDOWS) + f"""
SELECT {_wtime()} AS time, host, toString(gpu) AS gpu, avg(compute_bound) AS compute_bound_share
FROM gpu_w GROUP BY time, host, gpu ORDER BY time, host, gpu""")],
            "share of the GPU's windows that were compute-bound", unit="percentunit",
            links=[link("Fleet view of ${__field.labels.host} GPU ${__field.labels.gpu}", FLEET_UID,
                        {"host": "${__field.labels.host}", "gpu": "${__field.labels.gpu}"})], w=16),
        timeseries("IO-bound share", [sql_target(_with(GPU_WINDOWS, IO_WINDOWS) + f"""
SELECT {_wtime('gpu_w.w')} AS time, gpu_w.host AS host, avg(io_w.io_bound) AS io_bound_share
FROM gpu_w INNER JOIN io_w ON gpu_w.host = io_w.host AND gpu_w.w = io_w.w
GROUP BY time, host ORDER BY time, host""")],
            "share of the host's GPU windows with an IO-bound device",
            unit="percentunit",
            links=[link("IO of ${__field.labels.host}", IO_UID, {"host": "${__field.labels.host}"})]),
        timeseries("Comm-bound share", [sql_target(_with(COMM_WINDOWS) + f"""
SELECT {_wtime()} AS time, run_id, toString(rank) AS rank, avg(comm_bound) AS comm_bound_share
FROM comm_w GROUP BY time, run_id, rank ORDER BY time, run_id, rank""")],
            "share of the rank's traced windows that were comm-bound", unit="percentunit",
            links=[link("NCCL view of ${__field.labels.run_id}", NCCL_UID, {"run_id": "${__field.labels.run_id}"})]),
        row("Evidence"),
        timeseries("SM activity and memory bandwidth", [sql_target(_with(GPU_WINDOWS) + f"""
SELECT {_wtime()} AS time, host, toString(gpu) AS gpu,
       avgIf(sm, isFinite(sm)) AS sm_active_ratio, avgIf(dram, isFinite(dram)) AS dram_active_ratio,
       avgIf(l2, isFinite(l2)) AS l2_bandwidth_ratio
FROM gpu_w GROUP BY time, host, gpu ORDER BY time, host, gpu""")],
            "compute-bound needs SM above the red line and bandwidth below the orange one", unit="percentunit",
            thresholds=[(None, "green"), (C.compute_bandwidth_max, "orange"), (C.compute_sm_active_min, "red")],
            w=8),
        timeseries("Block-IO read p99", [sql_target(f"""
SELECT $__timeInterval(ts) AS time, toString(host) AS host, toString(device) AS device, \
max(p99_seconds) AS read_p99_seconds
FROM {t(IO_LATENCY)} WHERE $__timeFilter(ts) AND op IN ('read', 'all') AND {cond('host', 'host')}
GROUP BY time, host, device ORDER BY time, host, device""")],
            "threshold: the IO rule's read p99", unit="s",
            thresholds=[(None, "green"), (C.io_read_p99_min_seconds, "red")],
            links=[link("IO of ${__field.labels.host}", IO_UID, {"host": "${__field.labels.host}",
                                                                  "device": "${__field.labels.device}"})], w=8),
        timeseries("Block-IO queue depth", [sql_target(f"""
SELECT $__timeInterval(ts) AS time, toString(host) AS host, toString(device) AS device, max(queue_depth) AS queue_depth
FROM {t(IO_LATENCY)} WHERE $__timeFilter(ts) AND op IN ('read', 'all') AND {cond('host', 'host')}
GROUP BY time, host, device ORDER BY time, host, device""")],
            "threshold: the IO rule's queue depth", unit="short",
            thresholds=[(None, "green"), (C.io_queue_depth_min, "red")], w=8),
        row("Drill down"),
        table("GPUs by stall share", [sql_target(_with(GPU_WINDOWS, IO_WINDOWS) + """
SELECT gpu_w.host AS host, toString(gpu_w.gpu) AS gpu, count() AS windows,
       avg(compute_bound) AS compute_bound_share, avgIf(io_w.io_bound, io_w.w > 0) AS io_bound_share,
       avgIf(sm, isFinite(sm)) AS sm_active_ratio, avgIf(dram, isFinite(dram)) AS dram_active_ratio,
       avgIf(l2, isFinite(l2)) AS l2_bandwidth_ratio
FROM gpu_w LEFT JOIN io_w ON gpu_w.host = io_w.host AND gpu_w.w = io_w.w
GROUP BY host, gpu ORDER BY compute_bound_share + io_bound_share DESC, host, gpu""", table=True)],
            "click a host for its block IO, a GPU for its traffic and memory",
            column_links={
                "host": [link("IO of ${__data.fields.host}", IO_UID, {"host": "${__data.fields.host}"})],
                "gpu": [link("Fleet view of ${__data.fields.host} GPU ${__data.fields.gpu}", FLEET_UID,
                             {"host": "${__data.fields.host}", "gpu": "${__data.fields.gpu}"}),
                        link("Heatmap of ${__data.fields.host}", HEATMAP_UID, {"host": "${__data.fields.host}"})],
            },
            column_units={c: "percentunit" for c in ("compute_bound_share", "io_bound_share", "sm_active_ratio",
                                                      "dram_active_ratio", "l2_bandwidth_ratio")}, w=12),
        table("Ranks by comm share", [sql_target(_with(COMM_WINDOWS) + """
SELECT run_id, rank, any(host) AS host, count() AS traced_windows, avg(comm_share) AS mean_comm_share,
       avg(comm_bound) AS comm_bound_share
FROM comm_w GROUP BY run_id, rank ORDER BY comm_bound_share DESC, run_id, rank""", table=True)],
            "click a run for its collectives and stragglers",
            column_links={"run_id": [link("NCCL view of ${__data.fields.run_id}", NCCL_UID,
                                          {"run_id": "${__data.fields.run_id}"})]},
            column_units={"mean_comm_share": "percentunit", "comm_bound_share": "percentunit"}, w=12),
    ]
    return Board(UID, "triscope / stall breakdown", "Compute-, IO- and comm-bound shares of GPU time with the "
                 "evidence behind them; drill down by host and GPU.", variables, panels, tags=["stalls"])
