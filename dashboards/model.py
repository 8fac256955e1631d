"""Small builders for Grafana dashboard JSON: datasources, targets, panels, variables, layout.

Every board is plain data (dicts) built by these functions, so the generated JSON is
deterministic and reviewable. ClickHouse targets use the ``grafana-clickhouse-datasource``
plugin's v4 SQL editor model (``pluginVersion``, ``editorType: "sql"``, ``rawSql``, ``format`` 0 =
time series / 1 = table, ``queryType`` timeseries / table): a target without ``pluginVersion`` is
read as a v3 query and migrated, which marks the board modified on open. Query variables use the
plugin's variable model (``queryType: "sql"``, ``rawSql``). Prometheus targets use ``expr``.

Why not grafana-foundation-sdk (measured with 10.1.0, and its 11.6.0 build, by
``bench/grafana_sdk_compare.py``; docs/dashboards.md has the figures): it has no dataquery for
grafana-clickhouse-datasource, so ``rawSql``, ``format``, ``editorType`` and ``pluginVersion`` still
need a hand-written target class (the same dict as :func:`sql_target`). What it generates for the
fleet and incidents boards fails two of tests/test_dashboards.py's checks: panels have no ids (every row
0) and its variable model has no ``definition``. The schema version is set by the SDK build (36 or 41,
not 39), 10.1.0 cannot express the built-in annotation, data links come out as dashboard links (8 extra
keys each), and its layout lets a panel run past the 24 columns (the weights board). The port is
shorter (65 helper lines for 152 here; boards 57 / 116 lines for 62 / 127), but only with 19 lines
patching the JSON afterwards and a layout of our own, so the SDK's types would cover none of the
fields the plugin reads.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

SCHEMA_VERSION = 39  # Grafana 11.x dashboards
CLICKHOUSE_TYPE = "grafana-clickhouse-datasource"
PROMETHEUS_TYPE = "prometheus"
CLICKHOUSE_PLUGIN_VERSION = "4.20.0"
"""The plugin version compose/compose.yaml installs (GF_INSTALL_PLUGINS); tests check they agree."""
CLICKHOUSE_UID = "triscope-clickhouse"
PROMETHEUS_UID = "triscope-prometheus"
CLICKHOUSE = {"type": CLICKHOUSE_TYPE, "uid": CLICKHOUSE_UID}
PROMETHEUS = {"type": PROMETHEUS_TYPE, "uid": PROMETHEUS_UID}
FOLDER_TITLE = "triscope"
FOLDER_UID = "triscope"
TAG = "triscope"

FORMAT_TIME_SERIES = 0
FORMAT_TABLE = 1


def sql_target(sql: str, ref: str = "A", table: bool = False) -> dict[str, Any]:
    """A ClickHouse SQL-editor target (time series unless ``table``)."""
    return {
        "datasource": dict(CLICKHOUSE), "editorType": "sql", "rawSql": sql.strip(), "refId": ref,
        "pluginVersion": CLICKHOUSE_PLUGIN_VERSION, "format": FORMAT_TABLE if table else FORMAT_TIME_SERIES,
        "queryType": "table" if table else "timeseries",
    }


def prom_target(expr: str, legend: str = "", ref: str = "A") -> dict[str, Any]:
    """A Prometheus range-query target."""
    return {"datasource": dict(PROMETHEUS), "expr": expr, "legendFormat": legend or "__auto",
            "range": True, "refId": ref}


def link(title: str, board_uid: str, set_vars: dict[str, str] | None = None, carry: Sequence[str] = (),
         keep_time: bool = True) -> dict[str, Any]:
    """A data link to another board: ``set_vars`` become ``var-NAME=VALUE`` (values may use
    ``${__data.fields.x}`` / ``${__field.labels.x}``); ``carry`` passes the current selection of
    these variables on (``${NAME:queryparam}``)."""
    parts = [f"var-{name}={value}" for name, value in (set_vars or {}).items()]
    parts += [f"${{{name}:queryparam}}" for name in carry]
    if keep_time:
        parts.append("${__url_time_range}")
    return {"title": title, "url": f"/d/{board_uid}?{'&'.join(parts)}"}


@dataclass
class Panel:
    """One panel before layout: its JSON minus ``id`` and ``gridPos``."""

    body: dict[str, Any]
    w: int = 12
    h: int = 8


def _panel(kind: str, title: str, targets: list[dict[str, Any]], description: str, unit: str,
           options: dict[str, Any] | None, custom: dict[str, Any] | None, links: Sequence[dict[str, Any]],
           overrides: list[dict[str, Any]] | None, thresholds: list[tuple[float | None, str]] | None,
           w: int, h: int, extra: dict[str, Any] | None = None) -> Panel:
    defaults: dict[str, Any] = {}
    if unit:
        defaults["unit"] = unit
    if custom:
        defaults["custom"] = custom
    if links:
        defaults["links"] = list(links)
    if thresholds:
        defaults["thresholds"] = {"mode": "absolute",
                                  "steps": [{"color": c, "value": v} for v, c in thresholds]}
    body = {
        "type": kind, "title": title, "description": description,
        "datasource": dict(targets[0]["datasource"]) if targets else dict(CLICKHOUSE),
        "targets": targets,
        "fieldConfig": {"defaults": defaults, "overrides": overrides or []},
        "options": options or {},
    }
    body.update(extra or {})
    return Panel(body, w, h)


def timeseries(title: str, targets: list[dict[str, Any]], description: str = "", unit: str = "",
               links: Sequence[dict[str, Any]] = (), thresholds: list[tuple[float | None, str]] | None = None,
               stack: bool = False, w: int = 12, h: int = 8) -> Panel:
    """A time-series panel (thresholds, when given, are drawn as dashed lines)."""
    custom: dict[str, Any] = {"drawStyle": "line", "lineWidth": 1, "fillOpacity": 10, "showPoints": "never",
                              "spanNulls": False}
    if stack:
        custom["stacking"] = {"mode": "normal", "group": "A"}
        custom["fillOpacity"] = 60
    if thresholds:
        custom["thresholdsStyle"] = {"mode": "dashed"}
    options = {"legend": {"displayMode": "table", "placement": "right", "calcs": ["mean", "max"]},
               "tooltip": {"mode": "multi", "sort": "desc"}}
    return _panel("timeseries", title, targets, description, unit, options, custom, links, None, thresholds, w, h)


def table(title: str, targets: list[dict[str, Any]], description: str = "",
          column_links: dict[str, list[dict[str, Any]]] | None = None,
          column_units: dict[str, str] | None = None, w: int = 24, h: int = 8) -> Panel:
    """A table; ``column_links`` adds data links on the named columns, ``column_units`` units."""
    overrides = []
    for name, links in (column_links or {}).items():
        overrides.append({"matcher": {"id": "byName", "options": name},
                          "properties": [{"id": "links", "value": links}]})
    for name, unit in (column_units or {}).items():
        overrides.append({"matcher": {"id": "byName", "options": name},
                          "properties": [{"id": "unit", "value": unit}]})
    options = {"showHeader": True, "cellHeight": "sm", "footer": {"show": False}}
    return _panel("table", title, targets, description, "", options, {"align": "auto", "filterable": True},
                  (), overrides, None, w, h)


def stat(title: str, targets: list[dict[str, Any]], description: str = "", unit: str = "",
         thresholds: list[tuple[float | None, str]] | None = None, w: int = 6, h: int = 4) -> Panel:
    """A single-value panel (last value of the series, or the table's value)."""
    options = {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
               "colorMode": "value", "graphMode": "area", "textMode": "auto"}
    return _panel("stat", title, targets, description, unit, options, None, (), None,
                  thresholds or [(None, "green")], w, h)


def bargauge(title: str, targets: list[dict[str, Any]], description: str = "", unit: str = "",
             thresholds: list[tuple[float | None, str]] | None = None, w: int = 12, h: int = 8) -> Panel:
    """Horizontal bars, one per row of a table result (``values: true``)."""
    options = {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": True},
               "orientation": "horizontal", "displayMode": "gradient", "showUnfilled": True}
    return _panel("bargauge", title, targets, description, unit, options, None, (), None,
                  thresholds or [(None, "green")], w, h)


def heatmap(title: str, targets: list[dict[str, Any]], description: str = "", y_unit: str = "",
            w: int = 12, h: int = 9) -> Panel:
    """A heatmap of buckets computed in ClickHouse.

    The query returns long rows ``xMin`` (time or number), ``yMin``, ``count`` ordered by x then y;
    Grafana's *grouping to matrix* transformation pivots them into the heatmap's rows frame (x,
    then one count field per y bucket, named by its lower edge). With a numeric x, Grafana keeps
    the fields in order of first appearance, so such queries return the complete grid (zeros
    included) so that the first x row lists every y bucket in ascending order."""
    options = {
        "calculate": False,
        "cellGap": 1,
        "color": {"mode": "scheme", "scheme": "Turbo", "scale": "exponential", "exponent": 0.5,
                  "fill": "dark-orange", "steps": 64, "reverse": False},
        "yAxis": {"axisPlacement": "left", "unit": y_unit},
        "rowsFrame": {"layout": "ge"},
        "cellValues": {"unit": "short"},
        "tooltip": {"mode": "single", "yHistogram": True, "showColorScale": True},
        "legend": {"show": True},
        "filterValues": {"le": 1e-9},
        "exemplars": {"color": "rgba(255,0,255,0.7)"},
    }
    matrix = {"id": "groupingToMatrix", "options": {"columnField": "yMin", "rowField": "xMin",
                                                    "valueField": "count", "emptyValue": "zero"}}
    return _panel("heatmap", title, targets, description, "", options,
                  {"scaleDistribution": {"type": "linear"}, "hideFrom": {"legend": False, "tooltip": False,
                                                                          "viz": False}},
                  (), None, None, w, h, extra={"transformations": [matrix]})


def text(title: str, markdown: str, w: int = 24, h: int = 3) -> Panel:
    """A markdown note."""
    return Panel({"type": "text", "title": title, "options": {"mode": "markdown", "content": markdown.strip()}},
                 w, h)


def row(title: str) -> Panel:
    """A (non-collapsed) row header."""
    return Panel({"type": "row", "title": title, "collapsed": False, "panels": []}, 24, 1)


# ---------------------------------------------------------------- variables

@dataclass(frozen=True)
class Variable:
    """A dashboard template variable; ``sql`` makes it a ClickHouse query variable."""

    name: str
    label: str
    sql: str = ""
    multi: bool = True
    include_all: bool = True
    kind: str = "query"  # query, textbox, custom, constant
    default: str = ""
    hide: int = 0
    description: str = ""

    def to_json(self) -> dict[str, Any]:
        base: dict[str, Any] = {"name": self.name, "label": self.label, "type": self.kind, "hide": self.hide,
                                "skipUrlSync": False, "description": self.description}
        if self.kind == "query":
            sql = self.sql.strip()
            base.update({
                "datasource": dict(CLICKHOUSE), "definition": sql,
                "query": {"queryType": "sql", "rawSql": sql, "refId": "var"},  # the plugin's default refId
                "refresh": 2,  # on time-range change; sort 0 keeps the SQL ORDER BY (GPU 2 before 10)
                "regex": "", "sort": 0, "multi": self.multi, "includeAll": self.include_all,
                "allValue": None, "options": [],
                "current": ({"selected": True, "text": ["All"], "value": ["$__all"]} if self.include_all
                            else {}),
            })
        else:
            base.update({"query": self.default,
                         "current": {"selected": False, "text": self.default, "value": self.default},
                         "options": [{"selected": True, "text": self.default, "value": self.default}]})
        return base


# ---------------------------------------------------------------- dashboard

def layout(panels: Iterable[Panel]) -> list[dict[str, Any]]:
    """Assign ids (1, 2, ...) and flow panels left to right, top to bottom, on the 24-column grid."""
    out: list[dict[str, Any]] = []
    x = y = row_h = 0
    for i, p in enumerate(panels, start=1):
        if p.body["type"] == "row" or x + p.w > 24:
            y += row_h
            x = row_h = 0
        out.append({"id": i, "gridPos": {"h": p.h, "w": p.w, "x": x, "y": y}, **p.body})
        x += p.w
        row_h = max(row_h, p.h)
        if p.body["type"] == "row":
            y += p.h
            x = row_h = 0
    return out


@dataclass
class Board:
    """One dashboard: uid, title, variables and panels."""

    uid: str
    title: str
    description: str
    variables: list[Variable]
    panels: list[Panel]
    tags: list[str] = field(default_factory=list)
    time_from: str = "now-1h"
    refresh: str = "30s"

    def to_json(self) -> dict[str, Any]:
        return {
            "uid": self.uid, "title": self.title, "description": self.description,
            "tags": [TAG, *self.tags], "timezone": "utc", "editable": True, "graphTooltip": 1,
            "schemaVersion": SCHEMA_VERSION, "version": 1, "id": None,
            "time": {"from": self.time_from, "to": "now"}, "refresh": self.refresh,
            "fiscalYearStartMonth": 0, "liveNow": False, "weekStart": "",
            "timepicker": {"refresh_intervals": ["10s", "30s", "1m", "5m", "15m"]},
            "links": [{"title": "triscope boards", "type": "dashboards", "tags": [TAG], "asDropdown": True,
                       "includeVars": True, "keepTime": True, "icon": "external link", "targetBlank": False}],
            "annotations": {"list": [{
                "builtIn": 1, "datasource": {"type": "grafana", "uid": "-- Grafana --"}, "enable": True,
                "hide": True, "iconColor": "rgba(0, 211, 255, 1)", "name": "Annotations & Alerts",
                "type": "dashboard"}]},
            "templating": {"list": [v.to_json() for v in self.variables]},
            "panels": layout(self.panels),
        }
