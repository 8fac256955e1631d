"""The ``host`` collector: each engine's CPU run and run-queue wait, its RSS, and the host's PSI and OOM kills.

``[host] engines`` names the engines by their address (``"127.0.0.1:8000"``, the serving-metrics
backend; the process listening on the port and its descendants are the engine) or as tables
``{backend = "...", pid = N}``; empty, the ``[serving_metrics]`` targets on this host. One
``host_samples`` row per engine and window, and one host-wide row (``backend = ''``).

``[host] node_exporter = "http://127.0.0.1:9100/metrics"`` reads the host-wide PSI and OOM kills from a
prometheus-node-exporter instead of ``/proc`` (and names the host row by its ``nodename``); a failed
scrape leaves those columns NaN for the window (missing, not zero) and is logged once per outage.
"""

from __future__ import annotations

import logging
import math
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from triscope.collectors.host import node_exporter, procfs
from triscope.component import ComponentConfig, Context, config_field, interval
from triscope.errors import ConfigError, InputError
from triscope.http_client import HttpClientConfig
from triscope.schema import HOST_SAMPLES, Table, encode_ts

LOCAL = {"127.0.0.1", "localhost", "::1", "0.0.0.0", ""}
RESOLVE_EVERY_S = 30.0
"""A missing engine's PID is looked up again this often (and whenever its process is gone)."""
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class HostHttp(HttpClientConfig):
    """``[host.http]``: the node-exporter scrape (a busy host's page is 60-500 kB)."""

    section = "host.http"
    timeout_s: float = 2.0
    redirects: str = "same-origin"


@dataclass(frozen=True)
class HostConfig(ComponentConfig):
    section = "host"
    interval_s: float = 1.0
    engines: list[str | dict[str, Any]] = config_field([])
    host: str = ""
    node_exporter: str = ""
    http: HostHttp = field(default_factory=HostHttp)
    """``[host.http]``: the node-exporter scrape's client (timeout_s 2.0, at most interval_s)."""

    def validate(self, where: str) -> None:
        interval(where, interval_s=self.interval_s)
        if self.node_exporter and urlsplit(self.node_exporter).scheme not in ("http", "https"):
            raise ConfigError(f"{where} node_exporter {self.node_exporter!r}: not an http(s) URL")
        for e in self.engines:
            if isinstance(e, dict) and (set(e) - {"backend", "pid"} or not isinstance(e.get("backend"), str)):
                raise ConfigError(f"{where} engines entry {e!r}: a table takes backend = \"host:port\" and pid")


@dataclass
class _Engine:
    backend: str
    port: int
    pid: int = 0
    fixed: bool = False
    looked_at: float = -math.inf
    last: tuple[float, float] | None = None


class HostCollector:
    name = "host"

    def __init__(self, cfg: HostConfig, config: Mapping[str, Any] | None = None) -> None:
        self.interval_s = cfg.interval_s
        self.hostname = cfg.host or socket.gethostname()
        self._host_named = bool(cfg.host)
        self.engines = [self._engine(e) for e in (cfg.engines or _targets(config or {}))]
        self.node_exporter = cfg.node_exporter
        self.node_http = cfg.http.replace(timeout_s=min(cfg.http.timeout_s, max(0.1, cfg.interval_s)))
        self.node_errors = 0
        self._node_down = False
        self._psi: dict[str, float] = {}
        self._oom = math.nan
        self._t = 0.0

    @staticmethod
    def _engine(spec: str | dict[str, Any]) -> _Engine:
        backend = spec if isinstance(spec, str) else str(spec["backend"])
        pid = 0 if isinstance(spec, str) else int(spec.get("pid") or 0)
        host, _, port = backend.rpartition(":")
        if not port.isdigit():
            raise ConfigError(f"[host] engine {backend!r} is not host:port")
        return _Engine(backend, int(port), pid, fixed=pid > 0)

    def start(self) -> None:
        self._psi, self._oom = self._host_totals()
        self._t = time.monotonic()
        self._collect_engines(time.time_ns(), 0.0)

    def _host_totals(self) -> tuple[dict[str, float], float]:
        """Cumulative PSI seconds and OOM kills, from node-exporter when configured, else /proc."""
        if not self.node_exporter:
            return procfs.psi_totals(), procfs.oom_kills()
        try:
            reading = node_exporter.scrape(self.node_exporter, self.node_http)
        except InputError as exc:
            self.node_errors += 1
            if not self._node_down:
                log.warning("host: node-exporter scrape failed, host pressure unknown until it answers: %s", exc)
            self._node_down = True
            return {}, math.nan
        if self._node_down:
            log.info("host: node-exporter %s answers again", self.node_exporter)
        self._node_down = False
        if reading.nodename and not self._host_named:
            self.hostname = reading.nodename
        return reading.psi, reading.oom_kills

    def _pids(self, e: _Engine, now: float) -> list[int]:
        if e.pid and not procfs.alive(e.pid):
            e.pid, e.last = (e.pid if e.fixed else 0), None
        if not e.pid and not e.fixed and now - e.looked_at >= RESOLVE_EVERY_S:
            e.looked_at = now
            e.pid = procfs.listening_pid(e.port) or 0
        return [e.pid] if e.pid and procfs.alive(e.pid) else []

    def _collect_engines(self, ts_ns: int, window: float) -> list[dict[str, Any]]:
        rows = []
        children = procfs.children_map() if self.engines else {}
        now = time.monotonic()
        for e in self.engines:
            roots = self._pids(e, now)
            pids = procfs.tree(roots[0], children) if roots else []
            run, wait = procfs.run_and_wait_seconds(pids) if pids else (math.nan, math.nan)
            prev, e.last = e.last, (run, wait) if pids else None
            if window <= 0:
                continue
            row = {"ts": encode_ts(ts_ns), "host": self.hostname, "backend": e.backend, "processes": len(pids),
                   "window_seconds": window, "rss_bytes": procfs.rss_bytes(pids) if pids else math.nan,
                   "cpu_seconds": math.nan, "wait_seconds": math.nan}
            if prev is not None and pids:
                row["cpu_seconds"], row["wait_seconds"] = max(0.0, run - prev[0]), max(0.0, wait - prev[1])
            rows.append(row)
        return rows

    def collect(self) -> dict[Table, dict[str, list[Any]]]:
        now = time.monotonic()
        window, self._t = now - self._t, now
        start_ns = time.time_ns() - int(window * 1e9)
        psi, oom = self._host_totals()
        pressure = {k: (psi[k] - self._psi[k]) / window for k in psi if k in self._psi and window > 0}
        kills = oom - self._oom if math.isfinite(oom) and math.isfinite(self._oom) else math.nan
        self._psi, self._oom = psi, oom
        shared = {"psi_cpu_some": pressure.get("cpu_some", math.nan),
                  "psi_memory_some": pressure.get("memory_some", math.nan),
                  "psi_memory_full": pressure.get("memory_full", math.nan),
                  "psi_io_some": pressure.get("io_some", math.nan), "psi_io_full": pressure.get("io_full", math.nan),
                  "oom_kills": kills}
        rows = [{**r, **shared} for r in self._collect_engines(start_ns, window)]
        rows.append({"ts": encode_ts(start_ns), "host": self.hostname, "backend": "", "processes": 0,
                     "window_seconds": window, "cpu_seconds": math.nan, "wait_seconds": math.nan,
                     "rss_bytes": math.nan, **shared})
        return {HOST_SAMPLES: HOST_SAMPLES.columns_of(rows)}

    def close(self) -> None:
        """Nothing held between windows."""


def _targets(config: Mapping[str, Any]) -> list[str]:
    """The ``[serving_metrics]`` targets on this host, as engine addresses."""
    out = []
    for t in (config.get("serving_metrics") or {}).get("targets", []):
        url = t if isinstance(t, str) else str(t.get("url", ""))
        parts = urlsplit(url)
        if parts.hostname in LOCAL and parts.port:
            backend = t.get("backend") if isinstance(t, dict) else None
            out.append(str(backend or parts.netloc))
    return out


def create(config: Mapping[str, Any], context: Context) -> HostCollector:
    return HostCollector(HostConfig.from_config(config), config)


__all__ = ["HostCollector", "HostConfig", "create"]
