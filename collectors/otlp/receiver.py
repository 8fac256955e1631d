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

The server (:mod:`.server`) runs on the daemon's server kit, on 127.0.0.1:4318 by default.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from triscope.collectors.otlp.decode import Limits
from triscope.collectors.otlp.links import MappedBatch, SpanMapper
from triscope.collectors.otlp.server import TRACES_PATH, OtlpServer
from triscope.collectors.request_classes import parse_class_rules
from triscope.collectors.span_mapping import DEFAULT_RULES, SpanRules
from triscope.component import ComponentConfig, Context, Submit, config_field, interval, port, positive
from triscope.errors import ConfigError, SpoolUnavailable
from triscope.http_body import HttpError
from triscope.loop_server import DEFAULT_HOST, DEFAULT_MAX_CONNECTIONS
from triscope.schema import REQUESTS, Table

log = logging.getLogger(__name__)

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


_UNUSED = ("buffer_rows", "batch_rows")


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
        self.reserve_lock = threading.Lock()
        self._server: OtlpServer | None = None
        self._inflight = 0
        self._closing = False
        self._idle = threading.Condition()

    @property
    def address(self) -> tuple[str, int]:
        """The bound (host, port); the port is the real one when configured as 0."""
        if self._server is None:
            return self.config.host, self.config.port
        return self.config.host, self._server.port

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

    def reserve(self, size: int) -> None:
        """Reserves ``size`` body bytes of ``max_buffered_bytes`` before the body is read; HttpError 503 +
        Retry-After when they are taken (the body is then not read, so the connection closes)."""
        with self.reserve_lock:
            if self._buffered and self._buffered + size > self.config.max_buffered_bytes:
                raise self._busy(f"{self._buffered} body bytes held, max_buffered_bytes "
                                 f"{self.config.max_buffered_bytes}")
            self._buffered += size

    def unreserve(self, size: int) -> None:
        with self.reserve_lock:
            self._buffered -= size

    @contextlib.contextmanager
    def buffered(self, size: int) -> Iterator[None]:
        """:meth:`reserve` for a block."""
        self.reserve(size)
        try:
            yield
        finally:
            self.unreserve(size)

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
        try:
            self._server = OtlpServer(self)
        except OSError as exc:
            raise ConfigError(f"cannot bind OTLP receiver to {host}:{bound}: {exc.strerror or exc}") from None
        self._closing = False
        self._server.start()

    def collect(self) -> dict[Table, Any]:
        """Nothing: spans reach the writer as they arrive."""
        return {}

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop accepting, wait (up to ``timeout_s``) for requests being stored; safe to call twice."""
        with self._idle:
            self._closing = True
        if self._server is not None:
            self._server.close(drain_s=timeout_s)  # requests being decoded or stored get their answer
            self._server = None
        with self._idle:
            self._idle.wait_for(lambda: self._inflight == 0, timeout=timeout_s)


def create(config: dict[str, Any], context: Context) -> OtlpReceiver:
    """``triscope run`` entry point (``[run] collectors = ["otlp"]``): spans go to ``context.submit``."""
    return OtlpReceiver(OtlpConfig.from_config(config), context.submit)


__all__ = ["TRACES_PATH", "OtlpConfig", "OtlpReceiver", "create"]
