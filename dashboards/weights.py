"""Routing weights: their history (``weights_history``), the live feed (Prometheus) and the inputs.

``weights_history`` (domain ``weights``) holds one row per backend per engine update: weight,
target, lb_weight, state, reasons and the four factors. The live values come from the feed's
``/metrics`` (``triscope_backend_*``). The inputs are recomputed from the store with the engine's
formulas, per GPU and per request class (finer than the history's per-backend factors): memory
penalty ``1 / max(0.05, 1 - used/total)``, KV-cache penalty, QPS and the P99 priority weight
``weight * max(1, p99/sla)^alpha`` (default classes).
"""

from __future__ import annotations

from triscope.analyzers.routing import DEFAULT_CLASSES, WeightsConfig
from triscope.dashboards.common import (
    BACKEND_FILTER,
    DATABASE,
    GPU_FILTER,
    backend_var,
    cond,
    gpu_var,
    host_var,
    request_var,
    t,
)
from triscope.dashboards.model import Board, link, prom_target, row, sql_target, table, text, timeseries
from triscope.schema import GPU_SAMPLES, REQUESTS, SERVING_METRICS, WEIGHTS_HISTORY

UID = "triscope-weights"
HEATMAP_UID = "triscope-heatmap"
FLEET_UID = "triscope-fleet"
HISTORY = t(WEIGHTS_HISTORY)
PENALTY_FLOOR = 0.05  # headroom_penalty: 1 / max(0.05, 1 - ratio)
DEFAULTS = WeightsConfig()
KV_PENALTY = (f"1 / greatest({PENALTY_FLOOR!r}, 1 - least(1, greatest(0, "
              "avgIf(kv_cache_usage_ratio, isFinite(kv_cache_usage_ratio)))))")


def _array(values: list[float]) -> str:
    return "[" + ", ".join(repr(float(v)) for v in values) + "]"


def priority_sql() -> str:
    """P99 priority weight per request class and time bucket, with the default classes' SLA / weight / alpha."""
    names = sorted(DEFAULT_CLASSES)
    quoted = "[" + ", ".join(f"'{n}'" for n in names) + "]"
    sla = _array([DEFAULT_CLASSES[n]["sla_ms"] / 1000.0 for n in names])
    weight = _array([DEFAULT_CLASSES[n]["weight"] for n in names])
    alpha = _array([DEFAULT_CLASSES[n]["alpha"] for n in names])
    return f"""
SELECT time, request_class,
       transform(request_class, {quoted}, {weight}, 1.0)
         * pow(greatest(1.0, p99 / transform(request_class, {quoted}, {sla}, 1.0)),
               transform(request_class, {quoted}, {alpha}, 1.0)) AS priority_weight
FROM (
  SELECT $__timeInterval(ts) AS time, toString(request_class) AS request_class,
         quantileIf(0.99)(latency_seconds, isFinite(latency_seconds)) AS p99
  FROM {t(REQUESTS)}
  WHERE $__timeFilter(ts) AND request_class IN {quoted} AND {BACKEND_FILTER}
    AND {cond('request_class', 'request_class')}
  GROUP BY time, request_class
)
ORDER BY time, request_class"""


def board() -> Board:
    """The routing-weights dashboard."""
    variables = [DATABASE, host_var(GPU_SAMPLES, REQUESTS, SERVING_METRICS), gpu_var(), backend_var(),
                 request_var("request_class", "Request class")]
    drain, release = DEFAULTS.drain_memory_ratio, DEFAULTS.release_memory_ratio
    panels = [
        text("Where the numbers come from", f"History: `{WEIGHTS_HISTORY.name}`, one row per backend per engine update "
             "(written by `triscope weights serve` when `[weights] history = true`). Live: the feed's /metrics "
             "scraped by Prometheus. Inputs: recomputed from the store with the engine's formulas.", h=2),
        row(f"History ({WEIGHTS_HISTORY.name})"),
        timeseries("Weight and target per backend", [sql_target(f"""
SELECT $__timeInterval(ts) AS time, toString(backend) AS backend, avg(weight) AS weight, avg(target) AS target
FROM {HISTORY} WHERE $__timeFilter(ts) AND {cond('backend', 'backend')}
GROUP BY time, backend ORDER BY time, backend""")],
            "damped weight (0 = drained) and the undamped target it moves toward", unit="percentunit", w=12,
            links=[link("Heatmap of ${__field.labels.backend}", HEATMAP_UID,
                        {"backend": "${__field.labels.backend}"})]),
        timeseries("Weight factors per backend", [sql_target(f"""
SELECT $__timeInterval(ts) AS time, toString(backend) AS backend, avg(factor_memory) AS memory,
       avg(factor_kv_cache) AS kv_cache, avg(factor_load) AS load, avg(factor_latency) AS latency
FROM {HISTORY} WHERE $__timeFilter(ts) AND {cond('backend', 'backend')}
GROUP BY time, backend ORDER BY time, backend""")],
            "the penalties the weight divides by (1 = no penalty)", unit="short", w=12),
        timeseries("Load-balancer weight", [sql_target(f"""
SELECT $__timeInterval(ts) AS time, toString(backend) AS backend, max(lb_weight) AS lb_weight
FROM {HISTORY} WHERE $__timeFilter(ts) AND {cond('backend', 'backend')}
GROUP BY time, backend ORDER BY time, backend""")],
            f"the integer weight HAProxy / Envoy / Traefik received (scale {DEFAULTS.lb_scale})", unit="short",
            w=12),
        table("Down, drained and stale backends", [sql_target(f"""
SELECT toString(backend) AS backend, toString(state) AS state, reasons, stale, count() AS updates,
       min(ts) AS first_seen, max(ts) AS last_seen, max(version) AS last_version
FROM {HISTORY} WHERE $__timeFilter(ts) AND {cond('backend', 'backend')}
  AND (state != 'ready' OR stale = 1 OR reasons != '')
GROUP BY backend, state, reasons, stale ORDER BY last_seen DESC LIMIT 100""", table=True)],
            "updates in which a backend was down (it did not answer: no traffic), drained, stale or absent on its "
            "own, or the fleet fell back to equal weights (stale = 1: no backend had fresh inputs)",
            column_links={"backend": [link("Fleet view of ${__data.fields.backend}", FLEET_UID,
                                           {"backend": "${__data.fields.backend}"})]}, w=12),
        row("Live (Prometheus: the feed's /metrics)"),
        timeseries("Weight per backend", [prom_target('triscope_backend_weight{backend=~"${backend:regex}"}',
                                                      "{{backend}}")],
                   "0..1 after damping; the load balancer gets lb_weight", unit="percentunit", w=8,
                   links=[link("Heatmap of ${__field.labels.backend}", HEATMAP_UID,
                               {"backend": "${__field.labels.backend}"})]),
        timeseries("Weight factors", [prom_target(
            'triscope_backend_weight_factor{backend=~"${backend:regex}"}', "{{backend}} {{factor}}")],
            "memory, KV-cache, load and latency penalties per backend", unit="short", w=8),
        timeseries("Down and draining backends", [
            prom_target('triscope_backend_down{backend=~"${backend:regex}"}', "{{backend}} down"),
            prom_target('triscope_backend_draining{backend=~"${backend:regex}"}', "{{backend}} drained", ref="C"),
            prom_target("triscope_kv_cache_scale_recommendation", "{{action}}", ref="B")],
            "1 while down (scrape refused or failing, requests failing, spans stopped: no traffic) or drained "
            "(memory or KV cache past its drain ratio); KV-cache scale action", unit="short", w=8),
        timeseries("Admission level per class", [
            prom_target("triscope_class_admission_level", "{{request_class}} level"),
            prom_target("triscope_class_shed_ratio", "{{request_class}} shed", ref="B"),
            prom_target("triscope_fleet_pressure_ratio", "fleet pressure", ref="C")],
            "0 normal, 1 degrade (shed a share of the lowest class), 2 limit (token bucket), 3 break (fallback); "
            "the shed share and the fleet pressure they follow ([weights.levels])", unit="short", w=8),
        timeseries("Weight updates per second", [prom_target(
            "rate(triscope_weights_updates_total[$__rate_interval])", "{{instance}}")],
            "the feed's update loop (triscope_weights_updates_total)", unit="ops", w=12),
        timeseries("Weight feed age", [
            prom_target("time() - triscope_weights_last_update_timestamp_seconds", "since last update"),
            prom_target('max by (backend) (triscope_backend_input_age_seconds{backend=~"${backend:regex}"})',
                        "input age {{backend}}", ref="B")],
            "seconds since the last weight update and since each backend's newest input (stale after 15 s)",
            unit="s", thresholds=[(None, "green"), (DEFAULTS.stale_after_s, "red")], w=12),
        row("Per-request picker (Prometheus: the daemon's /metrics, HAProxy's Lua picker)"),
        timeseries("Picks per backend", [
            prom_target('sum by (backend) (rate(triscope_epp_picks_total{backend=~"${backend:regex}"}'
                        '[$__rate_interval]))', "{{backend}} (Envoy picker)"),
            prom_target("sum(rate(triscope_haproxy_picks_total[$__rate_interval]))", "HAProxy Lua picker", ref="B")],
            "requests per second each picker sent ([epp] per backend; the Lua action's total)", unit="reqps", w=8),
        timeseries("Refused by admission level", [
            prom_target("sum by (request_class, level) (rate(triscope_epp_refused_total[$__rate_interval]))",
                        "{{request_class}} {{level}}"),
            prom_target("sum by (level) (rate(triscope_haproxy_pick_refused_total[$__rate_interval]))",
                        "HAProxy {{level}}", ref="B")],
            "requests per second a class's level refused (degrade, limit, break): each one got the fallback",
            unit="reqps", w=8),
        timeseries("Picker ledger and scrapes", [
            prom_target('triscope_epp_in_flight_requests{backend=~"${backend:regex}"}', "{{backend}} in flight"),
            prom_target('rate(triscope_epp_scrape_failures_total{backend=~"${backend:regex}"}[$__rate_interval])',
                        "{{backend}} failed scrapes/s", ref="B"),
            prom_target('triscope_epp_scrape_period_seconds{backend=~"${backend:regex}"}',
                        "{{backend}} scrape period s", ref="C")],
            "the picker's requests in flight per backend, its failed /metrics scrapes and each scrape period "
            "(longer while an engine is slow to answer: the scrape budget)", unit="short", w=8),
        timeseries("HAProxy Lua picker: where it differed from leastconn", [
            prom_target("sum(rate(triscope_haproxy_pick_diverted_total[$__rate_interval]))", "diverted"),
            prom_target("sum(rate(triscope_haproxy_pick_excluded_total[$__rate_interval]))", "excluded", ref="B"),
            prom_target("sum(rate(triscope_haproxy_pick_no_fit_total[$__rate_interval]))", "fitted nowhere", ref="C"),
            prom_target("sum(rate(triscope_haproxy_pick_no_table_total[$__rate_interval]))", "no table", ref="D")],
            "picks per second sent where HAProxy had more in flight (diverted), leaving out a server HAProxy had up "
            "(drained, unready, closed to the class), of a request that fitted no free KV, or without a fresh table",
            unit="reqps", w=12),
        timeseries("HAProxy Lua picker: pick table age", [
            prom_target("max(triscope_haproxy_pick_table_age_seconds)", "table age"),
            prom_target("sum(rate(triscope_haproxy_pick_table_poll_failures_total[$__rate_interval]))",
                        "failed polls/s", ref="B")],
            "age of the last table the action polled from [epp] (past unready_after_s, 3 s, it picks as leastconn)",
            unit="s", thresholds=[(None, "green"), (3.0, "red")], w=12),
        row("Inputs history (ClickHouse)"),
        timeseries("Memory penalty per GPU", [sql_target(f"""
SELECT $__timeInterval(ts) AS time, toString(host) AS host, toString(gpu) AS gpu,
       1 / greatest({PENALTY_FLOOR!r}, 1 - least(1, greatest(0, avgIf(memory_used_bytes / memory_total_bytes,
           isFinite(memory_used_bytes) AND memory_total_bytes > 0)))) AS memory_penalty
FROM {t(GPU_SAMPLES)} WHERE $__timeFilter(ts) AND {GPU_FILTER}
GROUP BY time, host, gpu ORDER BY time, host, gpu""")],
            f"1 / max(0.05, 1 - used/total); drained at {drain:.0%} used ({1 / max(PENALTY_FLOOR, 1 - drain):.0f}x), "
            f"released at {release:.0%}", unit="short", w=12),
        timeseries("KV-cache penalty per backend", [sql_target(f"""
SELECT $__timeInterval(ts) AS time, toString(backend) AS backend,
       {KV_PENALTY}
         AS kv_cache_penalty
FROM {t(SERVING_METRICS)} WHERE $__timeFilter(ts) AND {BACKEND_FILTER}
GROUP BY time, backend ORDER BY time, backend""")], "1 / max(0.05, 1 - KV-cache usage)", unit="short", w=12),
        timeseries("P99 priority weight per request class", [sql_target(priority_sql())],
                   "weight x max(1, p99/sla)^alpha: realtime speech 200 ms / 8 / 2.5, interactive image-text "
                   "800 ms / 4 / 2.0, offline video 5000 ms / 1 / 1.0", unit="short", w=12),
        timeseries("QPS per backend", [sql_target(f"""
SELECT $__timeInterval(ts) AS time, toString(backend) AS backend, count() / $__interval_s AS qps
FROM {t(REQUESTS)} WHERE $__timeFilter(ts) AND {BACKEND_FILTER} AND {cond('request_class', 'request_class')}
GROUP BY time, backend ORDER BY time, backend""")], "the load input (capacity_qps per backend in the config)",
            unit="reqps", w=12),
    ]
    return Board(UID, "triscope / routing weights", "Load-balancer weights over time, live, and their inputs; "
                 "drill down by host, GPU, backend and request class.", variables, panels, tags=["weights"])
