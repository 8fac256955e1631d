"""``[query]``: the daemon serves its embedded store over ClickHouse's HTTP interface (docs/query.md).

chDB allows one process per data directory, so while ``triscope run`` collects, nothing else can
open the store. The daemon therefore answers the subset of ClickHouse's HTTP interface its clients
use (clickhouse-connect, the CLI through it, Grafana's ClickHouse plugin, ``@clickhouse/client``):
``GET /?query=`` and ``POST /`` (the query in the body, or in ``query`` with the body appended),
``GET /ping``; ``database``, ``default_format``, ``query_id``, ``param_NAME`` query parameters and any
other URL parameter as a setting of the query; ``X-ClickHouse-User``/``-Key``/``-Database``/``-Format``
headers, Basic auth or ``user``/``password`` parameters. Every format chDB writes is served as chDB
writes it (Native, RowBinaryWithNamesAndTypes, Arrow, JSON, TSV, ...).

Bounds: 127.0.0.1 by default, a token (the ``[query] password``, else a random one per run written
to the discovery file only the store's owner can read), read-only unless ``readonly = false`` (the
statement kind is checked and the engine's ``readonly = 2`` holds on the query connections, never on the
writer's), ``max_query_bytes``, ``max_concurrent`` queries on their own connections (``max_queued``
more wait, then 503), ``max_execution_time_s`` and ``max_memory_bytes`` per query, which a query can
neither raise in its text nor in its parameters, and the server kit's connection bounds (the daemon's
event loop, :mod:`triscope.loop_http`). A request is read, checked and authorized on the event loop and
its query runs on one of the ``max_concurrent`` query threads, each with a chDB connection of its own kept
for the process's life: a query costs one hand-off to a thread and one wake-up of the loop.
"""

from __future__ import annotations

import base64
import hmac
import logging
import os
import re
import secrets
import threading
import uuid
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl, urlsplit

from triscope.component import ComponentConfig, non_negative, port, positive
from triscope.errors import ConfigError, StoreError
from triscope.loop_http import Answer, BlockingHttpConnection, BlockingHttpServer
from triscope.loop_server import DEFAULT_HEADER_TIMEOUT_S, DEFAULT_HOST
from triscope.query_discovery import Endpoint, publish, withdraw

log = logging.getLogger(__name__)

READ_STATEMENTS = ("SELECT", "WITH", "SHOW", "DESCRIBE", "DESC", "EXISTS", "EXPLAIN")
BOUND_SETTINGS = ("readonly", "max_execution_time", "max_memory_usage", "max_memory_usage_for_user",
                  "timeout_overflow_mode", "max_threads", "os_thread_priority")
"""Settings the endpoint fixes: a query cannot raise them in its text or its URL parameters."""
NOT_SETTINGS = {"query", "database", "default_format", "query_id", "session_id", "session_timeout", "session_check",
                "compress", "decompress", "user", "password", "quota_key", "buffer_size", "wait_end_of_query",
                "enable_http_compression", "http_headers_progress_interval_ms", "send_progress_in_http_headers",
                "client_protocol_version", "cancel_http_readonly_queries_on_client_close", "http_response_buffer_size",
                "http_wait_end_of_query", "http_write_exception_in_output_format"}
"""URL parameters of ClickHouse's HTTP interface that are not settings of the query (ignored here when
they only tune the transport)."""
_SETTING_NAME = re.compile(r"[a-z_][a-z0-9_]*")
_FORMAT_TAIL = re.compile(r"\sFORMAT\s+([A-Za-z0-9_]+)\s*;?\s*$", re.IGNORECASE)
_SETTINGS_TAIL = re.compile(r"\sSETTINGS\s+(.+)$", re.IGNORECASE | re.DOTALL)
_COMMENT = re.compile(r"^\s*(--[^\n]*\n|/\*.*?\*/)", re.DOTALL)
_CODE = re.compile(r"Code: (\d+)")
_WORD = re.compile(r"[A-Za-z]+")


@dataclass(frozen=True)
class QueryConfig(ComponentConfig):
    """``[query]``: the daemon's query endpoint over its embedded store."""

    section = "query"
    enabled: bool = True
    """Serve the embedded store while ``triscope run`` holds it (a server store is queried directly)."""
    bind: str = DEFAULT_HOST
    port: int = 8124
    """0 = ephemeral (the CLI finds it through the discovery file)."""
    username: str = "triscope"
    password: str = ""
    """Empty: a random token per run, in the discovery file beside the store (mode 0600)."""
    readonly: bool = True
    max_query_bytes: int = 1 << 20
    max_concurrent: int = 4
    max_queued: int = 16
    max_execution_time_s: float = 30.0
    max_memory_bytes: int = 4 << 30
    max_threads: int = 0
    """Engine threads per query (0 = a quarter of the cores, at least 1): the writer keeps the rest."""
    thread_nice: int = 10
    """Added to the daemon's own nice value for the threads running a query (ClickHouse's
    ``os_thread_priority``, at most 19): above 0 the writer's inserts go first when both want a core,
    however the daemon itself is niced. Needs CAP_SYS_NICE (root); a no-op without it."""
    max_connections: int = 64

    def validate(self, where: str) -> None:
        port(where, "port", self.port)
        positive(where, max_query_bytes=self.max_query_bytes, max_concurrent=self.max_concurrent,
                 max_execution_time_s=self.max_execution_time_s, max_memory_bytes=self.max_memory_bytes,
                 max_connections=self.max_connections)
        non_negative(where, max_queued=self.max_queued, max_threads=self.max_threads)
        if not -20 <= self.thread_nice <= 19:
            raise ConfigError(f"{where} thread_nice must be a nice value from -20 to 19, got {self.thread_nice}")
        if not self.username or any(c in self.username for c in ":\n\r"):
            raise ConfigError(f"{where} username must be a non-empty name without ':' or newlines")


class QueryError(Exception):
    """An error answer in ClickHouse's shape: status, ``Code: N. DB::Exception: ...`` text, the code."""

    def __init__(self, status: int, code: int, message: str) -> None:
        super().__init__(message)
        self.status, self.code = status, code


def query_nice(thread_nice: int) -> int:
    """The nice value of a query's threads: ``thread_nice`` above this thread's own (the daemon's), in -20..19."""
    return max(-20, min(19, os.nice(0) + thread_nice))


def statement_kind(sql: str) -> str:
    """The statement's first keyword, upper case (comments and opening parentheses skipped)."""
    text = sql
    while (m := _COMMENT.match(text)) is not None:
        text = text[m.end():]
    word = _WORD.search(text.lstrip(" \t\r\n("))  # the first word only: the text may be a megabyte
    return word.group(0).upper() if word else ""


def with_settings(sql: str, settings: dict[str, str]) -> str:
    """``sql`` with ``SETTINGS k = v, ...`` added (merged into its own SETTINGS clause, before its FORMAT)."""
    if not settings:
        return sql
    clause = ", ".join(f"{k} = {_literal(v)}" for k, v in settings.items())
    body, fmt = sql.rstrip().rstrip(";"), ""
    if (m := _FORMAT_TAIL.search(body)) is not None:
        body, fmt = body[:m.start()], body[m.start():]
    joiner = ", " if _SETTINGS_TAIL.search(body) else " SETTINGS "
    return f"{body}{joiner}{clause}{fmt}"


def _literal(value: str) -> str:
    if re.fullmatch(r"-?\d+(\.\d+)?", value):
        return value
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


class QueryService:
    """Runs queries on the embedded store for the endpoint, on ``max_concurrent`` connections of its own."""

    def __init__(self, store: Any, cfg: QueryConfig) -> None:
        self.store, self.cfg = store, cfg
        self._pool = ThreadPoolExecutor(max_workers=cfg.max_concurrent, thread_name_prefix="triscope-query")
        self._local = threading.local()
        self._lock = threading.Lock()
        self.waiting = 0
        self.queries_total = 0
        self.errors_total = 0
        self.refused_total = 0

    def _prepare(self) -> None:
        """The bounds on this worker's own connection, once (the writer's connection keeps none of them)."""
        if getattr(self._local, "ready", False):
            return
        statements = [f"USE {self.store.database}",  # unqualified names resolve as with a server's database
                      "SET output_format_arrow_low_cardinality_as_dictionary = 0",  # as a server's default
                      f"SET max_execution_time = {int(self.cfg.max_execution_time_s)}",
                      f"SET max_memory_usage = {int(self.cfg.max_memory_bytes)}",
                      f"SET max_threads = {self.cfg.max_threads or max(1, (os.cpu_count() or 1) // 4)}",
                      f"SET os_thread_priority = {query_nice(self.cfg.thread_nice)}"]
        if self.cfg.readonly:
            statements.append("SET readonly = 2")  # reads, and settings other than readonly
        for sql in statements:
            self.store.command(sql)
        self._local.ready = True

    def submit(self, work: Callable[..., Answer], *args: Any) -> Future[Answer]:
        """``work(*args)`` on a query thread (its chDB connection prepared), or QueryError 503 when
        ``max_concurrent`` run and ``max_queued`` wait already. Called on the event loop."""
        with self._lock:
            if self.waiting >= self.cfg.max_concurrent + self.cfg.max_queued:
                self.refused_total += 1
                raise QueryError(503, 202, f"more than {self.cfg.max_concurrent + self.cfg.max_queued} queries "
                                           "running or waiting ([query] max_concurrent, max_queued)")
            self.waiting += 1
            self.queries_total += 1
        try:
            return self._pool.submit(self._counted, work, args)
        except RuntimeError:  # shut down
            with self._lock:
                self.waiting -= 1
            raise QueryError(503, 202, "the query endpoint is stopping") from None

    def _counted(self, work: Callable[..., Answer], args: tuple[Any, ...]) -> Answer:
        try:
            self._prepare()
            return work(*args)
        finally:
            with self._lock:
                self.waiting -= 1

    def execute(self, sql: str, fmt: str, params: dict[str, str]) -> bytes:
        """The answer as chDB writes it in ``fmt``; QueryError with the engine's code. On a query thread."""
        try:
            return self.store.query_raw(sql, fmt, params)  # chDB writes the format itself
        except StoreError as exc:
            self.failed()
            text = str(exc).removeprefix("query failed: ")
            m = _CODE.search(text)
            raise QueryError(500, int(m.group(1)) if m else 1000, text) from None

    def failed(self) -> None:
        """Count a query that ended in an error (or without an answer in time)."""
        with self._lock:
            self.errors_total += 1

    def close(self) -> None:
        """Stop taking queries; a query still running ends within ``max_execution_time_s``."""
        self._pool.shutdown(wait=True, cancel_futures=True)

    def stats(self) -> dict[str, int]:
        return {"queries_total": self.queries_total, "errors_total": self.errors_total,
                "refused_total": self.refused_total, "running_or_waiting": self.waiting}


def _authorize(endpoint: QueryEndpoint, args: dict[str, str], headers: dict[str, str]) -> None:
    """QueryError 401 unless the request names the endpoint's user and token (headers by lower-case name)."""
    user = headers.get("x-clickhouse-user") or args.get("user", "")
    key = headers.get("x-clickhouse-key") or args.get("password", "")
    auth = headers.get("authorization", "")
    if auth.lower().startswith("basic "):
        try:
            user, _, key = base64.b64decode(auth[6:].strip()).decode().partition(":")
        except (ValueError, UnicodeDecodeError):
            user, key = "", ""
    if not (hmac.compare_digest(user.encode(), endpoint.username.encode())
            and hmac.compare_digest(key.encode(), endpoint.token.encode())):
        raise QueryError(401, 516, f"{user or 'default'}: Authentication failed: password is incorrect, "
                                   "or there is no user with such name")


def _headers(body: bytes, extra: dict[str, str]) -> list[tuple[str, str]]:
    summary = ('{"read_rows": "0", "read_bytes": "0", "written_rows": "0", "written_bytes": "0", '
               f'"result_rows": "0", "result_bytes": "{len(body)}"}}')  # as json.dumps writes it, for less
    return [("X-ClickHouse-Server-Display-Name", "triscope"), ("X-ClickHouse-Timezone", "UTC"),
            ("X-ClickHouse-Summary", summary), *extra.items()]


def _error(exc: QueryError, query_id: str = "") -> Answer:
    text = f"Code: {exc.code}. DB::Exception: {exc}. (triscope query endpoint)\n".encode()
    extra = {"X-ClickHouse-Exception-Code": str(exc.code)}
    if query_id:
        extra["X-ClickHouse-Query-Id"] = query_id
    return exc.status, "text/plain; charset=UTF-8", text, _headers(text, extra)


class _Server(BlockingHttpServer):
    """ClickHouse's HTTP interface on the server kit: requests checked on the loop, queries on query threads."""

    thread_name = "triscope-query"
    server_header = "triscope-query"
    body_limit_key = "[query] max_query_bytes"
    accept_chunked = True  # @clickhouse/client chunks its bodies

    def __init__(self, endpoint: QueryEndpoint) -> None:
        cfg = endpoint.cfg
        self.endpoint = endpoint
        self.max_body_bytes = cfg.max_query_bytes
        self.answer_timeout_s = cfg.max_execution_time_s + 5.0  # the engine's bound, then a 504
        # the kit's own executor stays idle: queries go to QueryService's threads, which answer 503 past
        # max_concurrent + max_queued
        super().__init__(cfg.bind, cfg.port, cfg.max_connections, 0, DEFAULT_HEADER_TIMEOUT_S, workers=1)

    def error_answer(self, conn: BlockingHttpConnection, status: int,
                     message: str) -> tuple[str, bytes, list[tuple[str, str]]]:
        """A refused request (413, 400, ...) in ClickHouse's shape."""
        _, ctype, body, extra = _error(QueryError(status, 241 if status == 413 else 1000, message))
        return ctype, body, list(extra)

    def late_answer(self, conn: BlockingHttpConnection) -> Answer:
        self.endpoint.service.failed()
        return _error(QueryError(504, 159, f"no answer within {self.endpoint.cfg.max_execution_time_s:g} s"))

    def dispatch(self, conn: BlockingHttpConnection, method: str, path: str, body: bytes) -> Answer | Future[Answer]:
        if method == "GET" and path in ("/ping", "/") and "query=" not in conn.target:
            return 200, "text/plain; charset=UTF-8", b"Ok.\n", _headers(b"Ok.\n", {})
        if method not in ("GET", "POST"):
            return _error(QueryError(405, 1000, f"{method} is not served; use GET or POST"))
        query_id = ""
        try:
            args = dict(parse_qsl(urlsplit(conn.target).query, keep_blank_values=True))
            query_id = args.get("query_id") or str(uuid.uuid4())
            _authorize(self.endpoint, args, conn.headers)
            sql, fmt, params = self.endpoint.request(args, conn.headers, body)
            return self.endpoint.service.submit(self._answer, sql, fmt, params, query_id)
        except QueryError as exc:
            return _error(exc, query_id)

    def _answer(self, sql: str, fmt: str, params: dict[str, str], query_id: str) -> Answer:
        """On a query thread: the whole answer, so the loop only writes it."""
        try:
            data = self.endpoint.service.execute(sql, fmt, params)
        except QueryError as exc:
            return _error(exc, query_id)
        fmt = _format_of(sql, fmt)
        return 200, _content_type(fmt), data, _headers(data, {"X-ClickHouse-Format": fmt,
                                                              "X-ClickHouse-Query-Id": query_id})


def _format_of(sql: str, fmt: str) -> str:
    m = _FORMAT_TAIL.search(sql)
    return m.group(1) if m else fmt


def _content_type(fmt: str) -> str:
    if fmt.startswith("JSON"):
        return "application/json; charset=UTF-8"
    if fmt in ("TabSeparated", "TSV", "CSV", "TabSeparatedWithNames", "TSVWithNames", "CSVWithNames", "Pretty"):
        return "text/plain; charset=UTF-8"
    return "application/octet-stream"


class QueryEndpoint:
    """The HTTP server and its :class:`QueryService`; publishes the discovery file while it serves."""

    def __init__(self, store: Any, cfg: QueryConfig) -> None:
        self.cfg = cfg
        self.store = store
        self.username = cfg.username
        self.token = cfg.password or secrets.token_urlsafe(24)
        self.service = QueryService(store, cfg)
        self._server: _Server | None = None

    def request(self, args: dict[str, str], headers: dict[str, str], body: bytes) -> tuple[str, str, dict[str, str]]:
        """(SQL with its settings, output format, query parameters) of one request; QueryError when refused."""
        lower = {k.lower(): v for k, v in headers.items()}
        sql = args.get("query", "")
        text = body.decode("utf-8", errors="replace")
        sql = f"{sql}\n{text}" if sql and text else (sql or text)
        if not sql.strip():
            raise QueryError(400, 62, "Empty query")
        if len(sql.encode()) > self.cfg.max_query_bytes:
            raise QueryError(413, 241, f"query longer than {self.cfg.max_query_bytes} bytes ([query] max_query_bytes)")
        kind = statement_kind(sql)
        if self.cfg.readonly and kind not in READ_STATEMENTS:
            raise QueryError(403, 164, f"Cannot execute {kind or 'this'} query in readonly mode ([query] readonly)")
        tail = _SETTINGS_TAIL.search(_FORMAT_TAIL.sub("", sql))
        if tail is not None:
            named = {n.lower() for n in re.findall(r"([A-Za-z_][A-Za-z0-9_]*)\s*=", tail.group(1))}
            fixed = sorted(named & set(BOUND_SETTINGS))
            if fixed:
                raise QueryError(403, 164, f"setting {fixed[0]} is fixed by [query] and cannot be changed")
        settings = {k: v for k, v in args.items()
                    if k not in NOT_SETTINGS and not k.startswith("param_") and k not in BOUND_SETTINGS
                    and _SETTING_NAME.fullmatch(k)}
        params = {k[6:]: v for k, v in args.items() if k.startswith("param_")}
        fmt = lower.get("x-clickhouse-format") or args.get("default_format") or "TabSeparated"
        database = lower.get("x-clickhouse-database") or args.get("database")
        if database and database != getattr(self.store, "database", database):
            raise QueryError(404, 81, f"Database {database} does not exist here (this endpoint serves "
                                      f"{self.store.database})")
        return with_settings(sql, settings), fmt, params

    def start(self) -> QueryEndpoint:
        try:
            self._server = _Server(self)
        except OSError as exc:
            raise ConfigError(f"cannot bind the query endpoint to {self.cfg.bind}:{self.cfg.port}: "
                              f"{exc.strerror or exc}") from None
        self._server.start()
        path = getattr(self.store, "path", "")
        if path:
            publish(Endpoint(os.getpid(), self.cfg.bind, self.port, path,
                             self.store.database, self.username, self.token))
        log.info("query endpoint: http://%s:%d (ClickHouse HTTP interface, %s)", self.cfg.bind, self.port,
                 "read-only" if self.cfg.readonly else "read-write")
        return self

    @property
    def port(self) -> int:
        return self._server.port if self._server is not None else -1

    @property
    def url(self) -> str:
        return f"http://{self.cfg.bind}:{self.port}"

    def close(self) -> None:
        path = getattr(self.store, "path", "")
        if path:
            withdraw(path)
        if self._server is not None:
            self._server.close()
            self._server = None
        self.service.close()

    def stats(self) -> dict[str, int]:
        return self.service.stats()


__all__ = ["QueryConfig", "QueryEndpoint", "QueryError", "QueryService", "statement_kind", "with_settings"]
