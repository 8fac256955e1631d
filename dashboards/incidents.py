"""Incidents: the signals ``diagnose`` judges a serving incident by, per backend over time, and the windows
where a class broke its SLO (docs/diagnose.md, "Incidents")."""

from __future__ import annotations

from triscope.analyzers.incidents import IncidentsConfig
from triscope.analyzers.routing import DEFAULT_CLASSES
from triscope.dashboards.common import DATABASE, cond, distinct, t
from triscope.dashboards.model import Board, Variable, link, row, sql_target, table, timeseries
from triscope.schema import HOST_SAMPLES, REQUESTS, SCRAPE_HEALTH, SERVING_METRICS

UID = "triscope-incidents"
FLEET_UID = "triscope-fleet"
CFG = IncidentsConfig()
REQ, SRV, HEALTH, HOST = t(REQUESTS), t(SERVING_METRICS), t(SCRAPE_HEALTH), t(HOST_SAMPLES)
BACKEND = cond("backend", "backend")
SLA_S = {name: spec["sla_ms"] / 1000.0 for name, spec in DEFAULT_CLASSES.items()}
SLA_MAP = "map(" + ", ".join(f"'{k}', {v!r}" for k, v in SLA_S.items()) + ")"
DEFAULT_SLA = SLA_S["interactive_image_text"]
SLA_OF = f"mapContains({SLA_MAP}, toString(request_class)) ? {SLA_MAP}[toString(request_class)] : {DEFAULT_SLA!r}"
FLEET_LINK = [link("Fleet view of ${__field.labels.backend}", FLEET_UID, {"backend": "${__field.labels.backend}"})]


def _per_backend(table_name: str, expr: str, alias: str, where: str = "1=1") -> str:
    return f"""
SELECT $__timeInterval(ts) AS time, toString(backend) AS backend, {expr} AS {alias}
FROM {table_name} WHERE $__timeFilter(ts) AND backend != '' AND {BACKEND} AND {where}
GROUP BY time, backend ORDER BY time, backend"""


def board() -> Board:
    """The incidents dashboard."""
    variables = [DATABASE, Variable("backend", "Backend", distinct("backend", [REQUESTS, SERVING_METRICS], []))]
    panels = [
        row("Breaches"),
        table("Windows that broke an SLO", [sql_target(f"""
SELECT toStartOfInterval(ts, INTERVAL {int(CFG.window_s)} SECOND) AS window, toString(backend) AS backend,
       toString(request_class) AS request_class, count() AS requests, countIf(status = 'error') AS failed,
       quantileExactIf(0.99)(latency_seconds, status != 'error') AS p99_seconds,
       p99_seconds / any({SLA_OF}) AS p99_over_sla
FROM {REQ} WHERE $__timeFilter(ts) AND backend != '' AND {BACKEND}
GROUP BY window, backend, request_class
HAVING (requests >= {CFG.min_requests} AND p99_over_sla > 1)
    OR (failed >= {CFG.min_requests} AND failed / requests >= {CFG.error_ratio!r})
ORDER BY window DESC, backend LIMIT 500""", table=True)],
              f"{CFG.window_s:g} s windows where a class's P99 was over its SLA or {CFG.error_ratio:.0%} of requests "
              "failed; `triscope diagnose --since` merges them into incidents and names the cause",
              column_links={"backend": [link("Fleet view of ${__data.fields.backend}", FLEET_UID,
                                             {"backend": "${__data.fields.backend}"})]},
              column_units={"p99_seconds": "s"}, w=24),
        timeseries("P99 over SLA per backend", [sql_target(f"""
SELECT $__timeInterval(ts) AS time, toString(backend) AS backend,
       max(latency_seconds / ({SLA_OF})) AS p99_over_sla
FROM (SELECT ts, backend, request_class, latency_seconds FROM {REQ}
      WHERE $__timeFilter(ts) AND backend != '' AND {BACKEND} AND status != 'error')
GROUP BY time, backend ORDER BY time, backend""")],
                   "worst request latency over its class's SLA (1 = at the SLA)", unit="short",
                   thresholds=[(None, "green"), (1.0, "red")], links=FLEET_LINK, w=12),
        timeseries("Failed requests per backend", [sql_target(_per_backend(
            REQ, "countIf(status = 'error') / $__interval_s", "failed_per_second"))],
                   "requests that ended in an error (a dead backend's requests fail here)", unit="reqps",
                   links=FLEET_LINK, w=12),
        row("What moved first"),
        timeseries("Scrape up per backend", [sql_target(_per_backend(HEALTH, "min(up)", "up"))],
                   "0 while its /metrics scrape fails: the backend is down", unit="short", links=FLEET_LINK, w=8),
        timeseries("KV usage per backend", [sql_target(_per_backend(SRV, "max(kv_cache_usage_ratio)", "kv_usage"))],
                   f"KV pressure from {CFG.kv_high:.0%}", unit="percentunit",
                   thresholds=[(None, "green"), (CFG.kv_high, "red")], links=FLEET_LINK, w=8),
        timeseries("Waiting and preemptions per backend", [
            sql_target(_per_backend(SRV, "max(queue_length)", "waiting")),
            sql_target(_per_backend(SRV, "max(preemptions_total) - min(preemptions_total)", "preemptions"), ref="B")],
                   "requests waiting in the engine; preemptions in the interval", unit="short", links=FLEET_LINK,
                   w=8),
        timeseries("Completed requests (fleet)", [sql_target(f"""
SELECT $__timeInterval(ts) AS time, count() / $__interval_s AS completed_per_second
FROM {REQ} WHERE $__timeFilter(ts) AND backend != '' AND {BACKEND} GROUP BY time ORDER BY time""")],
                   f"a jump of {CFG.qps_jump:.0%} over the baseline before a breach reads as load", unit="reqps",
                   w=8),
        timeseries("Run-queue wait per engine", [sql_target(_per_backend(
            HOST, "sum(wait_seconds) / sum(window_seconds)", "cpu_wait_ratio"))],
                   f"share of the time its threads waited for a CPU (host collector); starved from "
                   f"{CFG.cpu_wait:.0%}", unit="percentunit", thresholds=[(None, "green"), (CFG.cpu_wait, "red")],
                   links=FLEET_LINK, w=8),
        timeseries("Host pressure and OOM kills", [sql_target(f"""
SELECT $__timeInterval(ts) AS time, toString(host) AS host, max(psi_cpu_some) AS cpu, max(psi_memory_some) AS memory,
       max(psi_io_some) AS io, sum(oom_kills) AS oom_kills
FROM {HOST} WHERE $__timeFilter(ts) AND backend = '' GROUP BY time, host ORDER BY time, host""")],
                   "PSI shares (some task stalled) and OOM kills per host", unit="short", w=8),
    ]
    return Board(UID, "triscope / incidents", "Where request classes broke their SLO, and the signals that moved "
                 "before: scrape health, KV, queues, load, run-queue wait, host pressure.", variables, panels,
                 tags=["incidents"])
