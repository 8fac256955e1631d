"""Prometheus ``/metrics`` exporter of ``triscope run``: pipeline health plus metrics derived from the store.

``[run] exporters = ["prometheus"]``; the ``[prometheus]`` section (:class:`PrometheusConfig`) sets
``listen`` (127.0.0.1) and ``port``. Pipeline health (writer rows submitted / written / replayed /
dropped / rejected, spool queue and bytes, last write, rows and errors per collector, store up)
comes from the daemon's live counters on every scrape; derived metrics (request rate and P99
per backend, GPU memory, KV-cache usage, stall shares) from SQL over the last ``window_s``
seconds of the store (:mod:`.queries`), cached (:mod:`.collector`). Served by :mod:`.server`.
"""

from triscope.exporters.prometheus.collector import TriscopeCollector
from triscope.exporters.prometheus.config import PrometheusConfig, prometheus_config
from triscope.exporters.prometheus.server import PrometheusExporter, create

__all__ = ["PrometheusConfig", "PrometheusExporter", "TriscopeCollector", "create", "prometheus_config"]
