"""Prometheus families of the per-request picker (``[epp]``, exporters/epp_service.py) from its live counters.

The daemon hands every exporter's ``stats()`` to this exporter under ``exporters``; the picker's
(``exporters.epp``) becomes ``triscope_epp_*``: picks per backend, requests answered without one
(refused by an admission level, or a body it could not read), requests in flight, scrapes and their
failures per backend, each backend's scrape period and the pick tables served to HAProxy.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric


def picker_families(stats: Mapping[str, Any]) -> Iterator[Metric]:
    """The ``triscope_epp_*`` families from :meth:`EppService.stats` (nothing for an empty mapping)."""
    if not stats:
        return
    picks = CounterMetricFamily("triscope_epp_picks_total", "Requests the picker sent to each backend.",
                                labels=["backend"])
    answered = CounterMetricFamily("triscope_epp_answered_total", "Requests the picker answered itself "
                                   "instead of routing them, by HTTP status (refusals, unreadable bodies).",
                                   labels=["status"])
    for key, n in sorted((stats.get("picks") or {}).items()):
        if key.startswith("status:"):
            answered.add_metric([key.split(":", 1)[1]], float(n))
        else:
            picks.add_metric([key], float(n))
    yield from (picks, answered)
    refused = CounterMetricFamily("triscope_epp_refused_total", "Requests refused by their class's admission "
                                  "level ([weights.levels]).", labels=["request_class", "level"])
    for key, n in sorted((stats.get("refused") or {}).items()):
        request_class, _, level = key.rpartition(":")
        refused.add_metric([request_class, level], float(n))
    yield refused
    in_flight = GaugeMetricFamily("triscope_epp_in_flight_requests", "Requests the picker sent that have not "
                                  "ended, per backend (its ledger).", labels=["backend"])
    for backend, n in sorted((stats.get("in_flight") or {}).items()):
        in_flight.add_metric([backend], float(n))
    yield in_flight
    scrapes = CounterMetricFamily("triscope_epp_scrapes_total", "Scrapes of the engines' /metrics that answered.")
    scrapes.add_metric([], float(stats.get("scrapes_total", 0)))
    failures = CounterMetricFamily("triscope_epp_scrape_failures_total", "Scrapes of a backend's /metrics that "
                                   "failed (timeout, refused, unreadable).", labels=["backend"])
    for backend, n in sorted((stats.get("scrape_failures") or {}).items()):
        failures.add_metric([backend], float(n))
    period = GaugeMetricFamily("triscope_epp_scrape_period_seconds", "Each backend's current scrape period "
                               "(scrape_interval_s, longer while its /metrics is slow: the scrape budget).",
                               labels=["backend"])
    for backend, seconds in sorted((stats.get("scrape_periods_s") or {}).items()):
        period.add_metric([backend], float(seconds))
    yield from (scrapes, failures, period)
    version = GaugeMetricFamily("triscope_epp_weights_version", "Version of the weight engine's result the "
                                "picker follows (0: none yet).")
    version.add_metric([], float(stats.get("weights_version", 0)))
    yield version
    if "tables_served" in stats:
        tables = CounterMetricFamily("triscope_epp_pick_tables_served_total", "Pick tables served to HAProxy's "
                                     "Lua picker (GET /v1/pick-table).")
        tables.add_metric([], float(stats["tables_served"]))
        yield tables
