"""OTLP/HTTP trace receiver: ``POST /v1/traces`` into ``requests``, spooled before the answer.

Request spans (vLLM ``llm_request`` and any span with ``gen_ai.*`` attributes; every span with
``all_spans = true``) are mapped by :mod:`triscope.collectors.span_mapping` (backend and model from
configurable attributes, a parent span linked in by :mod:`.links`) and handed to the writer
(``context.submit``) before the 200 goes out, so an acknowledged span is durable. Spans that
cannot be stored (bad ids, a time the store cannot hold) are reported back with OTLP
``partial_success``; the rest are kept.

* ``Content-Type: application/x-protobuf`` or ``application/json``; the answer uses the same type.
* ``Content-Encoding: gzip`` is accepted. Memory is bounded by bytes: the body on the wire
  (``max_body_bytes``), inflated (``max_decompressed_bytes``, JSON ``max_json_bytes``), bodies held
  at once (``max_buffered_bytes``), decodes at once (``max_concurrent_decodes``), spans per request
  (``max_spans_per_request``) and string length (``max_attribute_length``, longer ones are cut).
* Errors answer a ``google.rpc.Status`` (code, one-line message) in the request's encoding:
  400 malformed, 401 bad or missing bearer token, 404/405 wrong path or method, 411 no length,
  413 too large, 415 unknown content type, 503 (``Retry-After``) when busy or the spool cannot take rows.

The server is a :class:`triscope.httpserver.BoundedHTTPServer` on 127.0.0.1:4318 by default.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from triscope.collectors.otlp.decode import (
    JSON,
    PROTOBUF,
    RPC_CODE,
    Limits,
    TooManySpans,
    decode_spans,
    encode_response,
    encode_status,
    gunzip_bounded,
)
from triscope.collectors.otlp.links import MappedBatch, SpanMapper
from triscope.collectors.request_classes import parse_class_rules
from triscope.collectors.span_mapping import DEFAULT_RULES, SpanRules
from triscope.component import ComponentConfig, Context, Submit, config_field, interval, port, positive
from triscope.errors import ConfigError, InputError, SpoolUnavailable
from triscope.httpserver import (
    DEFAULT_HOST,
    DEFAULT_MAX_CONNECTIONS,
    BoundedHTTPHandler,
    BoundedHTTPServer,
    HttpError,
    read_body,
    serve_in_thread,
    stop,
)
from triscope.schema import REQUESTS, Table

log = logging.getLogger(__name__)

TRACES_PATH = "/v1/traces"
DECODE_WAIT_S = 2.0
"""How long a request waits for a decode slot before 503: decoding is CPU-bound, a longer queue only adds memory."""


@dataclass(frozen=True)
class OtlpConfig(ComponentConfig):
    """``[otlp]``: where to listen, the bearer token, body bounds."""

    section = "otlp"
    aliases = {"buffer_rows": "", "batch_rows": ""}  # spans are spooled on arrival; [writer] batches them
    host: str = DEFAULT_HOST
    port: int = 4318
    token: str = ""
    all_spans: bool = False
    max_body_bytes: int = 8 * 1024 * 1024
    max_decompressed_bytes: int = 64 * 1024 * 1024
    max_json_bytes: int = 8 * 1024 * 1024
    """JSON costs up to ~24x its size in Python objects; send big batches as protobuf."""
    max_buffered_bytes: int = 64 * 1024 * 1024
    """Request bodies held at once (by Content-Length); past it new requests get 503 + Retry-After."""
    max_concurrent_decodes: int = 2
    max_spans_per_request: int = 50_000
    max_attribute_length: int = 4096
    """Longer strings (names, attribute values) are cut to this many characters."""
    address_attributes: tuple[str, ...] = DEFAULT_RULES.address_attributes
    port_attributes: tuple[str, ...] = DEFAULT_RULES.port_attributes
    model_attributes: tuple[str, ...] = DEFAULT_RULES.model_attributes
    model: str = ""
    """Model of spans that name none (vLLM's llm_request span does not)."""
    models: dict[str, str] = field(default_factory=dict)
    """Model by backend id or service.name, for spans that name none."""
    class_rules: list[dict[str, Any]] = config_field([])
    """``[[otlp.class_rules]]``: the request class of spans that name none (collectors/request_classes.py)."""
    default_class: str = ""
    """The class of spans no rule matches ("" = the weight engine's ``[weights] default_class``)."""
    link_cache_spans: int = 20_000
    """Parent spans (and request spans' parents) remembered to link spans that arrive in separate requests."""
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    interval_s: float = 1.0
    """How often the daemon polls collect() (which has nothing to return: spans are submitted as they arrive)."""

    def validate(self, where: str) -> None:
        port(where, "port", self.port)
        positive(where, max_body_bytes=self.max_body_bytes, max_decompressed_bytes=self.max_decompressed_bytes,
                 max_json_bytes=self.max_json_bytes, max_buffered_bytes=self.max_buffered_bytes,
                 max_concurrent_decodes=self.max_concurrent_decodes, max_spans_per_request=self.max_spans_per_request,
                 max_attribute_length=self.max_attribute_length, link_cache_spans=self.link_cache_spans,
                 max_connections=self.max_connections)
        interval(where, interval_s=self.interval_s)
        parse_class_rules(self.class_rules, f"{where} class_rules")

    @property
    def rules(self) -> SpanRules:
        return SpanRules(address_attributes=tuple(self.address_attributes), port_attributes=tuple(self.port_attributes),
                         model_attributes=tuple(self.model_attributes), models=dict(self.models), model=self.model,
                         max_attribute_length=self.max_attribute_length,
                         class_rules=parse_class_rules(self.class_rules), default_class=self.default_class)


class _Handler(BoundedHTTPHandler):
    server_version = "triscope-otlp"
    receiver: OtlpReceiver  # set on the subclass made per receiver

    def _send(self, status: int, body: bytes, content_type: str, headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.end_headers()
        self.wfile.write(body)

    def _content_type(self) -> str:
        return (self.headers.get("Content-Type") or "").split(";")[0].strip().lower()

    def _fail(self, err: HttpError) -> None:
        kind = self._content_type()
        if kind in (PROTOBUF, JSON):
            body = encode_status(RPC_CODE.get(err.status, 2), str(err), kind)
        else:
            kind, body = "text/plain; charset=utf-8", (str(err) + "\n").encode()
        self._send(err.status, body, kind, err.headers)

    def do_POST(self) -> None:
        try:
            self._post()
        except HttpError as err:
            self.close_connection = True  # the body may be unread (refused before reading): never reuse the socket
            self._fail(err)

    def _reject_method(self) -> None:
        self.close_connection = True
        self._fail(HttpError(405, f"method {self.command} not allowed; POST {TRACES_PATH}", {"Allow": "POST"}))

    do_GET = do_PUT = do_DELETE = do_PATCH = _reject_method

    def _refuse(self, status: int, message: str, headers: dict[str, str] | None = None) -> HttpError:
        self.close_connection = True  # the body is not read
        return HttpError(status, message, headers)

    def _post(self) -> None:
        rx = self.receiver
        if self.path.split("?")[0] != TRACES_PATH:
            raise self._refuse(404, f"unknown path {self.path}; traces go to POST {TRACES_PATH}")
        if rx.config.token:
            given = self.headers.get("Authorization") or ""
            if not hmac.compare_digest(given.encode(), f"Bearer {rx.config.token}".encode()):
                raise self._refuse(401, "missing or wrong bearer token", {"WWW-Authenticate": "Bearer"})
        kind = self._content_type()
        if kind not in (PROTOBUF, JSON):
            raise self._refuse(415, f"unsupported Content-Type {kind or '(none)'}; use {PROTOBUF} or {JSON}")
        try:
            length = max(0, int(self.headers.get("Content-Length") or 0))
        except ValueError:
            length = 0  # read_body answers it
        with rx.buffered(min(length, rx.config.max_body_bytes)):
            body = read_body(self, rx.config.max_body_bytes, required=True)
            with rx.decoding():
                batch = self._decode(body, kind)
            del body
        rx.store(batch)
        message = f"{batch.rejected} span(s) rejected; first: {batch.first_error}" if batch.rejected else ""
        self._send(200, encode_response(batch.rejected, message, kind), kind)

    def _decode(self, body: bytes | bytearray, kind: str) -> MappedBatch:
        rx = self.receiver
        encoding = (self.headers.get("Content-Encoding") or "identity").strip().lower()
        limit = rx.config.max_decompressed_bytes if kind == PROTOBUF else rx.config.max_json_bytes
        try:
            if encoding == "gzip":
                body = gunzip_bounded(body, limit)
            elif encoding != "identity":
                raise HttpError(415, f"unsupported Content-Encoding {encoding}; use gzip or none")
            if len(body) > limit:
                raise HttpError(413, f"{'JSON ' if kind == JSON else ''}body exceeds {limit} bytes")
            views = decode_spans(body, kind, rx.limits)
            del body  # JSON is parsed by now; the protobuf walk holds its own reference
            return rx.mapper.map(views)
        except (OverflowError, TooManySpans) as exc:
            rx.count("too_large")
            raise HttpError(413, str(exc)) from None
        except InputError as exc:
            rx.count("bad_requests")
            raise HttpError(400, str(exc)) from None


class OtlpReceiver:
    """OTLP/HTTP trace receiver implementing the :class:`triscope.component.Collector` protocol."""

    name = "otlp"

    def __init__(self, config: OtlpConfig, submit: Submit) -> None:
        self.config = config
        self.interval_s = config.interval_s
        self.submit = submit
        rules = config.rules
        self.limits = Limits(config.max_spans_per_request, config.max_attribute_length, rules.wanted)
        self.mapper = SpanMapper(rules, config.all_spans, config.link_cache_spans)
        self.stats = {"spans": 0, "rejected_spans": 0, "merged_spans": 0, "unreached_spans": 0, "bad_requests": 0,
                      "too_large": 0, "busy": 0}
        self._stats_lock = threading.Lock()
        self._decodes = threading.BoundedSemaphore(config.max_concurrent_decodes)
        self._buffered = 0
        self._buffer_lock = threading.Lock()
        self._server: BoundedHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self._inflight = 0
        self._closing = False
        self._idle = threading.Condition()

    @property
    def address(self) -> tuple[str, int]:
        """The bound (host, port); the port is the real one when configured as 0."""
        if self._server is None:
            return self.config.host, self.config.port
        host, bound = self._server.server_address[:2]
        return str(host), int(bound)

    @property
    def url(self) -> str:
        host, bound = self.address
        return f"http://{'[' + host + ']' if ':' in host else host}:{bound}{TRACES_PATH}"

    def count(self, key: str, n: int = 1) -> None:
        with self._stats_lock:
            self.stats[key] += n

    @contextlib.contextmanager
    def _request(self) -> Iterator[None]:
        """Counts a request in flight; refuses new ones once close() began (503, retryable)."""
        with self._idle:
            if self._closing:
                raise HttpError(503, "receiver is shutting down; retry later", {"Retry-After": "1"})
            self._inflight += 1
        try:
            yield
        finally:
            with self._idle:
                self._inflight -= 1
                self._idle.notify_all()

    def _busy(self, what: str) -> HttpError:
        self.count("busy")
        return HttpError(503, f"receiver busy ({what}); retry later", {"Retry-After": "1"})

    @contextlib.contextmanager
    def buffered(self, size: int) -> Iterator[None]:
        """Reserves ``size`` body bytes of ``max_buffered_bytes``; 503 + Retry-After when they are taken
        (the body is then not read, so the connection closes)."""
        with self._buffer_lock:
            if self._buffered and self._buffered + size > self.config.max_buffered_bytes:
                raise self._busy(f"{self._buffered} body bytes held, max_buffered_bytes "
                                 f"{self.config.max_buffered_bytes}")
            self._buffered += size
        try:
            yield
        finally:
            with self._buffer_lock:
                self._buffered -= size

    @contextlib.contextmanager
    def decoding(self) -> Iterator[None]:
        """One of ``max_concurrent_decodes`` slots, waited for up to DECODE_WAIT_S, else 503 + Retry-After."""
        if not self._decodes.acquire(timeout=DECODE_WAIT_S):
            raise self._busy(f"{self.config.max_concurrent_decodes} decodes running")
        try:
            yield
        finally:
            self._decodes.release()

    def store(self, batch: MappedBatch) -> None:
        """Hand a batch's rows to the writer (spooled when this returns); HttpError 503/500 when it cannot."""
        if batch.rows:
            with self._request():
                try:
                    self.submit(REQUESTS, batch.columns)
                except SpoolUnavailable as exc:
                    raise HttpError(503, f"cannot spool spans now ({exc}); retry later",
                                    {"Retry-After": "1"}) from None
                except Exception as exc:
                    log.warning("otlp: storing %d span(s) failed: %s", batch.rows, exc)
                    raise HttpError(500, f"cannot store spans: {exc}") from None
        self.count("spans", batch.rows)
        self.count("rejected_spans", batch.rejected)
        self.count("merged_spans", batch.merged)
        self.count("unreached_spans", batch.unreached)

    def start(self) -> None:
        """Bind and serve in a background thread; ConfigError (one line) when the address is unusable."""
        if self._server is not None:
            return
        host, bound = self.config.host, self.config.port
        handler = type("OtlpHandler", (_Handler,), {"receiver": self})
        try:
            self._server = BoundedHTTPServer((host, bound), handler, max_connections=self.config.max_connections,
                                             name="otlp")
        except OSError as exc:
            raise ConfigError(f"cannot bind OTLP receiver to {host}:{bound}: {exc.strerror or exc}") from None
        self._closing = False
        self._thread = serve_in_thread(self._server, "triscope-otlp", poll_interval=0.05)

    def collect(self) -> dict[Table, Any]:
        """Nothing: spans reach the writer as they arrive."""
        return {}

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop accepting, wait (up to ``timeout_s``) for requests being stored; safe to call twice."""
        with self._idle:
            self._closing = True
        if self._server is not None:
            stop(self._server, self._thread)
            self._server, self._thread = None, None
        with self._idle:
            self._idle.wait_for(lambda: self._inflight == 0, timeout=timeout_s)


def create(config: dict[str, Any], context: Context) -> OtlpReceiver:
    """``triscope run`` entry point (``[run] collectors = ["otlp"]``): spans go to ``context.submit``."""
    return OtlpReceiver(OtlpConfig.from_config(config), context.submit)


__all__ = ["TRACES_PATH", "OtlpConfig", "OtlpReceiver", "create"]
