"""The ``dcgm`` collector: every target fetched on its own thread under one total deadline.

A target that trickles its body, hangs or refuses costs only its own rows: the collect waits at
most ``ceil(targets / max_parallel) x timeout_s`` (plus a grace second) and a target whose
previous fetch is still running is reported, not fetched twice. A failing target never raises:
it yields state rows (``unreachable`` / ``error`` + a one-line ``error``) for the GPUs last seen
there, is counted (:meth:`DcgmScraper.take_errors`) and logged once per change of state.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from triscope.collectors.dcgm.config import DcgmConfig, TargetSpec
from triscope.collectors.dcgm.rows import NO_GPU, Gpu, Identity, parse_gpus, rows_from_gpus, state_row
from triscope.errors import InputError, one_line
from triscope.http_fetch import UnreachableError
from triscope.schema import GPU_SAMPLES, Table, encode_ts
from triscope.target_pool import TargetPool
from triscope.tick_clock import TickClock

log = logging.getLogger("triscope.collectors.dcgm")

Fetcher = Callable[[str, float, int], str]
"""``fetcher(url, timeout_s, max_body_bytes) -> text``: raises InputError / UnreachableError."""


@dataclass
class Target:
    """One endpoint and what was last seen there."""

    spec: TargetSpec
    ident: Identity
    seen: dict[tuple[str, int, str], Gpu] = field(default_factory=dict)
    stamps: dict[tuple[str, int, str], int] = field(default_factory=dict)
    """Sample time (ms) of each GPU's last stored row, when the source stamps samples (/federate)."""
    last_error: str = ""

    @property
    def url(self) -> str:
        return self.spec.url

    @property
    def host(self) -> str:
        return self.ident.host or self.ident.default_host


class DcgmScraper:
    """Collector scraping dcgm-exporter targets; ``config`` is a :class:`DcgmConfig` or the whole configuration."""

    name = "dcgm"

    def __init__(self, config: Mapping[str, Any] | DcgmConfig | None = None, fetcher: Fetcher | None = None) -> None:
        cfg = config if isinstance(config, DcgmConfig) else DcgmConfig.from_config(config)
        pods = tuple(cfg.exporter_pods)
        self.targets = [Target(s, Identity(s.url_host, s.host, s.host_label, pods)) for s in cfg.targets()]
        self.interval_s = cfg.interval_s
        self._clock = TickClock(cfg.interval_s)
        self.http = cfg.http
        self.timeout_s = cfg.http.timeout_s
        self.max_body_bytes = cfg.http.max_body_bytes
        self.fetcher: Fetcher = fetcher or self._fetch
        self._pool: TargetPool[str] = TargetPool("dcgm", cfg.http.max_parallel, cfg.http.timeout_s)
        self._new_errors: list[str] = []
        self._lock = threading.Lock()  # the daemon's last collect may overlap the loop's

    def start(self) -> None:
        """Nothing to acquire: the fetch threads start with the first collect()."""

    def _fetch(self, url: str, timeout_s: float, max_body_bytes: int) -> str:
        """GET within ``timeout_s`` in total; errors name the config key a user would change."""
        t0 = time.monotonic()
        try:
            body = self.http.replace(timeout_s=timeout_s, max_body_bytes=max_body_bytes).get(url)
        except UnreachableError:
            if time.monotonic() - t0 >= timeout_s:
                raise UnreachableError(f"{url}: scrape failed: timed out after {timeout_s:g} s "
                                       "(timeout_s: total deadline for connect, headers and body)") from None
            raise
        except InputError as exc:
            if "exceeds" in str(exc):
                raise InputError(f"{url}: response exceeds max_body_bytes = {max_body_bytes}") from None
            raise
        return body.decode("utf-8", errors="replace")

    def take_errors(self) -> list[str]:
        """One-line messages of the target failures since the last call (the collector loop counts them)."""
        with self._lock:
            taken, self._new_errors = self._new_errors, []
        return taken

    def _failed(self, target: Target, ts_ns: int, state: str, message: str) -> list[dict[str, Any]]:
        self._new_errors.append(message)
        if message != target.last_error:  # once per change of state, not once per tick
            log.warning("dcgm: %s", message)
        target.last_error = message
        ts = encode_ts(ts_ns)
        known = list(target.seen.values()) or [Gpu(target.host, NO_GPU)]
        return [state_row(ts, Gpu(g.host, g.index, g.uuid, g.model, g.mig_instance, g.mig_profile), state, message)
                for g in known]

    def _parsed(self, target: Target, text: str, ts_ns: int) -> list[dict[str, Any]]:
        gpus, warning = parse_gpus(text, target.ident, target.url)
        if target.last_error and not warning:
            log.warning("dcgm: %s answers again", target.url)
        elif warning and warning != target.last_error:
            log.warning("dcgm: %s", warning)
        target.last_error = warning
        target.seen = {g.key: Gpu(g.host, g.index, g.uuid, g.model, g.mig_instance, g.mig_profile) for g in gpus}
        # A federated sample is re-served until Prometheus scrapes again: store each one once.
        fresh = [g for g in gpus if g.stamp_ms is None or target.stamps.get(g.key) != g.stamp_ms]
        target.stamps = {g.key: g.stamp_ms for g in gpus if g.stamp_ms is not None}
        return rows_from_gpus(fresh, ts_ns, warning)

    def collect(self) -> dict[Table, dict[str, list[Any]]]:
        """Scrape every target once, concurrently; failed targets become state rows (never raises for a target)."""
        with self._lock:
            return self._collect()

    def _collect(self) -> dict[Table, dict[str, list[Any]]]:
        ts_ns = self._clock.now_ns()
        # a target still fetching since the last collect is reported below, not fetched twice
        futures = self._pool.run({t.url: partial(self.fetcher, t.url, self.timeout_s, self.max_body_bytes)
                                  for t in self.targets})
        rows: list[dict[str, Any]] = []
        for target in self.targets:
            future = futures.get(target.url)
            if future is None or not future.done():
                rows += self._failed(target, ts_ns, "unreachable", f"{target.url}: scrape failed: timed out "
                                     f"(no answer within {self.timeout_s:g} s; the fetch is still running)")
                continue
            try:
                rows += self._parsed(target, future.result(), ts_ns)
            except UnreachableError as exc:
                rows += self._failed(target, ts_ns, "unreachable", one_line(exc))
            except InputError as exc:
                rows += self._failed(target, ts_ns, "error", one_line(exc))
            except Exception as exc:  # a target's bad input must never cost the others their rows
                rows += self._failed(target, ts_ns, "error", f"{target.url}: {type(exc).__name__}: {one_line(exc)}")
        return {GPU_SAMPLES: GPU_SAMPLES.columns_of(rows)} if rows else {}

    def close(self) -> None:
        """Stop the fetch threads without waiting for one in flight (each ends by its deadline); safe twice."""
        self._pool.close()


__all__ = ["DcgmScraper", "Target"]
