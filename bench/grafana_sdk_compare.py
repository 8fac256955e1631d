"""Would grafana-foundation-sdk serve the boards better than dashboards/model.py?  A measurement.

Ports two representative boards to the SDK's typed builders, written the way the SDK intends
(its dashboard / row / timeseries / table / stat / prometheus builders, its layout, its variable
builders) with the same SQL, and compares them with what ``dashboards/model.py`` generates:

- the JSON, field by field, for what the ClickHouse plugin and tests/test_dashboards.py read
  (targets: rawSql, format, queryType, editorType, pluginVersion, datasource; variables: the v4
  variable model and ``definition``; panel ids and grid positions; schema version), plus every
  other path that differs;
- the lines of code of the board definitions and of the helpers each approach needs;
- whether the SDK board passes the checks tests/test_dashboards.py applies to every board.

Run: ``python bench/grafana_sdk_compare.py`` (skips with a message when the SDK is not installed:
it is not a dependency of triscope).
"""

from __future__ import annotations

import inspect
import json
import sys
from collections.abc import Iterator
from typing import Any

try:
    from grafana_foundation_sdk.builders import common as cb
    from grafana_foundation_sdk.builders import dashboard as db
    from grafana_foundation_sdk.builders import prometheus as pb
    from grafana_foundation_sdk.builders import stat as sb
    from grafana_foundation_sdk.builders import table as tb
    from grafana_foundation_sdk.builders import timeseries as tsb
    from grafana_foundation_sdk.cog import builder as cogbuilder
    from grafana_foundation_sdk.cog import variants as cogvariants
    from grafana_foundation_sdk.cog.encoder import JSONEncoder
    from grafana_foundation_sdk.models import common as cm
    from grafana_foundation_sdk.models import dashboard as dm
except ImportError:
    print("grafana-foundation-sdk is not installed (pip install grafana-foundation-sdk): nothing to compare")
    sys.exit(0)

from triscope.dashboards import fleet, incidents, model
from triscope.dashboards.common import REQUEST_FILTER, distinct
from triscope.dashboards.incidents import BACKEND, CFG, FLEET_LINK, FLEET_UID, HEALTH, HOST, REQ, SLA_OF, SRV
from triscope.dashboards.model import CLICKHOUSE_PLUGIN_VERSION, CLICKHOUSE_TYPE, CLICKHOUSE_UID
from triscope.schema import GPU_SAMPLES, REQUESTS, SERVING_METRICS

# ---------------------------------------------------------------- the SDK port: helpers it needs

# spelled GraphTresholdsStyleMode in the builds for Grafana 10.x, fixed in those for 11.x
_STYLE: Any = getattr(cm, "GraphThresholdsStyleMode", None) or getattr(cm, "GraphTresholdsStyleMode")  # noqa: B009
DASHED = _STYLE.DASHED
CH = dm.DataSourceRef(type_val=CLICKHOUSE_TYPE, uid=CLICKHOUSE_UID)
PROM = dm.DataSourceRef(type_val="prometheus", uid="triscope-prometheus")


class ClickHouseQuery(cogvariants.Dataquery):
    """The SDK has no dataquery for grafana-clickhouse-datasource: a hand-written one."""

    def __init__(self, sql: str, ref: str, table: bool) -> None:
        self.sql, self.ref, self.table = sql.strip(), ref, table

    def to_json(self) -> dict[str, object]:
        return {"datasource": CH, "editorType": "sql", "rawSql": self.sql, "refId": self.ref,
                "pluginVersion": CLICKHOUSE_PLUGIN_VERSION, "format": int(self.table),
                "queryType": "table" if self.table else "timeseries"}


class SQL(cogbuilder.Builder[ClickHouseQuery]):
    def __init__(self, sql: str, ref: str = "A", table: bool = False) -> None:
        self._q = ClickHouseQuery(sql, ref, table)

    def build(self) -> ClickHouseQuery:
        return self._q


def prom(expr: str, legend: str, ref: str = "A") -> pb.Dataquery:
    return pb.Dataquery().expr(expr).legend_format(legend).range().ref_id(ref).datasource(PROM)


def steps(pairs: list[tuple[float | None, str]]) -> db.ThresholdsConfig:
    return db.ThresholdsConfig().mode(dm.ThresholdsMode.ABSOLUTE).steps(
        [dm.Threshold(value=v, color=c) for v, c in pairs])


def data_link(lk: dict[str, Any]) -> db.DashboardLink:
    return db.DashboardLink(lk["title"]).url(lk["url"])


def ts(title: str, desc: str, unit: str, *targets: Any, links: list[dict[str, Any]] | None = None,
       thresholds: list[tuple[float | None, str]] | None = None, w: int = 12) -> tsb.Panel:
    p = (tsb.Panel().title(title).description(desc).unit(unit).span(w).height(8)
         .datasource(PROM if isinstance(targets[0], pb.Dataquery) else CH).targets(list(targets))
         .draw_style(cm.GraphDrawStyle.LINE).line_width(1).fill_opacity(10).show_points(cm.VisibilityMode.NEVER)
         .span_nulls(False)
         .legend(cb.VizLegendOptions().display_mode(cm.LegendDisplayMode.TABLE)
                 .placement(cm.LegendPlacement.RIGHT).show_legend(True).calcs(["mean", "max"]))
         .tooltip(cb.VizTooltipOptions().mode(cm.TooltipDisplayMode.MULTI).sort(cm.SortOrder.DESCENDING)))
    if links:
        p = p.data_links([data_link(lk) for lk in links])
    if thresholds:
        p = p.thresholds(steps(thresholds)).thresholds_style(
            cb.GraphThresholdsStyleConfig().mode(DASHED))
    return p


def tab(title: str, desc: str, target: SQL, links: dict[str, list[dict[str, Any]]],
        units: dict[str, str]) -> tb.Panel:
    p = (tb.Panel().title(title).description(desc).span(24).height(8).datasource(CH).targets([target])
         .show_header(True).cell_height(cm.TableCellHeight.SM).footer(cb.TableFooterOptions().show(False)))
    for name, lks in links.items():
        p = p.override_by_name(name, [dm.DynamicConfigValue(id_val="links", value=lks)])
    for name, unit in units.items():
        p = p.override_by_name(name, [dm.DynamicConfigValue(id_val="unit", value=unit)])
    return p


def stat(title: str, desc: str, unit: str, sql: str,
         thresholds: list[tuple[float | None, str]] | None = None) -> sb.Panel:
    return (sb.Panel().title(title).description(desc).unit(unit).span(6).height(4).datasource(CH)
            .targets([SQL(sql, table=True)]).thresholds(steps(thresholds or [(None, "green")]))
            .reduce_options(cb.ReduceDataOptions().calcs(["lastNotNull"]).fields("").values(False))
            .color_mode(cm.BigValueColorMode.VALUE).graph_mode(cm.BigValueGraphMode.AREA)
            .text_mode(cm.BigValueTextMode.AUTO))


def var(name: str, label: str, sql: str) -> db.QueryVariable:
    return (db.QueryVariable(name).label(label).datasource(CH)
            .query({"queryType": "sql", "rawSql": sql, "refId": "var"})
            .refresh(dm.VariableRefresh.ON_TIME_RANGE_CHANGED).sort(dm.VariableSort.DISABLED).multi(True)
            .include_all(True).current(dm.VariableOption(selected=True, text=["All"], value=["$__all"])))


def database_var() -> db.TextBoxVariable:
    return (db.TextBoxVariable("database").label("ClickHouse database").hide(dm.VariableHide.HIDE_VARIABLE)
            .description("database holding the triscope tables ([store] database)").default_value("triscope"))


def board(uid: str, title: str, desc: str, tags: list[str]) -> db.Dashboard:
    return (db.Dashboard(title).uid(uid).description(desc).tags(["triscope", *tags]).timezone("utc")
            .editable().tooltip(dm.DashboardCursorSync.CROSSHAIR).time("now-1h", "now").refresh("30s")
            .timepicker(db.TimePicker().refresh_intervals(["10s", "30s", "1m", "5m", "15m"]))
            .link(db.DashboardLink("triscope boards").type(dm.DashboardLinkType.DASHBOARDS).tags(["triscope"])
                  .as_dropdown(True).include_vars(True).keep_time(True).icon("external link").target_blank(False)))


# ---------------------------------------------------------------- the SDK port: two boards


def sdk_incidents() -> db.Dashboard:
    def per_backend(table_name: str, expr: str, alias: str) -> str:
        return incidents._per_backend(table_name, expr, alias)

    return (board(incidents.UID, "triscope / incidents", "Where request classes broke their SLO, and the signals "
                  "that moved before: scrape health, KV, queues, load, run-queue wait, host pressure.", ["incidents"])
            .with_variable(database_var())
            .with_variable(var("backend", "Backend", distinct("backend", [REQUESTS, SERVING_METRICS], [])))
            .with_row(db.Row("Breaches"))
            .with_panel(tab("Windows that broke an SLO", f"{CFG.window_s:g} s windows where a class's P99 was over "
                            f"its SLA or {CFG.error_ratio:.0%} of requests failed; `triscope diagnose --since` "
                            "merges them into incidents and names the cause", SQL(f"""
SELECT toStartOfInterval(ts, INTERVAL {int(CFG.window_s)} SECOND) AS window, toString(backend) AS backend,
       toString(request_class) AS request_class, count() AS requests, countIf(status = 'error') AS failed,
       quantileExactIf(0.99)(latency_seconds, status != 'error') AS p99_seconds,
       p99_seconds / any({SLA_OF}) AS p99_over_sla
FROM {REQ} WHERE $__timeFilter(ts) AND backend != '' AND {BACKEND}
GROUP BY window, backend, request_class
HAVING (requests >= {CFG.min_requests} AND p99_over_sla > 1)
    OR (failed >= {CFG.min_requests} AND failed / requests >= {CFG.error_ratio!r})
ORDER BY window DESC, backend LIMIT 500""", table=True),
                            {"backend": [model.link("Fleet view of ${__data.fields.backend}", FLEET_UID,
                                                    {"backend": "${__data.fields.backend}"})]},
                            {"p99_seconds": "s"}))
            .with_panel(ts("P99 over SLA per backend", "worst request latency over its class's SLA (1 = at the SLA)",
                           "short", SQL(f"""
SELECT $__timeInterval(ts) AS time, toString(backend) AS backend,
       max(latency_seconds / ({SLA_OF})) AS p99_over_sla
FROM (SELECT ts, backend, request_class, latency_seconds FROM {REQ}
      WHERE $__timeFilter(ts) AND backend != '' AND {BACKEND} AND status != 'error')
GROUP BY time, backend ORDER BY time, backend"""), thresholds=[(None, "green"), (1.0, "red")], links=FLEET_LINK))
            .with_panel(ts("Failed requests per backend", "requests that ended in an error (a dead backend's "
                           "requests fail here)", "reqps", SQL(per_backend(
                               REQ, "countIf(status = 'error') / $__interval_s", "failed_per_second")),
                           links=FLEET_LINK))
            .with_row(db.Row("What moved first"))
            .with_panel(ts("Scrape up per backend", "0 while its /metrics scrape fails: the backend is down", "short",
                           SQL(per_backend(HEALTH, "min(up)", "up")), links=FLEET_LINK, w=8))
            .with_panel(ts("KV usage per backend", f"KV pressure from {CFG.kv_high:.0%}", "percentunit",
                           SQL(per_backend(SRV, "max(kv_cache_usage_ratio)", "kv_usage")),
                           thresholds=[(None, "green"), (CFG.kv_high, "red")], links=FLEET_LINK, w=8))
            .with_panel(ts("Waiting and preemptions per backend", "requests waiting in the engine; preemptions in the "
                           "interval", "short", SQL(per_backend(SRV, "max(queue_length)", "waiting")),
                           SQL(per_backend(SRV, "max(preemptions_total) - min(preemptions_total)", "preemptions"),
                               ref="B"), links=FLEET_LINK, w=8))
            .with_panel(ts("Completed requests (fleet)", f"a jump of {CFG.qps_jump:.0%} over the baseline before a "
                           "breach reads as load", "reqps", SQL(f"""
SELECT $__timeInterval(ts) AS time, count() / $__interval_s AS completed_per_second
FROM {REQ} WHERE $__timeFilter(ts) AND backend != '' AND {BACKEND} GROUP BY time ORDER BY time"""), w=8))
            .with_panel(ts("Run-queue wait per engine", f"share of the time its threads waited for a CPU (host "
                           f"collector); starved from {CFG.cpu_wait:.0%}", "percentunit", SQL(per_backend(
                               HOST, "sum(wait_seconds) / sum(window_seconds)", "cpu_wait_ratio")),
                           thresholds=[(None, "green"), (CFG.cpu_wait, "red")], links=FLEET_LINK, w=8))
            .with_panel(ts("Host pressure and OOM kills", "PSI shares (some task stalled) and OOM kills per host",
                           "short", SQL(f"""
SELECT $__timeInterval(ts) AS time, toString(host) AS host, max(psi_cpu_some) AS cpu, max(psi_memory_some) AS memory,
       max(psi_io_some) AS io, sum(oom_kills) AS oom_kills
FROM {HOST} WHERE $__timeFilter(ts) AND backend = '' GROUP BY time, host ORDER BY time, host"""), w=8)))


def sdk_fleet() -> db.Dashboard:
    f = fleet
    lat, rng, per_instance = f._LAT, f._RANGE_S, f._PER_INSTANCE
    variables: list[Any] = [database_var(), var("host", "Host", distinct("host", [GPU_SAMPLES, REQUESTS,
                                                                                   SERVING_METRICS], []))]
    variables += [var(v.name, v.label, v.sql) for v in (f.gpu_var(), f.backend_var(), *f.request_vars())]
    return (board(f.UID, "triscope / fleet overview", "QPS, GPU memory and P99 latency per backend; drill down by "
                  "host, GPU, model version, modality, input resolution and request class.", ["fleet"])
            .variables(variables)
            .with_row(db.Row("Traffic, memory and tail latency"))
            .with_panel(stat("Fleet QPS", "requests per second over the time range", "reqps",
                             f"SELECT count() / {rng} AS qps FROM {f.REQ} WHERE $__timeFilter(ts) "
                             f"AND {REQUEST_FILTER}"))
            .with_panel(stat("Fleet P99 latency", "end-to-end latency, all selected requests", "s",
                             f"SELECT quantileIf(0.99)(latency_seconds, {lat}) AS p99_latency_seconds FROM {f.REQ} "
                             f"WHERE $__timeFilter(ts) AND {REQUEST_FILTER}",
                             [(None, "green"), (0.8, "orange"), (5.0, "red")]))
            .with_panel(stat("Error ratio", "requests with status = error", "percentunit",
                             f"SELECT countIf(status = 'error') / greatest(count(), 1) AS error_ratio FROM {f.REQ} "
                             f"WHERE $__timeFilter(ts) AND {REQUEST_FILTER}",
                             [(None, "green"), (0.01, "orange"), (0.05, "red")]))
            .with_panel(stat("Peak GPU memory used", "highest used/total of any selected GPU", "percentunit",
                             "SELECT maxIf(memory_used_bytes / memory_total_bytes, isFinite(memory_used_bytes) "
                             f"AND memory_total_bytes > 0) AS memory_used_ratio FROM {f.GPU} WHERE $__timeFilter(ts) "
                             f"AND {f.GPU_FILTER}", [(None, "green"), (0.92, "orange"), (0.97, "red")]))
            .with_panel(ts("QPS per backend", "request starts per second (requests.ts)", "reqps", SQL(
                f"SELECT $__timeInterval(ts) AS time, toString(backend) AS backend, count() / $__interval_s AS qps "
                f"FROM {f.REQ} WHERE $__timeFilter(ts) AND {REQUEST_FILTER} GROUP BY time, backend "
                "ORDER BY time, backend"), links=[f._HEATMAP_BACKEND]))
            .with_panel(ts("P99 latency per backend", "end-to-end latency (requests.latency_seconds)", "s", SQL(
                f"SELECT $__timeInterval(ts) AS time, toString(backend) AS backend, "
                f"quantileIf(0.99)(latency_seconds, {lat}) AS p99_latency_seconds "
                f"FROM {f.REQ} WHERE $__timeFilter(ts) AND {REQUEST_FILTER} GROUP BY time, backend "
                "ORDER BY time, backend"), links=[f._HEATMAP_BACKEND]))
            .with_panel(ts("GPU memory used", "gpu_samples.memory_used_bytes (NVML / DCGM; a MIG GPU's instances "
                           "added up)", "bytes", SQL(
                               f"SELECT time, host, gpu, sum(used) AS memory_used_bytes FROM ({per_instance}) "
                               "GROUP BY time, host, gpu ORDER BY time, host, gpu"), links=[f._STALLS_GPU]))
            .with_panel(ts("GPU memory used / total", "the weight engine drains a backend at 97% and releases it at "
                           "92%", "percentunit", SQL(
                               f"SELECT time, host, gpu, sumIf(used, total > 0) / sumIf(total, total > 0) AS "
                               f"memory_used_ratio FROM ({per_instance}) WHERE isFinite(used) GROUP BY time, host, gpu "
                               "HAVING sumIf(total, total > 0) > 0 ORDER BY time, host, gpu"),
                           thresholds=[(None, "green"), (0.92, "orange"), (0.97, "red")], links=[f._STALLS_GPU]))
            .with_row(db.Row("Serving engines (vLLM / SGLang / TGI scrapes)"))
            .with_panel(ts("KV-cache usage per backend", "scale up at >= 85% for 2 s, down at <= 40% for 5 s",
                           "percentunit", SQL(
                               "SELECT $__timeInterval(ts) AS time, toString(backend) AS backend, "
                               "avgIf(kv_cache_usage_ratio, isFinite(kv_cache_usage_ratio)) AS kv_cache_usage_ratio "
                               f"FROM {f.SERVING} WHERE $__timeFilter(ts) AND {f.BACKEND_FILTER} "
                               "GROUP BY time, backend ORDER BY time, backend"),
                           thresholds=[(None, "green"), (0.40, "blue"), (0.85, "red")],
                           links=[model.link("Weights of ${__field.labels.backend}", f.WEIGHTS_UID,
                                             {"backend": "${__field.labels.backend}"})]))
            .with_panel(ts("Queue length per backend", "requests waiting and running (serving_metrics)", "short", SQL(
                "SELECT $__timeInterval(ts) AS time, toString(backend) AS backend, "
                "avgIf(queue_length, isFinite(queue_length)) AS queue_length, "
                "avgIf(running_requests, isFinite(running_requests)) AS running_requests "
                f"FROM {f.SERVING} WHERE $__timeFilter(ts) AND {f.BACKEND_FILTER} "
                "GROUP BY time, backend ORDER BY time, backend")))
            .with_row(db.Row("Drill down"))
            .with_panel(tab("Backends", "click a backend for its heatmap, a host for its stall breakdown", SQL(
                "SELECT toString(backend) AS backend, any(toString(host)) AS host, count() AS requests, "
                f"count() / {rng} AS qps, "
                f"quantileIf(0.5)(latency_seconds, {lat}) AS p50_latency_seconds, "
                f"quantileIf(0.99)(latency_seconds, {lat}) AS p99_latency_seconds, "
                "countIf(status = 'error') / count() AS error_ratio, "
                "arrayStringConcat(arraySort(groupUniqArray(toString(model))), ', ') AS models "
                f"FROM (SELECT * FROM {f.REQ} WHERE $__timeFilter(ts) AND {REQUEST_FILTER}) "
                "GROUP BY backend ORDER BY p99_latency_seconds DESC", table=True),
                {"backend": [model.link("QPS x memory x latency of ${__data.fields.backend}", f.HEATMAP_UID,
                                        {"backend": "${__data.fields.backend}"}, carry=f.REQUEST_DIMENSIONS)],
                 "host": [model.link("Stalls on ${__data.fields.host}", f.STALLS_UID,
                                     {"host": "${__data.fields.host}"})]},
                {"qps": "reqps", "p50_latency_seconds": "s", "p99_latency_seconds": "s",
                 "error_ratio": "percentunit"}))
            .with_panel(tab("Request mix", "click a value to keep only it (the other selections stay)", SQL(
                "SELECT toString(model_version) AS model_version, toString(modality) AS modality, "
                "toString(input_resolution) AS input_resolution, toString(request_class) AS request_class, "
                f"count() AS requests, quantileIf(0.99)(latency_seconds, {lat}) AS p99_latency_seconds, "
                "avg(prompt_tokens) AS mean_prompt_tokens, avg(image_pixels) AS mean_image_pixels "
                f"FROM {f.REQ} WHERE $__timeFilter(ts) AND {REQUEST_FILTER} "
                "GROUP BY model_version, modality, input_resolution, request_class ORDER BY requests DESC LIMIT 200",
                table=True), {c: [f._self(c)] for c in ("model_version", "modality", "input_resolution",
                                                        "request_class")}, {"p99_latency_seconds": "s"}))
            .with_row(db.Row("Pipeline health (Prometheus: triscope run /metrics)"))
            .with_panel(ts("Store and scrape targets up", "1 = up: the store takes writes, Prometheus reaches the "
                           "daemon, each collector runs", "bool", prom("triscope_store_up", "store {{instance}}"),
                           prom('up{job=~"triscope.*"}', "scrape {{job}} {{instance}}", ref="B"),
                           prom("triscope_collector_up", "collector {{collector}}", ref="C"), w=8))
            .with_panel(ts("Writer rows per second", "rows through the batching writer; dropped or rejected rows are "
                           "data lost", "cps",
                           prom("rate(triscope_writer_rows_written_total[$__rate_interval])", "written"),
                           prom("rate(triscope_writer_rows_submitted_total[$__rate_interval])", "submitted", ref="B"),
                           prom("rate(triscope_writer_rows_dropped_total[$__rate_interval])", "dropped (spool full)",
                                ref="C"),
                           prom("rate(triscope_writer_rows_rejected_total[$__rate_interval])", "rejected", ref="D"),
                           w=8))
            .with_panel(ts("Writer backlog", "rows spooled but not yet in the store, and the age of the last insert",
                           "short", prom("triscope_writer_pending_rows", "pending rows"),
                           prom("time() - triscope_writer_last_write_timestamp_seconds", "seconds since last write",
                                ref="B"), w=8))
            .with_panel(ts("Spool on disk", "bytes waiting in the local spool (grows while the store is unreachable)",
                           "bytes", prom("triscope_writer_spool_bytes", "spool {{instance}}"), w=8))
            .with_panel(ts("Collector rows per second", "rows each collector hands to the writer", "cps", prom(
                "sum by (collector, table) (rate(triscope_collector_rows_total[$__rate_interval]))",
                "{{collector}} -> {{table}}"), w=8))
            .with_panel(ts("Collector and exporter errors", "failed collect() calls, failed /metrics store queries, "
                           "and the gaps collectors know of in their rows (blockio: probe runs the kernel skipped, "
                           "windows that may miss requests)", "short",
                           prom("sum by (collector) (increase(triscope_collector_errors_total[$__rate_interval]))",
                                "collector {{collector}}"),
                           prom("increase(triscope_exporter_store_query_errors_total[$__rate_interval])",
                                "exporter store queries", ref="B"),
                           prom("sum by (collector, kind) (increase(triscope_collector_gaps_total[$__rate_interval]))",
                                "{{collector}} gaps: {{kind}}", ref="C"), w=8)))


# ---------------------------------------------------------------- comparison

def to_json(builder: db.Dashboard) -> dict[str, Any]:
    result: dict[str, Any] = json.loads(json.dumps(builder.build(), cls=JSONEncoder))
    return result


def diff(a: Any, b: Any, path: str = "") -> Iterator[tuple[str, Any, Any]]:
    """(path, ours, sdk) for every leaf that differs; ``<absent>`` marks a missing key."""
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b)):
            yield from diff(a.get(k, "<absent>"), b.get(k, "<absent>"), f"{path}.{k}" if path else k)
    elif isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            yield from diff(x, y, f"{path}[{i}]")
    elif a != b:
        yield path, a, b


def by_title(panels: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {p["title"]: p for p in panels}


PLUGIN_FIELDS = ("rawSql", "format", "queryType", "editorType", "pluginVersion", "datasource", "refId")


def plugin_view(board: dict[str, Any]) -> dict[str, Any]:
    """What the ClickHouse plugin and tests/test_dashboards.py read from a board."""
    panels = {}
    for p in board.get("panels", []):
        panels[p["title"]] = {"id": p.get("id"), "gridPos": p.get("gridPos"), "datasource": p.get("datasource"),
                              "targets": [{k: t.get(k, "<absent>") for k in PLUGIN_FIELDS if "expr" not in t or
                                           k in ("datasource", "refId")} for t in p.get("targets", [])]}
    variables = {v["name"]: {k: v.get(k, "<absent>") for k in ("type", "query", "definition", "datasource", "refresh",
                                                               "sort", "multi", "includeAll", "current", "hide")}
                 for v in board["templating"]["list"]}
    return {"schemaVersion": board["schemaVersion"], "panels": panels, "variables": variables}


def test_checks(board: dict[str, Any]) -> list[str]:
    """The structural checks tests/test_dashboards.py applies to every board (test_board_json_is_valid,
    test_targets_are_v4_queries_of_the_provisioned_plugin), as a list of failures."""
    bad = []
    ids = [p.get("id") for p in board["panels"]]
    if not all(isinstance(i, int) for i in ids) or len(set(ids)) != len(ids):
        bad.append(f"panel ids not unique integers: {ids[:4]}...")
    cells: set[tuple[int, int]] = set()
    for p in board["panels"]:
        g = p["gridPos"]
        if g["x"] + g["w"] > 24:
            bad.append(f"{p['title']}: past the 24-column grid ({g})")
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        if cells & mine:
            bad.append(f"{p['title']}: overlaps another panel")
        cells |= mine
    for v in board["templating"]["list"]:
        if v["type"] == "query" and v["query"] != {"queryType": "sql", "rawSql": v.get("definition"), "refId": "var"}:
            bad.append(f"variable {v['name']}: query != {{queryType, rawSql: definition, refId}} (no definition)")
    if board["schemaVersion"] < 36:
        bad.append(f"schemaVersion {board['schemaVersion']}")
    return bad


def sdk_fixup(board: dict[str, Any]) -> dict[str, Any]:
    """What the SDK JSON needs, patched as dicts, to pass the checks above and match what the plugin reads."""
    board["schemaVersion"] = model.SCHEMA_VERSION
    board["annotations"] = model.Board("", "", "", [], []).to_json()["annotations"]
    for i, p in enumerate(board["panels"], start=1):
        p["id"] = i
        if p["type"] == "table":
            p["fieldConfig"]["defaults"]["custom"] = {"align": "auto", "filterable": True}
        for lk in p.get("fieldConfig", {}).get("defaults", {}).get("links", []):
            for key in ("asDropdown", "icon", "includeVars", "keepTime", "tags", "targetBlank", "tooltip", "type"):
                lk.pop(key, None)
    for v in board["templating"]["list"]:
        if v["type"] == "query":
            v["definition"] = v["query"]["rawSql"]
        elif v["type"] == "textbox":
            v["current"] = {"selected": False, "text": v["query"], "value": v["query"]}
            v["options"] = [{"selected": True, "text": v["query"], "value": v["query"]}]
            v.pop("multi", None), v.pop("includeAll", None)
    return board


def sdk_layout(board: dict[str, Any]) -> list[str]:
    """Our panel sizes placed by the SDK's Dashboard.with_panel / with_row: where the grid positions differ."""
    d = db.Dashboard(board["title"])
    for p in board["panels"]:
        g = p["gridPos"]
        d = (d.with_row(db.Row(p["title"])) if p["type"] == "row"
             else d.with_panel(db.Panel().type(p["type"]).title(p["title"]).span(g["w"]).height(g["h"])))
    placed = to_json(d)["panels"]
    return [f"{p['title']}: ours {p['gridPos']} / sdk {q['gridPos']}" for p, q in zip(board["panels"], placed,
                                                                                     strict=True)
            if p["gridPos"] != q["gridPos"]]


def code_lines(obj: Any) -> int:
    """Non-blank, non-comment source lines (docstrings included: both sides have them)."""
    return sum(1 for ln in inspect.getsource(obj).splitlines() if ln.strip() and not ln.strip().startswith("#"))


def main() -> int:
    from importlib.metadata import version

    print(f"grafana-foundation-sdk {version('grafana-foundation-sdk')} vs dashboards/model.py\n")
    ours = {"incidents": incidents.board().to_json(), "fleet": fleet.board().to_json()}
    sdk = {"incidents": to_json(sdk_incidents()), "fleet": to_json(sdk_fleet())}

    print("## Lines of code (non-blank, non-comment)\n")
    print("| | model.py builders | SDK port |\n|---|---|---|")
    sdk_helpers = [ClickHouseQuery, SQL, prom, steps, data_link, ts, tab, stat, var, database_var, board]
    ours_helpers = [model.sql_target, model.prom_target, model.Panel, model._panel, model.timeseries, model.table,
                    model.stat, model.row, model.Variable, model.layout, model.Board]
    print(f"| helpers (the same panel kinds) | {sum(map(code_lines, ours_helpers))} | "
          f"{sum(map(code_lines, sdk_helpers))} |")
    print(f"| incidents board | {code_lines(incidents.board)} | {code_lines(sdk_incidents)} |")
    print(f"| fleet board | {code_lines(fleet.board)} | {code_lines(sdk_fleet)} |")

    print(f"| fix-ups of the SDK JSON to pass the tests (below) | | {code_lines(sdk_fixup)} |")
    print(f"| own layout, the SDK's overflows the weights board (below) | (in helpers) | {code_lines(model.layout)} |")
    print("\n## Layout: the SDK's grid placement of every board's panels\n")
    from triscope.dashboards.boards import all_boards

    for stem, board_json in all_boards().items():
        moved = sdk_layout(board_json)
        print(f"- {stem}: {len(moved)} of {len(board_json['panels'])} panels placed elsewhere")
        for m in moved[:3]:
            print(f"  - {m}")
    for name in ("incidents", "fleet"):
        a, b = ours[name], sdk[name]
        print(f"\n## {name}\n")
        sql_a = [(p["title"], t.get("rawSql")) for p in a["panels"] for t in p.get("targets", [])]
        sql_b = [(p["title"], t.get("rawSql")) for p in b["panels"] for t in p.get("targets", [])]
        print(f"- same SQL in every target: {sql_a == sql_b} ({len(sql_a)} targets)")
        plugin = list(diff(plugin_view(a), plugin_view(b)))
        print(f"- fields the ClickHouse plugin / the tests read that differ: {len(plugin)}")
        for path, x, y in plugin:
            print(f"  - `{path}`: ours {json.dumps(x)[:90]} / sdk {json.dumps(y)[:90]}")
        failures = test_checks(b)
        print(f"- tests/test_dashboards.py checks failed by the SDK board: {len(failures)}")
        for f in failures:
            print(f"  - {f}")
        rest = [d for d in diff({k: v for k, v in a.items() if k not in ("panels", "templating")},
                                {k: v for k, v in b.items() if k not in ("panels", "templating")})]
        print(f"- dashboard-level fields that differ: {len(rest)}")
        for path, x, y in rest:
            print(f"  - `{path}`: ours {json.dumps(x)[:90]} / sdk {json.dumps(y)[:90]}")
        pa, pb_ = by_title(a["panels"]), by_title(b["panels"])
        other: dict[str, int] = {}
        for title in pa:
            for path, _x, _y in diff(pa[title], pb_.get(title, {})):
                key = path.split("[")[0] if path.startswith("targets") else path
                if not key.startswith(("id", "gridPos", "targets")):
                    other[key] = other.get(key, 0) + 1
        va, vb = a["templating"]["list"], b["templating"]["list"]
        for x, y in zip(va, vb, strict=False):
            for path, _x, _y in diff(x, y):
                other[f"templating.{path}"] = other.get(f"templating.{path}", 0) + 1
        fixed = sdk_fixup(json.loads(json.dumps(b)))
        print(f"- after sdk_fixup: {len(test_checks(fixed))} checks failed, "
              f"{len(list(diff(plugin_view(a), plugin_view(fixed))))} plugin / test fields differ")
        size = [len(json.dumps(x, indent=2, sort_keys=True)) for x in (a, b)]
        print(f"- committed JSON: ours {size[0]} bytes, sdk {size[1]} bytes ({size[1] / size[0] - 1:+.0%})")
        print(f"- other panel / variable paths that differ ({len(other)}; count of panels or variables):")
        for key in sorted(other):
            print(f"  - `{key}` x{other[key]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
