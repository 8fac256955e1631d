"""The QPS x GPU memory x latency heatmap, in ClickHouse SQL with the analyzer's semantics.

Same definitions as :mod:`triscope.analyzers.heatmap` (default :class:`HeatmapSpec`): a request's
QPS is its backend's request count in its 100 ms window / 0.1 s (host and backend variables pick
backends; the model, version, modality, resolution and class variables pick the requests counted,
not the load); its memory is the mean ``memory_used_bytes`` of its GPU (``requests.gpu`` as index or
uuid) in the latest sampled window at most 5 s earlier (ASOF join); a request with an empty
``gpu`` gets its whole host: in every window where one of the host's GPUs reported, the sum of each
GPU's latest window mean (each at most 5 s old), as in the analyzer;
bins of 5 QPS, 200 MB and 10 ms, values past the last bin clamped into it. Requests without a
memory sample in reach are counted as unmatched and left out.

Those windows are 100 ms while the panel's interval is at most 1 s; beyond, they are the interval
rounded up to a multiple of 10 s (:func:`~triscope.dashboards.rollup_sql.window_ns`) and the GPU
means come from the 10 s or 1 min rollup: the tensor ``triscope heatmap`` computes with that
``window_ms``, QPS being the window's request count over its width.
"""

from __future__ import annotations

from triscope.analyzers.heatmap import HeatmapSpec
from triscope.dashboards.common import (
    BACKEND_FILTER,
    DATABASE,
    REQUEST_DIMENSIONS,
    REQUEST_SELECTED,
    backend_var,
    cond,
    host_var,
    request_vars,
    t,
)
from triscope.dashboards.model import Board, Panel, heatmap, link, row, sql_target, stat, table, text
from triscope.dashboards.rollup_sql import gauge_windows, window_bucket, window_ns
from triscope.schema import GPU_SAMPLES, REQUESTS
from triscope.schema.gpu import GPU_SAMPLES_1M, GPU_SAMPLES_10S

UID = "triscope-heatmap"
FLEET_UID = "triscope-fleet"
SPEC = HeatmapSpec()


def _g(x: float) -> str:
    return repr(float(x))


def _per_gpu(hosts: str, spec: HeatmapSpec) -> str:
    """Per GPU of ``hosts`` (a condition on ``host``) and window: ``h``, ``gpu``, ``w``, the mean finite
    ``memory_used_bytes`` (``used``), reaching back as far as the ASOF lookup may; from the rollup whose
    bucket divides the window when one does."""
    reach = f"toIntervalSecond(intDiv(({_max_age_w(spec)} + 1) * {_wns(spec)}, 1000000000) + 1)"
    windows = gauge_windows((GPU_SAMPLES_10S, GPU_SAMPLES_1M), {"h": "toString(host)", "gpu": "gpu"},
                            {"used": "memory_used_bytes"}, hosts, spec.window_ns,
                            time_filter=f"ts >= $__fromTime - {reach} AND ts <= $__toTime")
    return f"SELECT h, gpu, w, used FROM ({windows}) WHERE isFinite(used)"


def _wns(spec: HeatmapSpec) -> str:
    return window_ns(spec.window_ns)


def _max_age_w(spec: HeatmapSpec) -> str:
    return f"intDiv({int(spec.memory_max_age_s * 1e9)}, {_wns(spec)})"


def _hosts_whose_requests(gpu: str) -> str:
    """Hosts with a request in the range whose ``gpu`` meets ``gpu``: the memory rows only they need
    are read for them alone (none at all when no request asks)."""
    return f"host IN (SELECT host FROM {t(REQUESTS)} WHERE $__timeFilter(ts) AND {BACKEND_FILTER} AND {gpu})"


def cells_cte(spec: HeatmapSpec = SPEC) -> str:
    """CTEs ``wins`` (per backend window), ``mem`` (per GPU / host window) and ``cells`` (joined).

    The window is ``spec.window_ms`` while the panel's interval is at most 1 s, else the interval
    (:func:`~triscope.dashboards.rollup_sql.window_ns`): the tensor of ``triscope heatmap`` with that
    ``window_ms``."""
    wns, max_age_w = _wns(spec), _max_age_w(spec)
    sel = f"isFinite(latency_seconds) AND {REQUEST_SELECTED}"
    by_uuid = _hosts_whose_requests("gpu != '' AND NOT match(toString(gpu), '^[0-9]+$')")
    whole = _hosts_whose_requests("gpu = ''")
    return f"""
WITH
  wins AS (
    SELECT toString(backend) AS b, intDiv(toUnixTimestamp64Nano(ts), {wns}) AS w,
           any(toString(host)) AS h, any(toString(gpu)) AS g, count() AS n,
           groupArrayIf(latency_seconds, {sel}) AS lats,
           groupArrayIf(toString(modality), {sel}) AS mods,
           groupArrayIf(toString(request_class), {sel}) AS classes
    FROM {t(REQUESTS)}
    WHERE $__timeFilter(ts) AND {BACKEND_FILTER}
    GROUP BY b, w
  ),
  mem AS (
    SELECT h, toString(gpu) AS g, w, used FROM ({_per_gpu(cond('host', 'host'), spec)})
    UNION ALL
    SELECT p.h AS h, u.uuid AS g, p.w AS w, p.used AS used FROM ({_per_gpu(by_uuid, spec)}) AS p
    INNER JOIN (SELECT DISTINCT toString(host) AS h, gpu, toString(gpu_uuid) AS uuid FROM {t(GPU_SAMPLES)}
                WHERE $__timeFilter(ts) AND gpu_uuid != '' AND {by_uuid}) AS u ON p.h = u.h AND p.gpu = u.gpu
    UNION ALL
    SELECT x.hh AS h, '' AS g, x.ww AS w, sumIf(p.used, p.w > 0 AND x.ww - p.w <= {max_age_w}) AS used
    FROM (SELECT hw.h AS hh, hw.w AS ww, hg.gpu AS gg
          FROM (SELECT DISTINCT h, w FROM ({_per_gpu(whole, spec)})) AS hw
          INNER JOIN (SELECT DISTINCT h, gpu FROM ({_per_gpu(whole, spec)})) AS hg ON hw.h = hg.h) AS x
    ASOF LEFT JOIN ({_per_gpu(whole, spec)}) AS p ON x.hh = p.h AND x.gg = p.gpu AND x.ww >= p.w
    GROUP BY x.hh, x.ww
  ),
  cells AS (
    SELECT wins.b AS backend, wins.w AS w, wins.lats AS lats, wins.mods AS mods, wins.classes AS classes,
           mem.w > 0 AND wins.w - mem.w <= {max_age_w} AS matched, mem.used AS used,
           least(toUInt32(floor(wins.n * 1e9 / {wns} / {_g(spec.qps_bin)})), {spec.qps_bins - 1}) AS qbin,
           least(toUInt32(floor(greatest(mem.used, 0) / {_g(spec.memory_bin_bytes)})), {spec.memory_bins - 1}) AS mbin
    FROM wins ASOF LEFT JOIN mem ON wins.h = mem.h AND wins.g = mem.g AND wins.w >= mem.w
  )
"""


def _lbin(spec: HeatmapSpec = SPEC) -> str:
    return f"least(toUInt32(floor(greatest(lat, 0) / {_g(spec.latency_bin_s)})), {spec.latency_bins - 1})"


def _wtime(spec: HeatmapSpec = SPEC) -> str:
    """The time a window is plotted at on a time axis (grouped by the interval when finer than it)."""
    return window_bucket("w", spec.window_ns)


def slice_sql(x: str, y: str, spec: HeatmapSpec = SPEC) -> str:
    """Cells (``xMin``, ``yMin``, ``count``) of the 2-D slice over axes ``x``, ``y`` (qps, memory,
    latency; ``x`` may also be time), ordered by x then y. Numeric slices return the complete grid
    (zero counts included), which the heatmap panel's grouping-to-matrix pivot needs."""
    bins = {"qps": ("qbin", spec.qps_bin, spec.qps_bins), "memory": ("mbin", spec.memory_bin_bytes, spec.memory_bins),
            "latency": (_lbin(spec), spec.latency_bin_s, spec.latency_bins)}
    ycol, ywidth, yn = bins[y]
    if x == "time":
        return (cells_cte(spec) + f"SELECT {_wtime(spec)} AS xMin, round({ycol} * {_g(ywidth)}, 6) "
                "AS yMin, count() AS count\nFROM cells ARRAY JOIN lats AS lat WHERE matched "
                "GROUP BY xMin, yMin ORDER BY xMin, yMin")
    xcol, xwidth, xn = bins[x]
    return (cells_cte(spec) + f""",
  counts AS (
    SELECT toUInt32({xcol}) AS xb, toUInt32({ycol}) AS yb, count() AS n
    FROM cells ARRAY JOIN lats AS lat WHERE matched GROUP BY xb, yb
  )
SELECT round(g.xb * {_g(xwidth)}, 6) AS xMin, round(g.yb * {_g(ywidth)}, 6) AS yMin, counts.n AS count
FROM (SELECT toUInt32(x.number) AS xb, toUInt32(y.number) AS yb FROM numbers({xn}) AS x \
CROSS JOIN numbers({yn}) AS y) AS g
LEFT JOIN counts ON g.xb = counts.xb AND g.yb = counts.yb
ORDER BY xMin, yMin""")


_UNITS = {"qps": "reqps", "memory": "bytes", "latency": "s"}


def _slice_panel(title: str, x: str, y: str, description: str) -> Panel:
    """A heatmap panel of the 2-D slice over ``x`` (an axis or time) and ``y``."""
    return heatmap(title, [sql_target(slice_sql(x, y), table=True)], description, y_unit=_UNITS[y], w=8)


def board() -> Board:
    """The heatmap dashboard."""
    s = SPEC
    variables = [DATABASE, host_var(REQUESTS), backend_var(), *request_vars()]
    note = (f"Windows of {s.window_ms:g} ms per backend while the panel's interval is at most 1 s, else of the "
            "interval rounded up to a multiple of 10 s (QPS = requests in the window / its width); "
            f"bins of {s.qps_bin:g} QPS x {s.qps_bins}, "
            f"{s.memory_bin_bytes / 1e6:g} MB x {s.memory_bins}, {s.latency_bin_s * 1e3:g} ms x {s.latency_bins} "
            "(values past the last bin are clamped into it). The same tensor as `triscope heatmap`; "
            "the x and y values are each bin's lower edge.")
    panels = [
        text("How to read", note, h=2),
        row("Slices of the tensor (x = bin of the first axis, y = bin of the second, colour = requests)"),
        _slice_panel("QPS x latency", "qps", "latency", "requests per (QPS bin, latency bin), memory summed out"),
        _slice_panel("GPU memory x latency", "memory", "latency",
                     "requests per (memory bin, latency bin), QPS summed out"),
        _slice_panel("QPS x GPU memory", "qps", "memory", "requests per (QPS bin, memory bin), latency summed out"),
        row("Over time"),
        _slice_panel("Latency over time", "time", "latency", "requests per latency bin and time bucket"),
        _slice_panel("QPS over time", "time", "qps", "requests per QPS bin of their backend window"),
        _slice_panel("GPU memory over time", "time", "memory", "requests per GPU-memory bin"),
        row("Load patterns"),
        table("Busiest (QPS, memory) cells", [sql_target(
            cells_cte() + f"SELECT qbin * {_g(s.qps_bin)} AS qps_from, "
            f"mbin * {_g(s.memory_bin_bytes)} AS memory_from_bytes, "
            "count() AS requests, quantileExactInclusive(0.95)(lat) AS p95_latency_seconds, "
            "topKWeighted(1)(modality, 1)[1] AS modality, topKWeighted(1)(rclass, 1)[1] AS request_class, "
            "round(max(used)) AS memory_max_bytes\n"
            "FROM cells ARRAY JOIN lats AS lat, mods AS modality, classes AS rclass WHERE matched "
            "GROUP BY qbin, mbin ORDER BY requests DESC, qbin, mbin LIMIT 20", table=True)],
            "the analyzer's patterns: requests, exact P95 and the dominant modality / class per cell",
            column_links={
                "modality": [link("Fleet: modality ${__data.fields.modality}", FLEET_UID,
                                  {"modality": "${__data.fields.modality}"}, carry=["host", "backend"])],
                "request_class": [link("Fleet: class ${__data.fields.request_class}", FLEET_UID,
                                       {"request_class": "${__data.fields.request_class}"},
                                       carry=["host", "backend"])],
            },
            column_units={"qps_from": "reqps", "memory_from_bytes": "bytes", "p95_latency_seconds": "s",
                          "memory_max_bytes": "bytes"}, w=16),
        stat("Requests without a memory sample", [sql_target(
            cells_cte() + "SELECT countIf(NOT matched) AS unmatched_requests FROM cells ARRAY JOIN lats AS lat",
            table=True)], f"no GPU sample of their GPU within {s.memory_max_age_s:g} s: left out of the tensor",
            thresholds=[(None, "green"), (1.0, "orange")], w=8, h=8),
    ]
    return Board(UID, "triscope / QPS x memory x latency", "The heatmap tensor of request load, GPU memory "
                 "and latency, sliced by any two axes; drill down by host, backend, model version, modality, "
                 "input resolution and request class.", variables, panels, tags=["heatmap"])


__all__ = ["REQUEST_DIMENSIONS", "SPEC", "UID", "board", "cells_cte", "slice_sql"]
