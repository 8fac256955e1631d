"""The test bed's policies: each one a real load balancer (and picker) in front of a fleet.

| policy | data path | decides on |
|---|---|---|
| ``haproxy-rr`` / ``haproxy-leastconn`` | HAProxy | nothing / its own connection counts |
| ``sglang-p2c`` / ``-cache-aware`` | sglang-router 0.3.2 (real) | ``/get_load`` every 30 s / prefix tree + counts |
| ``gie-epp`` | Envoy + ext_proc, the GIE Endpoint Picker's default profile | queue, KV, prefix scrapes every 50 ms |
| ``triscope`` | HAProxy leastconn + triscope's agent-check feed | KV, queue, latency, QPS scrapes every 100 ms |
| ``triscope-epp`` | Envoy + ext_proc, triscope's ``[epp]`` service | own in-flight ledger, KV fit, 250 ms scrapes,
  the weight engine's drains / class admission / weights (its feed polled every 250 ms) |
| ``triscope-epp-levels`` | the same | the same, and the engine's admission levels per class |
| ``triscope-haproxy`` | HAProxy + triscope's Lua picker (``exporters/haproxy_pick.lua``) | ``[epp]``'s scrapes
  and engine view through its pick table (polled every 50 ms), HAProxy's own in-flight counts |
| ``triscope-haproxy-levels`` | the same | the same, and the engine's admission levels per class |

Every data path has health checks a user would configure (HAProxy ``check``, GIE's pod readiness,
sglang-router's own) and no retries of a request that reached a backend (``retries 0``,
``--disable-retries``, Envoy's default). docs/closed_loop.md lists the settings.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from triscope.analyzers.routing.config import DEFAULT_CLASSES
from triscope.exporters.epp_service import EppConfig, EppService
from triscope.exporters.haproxy_pick import TABLE_PATH
from triscope.ticker import Ticker
from triscope_bed.engines.vllm_sidecar import VllmSidecar
from triscope_bed.fleet.bench_fleet import FeedWorker
from triscope_bed.fleet.testbed_fleet import Fleet
from triscope_bed.peers.gateway_log import read_access_log, summarize
from triscope_bed.peers.gie_epp import GieParams
from triscope_bed.peers.gie_extproc import EnvoyGateway, GieGateway
from triscope_bed.peers.haproxy import HAProxy, PickSetup, Server
from triscope_bed.peers.haproxy_log import brief
from triscope_bed.peers.haproxy_log import summarize as summarize_requests
from triscope_bed.peers.sglang import LOAD_POLL_S, SglangRouter

POLICIES = ("haproxy-rr", "haproxy-leastconn", "sglang-p2c", "sglang-cache-aware", "gie-epp", "triscope",
            "triscope-epp", "triscope-epp-levels", "triscope-haproxy", "triscope-haproxy-levels")
EPP_ENGINE_INTERVAL_S = 1.0
"""triscope-epp's weight engine period, ``[weights] interval_s``'s default: its decisions (drains, class
admission, levels) change slowly, and each of its scrapes costs a vLLM engine ~10 ms of CPU on top of the
picker's own."""
HEALTH_CHECK_MS = 1000
"""HAProxy ``check inter`` (x3 failures to mark down), like GIE's 1 s readiness probe x 3."""
TRISCOPE_WEIGHTS: dict[str, Any] = {"interval_s": 0.1, "queue_weight": 1.0, "window_s": 5.0, "stale_after_s": 2.0,
                                    "ewma_down": 0.5, "max_step_down": 0.5, "ewma_up": 0.3, "max_step_up": 0.2}
"""[weights] of the test bed's feed: the closed-loop bench's, with a faster cut (a dying backend drains in
~0.3 s) and 2 s staleness (a backend whose scrapes fail is drained, as GIE's readiness removes a pod)."""


@dataclass
class FrontOptions:
    sla_s: dict[str, float] = field(default_factory=dict)
    """Class SLAs of the test bed (CPU scale), handed to triscope's feed as ``[weights.classes.*] sla_ms``."""
    sglang_warmup_s: float = LOAD_POLL_S + 1
    """sglang-router's first ``/get_load`` poll runs before any worker is registered; the run starts after
    its second one (a router in production has been up for longer than 30 s)."""
    agent_inter_ms: int = 100
    epp_scrape_s: float = 0.25
    """triscope-epp's scrape period: its ledger covers what changes between scrapes, and each scrape costs the
    engine's API server CPU (``bench/datapath_cpu.py --vllm-scrape-cost``)."""
    epp_engine_s: float = EPP_ENGINE_INTERVAL_S
    """triscope-epp's weight engine period (its own scrapes of every engine)."""
    weights: dict[str, Any] = field(default_factory=dict)
    picker: dict[str, Any] = field(default_factory=dict)
    """triscope-epp's ``[epp]`` settings (``--epp-picker KEY=VALUE``)."""
    seed: int = 0


@dataclass
class Front:
    """A started policy: where the load generator sends requests, and what it reports afterwards."""

    port: int
    info: dict[str, Any] = field(default_factory=dict)


def triscope_overrides(opts: FrontOptions) -> dict[str, Any]:
    classes = {c: {**spec, "sla_ms": 1000.0 * opts.sla_s[c]} if c in opts.sla_s else dict(spec)
               for c, spec in DEFAULT_CLASSES.items()}
    return {**TRISCOPE_WEIGHTS, "classes": classes, **opts.weights}


def epp_config(opts: FrontOptions, chars_per_token: float) -> EppConfig:
    """triscope-epp's ``[epp]``: ephemeral port, the bed's scrape period and prompt size, ``opts.picker``
    on top (ConfigError for a key ``[epp]`` does not have)."""
    return EppConfig.from_config({"epp": {"port": 0, "scrape_interval_s": opts.epp_scrape_s,
                                          "chars_per_token": chars_per_token, **opts.picker}})


class ExternalWork:
    """Samples, every 100 ms, whether the picker believes another client's requests run on each backend:
    with no tenant on the bed (every scenario but ``pinned``) any such belief is a misreading of a scrape."""

    def __init__(self, service: EppService, period_s: float = 0.1) -> None:
        self.service = service
        self.samples = 0
        self.seen: dict[str, int] = dict.fromkeys(service.picker.backends, 0)
        self.weight_sum: dict[str, float] = dict.fromkeys(service.picker.backends, 0.0)
        self.short: dict[str, int] = dict.fromkeys(service.picker.backends, 0)
        self.unready: dict[str, int] = dict.fromkeys(service.picker.backends, 0)
        self._ticker = Ticker("epp-external-work", period_s, self._sample)

    def _sample(self) -> None:
        rows = self.service.picker.explain(time.monotonic())
        self.samples += 1
        for name, row in rows.items():
            self.seen[name] += row["external_requests"] > 0
            self.weight_sum[name] += row["weight"]
            self.short[name] += row["free_kv_tokens"] - row["reserve_tokens"] < self.service.picker.mean_size()
            self.unready[name] += not row["healthy"]

    def shares(self) -> dict[str, float]:
        return {name: round(n / self.samples, 4) if self.samples else 0.0 for name, n in self.seen.items()}

    def report(self) -> dict[str, dict[str, float]]:
        """Per backend over the run's samples: the engine's mean relative weight, the share of samples in
        which a request of the mean size did not fit its free KV and the share in which the picker held it
        unready (what tilts picks between alike engines)."""
        n = max(1, self.samples)
        return {name: {"weight_mean": round(self.weight_sum[name] / n, 4),
                       "short_share": round(self.short[name] / n, 4),
                       "unready_share": round(self.unready[name] / n, 4)} for name in self.seen}

    def __enter__(self) -> ExternalWork:
        self._ticker.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._ticker.stop(2.0)


class DownWatch:
    """Polls the feed's ``/v1/weights`` and keeps when each backend was first published down, so the run can
    count what HAProxy still sent it afterwards (the ``killed`` scenario's check)."""

    def __init__(self, feed: FeedWorker, period_s: float = 0.1) -> None:
        self.feed = feed
        self.down_at: dict[str, float] = {}
        self._ticker = Ticker("testbed-down-watch", period_s, self._poll)

    def _poll(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            doc = self.feed.weights_doc()
            now = time.time()
            for name, b in (doc.get("backends") or {}).items():
                if b.get("state") == "down":
                    self.down_at.setdefault(name, now)

    def __enter__(self) -> DownWatch:
        self._ticker.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._ticker.stop(2.0)

    def report(self, hap: HAProxy, agent_inter_s: float) -> dict[str, dict[str, Any]]:
        """Per backend seen down: when, and the requests HAProxy accepted for it after it was published down
        and after the agent's next check could have told HAProxy."""
        records = [r for r in hap.request_log() if r.server in self.down_at]
        return {name: {"down_at": round(t, 3),
                       "sent_after_down": sum(1 for r in records if r.server == name and r.accepted_s > t),
                       "sent_after_agent_check": sum(1 for r in records
                                                     if r.server == name and r.accepted_s > t + agent_inter_s)}
                for name, t in sorted(self.down_at.items())}


def routed_by_haproxy(hap: HAProxy) -> dict[str, int]:
    """Requests HAProxy sent each server (``stot``), read before it stops."""
    with contextlib.suppress(OSError, ValueError):
        return {row["svname"]: int(row["stot"]) for row in hap.stats()}
    return {}


def logged_requests(hap: HAProxy) -> dict[str, Any]:
    """HAProxy's request log in brief (:mod:`triscope_bed.peers.haproxy_log`; ``bench/pick_log.py`` reads it in
    full): the split, the in-flight spread at arrivals and, with the Lua picker, its fit states and the picks it sent
    where HAProxy had more requests in flight."""
    return brief(summarize_requests(hap.request_log()))


@contextlib.contextmanager
def front(policy: str, fleet: Fleet, workdir: Path, opts: FrontOptions) -> Iterator[Front]:
    """Start ``policy`` in front of ``fleet`` (every backend alive), yield it, stop it."""
    workdir.mkdir(parents=True, exist_ok=True)
    servers = [Server(b.name, b.port) for b in fleet.backends]
    names = {b.address: b.name for b in fleet.backends}
    if policy in ("haproxy-rr", "haproxy-leastconn"):
        balance = "roundrobin" if policy == "haproxy-rr" else "leastconn"
        with HAProxy(workdir, servers, balance=balance, health_check_ms=HEALTH_CHECK_MS, retries=0) as hap:
            info: dict[str, Any] = {"balance": balance}
            yield Front(hap.port, info)
            info["routed"] = routed_by_haproxy(hap)
            info["request_log"] = logged_requests(hap)
    elif policy == "triscope":
        feed = FeedWorker({b.name: b.url for b in fleet.backends}, triscope_overrides(opts), 5.0).start()
        try:
            with HAProxy(workdir, servers, balance="leastconn", agent_port=feed.agent_port,
                         agent_inter_ms=opts.agent_inter_ms, health_check_ms=HEALTH_CHECK_MS, retries=0) as hap:
                time.sleep(max(0.5, 3 * opts.agent_inter_ms / 1000))  # the agent's first answers are in
                info = {"feed": feed.info.get("feed", "")}
                with DownWatch(feed) as watch:
                    yield Front(hap.port, info)
                info["routed"] = routed_by_haproxy(hap)
                info["request_log"] = logged_requests(hap)
                info["down"] = watch.report(hap, opts.agent_inter_ms / 1000)
        finally:
            feed.stop()
    elif policy in ("sglang-p2c", "sglang-cache-aware"):
        with contextlib.ExitStack() as stack:
            if fleet.kind == "vllm":  # vLLM serves none of the SGLang worker endpoints: a sidecar each
                urls = [stack.enter_context(VllmSidecar(b.port, fleet.model, b.kv_tokens, b.slots)).url
                        for b in fleet.backends]
            else:
                urls = [b.url for b in fleet.backends]
            router = stack.enter_context(SglangRouter(
                urls, "power_of_two" if policy == "sglang-p2c" else "cache_aware", workdir=workdir))
            if policy == "sglang-p2c":
                time.sleep(opts.sglang_warmup_s)
            yield Front(router.port, {"router": "sglang-router 0.3.2", "warmup_s": opts.sglang_warmup_s
                                      if policy == "sglang-p2c" else 0.0})
    elif policy == "gie-epp":
        with GieGateway([b.address for b in fleet.backends], workdir, GieParams(default_model=fleet.model),
                        seed=opts.seed) as gw:
            info = {"picker": "GIE EPP default profile (re-implemented), Envoy ext_proc"}
            yield Front(gw.port, info)
        info["gateway"] = summarize(read_access_log(gw.access_log_path), names)
    elif policy in ("triscope-epp", "triscope-epp-levels"):
        with epp_service(opts, fleet, levels=policy == "triscope-epp-levels") as service:
            seen = ExternalWork(service)
            with EnvoyGateway(service.port, workdir, waiting_for=service.waiting_for) as envoy, seen:
                info = {"picker": "triscope [epp] (HeadroomPicker), Envoy ext_proc", "scrape_s": opts.epp_scrape_s,
                        "engine_interval_s": opts.epp_engine_s, "levels": policy == "triscope-epp-levels"}
                yield Front(envoy.port, info)
            info["gateway"] = summarize(read_access_log(envoy.access_log_path), names)
            info["external_work_seen"] = seen.shares()
            info["picker_view"] = seen.report()
            info["epp"] = service.stats()
    elif policy in ("triscope-haproxy", "triscope-haproxy-levels"):
        # the same service serving its pick table to the Lua picker in HAProxy; its ext_proc port stays unused
        levels = policy == "triscope-haproxy-levels"
        with epp_service(opts, fleet, levels=levels, table=True) as service:
            wait_until_scraped(service)
            pick = PickSetup(f"http://127.0.0.1:{service.table_port}{TABLE_PATH}",
                             service.cfg.haproxy_pick_settings(), fallback=service.cfg.fallback)
            with HAProxy(workdir, servers, balance="leastconn", health_check_ms=HEALTH_CHECK_MS, retries=0,
                         pick=pick) as hap:
                time.sleep(0.3)  # the Lua task's first polls of the table are in
                info = {"picker": "triscope [epp] pick table, HAProxy Lua (haproxy_pick.lua)",
                        "scrape_s": opts.epp_scrape_s, "engine_interval_s": opts.epp_engine_s, "levels": levels}
                yield Front(hap.port, info)
                info["routed"] = routed_by_haproxy(hap)
                info["lua"] = hap.pick_stats()
                info["request_log"] = logged_requests(hap)
            info["epp"] = service.stats()
    else:
        raise ValueError(f"unknown policy {policy!r} (known: {', '.join(POLICIES)})")


@contextlib.contextmanager
def epp_service(opts: FrontOptions, fleet: Fleet, levels: bool = False, table: bool = False) -> Iterator[EppService]:
    """The product's ``[epp]`` service as a user runs it, started: its scrapers and its poll of the weight
    engine's ``/v1/weights``, the engine in a feed process of its own; ``levels``: the engine's admission
    levels on; ``table``: the pick table served on an ephemeral port."""
    overrides = {**triscope_overrides(opts), "interval_s": opts.epp_engine_s}
    if levels:
        overrides["levels"] = {"enabled": True, **overrides.get("levels", {})}
    cfg = epp_config(opts, fleet.chars_per_token)
    cfg = replace(cfg, table_port=0) if table else cfg
    feed = FeedWorker({b.name: b.url for b in fleet.backends}, overrides, 5.0).start()
    try:
        service = EppService(cfg, {b.name: b.address for b in fleet.backends},
                             f"http://127.0.0.1:{feed.info['http_port']}/v1/weights", seed=opts.seed)
        try:
            service.start()
            yield service
        finally:
            service.close()
    finally:
        feed.stop()


def wait_until_scraped(service: EppService, timeout_s: float = 10.0) -> None:
    """Block until the picker has scraped every backend once (RuntimeError with what it lacks after ``timeout_s``)."""
    deadline = time.monotonic() + timeout_s
    while (missing := service.waiting_for()) is not None:
        if time.monotonic() > deadline:
            raise RuntimeError(missing)
        time.sleep(0.05)
