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

from collections.abc import Mapping, Sequence

from triscope.dashboards.common import t
from triscope.schema.model import Rollup

INTERVAL = "$__interval_s"


def _fits(bucket_s: int) -> str:
    return f"({INTERVAL} >= {bucket_s} AND {INTERVAL} % {bucket_s} = 0)"


def gauge_averages(rollups: Sequence[Rollup], keys: Mapping[str, str], gauges: Mapping[str, str],
                   where: str) -> str:
    """``time``, the ``keys`` (alias -> expression over the table's key columns) and each gauge's
    average (alias -> gauge column) per ``$__timeInterval(ts)``, filtered by ``$__timeFilter(ts)``
    and ``where`` (key columns only), from the table that fits the panel's interval."""
    if not rollups:
        raise ValueError("gauge_averages needs at least one rollup")
    source = rollups[0].source
    ordered = sorted(rollups, key=lambda r: r.bucket_s, reverse=True)
    for r in ordered:
        if r.source is not source:
            raise ValueError(f"rollups of different tables: {source.name}, {r.source.name}")
        absent = [g for g in gauges.values() if g not in r.gauges]
        if absent:
            raise ValueError(f"{r.table.name} does not roll up {absent}")
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


__all__: Sequence[str] = ["INTERVAL", "gauge_averages"]
