"""Names usable in ``[run] collectors`` / ``[run] exporters``, each a ``module:create`` factory.

Adding a component is one line here plus its package (see docs/architecture.md). Any
``package.module:create`` path works too, for components that live outside triscope.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping

from triscope.component import Factory
from triscope.errors import ConfigError

COLLECTORS: dict[str, str] = {
    "blockio": "triscope.collectors.blockio:create",  # bpftrace as root, /proc/diskstats otherwise
    "blockio_bpftrace": "triscope.collectors.blockio:create",
    "blockio_diskstats": "triscope.collectors.blockio:create_diskstats",
    "blockio_ebpf_exporter": "triscope.collectors.blockio:create_ebpf_exporter",
    "serving_metrics": "triscope.collectors.serving_metrics:create",
    "otlp": "triscope.collectors.otlp:create",
    "nvml": "triscope.collectors.nvml:create",
    "dcgm": "triscope.collectors.dcgm:create",
    "torch_allocator": "triscope.collectors.torch_allocator:create",
    "host": "triscope.collectors.host:create",  # engines' CPU wait and RSS, host PSI and OOM kills
}
"""Collector names usable in ``[run] collectors``."""

EXPORTERS: dict[str, str] = {
    "prometheus": "triscope.exporters.prometheus:create",
    "weights_feed": "triscope.exporters.feed:create",
    "epp": "triscope.exporters.epp_service:create",  # per-request picks over Envoy ext_proc (GIE EPP)
}
"""Exporter names usable in ``[run] exporters``."""


def resolve(spec: str, registry: Mapping[str, str], kind: str) -> Factory:
    """The factory named by a registry key or ``module:create``; ConfigError (one line) otherwise."""
    target = registry.get(spec, spec)
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"unknown {kind} {spec!r}; use one of {', '.join(sorted(registry)) or '(none)'} "
                          "or 'package.module:create'")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        raise ConfigError(f"{kind} {spec!r}: module {exc.name} is not available") from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise ConfigError(f"{kind} {spec!r}: {module_name} has no factory {attr!r}")
    return factory
