"""dcgm-exporter scraper for ``gpu_samples``: one row per GPU (or MIG instance) and scrape.

Targets are dcgm-exporter endpoints or a Prometheus ``/federate`` endpoint re-exporting them;
each is fetched with a total deadline and a bounded body, on its own thread. Layout:
:mod:`.parse` (the text, DCGM fields and blank values), :mod:`.rows` (hosts, workloads, MIG
instances, rows), :mod:`.scraper` (the collector), :mod:`.config` (``[dcgm]``). Labels, units,
blanks, states and deployment shapes: docs/gpu-collectors.md. Registry name ``dcgm`` -> :func:`create`.
"""

from __future__ import annotations

from typing import Any

from triscope.collectors.dcgm.config import DcgmConfig, TargetSpec
from triscope.collectors.dcgm.parse import FIELDS, Field, Parsed, is_blank, parse_exposition
from triscope.collectors.dcgm.rows import NO_GPU, Identity, fold, rows_from_text
from triscope.collectors.dcgm.scraper import DcgmScraper
from triscope.component import Context
from triscope.http_fetch import UnreachableError


def create(config: dict[str, Any], context: Context) -> DcgmScraper:
    """The dcgm-exporter scraper (``[dcgm]``)."""
    return DcgmScraper(DcgmConfig.from_config(config))


__all__ = ["FIELDS", "NO_GPU", "DcgmConfig", "DcgmScraper", "Field", "Identity", "Parsed", "TargetSpec",
           "UnreachableError", "create", "fold", "is_blank", "parse_exposition", "rows_from_text"]
