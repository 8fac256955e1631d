"""Scrape vLLM, SGLang, TGI, Triton / TensorRT-LLM and llama.cpp ``/metrics`` into ``serving_metrics``.

One row per scraped instance and model: queue length, running requests, KV-cache usage, finished
requests, preemptions, sleep state, waiting by reason, swapped requests, and P50/P99 latency, P99
TTFT, queue time and inter-token latency from the *change* of the histograms since the previous
scrape (NaN on the first scrape, when nothing finished in between, and when the engine does not
expose the figure). Modules: :mod:`.engines` (family names per engine), :mod:`.aggregate` (data- and
tensor-parallel shapes), :mod:`.targets` (config), :mod:`.scraper` (the collector). Engine versions
and deployment shapes covered: docs/run.md.
"""

from __future__ import annotations

from typing import Any

from triscope.collectors.serving_metrics.aggregate import InstanceSnapshot, aggregate
from triscope.collectors.serving_metrics.engines import ENGINES, detect_server
from triscope.collectors.serving_metrics.scraper import ServingMetricsScraper
from triscope.collectors.serving_metrics.targets import ServingMetricsConfig, Target
from triscope.component import Context

SERVERS = ENGINES
"""Former name of :data:`~.engines.ENGINES`."""


def create(config: dict[str, Any], context: Context) -> ServingMetricsScraper:
    """``triscope run`` entry point (``[run] collectors = ["serving_metrics"]``); rows go back through collect()."""
    return ServingMetricsScraper(ServingMetricsConfig.from_config(config))


__all__ = ["ENGINES", "SERVERS", "InstanceSnapshot", "ServingMetricsConfig", "ServingMetricsScraper", "Target",
           "aggregate", "create", "detect_server"]
