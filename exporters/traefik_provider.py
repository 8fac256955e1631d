"""Traefik HTTP provider: the whole dynamic configuration for ``GET /v1/traefik``.

Traefik polls the endpoint every ``providers.http.pollInterval`` and treats any non-200 answer as
an error, so the full configuration is returned on every poll; a configuration equal to the last
one is "no change" on Traefik's side. Layout (docs/weights.md, docs/lb-envoy-traefik.md):

- one ``loadBalancer`` service per addressed backend, ``b-<name>`` (characters outside
  ``[A-Za-z0-9-]`` replaced by ``-``; a short hash suffix when two names collide);
- a ``weighted`` service ``[weights.feed] traefik_service`` over the ready ones with weight
  ``lb_weight`` (1..lb_scale); drained backends are left out of it (still defined as services);
- a router of the same name with ``traefik_rule`` on ``traefik_entrypoints``.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any

from triscope.analyzers.routing import READY, WeightParams, WeightsResult, split_address

_UNSAFE = re.compile(r"[^A-Za-z0-9-]")


def service_names(backends: list[str]) -> dict[str, str]:
    """Backend name -> Traefik service name ``b-<sanitised>``, unique even when sanitising collides."""
    base = {b: "b-" + _UNSAFE.sub("-", b) for b in backends}
    counts: dict[str, int] = {}
    for name in base.values():
        counts[name] = counts.get(name, 0) + 1
    return {b: (name if counts[name] == 1 else f"{name}-{hashlib.sha1(b.encode()).hexdigest()[:8]}")
            for b, name in base.items()}


def _server_url(address: str, scheme: str) -> str | None:
    try:
        host, port = split_address(address)
    except ValueError:
        return None
    if ":" in host:  # IPv6 literal
        host = f"[{host}]"
    return f"{scheme}://{host}:{port}"


def traefik_config(result: WeightsResult, params: WeightParams) -> dict[str, Any]:
    """Traefik dynamic configuration (the JSON document of the HTTP provider)."""
    feed = params.feed
    service, scheme, rule = feed.traefik_service, feed.traefik_scheme, feed.traefik_rule
    entrypoints = list(feed.traefik_entrypoints)

    urls = {b: _server_url(bw.inputs.address, scheme) for b, bw in result.backends.items()
            if bw.inputs.address}
    urls = {b: u for b, u in urls.items() if u}
    names = service_names(sorted(urls))
    services: dict[str, Any] = {}
    weighted = []
    for backend in sorted(urls):
        bw = result.backends[backend]
        services[names[backend]] = {"loadBalancer": {"servers": [{"url": urls[backend]}],
                                                     "passHostHeader": True}}
        if bw.state == READY:  # drained and down backends are left out of the weighted service
            weighted.append({"name": names[backend], "weight": max(1, int(bw.lb_weight))})
    if not weighted:
        # Nothing can serve: no router either, so Traefik answers 404 instead of logging a broken service.
        return {"http": {"services": services}} if services else {}
    services[service] = {"weighted": {"services": weighted}}
    router = {"rule": rule, "service": service, "entryPoints": entrypoints}
    return {"http": {"routers": {service: router}, "services": services}}


def render(result: WeightsResult, params: WeightParams, request_body: bytes) -> tuple[int, str, bytes]:
    """The feed's ``traefik`` format (:mod:`triscope.exporters.formats`): Traefik wants 200 on every poll,
    except with nothing to route to: 503 (an error to Traefik, which keeps its last configuration)."""
    config = traefik_config(result, params)
    if "routers" not in config.get("http", {}):
        body = json.dumps({"error": "no ready backend with an address is known yet; keep the current configuration"})
        return 503, "application/json", body.encode() + b"\n"
    return 200, "application/json", json.dumps(config, sort_keys=True).encode()


__all__ = ["render", "service_names", "traefik_config"]
