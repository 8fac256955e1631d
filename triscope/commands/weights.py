"""``triscope weights``: compute load-balancer weights from the store, or serve them as a feed.

``serve`` runs the ``weights_feed`` exporter (:mod:`triscope.exporters.feed`: ``/v1/weights``,
``/metrics``, Envoy EDS, Traefik provider, HAProxy agent) until SIGTERM/SIGINT, with a writer of its
own for the history rows; ``serve --once`` and ``show`` compute one update and print it (a table,
or the ``/v1/weights`` document with ``--json``).
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from triscope.commands._common import add_common
from triscope.commands._weights_haproxy import register_haproxy

if TYPE_CHECKING:
    from triscope.writer import Writer


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("weights", help="load-balancer weights from GPU memory, KV cache and P99")
    sub = parser.add_subparsers(dest="weights_command", metavar="ACTION")
    serve = sub.add_parser("serve", help="run the weight feed (HTTP + HAProxy agent) until interrupted")
    serve.add_argument("--bind", help="listen address (default [weights.feed] bind, 127.0.0.1)")
    serve.add_argument("--port", type=int, help="HTTP port (default [weights.feed] port; 0 = ephemeral, -1 = off)")
    serve.add_argument("--agent-port", type=int,
                       help="HAProxy agent-check port (default [weights.feed] agent_port; 0 = ephemeral, -1 = off)")
    serve.add_argument("--interval", type=float, metavar="S", help="update period (default [weights] interval_s)")
    serve.add_argument("--once", action="store_true", help="compute one update, print it and exit")
    add_common(serve)
    serve.set_defaults(func=run_serve)
    show = sub.add_parser("show", help="compute one update from the store and print it")
    show.add_argument("--at", metavar="WHEN", help="what the LBs were told then (ISO-8601 UTC, epoch seconds or a "
                                                    "duration ago), from weights_history")
    add_common(show)
    show.set_defaults(func=run_show)
    explain = sub.add_parser("explain", help="compute one update from the store and show every factor behind "
                                             "one backend's weight")
    explain.add_argument("backend", help="backend name as in `weights show` (host:port)")
    explain.add_argument("--at", metavar="WHEN", help="its recorded verdict then, from weights_history")
    add_common(explain)
    explain.set_defaults(func=run_explain)
    register_haproxy(sub)
    parser.set_defaults(func=lambda _args: (parser.print_help(), 2)[1])


def _params(args: argparse.Namespace) -> tuple[dict[str, Any], Any]:
    from triscope.analyzers.routing import WeightParams
    from triscope.commands._common import config_from

    config = config_from(args)
    if getattr(args, "interval", None) is not None:
        config.setdefault("weights", {})["interval_s"] = args.interval
    return config, WeightParams.from_config(config)


def _print(result: Any, as_json: bool) -> None:
    _print_doc(result.to_dict(), as_json)


def _print_doc(doc: dict[str, Any], as_json: bool) -> None:
    from triscope.commands._common import print_json

    if as_json:
        print_json(doc)
        return
    from rich.table import Table

    def fmt(x: float | None, spec: str = ".2f") -> str:
        return "-" if x is None else format(x, spec)

    table = Table(title=f"weights v{doc['version']}" + (" (STALE: equal weights)" if doc["stale"] else ""))
    for col in ("backend", "state", "weight", "target", "lb", "memory", "kv", "qps", "age s", "reasons"):
        table.add_column(col, justify="left" if col in ("backend", "state", "reasons") else "right")
    for name, b in doc["backends"].items():
        i = b["inputs"]
        table.add_row(name, b["state"], fmt(b["weight"]), fmt(b["target"]), str(b["lb_weight"]),
                      fmt(i["memory_used_ratio"], ".0%"), fmt(i["kv_cache_usage_ratio"], ".0%"), fmt(i["qps"], ".1f"),
                      fmt(b["age_seconds"], ".1f"), ", ".join(b["reasons"]))
    from triscope.console import report_console

    console = report_console()
    console.print(table)
    if not doc["backends"]:
        console.print("no backends: configure [weights.backends] or write serving_metrics / requests rows")
    if doc.get("unknown_backends"):
        console.print("unknown, not published (seen only in request spans: not configured, no scrape, no GPU "
                      f"samples): {', '.join(doc['unknown_backends'])}")
    if doc.get("down_backends"):
        console.print(f"down (no traffic until they answer): {', '.join(doc['down_backends'])}")
    if "at_ns" in doc:  # a recorded update: the engine's other outputs are not in weights_history
        from triscope.commands._common import utc_text

        console.print(f"as recorded in weights_history at or before {utc_text(doc['at_ns'])} UTC")
        return
    classes = ", ".join(f"{c} {v['priority_weight']:.1f}" for c, v in doc["classes"].items())
    console.print(f"class priority weights: {classes}")
    console.print(f"KV-cache scaling: {doc['scale']['action']} ({doc['scale']['reason']})")
    for name, adm in doc.get("class_admission", {}).items():
        closed = [b for b, state in adm["backends"].items()
                  if state != "ready" and doc["backends"][b]["state"] == "ready"]
        if closed or adm["shedding"]:
            console.print(f"class {name}: " + ("SHEDDING (no backend admits it)" if adm["shedding"]
                                              else f"closed on {', '.join(closed)} (KV or batch limit)"))


def _once(args: argparse.Namespace) -> int:
    from triscope.exporters.feed import WeightFeed
    from triscope.store import open_store

    config, params = _params(args)
    store = open_store(config)
    try:
        feed = WeightFeed(params, store=store)
        _print(feed.update(), args.json)
    finally:
        store.close()
    return 0


def explanation(result: Any, backend: str) -> dict[str, Any]:
    """Every factor behind ``backend``'s verdict in ``result``: the weight is 1 / the product of its
    penalties, normalised over the fleet, damped towards ``target``; what each LB is told follows."""
    from triscope.exporters.haproxy_agent import agent_reply

    b = result.backends[backend]
    doc = result.to_dict()["backends"][backend]
    penalties = doc["factors"]
    product = 1.0
    for v in penalties.values():
        product *= v if v is not None else 1.0
    return {
        "backend": backend, "version": result.version, "state": b.state, "reasons": list(b.reasons),
        "weight": doc["weight"], "target": doc["target"], "lb_weight": b.lb_weight,
        "penalties": penalties, "penalty_product": product, "raw_weight": 1.0 / product if product > 0 else None,
        "inputs": doc["inputs"], "age_seconds": doc["age_seconds"], "stale": backend in result.stale_backends,
        "drain_suppressed": b.drain_suppressed, "down": b.state == "down", "missing": list(b.missing),
        "class_admission": {c: states.get(backend) for c, states in result.class_admission.items()},
        "haproxy_agent_reply": agent_reply(result, backend).strip(),
        "class_priority_weights": {c: dict(v).get("priority_weight") for c, v in result.classes.items()},
    }


def run_explain(args: argparse.Namespace) -> int:
    """``triscope weights explain BACKEND``."""
    from triscope.commands._common import print_json
    from triscope.errors import InputError
    from triscope.exporters.feed import WeightFeed
    from triscope.store import open_store

    if getattr(args, "at", None):
        recorded = _recorded(args)
        if args.backend not in recorded["backends"]:
            raise InputError(f"no backend {args.backend!r} recorded then (recorded: "
                             f"{', '.join(sorted(recorded['backends']))})")
        b = recorded["backends"][args.backend]
        doc_at = {"backend": args.backend, "at_ns": recorded["at_ns"], "version": recorded["version"], **b}
        if args.json:
            print_json(doc_at)
        else:
            from triscope.console import report_console

            report_console().print(
                f"{args.backend} as recorded at {b['recorded_at_ns']} ns: {b['state']}"
                + (f" because {', '.join(b['reasons'])}" if b["reasons"] else "")
                + f", weight {b['weight']}, LB weight {b['lb_weight']}; penalties "
                + ", ".join(f"{k} {v:.3g}" for k, v in b["factors"].items() if v is not None), highlight=False)
        return 0
    config, params = _params(args)
    store = open_store(config)
    try:  # one update, as `weights show`
        result = WeightFeed(params, store=store).update()
    finally:
        store.close()
    if args.backend not in result.backends:
        known = ", ".join(sorted(result.backends)) or "none (no serving metrics, GPU samples or [weights.backends])"
        raise InputError(f"no backend {args.backend!r} in the weights (known: {known})")
    doc = explanation(result, args.backend)
    if args.json:
        print_json(doc)
        return 0
    from triscope.console import report_console

    def num(x: Any, spec: str = ".3g") -> str:
        return "-" if x is None else format(x, spec)

    console = report_console()
    console.print(f"[bold]{args.backend}[/bold] (weights v{doc['version']}): {doc['state']}"
                  + (f" because {', '.join(doc['reasons'])}" if doc["reasons"] else "")
                  + (" [STALE inputs]" if doc["stale"] else ""))
    if doc["down"]:
        console.print("down: it does not answer" + (f" ({doc['inputs']['scrape_error']})"
                                                     if doc["inputs"]["scrape_error"] else "")
                      + "; no load balancer sends it traffic until it answers again")
    console.print("penalties (each >= 1; raw weight = 1 / their product): " + ", ".join(
        f"{k} {num(v)}" for k, v in doc["penalties"].items()) + f" -> product {num(doc['penalty_product'])}")
    if doc["missing"]:
        console.print(f"missing: {', '.join(doc['missing'])} not reported by this backend; each took the "
                      "fleet's median penalty")
    console.print(f"weight {num(doc['weight'])} (target {num(doc['target'])}, damped), LB weight {doc['lb_weight']}, "
                  f"HAProxy agent says {doc['haproxy_agent_reply']!r}")
    i = doc["inputs"]
    console.print("inputs: " + ", ".join(f"{k} {num(v)}" for k, v in i.items()
                                         if k not in ("p99_seconds", "sources", "healthy", "scrape_error"))
                  + f", healthy {i['healthy']}, age {num(doc['age_seconds'])} s")
    if i["p99_seconds"]:
        console.print("P99 by class: " + ", ".join(f"{c} {num(v)} s" for c, v in i["p99_seconds"].items()))
    if doc["class_admission"]:
        console.print("class admission: " + ", ".join(f"{c} {s}" for c, s in doc["class_admission"].items()))
    return 0


def _recorded(args: argparse.Namespace) -> dict[str, Any]:
    """``--at WHEN``: the recorded update of every backend then (InputError when none was recorded)."""
    import time

    from triscope.analyzers.routing.history_read import weights_at
    from triscope.commands._common import parse_when, utc_text
    from triscope.errors import InputError
    from triscope.store import open_store

    config, params = _params(args)
    at_ns = parse_when(args.at, time.time_ns(), flag="--at")
    store = open_store(config)
    try:
        doc = weights_at(store, at_ns, params.lookback_s)
    finally:
        store.close()
    if not doc["backends"]:
        raise InputError(f"no weights recorded in the {params.lookback_s:g} s before {utc_text(at_ns)} UTC "
                         "(weights_history is written by a running feed with [weights] history = true)")
    return doc


def run_show(args: argparse.Namespace) -> int:
    """``triscope weights show``."""
    if getattr(args, "at", None):
        _print_doc(_recorded(args), args.json)
        return 0
    return _once(args)


def run_serve(args: argparse.Namespace) -> int:
    """``triscope weights serve``: the ``weights_feed`` exporter until SIGTERM/SIGINT (SIGHUP forgets
    the absent backends)."""
    if args.once:
        return _once(args)
    from triscope.component import Context
    from triscope.exporters.feed import create
    from triscope.store import open_store

    config, params = _params(args)
    stop = threading.Event()
    hup = threading.Event()
    # the store is opened by the feed and retried every update: with the store down the feed still
    # starts and serves equal weights marked stale over the backends it knows (docs/weights.md)
    writer = _history_writer(config) if params.history else None
    context = Context(open_store=lambda: open_store(config))
    if writer is not None:
        context = Context(open_store=context.open_store, submit=writer.submit)
    try:
        feed = create(config, context)
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, lambda *_: stop.set())
            signal.signal(signal.SIGINT, lambda *_: stop.set())
            if hasattr(signal, "SIGHUP"):
                signal.signal(signal.SIGHUP, lambda *_: hup.set())
        try:
            feed.start()
            print("weights feed: " + " ".join(f"{k}={v}" for k, v in feed.urls.items()), flush=True)
            if feed.last_error:
                print(f"triscope: warning: first update failed: {feed.last_error}", file=sys.stderr, flush=True)
            # a timed wait: a signal delivered to another thread only runs its handler once the main
            # thread is back in the interpreter, which a bare wait() may never be
            while not stop.wait(0.2):
                if hup.is_set():
                    hup.clear()
                    removed = feed.forget()
                    print(f"weights feed: forgot {', '.join(removed) or 'nothing (no absent backend)'}", flush=True)
        finally:
            feed.close()
    finally:
        if writer is not None:
            writer.close(timeout_s=3.0)  # after the feed: its last history rows are in; the rest stays spooled
    return 0


def _history_writer(config: dict[str, Any]) -> Writer:
    """A started writer for ``weights_history`` rows, spooling under ``[writer] spool_dir``/weights-serve
    (its own directory: a ``triscope run`` with the same config holds the spool directory itself)."""
    from triscope.store import open_store
    from triscope.writer import Writer, WriterConfig

    spool_dir = Path(WriterConfig.from_config(config).spool_dir) / "weights-serve"
    writer = Writer.from_config({**config, "writer": {**(config.get("writer") or {}), "spool_dir": str(spool_dir)}},
                                lambda: open_store(config))
    writer.start()
    return writer
