"""Envoy REST EDS (v3): a ``DiscoveryRequest`` in, a ``DiscoveryResponse`` of weighted endpoints out.

Envoy polls ``POST /v3/discovery:endpoints`` every ``refresh_delay`` (``api_type: REST``) and
applies the whole ``ClusterLoadAssignment`` each time, so every poll is answered with 200 and the
full resource list, versioned by the engine's ``version`` (docs/lb-envoy-traefik.md).

Cluster naming: the feed serves one assignment, named ``[weights.feed] envoy_cluster``
(default ``triscope``), holding every backend that has an address. That name is what Envoy sends
in ``resource_names``: the cluster's ``eds_cluster_config.service_name``, or the cluster's own
name when ``service_name`` is unset. Requested names other than it are not answered (Envoy keeps
waiting for them, as with any EDS server that does not know a resource).
"""

from __future__ import annotations

import ipaddress
import itertools
import json
import logging
import socket
from collections.abc import Mapping
from typing import Any

from triscope.analyzers.routing import DOWN, DRAIN, READY, WeightParams, WeightsResult, split_address

log = logging.getLogger(__name__)

CLA_TYPE = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment"
JSON_TYPE = "application/json"
_nonce = itertools.count(1)


def cluster_name(params: WeightParams) -> str:
    """The ClusterLoadAssignment name the feed answers (``[weights.feed] envoy_cluster``)."""
    return params.feed.envoy_cluster


def _error(status: int, message: str) -> tuple[int, bytes]:
    """One-line JSON error body ``{"error": "..."}`` (the feed serves it as application/json)."""
    return status, json.dumps({"error": message}).encode() + b"\n"


def parse_request(body: bytes, max_bytes: int) -> tuple[dict[str, Any] | None, tuple[int, bytes] | None]:
    """Decode a DiscoveryRequest; returns (request, None) or (None, error response)."""
    if len(body) > max_bytes:
        return None, _error(413, f"request body of {len(body)} bytes exceeds max_body_bytes={max_bytes}")
    if not body.strip():
        return {}, None  # curl -X POST without a body: answer as for "all resources"
    try:
        request = json.loads(body)
    except RecursionError:  # deep nesting ([[[[...) is the client's error, not a server fault
        return None, _error(400, "invalid DiscoveryRequest JSON: nested too deeply")
    except ValueError as exc:  # JSONDecodeError, bad UTF-8, an integer past Python's digit limit
        return None, _error(400, f"invalid DiscoveryRequest JSON: {' '.join(str(exc).split())}")
    if not isinstance(request, dict):
        return None, _error(400, "invalid DiscoveryRequest: expected a JSON object")
    type_url = request.get("type_url", request.get("typeUrl", ""))
    if type_url not in ("", None, CLA_TYPE):
        return None, _error(400, f"unsupported type_url {type_url!r} (this endpoint serves {CLA_TYPE})")
    names = request.get("resource_names", request.get("resourceNames", []))
    if names is None:
        names = []
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        return None, _error(400, "invalid DiscoveryRequest: resource_names must be a list of strings")
    request["resource_names"] = names
    return request, None


def _socket_address(address: str) -> dict[str, Any] | None:
    """Envoy EDS needs an IP: resolve a host name once per response; None when impossible."""
    try:
        host, port = split_address(address)
    except ValueError:
        log.warning("envoy eds: backend address %r is not host:port; endpoint left out", address)
        return None
    try:
        ip = str(ipaddress.ip_address(host))
    except ValueError:
        try:
            ip = str(socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][4][0])
        except (OSError, IndexError):
            log.warning("envoy eds: cannot resolve %r; endpoint left out", host)
            return None
    return {"address": ip, "port_value": port}


_HEALTH = {READY: "HEALTHY", DRAIN: "DRAINING", DOWN: "UNHEALTHY"}


def cluster_load_assignment(result: WeightsResult, params: WeightParams,
                            name: str | None = None) -> dict[str, Any]:
    """One ``ClusterLoadAssignment`` with every addressed backend, sorted by backend name.

    Ready backends: ``load_balancing_weight = lb_weight`` (1..lb_scale), ``HEALTHY``.
    Drained backends: weight 1 (Envoy rejects 0) and ``DRAINING``, so Envoy sends them no new requests;
    down backends (they do not answer): weight 1 and ``UNHEALTHY``.
    """
    lb_endpoints = []
    for backend, bw in sorted(result.backends.items()):
        sock = _socket_address(bw.inputs.address) if bw.inputs.address else None
        if sock is None:
            continue
        drained = bw.state != READY
        lb_endpoints.append({
            "endpoint": {"address": {"socket_address": sock},
                         "hostname": split_address(bw.inputs.address)[0]},
            "health_status": _HEALTH[bw.state],
            "load_balancing_weight": 1 if drained else max(1, int(bw.lb_weight)),
            "metadata": {"filter_metadata": {"triscope": {
                "backend": backend, "weight": float(bw.weight), "state": bw.state}}},
        })
    cla: dict[str, Any] = {"@type": CLA_TYPE, "cluster_name": name or cluster_name(params), "endpoints": []}
    if lb_endpoints:
        cla["endpoints"] = [{"lb_endpoints": lb_endpoints}]
    return cla


def discovery_response(result: WeightsResult, params: WeightParams,
                       request: Mapping[str, Any]) -> dict[str, Any]:
    """The DiscoveryResponse for a decoded request (see module docstring for naming)."""
    ours = cluster_name(params)
    names = list(request.get("resource_names") or [])
    wanted = [ours] if not names else [n for n in dict.fromkeys(names) if n == ours]
    return {
        "version_info": str(result.version),
        "resources": [cluster_load_assignment(result, params, n) for n in wanted],
        "type_url": CLA_TYPE,
        "nonce": f"{result.version}-{next(_nonce)}",
    }


def eds_response(result: WeightsResult, request_body: bytes, params: WeightParams) -> tuple[int, bytes]:
    """HTTP status and JSON body for ``POST /v3/discovery:endpoints``.

    200 with the full DiscoveryResponse on every poll; 400 (one-line JSON ``{"error": ...}``) for a body that is not a
    DiscoveryRequest; 413 when the body exceeds ``[weights.feed] max_body_bytes``; 503 when the
    assignment would hold no endpoint (nothing known yet), so Envoy keeps the hosts it has.
    """
    request, error = parse_request(request_body, params.feed.max_body_bytes)
    if error is not None:
        return error
    assert request is not None
    response = discovery_response(result, params, request)
    if any(not cla["endpoints"] for cla in response["resources"]):
        # Envoy applies an empty assignment (no hosts); after a failed fetch it keeps the hosts it has
        return _error(503, "no backend with an address is known yet; keep the current endpoints")
    return 200, json.dumps(response, separators=(",", ":")).encode()


def render(result: WeightsResult, params: WeightParams, request_body: bytes) -> tuple[int, str, bytes]:
    """The feed's ``envoy_eds`` format (:mod:`triscope.exporters.formats`)."""
    status, body = eds_response(result, request_body, params)
    return status, JSON_TYPE, body


__all__ = ["CLA_TYPE", "cluster_load_assignment", "cluster_name", "discovery_response", "eds_response",
           "parse_request", "render"]
