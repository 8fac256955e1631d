"""Panel SQL that averages gauges per interval from the raw table or the rollup that fits the interval.

A panel over 24 hours asks for a point every minute or two; reading it from ``gpu_samples`` scans
every 100 ms sample of the range. The rollups (``<table>_10s``, ``<table>_1m``: per bucket and key,
each gauge's sum and count of finite values) answer it from one row per bucket. Which one a query
reads is decided by the panel's own interval (the plugin's ``$__interval_s``, the same number
``$__timeInterval`` groups by): the coarsest rollup whose bucket divides the interval, else the raw
table. Every branch but the chosen one has a constant false condition, which ClickHouse folds
before reading, so the query scans one table. Because the bucket divides the interval, each window
is a union of whole buckets and ``sum(sum) / sum(count)`` equals the raw ``avgIf(g, isFinite(g))``;
only the range's first and last windows may differ, by the part of a bucket that straddles the
range's edge (the rollup's resolution).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from triscope.dashboards.common import t
from triscope.schema.rollup import Rollup

INTERVAL = "$__interval_s"


def _fits(bucket_s: int) -> str:
    return f"({INTERVAL} >= {bucket_s} AND {INTERVAL} % {bucket_s} = 0)"


def gauge_averages(rollups: Sequence[Rollup], keys: Mapping[str, str], gauges: Mapping[str, str],
                   where: str) -> str:
    """``time``, the ``keys`` (alias -> expression over the table's key columns) and each gauge's
    average (alias -> gauge column) per ``$__timeInterval(ts)``, filtered by ``$__timeFilter(ts)``
    and ``where`` (key columns only), from the table that fits the panel's interval."""
    _check(rollups, gauges.values())
    source = rollups[0].source
    ordered = sorted(rollups, key=lambda r: r.bucket_s, reverse=True)
    key_sql = ", ".join(f"{expr} AS {alias}" for alias, expr in keys.items())
    group = ", ".join(["time", *keys])

    def branch(table: str, aggregates: list[str], condition: str) -> str:
        return (f"SELECT $__timeInterval(ts) AS time, {key_sql}, {', '.join(aggregates)} FROM {table} "
                f"WHERE $__timeFilter(ts) AND {where} AND {condition} GROUP BY {group}")

    branches: list[str] = []
    taken: list[str] = []
    for r in ordered:
        condition = " AND ".join([_fits(r.bucket_s), *(f"NOT {c}" for c in taken)])
        taken.append(_fits(r.bucket_s))
        branches.append(branch(t(r.table), [f"sum(`{g}_sum`) / sum(`{g}_count`) AS {alias}"
                                            for alias, g in gauges.items()], condition))
    raw = " AND ".join(f"NOT {c}" for c in taken)
    branches.append(branch(t(source), [f"avgIf(`{g}`, isFinite(`{g}`)) AS {alias}" for alias, g in gauges.items()],
                           raw))
    return " UNION ALL ".join(branches)


COARSE_S = f"(intDiv({INTERVAL} + 9, 10) * 10)"
"""A coarse window in seconds: the panel's interval rounded up to a multiple of 10 s, so that the 10 s
rollup (or the 1 min one, when 60 s divides it) holds whole windows."""


def window_ns(fine_ns: int) -> str:
    """The width in ns of the windows a per-window rule is evaluated over: ``fine_ns`` while the
    panel's interval is at most 1 s (a zoomed-in range), else :data:`COARSE_S`: about as many windows
    as the panel has points, each answered by a rollup."""
    return f"toInt64(if({INTERVAL} > 1, {COARSE_S} * 1000000000, {fine_ns}))"


def window_time(w: str, fine_ns: int) -> str:
    """The start (DateTime, whole seconds) of window ``w`` of :func:`window_ns`."""
    return f"toDateTime(intDiv({w} * {window_ns(fine_ns)}, 1000000000))"


def window_bucket(w: str, fine_ns: int) -> str:
    """The time a time-axis panel plots window ``w`` at: fine windows grouped by ``$__timeInterval``,
    a coarse window (as wide as the interval or wider) at its own start."""
    start = window_time(w, fine_ns)
    return f"if({INTERVAL} > 1, {start}, $__timeInterval({start}))"


def _window_fits(bucket_s: int) -> str:
    return f"({INTERVAL} > 1 AND {COARSE_S} % {bucket_s} = 0)"


def gauge_windows(rollups: Sequence[Rollup], keys: Mapping[str, str], gauges: Mapping[str, str], where: str,
                  fine_ns: int, time_filter: str = "$__timeFilter(ts)") -> str:
    """``w`` (the window's number: start / :func:`window_ns`), the ``keys`` and each gauge's average
    per window, filtered by ``time_filter`` and ``where`` (key columns only), from the coarsest rollup
    whose bucket divides the window (every coarse window), else (fine windows) from the raw rows. Equal to the raw
    ``avgIf(g, isFinite(g))`` per window (the rollup's resolution aside: see the module's note)."""
    _check(rollups, gauges.values())
    source = rollups[0].source
    key_sql = ", ".join(f"{expr} AS {alias}" for alias, expr in keys.items())
    group = ", ".join([*keys, "w"])
    branches: list[str] = []
    taken: list[str] = []
    for r in sorted(rollups, key=lambda r: r.bucket_s, reverse=True):
        condition = " AND ".join([_window_fits(r.bucket_s), *(f"NOT {c}" for c in taken)])
        taken.append(_window_fits(r.bucket_s))
        averages = ", ".join(f"sum(`{g}_sum`) / sum(`{g}_count`) AS {alias}" for alias, g in gauges.items())
        branches.append(f"SELECT {key_sql}, intDiv(toInt64(toUnixTimestamp(ts)), {COARSE_S}) AS w, {averages} "
                        f"FROM {t(r.table)} WHERE {time_filter} AND {where} AND {condition} GROUP BY {group}")
    averages = ", ".join(f"avgIf(`{g}`, isFinite(`{g}`)) AS {alias}" for alias, g in gauges.items())
    branches.append(f"SELECT {key_sql}, intDiv(toUnixTimestamp64Nano(ts), {window_ns(fine_ns)}) AS w, {averages} "
                    f"FROM {t(source)} WHERE {time_filter} AND {where} AND "
                    f"{' AND '.join(f'NOT {c}' for c in taken)} GROUP BY {group}")
    return " UNION ALL ".join(branches)


def _check(rollups: Sequence[Rollup], gauges: Iterable[str]) -> None:
    if not rollups:
        raise ValueError("a rollup query needs at least one rollup")
    for r in rollups:
        if r.source is not rollups[0].source:
            raise ValueError(f"rollups of different tables: {rollups[0].source.name}, {r.source.name}")
        absent = [g for g in gauges if g not in r.gauges]
        if absent:
            raise ValueError(f"{r.table.name} does not roll up {absent}")


__all__: Sequence[str] = ["COARSE_S", "INTERVAL", "gauge_averages", "gauge_windows", "window_bucket", "window_ns",
                          "window_time"]
