"""Fleet overview: QPS, GPU memory and P99 latency per backend, serving-engine state, pipeline health."""

from __future__ import annotations

from triscope.dashboards.common import (
    BACKEND_FILTER,
    DATABASE,
    GPU_FILTER,
    REQUEST_DIMENSIONS,
    REQUEST_FILTER,
    backend_var,
    gpu_var,
    host_var,
    request_vars,
    t,
)
from triscope.dashboards.model import (
    Board,
    link,
    prom_target,
    row,
    sql_target,
    stat,
    table,
    timeseries,
)
from triscope.dashboards.rollup_sql import gauge_averages
from triscope.schema import GPU_SAMPLES, REQUESTS, SERVING_METRICS
from triscope.schema.gpu import GPU_SAMPLES_1M, GPU_SAMPLES_10S
from triscope.schema.requests import SERVING_METRICS_1M, SERVING_METRICS_10S

UID = "triscope-fleet"
HEATMAP_UID = "triscope-heatmap"
STALLS_UID = "triscope-stalls"
WEIGHTS_UID = "triscope-weights"

REQ = t(REQUESTS)
GPU = t(GPU_SAMPLES)
# One value per GPU, or per MIG instance (dcgm), and interval; the panels add a GPU's instances up.
# Read from the rollup that fits the panel's interval (dashboards/rollup_sql.py).
_PER_INSTANCE = gauge_averages([GPU_SAMPLES_10S, GPU_SAMPLES_1M],
                               {"host": "toString(host)", "gpu": "toString(gpu)", "mig_instance": "mig_instance"},
                               {"used": "memory_used_bytes", "total": "memory_total_bytes"}, GPU_FILTER)
SERVING = t(SERVING_METRICS)
_SERVING_ROLLUPS = [SERVING_METRICS_10S, SERVING_METRICS_1M]
_LAT = "isFinite(latency_seconds)"
_RANGE_S = "greatest(1, toUnixTimestamp($__toTime) - toUnixTimestamp($__fromTime))"

_HEATMAP_BACKEND = link("QPS x memory x latency of ${__field.labels.backend}", HEATMAP_UID,
                        {"backend": "${__field.labels.backend}"}, carry=REQUEST_DIMENSIONS)
_STALLS_GPU = link("Stalls of ${__field.labels.host} GPU ${__field.labels.gpu}", STALLS_UID,
                   {"host": "${__field.labels.host}", "gpu": "${__field.labels.gpu}"})


def _self(column: str) -> dict[str, object]:
    """Drill down on this board: keep the other selections, set this column's variable."""
    others = [c for c in ["host", "gpu", "backend", *REQUEST_DIMENSIONS] if c != column]
    return link(f"Only {column} = ${{__data.fields.{column}}}", UID,
                {column: f"${{__data.fields.{column}}}"}, carry=others)


def board() -> Board:
    """The fleet-overview dashboard."""
    variables = [DATABASE, host_var(GPU_SAMPLES, REQUESTS, SERVING_METRICS), gpu_var(), backend_var(),
                 *request_vars()]
    panels = [
        row("Traffic, memory and tail latency"),
        stat("Fleet QPS", [sql_target(
            f"SELECT count() / {_RANGE_S} AS qps FROM {REQ} WHERE $__timeFilter(ts) AND {REQUEST_FILTER}",
            table=True)], "requests per second over the time range", unit="reqps"),
        stat("Fleet P99 latency", [sql_target(
            f"SELECT quantileIf(0.99)(latency_seconds, {_LAT}) AS p99_latency_seconds FROM {REQ} "
            f"WHERE $__timeFilter(ts) AND {REQUEST_FILTER}", table=True)],
            "end-to-end latency, all selected requests", unit="s",
            thresholds=[(None, "green"), (0.8, "orange"), (5.0, "red")]),
        stat("Error ratio", [sql_target(
            f"SELECT countIf(status = 'error') / greatest(count(), 1) AS error_ratio FROM {REQ} "
            f"WHERE $__timeFilter(ts) AND {REQUEST_FILTER}", table=True)],
            "requests with status = error", unit="percentunit",
            thresholds=[(None, "green"), (0.01, "orange"), (0.05, "red")]),
        stat("Peak GPU memory used", [sql_target(
            "SELECT maxIf(memory_used_bytes / memory_total_bytes, isFinite(memory_used_bytes) "
            f"AND memory_total_bytes > 0) AS memory_used_ratio FROM {GPU} WHERE $__timeFilter(ts) AND {GPU_FILTER}",
            table=True)], "highest used/total of any selected GPU", unit="percentunit",
            thresholds=[(None, "green"), (0.92, "orange"), (0.97, "red")]),
        timeseries("QPS per backend", [sql_target(
            f"SELECT $__timeInterval(ts) AS time, toString(backend) AS backend, count() / $__interval_s AS qps "
            f"FROM {REQ} WHERE $__timeFilter(ts) AND {REQUEST_FILTER} GROUP BY time, backend ORDER BY time, backend")],
            "request starts per second (requests.ts)", unit="reqps", links=[_HEATMAP_BACKEND]),
        timeseries("P99 latency per backend", [sql_target(
            f"SELECT $__timeInterval(ts) AS time, toString(backend) AS backend, "
            f"quantileIf(0.99)(latency_seconds, {_LAT}) AS p99_latency_seconds "
            f"FROM {REQ} WHERE $__timeFilter(ts) AND {REQUEST_FILTER} GROUP BY time, backend ORDER BY time, backend")],
            "end-to-end latency (requests.latency_seconds)", unit="s", links=[_HEATMAP_BACKEND]),
        timeseries("GPU memory used", [sql_target(
            f"SELECT time, host, gpu, sum(used) AS memory_used_bytes FROM ({_PER_INSTANCE}) "
            "GROUP BY time, host, gpu ORDER BY time, host, gpu")],
            "gpu_samples.memory_used_bytes (NVML / DCGM; a MIG GPU's instances added up)", unit="bytes",
            links=[_STALLS_GPU]),
        timeseries("GPU memory used / total", [sql_target(
            f"SELECT time, host, gpu, sumIf(used, total > 0) / sumIf(total, total > 0) AS memory_used_ratio "
            f"FROM ({_PER_INSTANCE}) WHERE isFinite(used) GROUP BY time, host, gpu "
            "HAVING sumIf(total, total > 0) > 0 ORDER BY time, host, gpu")],
            "the weight engine drains a backend at 97% and releases it at 92%", unit="percentunit",
            thresholds=[(None, "green"), (0.92, "orange"), (0.97, "red")], links=[_STALLS_GPU]),
        row("Serving engines (vLLM / SGLang / TGI scrapes)"),
        timeseries("KV-cache usage per backend", [sql_target(
            "SELECT * FROM (" + gauge_averages(_SERVING_ROLLUPS, {"backend": "toString(backend)"},
                                               {"kv_cache_usage_ratio": "kv_cache_usage_ratio"}, BACKEND_FILTER)
            + ") ORDER BY time, backend")],
            "scale up at >= 85% for 2 s, down at <= 40% for 5 s", unit="percentunit",
            thresholds=[(None, "green"), (0.40, "blue"), (0.85, "red")],
            links=[link("Weights of ${__field.labels.backend}", WEIGHTS_UID,
                        {"backend": "${__field.labels.backend}"})]),
        timeseries("Queue length per backend", [sql_target(
            "SELECT * FROM (" + gauge_averages(_SERVING_ROLLUPS, {"backend": "toString(backend)"},
                                               {"queue_length": "queue_length", "running_requests": "running_requests"},
                                               BACKEND_FILTER)
            + ") ORDER BY time, backend")],
            "requests waiting and running (serving_metrics)", unit="short"),
        timeseries("Prefix-cache hit rate per backend", [sql_target(
            "SELECT time, backend, hits / queries AS prefix_cache_hit_ratio FROM ("
            "SELECT $__timeInterval(ts) AS time, toString(backend) AS backend, "
            "maxIf(prefix_cache_hits_total, isFinite(prefix_cache_hits_total)) "
            "- minIf(prefix_cache_hits_total, isFinite(prefix_cache_hits_total)) AS hits, "
            "maxIf(prefix_cache_queries_total, isFinite(prefix_cache_queries_total)) "
            "- minIf(prefix_cache_queries_total, isFinite(prefix_cache_queries_total)) AS queries "
            f"FROM {SERVING} WHERE $__timeFilter(ts) AND {BACKEND_FILTER} "
            "GROUP BY time, backend) WHERE queries > 0 ORDER BY time, backend")],
            "share of prompt tokens the engine found in its prefix cache in each interval (vLLM, SGLang)",
            unit="percentunit"),
        row("Drill down"),
        table("Backends", [sql_target(
            "SELECT toString(backend) AS backend, any(toString(host)) AS host, count() AS requests, "
            f"count() / {_RANGE_S} AS qps, "
            f"quantileIf(0.5)(latency_seconds, {_LAT}) AS p50_latency_seconds, "
            f"quantileIf(0.99)(latency_seconds, {_LAT}) AS p99_latency_seconds, "
            "countIf(status = 'error') / count() AS error_ratio, "
            "arrayStringConcat(arraySort(groupUniqArray(toString(model))), ', ') AS models "
            f"FROM (SELECT * FROM {REQ} WHERE $__timeFilter(ts) AND {REQUEST_FILTER}) "
            "GROUP BY backend ORDER BY p99_latency_seconds DESC",
            table=True)],
            "click a backend for its heatmap, a host for its stall breakdown",
            column_links={
                "backend": [link("QPS x memory x latency of ${__data.fields.backend}", HEATMAP_UID,
                                 {"backend": "${__data.fields.backend}"}, carry=REQUEST_DIMENSIONS)],
                "host": [link("Stalls on ${__data.fields.host}", STALLS_UID, {"host": "${__data.fields.host}"})],
            },
            column_units={"qps": "reqps", "p50_latency_seconds": "s", "p99_latency_seconds": "s",
                          "error_ratio": "percentunit"}),
        table("Request mix", [sql_target(
            "SELECT toString(model_version) AS model_version, toString(modality) AS modality, "
            "toString(input_resolution) AS input_resolution, toString(request_class) AS request_class, "
            f"count() AS requests, quantileIf(0.99)(latency_seconds, {_LAT}) AS p99_latency_seconds, "
            "avg(prompt_tokens) AS mean_prompt_tokens, avg(image_pixels) AS mean_image_pixels "
            f"FROM {REQ} WHERE $__timeFilter(ts) AND {REQUEST_FILTER} "
            "GROUP BY model_version, modality, input_resolution, request_class ORDER BY requests DESC LIMIT 200",
            table=True)],
            "click a value to keep only it (the other selections stay)",
            column_links={c: [_self(c)] for c in ("model_version", "modality", "input_resolution", "request_class")},
            column_units={"p99_latency_seconds": "s"}),
        row("Pipeline health (Prometheus: triscope run /metrics)"),
        timeseries("Store and scrape targets up", [
            prom_target("triscope_store_up", "store {{instance}}"),
            prom_target('up{job=~"triscope.*"}', "scrape {{job}} {{instance}}", ref="B"),
            prom_target("triscope_collector_up", "collector {{collector}}", ref="C")],
            "1 = up: the store takes writes, Prometheus reaches the daemon, each collector runs", unit="bool", w=8),
        timeseries("Writer rows per second", [
            prom_target("rate(triscope_writer_rows_written_total[$__rate_interval])", "written"),
            prom_target("rate(triscope_writer_rows_submitted_total[$__rate_interval])", "submitted", ref="B"),
            prom_target("rate(triscope_writer_rows_dropped_total[$__rate_interval])", "dropped (spool full)", ref="C"),
            prom_target("rate(triscope_writer_rows_rejected_total[$__rate_interval])", "rejected", ref="D")],
            "rows through the batching writer; dropped or rejected rows are data lost", unit="cps", w=8),
        timeseries("Writer backlog", [
            prom_target("triscope_writer_pending_rows", "pending rows"),
            prom_target("time() - triscope_writer_last_write_timestamp_seconds", "seconds since last write",
                        ref="B")],
            "rows spooled but not yet in the store, and the age of the last insert", unit="short", w=8),
        timeseries("Spool on disk", [prom_target("triscope_writer_spool_bytes", "spool {{instance}}")],
                   "bytes waiting in the local spool (grows while the store is unreachable)", unit="bytes", w=8),
        timeseries("Collector rows per second", [
            prom_target("sum by (collector, table) (rate(triscope_collector_rows_total[$__rate_interval]))",
                        "{{collector}} -> {{table}}")],
            "rows each collector hands to the writer", unit="cps", w=8),
        timeseries("Collector and exporter errors", [
            prom_target("sum by (collector) (increase(triscope_collector_errors_total[$__rate_interval]))",
                        "collector {{collector}}"),
            prom_target("increase(triscope_exporter_store_query_errors_total[$__rate_interval])",
                        "exporter store queries", ref="B"),
            prom_target("sum by (collector, kind) (increase(triscope_collector_gaps_total[$__rate_interval]))",
                        "{{collector}} gaps: {{kind}}", ref="C")],
            "failed collect() calls, failed /metrics store queries, and the gaps collectors know of in their rows "
            "(blockio: probe runs the kernel skipped, windows that may miss requests)", unit="short", w=8),
    ]
    return Board(UID, "triscope / fleet overview",
                 "QPS, GPU memory and P99 latency per backend; drill down by host, GPU, model version, modality, "
                 "input resolution and request class.", variables, panels, tags=["fleet"])
