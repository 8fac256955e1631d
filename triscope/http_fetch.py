"""Bounded HTTP GET for scrapers (serving_metrics, dcgm): one call, one total deadline, one bounded body.

``fetch(url, timeout_s=..., max_bytes=...)`` returns the body or raises :class:`InputError` with a
one-line message naming the URL. Unlike ``urlopen(timeout=...)``, whose timeout applies to each
socket read (a body trickled at 1 byte/s never times out), ``timeout_s`` here bounds the whole
fetch: connect, status line, headers and body. A shared watchdog thread shuts the socket down at
the deadline, which wakes any blocked read. Limits: DNS resolution is bounded by the system
resolver, not by ``timeout_s``; environment proxies are not used (scrapes go direct).

Redirects (``allow_redirects``): ``False`` answers a 3xx with an error; ``True`` or
``"same-origin"`` follows up to 5 redirects to the same scheme, host and port (e.g. Starlette's
``/metrics`` -> ``/metrics/``); ``"any"`` follows them to any http(s) URL. All within the same
deadline. Failures to get an answer (connect, deadline, HTTP status) raise
:class:`UnreachableError`, a subclass of InputError (:class:`RefusedError` when nothing listens);
a body over ``max_bytes``, a refused redirect or an unsupported encoding raise plain InputError.
"""

from __future__ import annotations

import contextlib
import heapq
import http.client
import itertools
import socket
import threading
import time
from collections.abc import Callable, Mapping
from urllib.parse import urljoin, urlsplit

from triscope.errors import InputError, one_line

MAX_REDIRECTS = 5
REDIRECT_POLICIES = ("none", "same-origin", "any")
"""Config spellings of ``allow_redirects`` (False, "same-origin", "any")."""
_CHUNK = 64 * 1024
_DEFAULT_HEADERS = {"Accept": "text/plain;version=0.0.4", "Accept-Encoding": "identity",
                    "User-Agent": "triscope-scraper"}


class UnreachableError(InputError):
    """The target gave no complete answer: connection refused, deadline passed, non-2xx status."""


class RefusedError(UnreachableError):
    """Nothing listens at the target's port (connection refused): its process is gone, not slow."""


class _Watchdog:
    """One daemon thread running callbacks at their deadlines (shared by every fetch)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._live: set[int] = set()
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None

    def arm(self, deadline: float, callback: Callable[[], None]) -> int:
        with self._cond:
            key = next(self._ids)
            heapq.heappush(self._heap, (deadline, key, callback))
            self._live.add(key)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="http-fetch-watchdog", daemon=True)
                self._thread.start()
            self._cond.notify()
            return key

    def disarm(self, key: int) -> None:
        with self._cond:
            self._live.discard(key)

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._heap and self._heap[0][1] not in self._live:
                    heapq.heappop(self._heap)  # disarmed: drop without waiting for its time
                if not self._heap:
                    self._cond.wait()
                    continue
                deadline, key, callback = self._heap[0]
                now = time.monotonic()
                if now < deadline:
                    self._cond.wait(deadline - now)
                    continue
                heapq.heappop(self._heap)
                self._live.discard(key)
                # Run under the lock so disarm() returning means the callback is not running;
                # a failed shutdown (socket already closed) must not kill the watchdog.
                with contextlib.suppress(Exception):
                    callback()


_WATCHDOG = _Watchdog()


def _redirect_policy(allow: bool | str) -> str:
    if allow is True:
        return "same-origin"
    if allow is False:
        return "none"
    if allow not in REDIRECT_POLICIES:
        raise ValueError(f"allow_redirects must be False, True, 'same-origin' or 'any', not {allow!r}")
    return allow


def _origin(url: str) -> tuple[str, str, int | None]:
    parts = urlsplit(url)
    return parts.scheme, (parts.hostname or "").lower(), parts.port or (443 if parts.scheme == "https" else 80)


def _reason_line(exc: BaseException) -> str:
    reason = getattr(exc, "reason", None)  # an OSError wrapped by urllib: the reason is the message
    return one_line(reason) if isinstance(reason, BaseException) else (str(reason) if reason else one_line(exc))


class _Attempt:
    """One GET on one connection, under the watchdog."""

    def __init__(self, url: str, deadline: float, headers: Mapping[str, str]) -> None:
        parts = urlsplit(url)
        try:
            port = parts.port
        except ValueError:
            raise InputError(f"{url}: not an http(s) URL (bad port)") from None
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise InputError(f"{url}: not an http(s) URL")
        self.url, self.deadline, self.headers = url, deadline, headers
        self.fired = False
        self.sock: socket.socket | None = None
        remaining = max(0.001, deadline - time.monotonic())
        cls = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
        self.conn = cls(parts.hostname, port, timeout=remaining)
        self.target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")

    def _fire(self) -> None:
        self.fired = True
        sock = self.sock or self.conn.sock
        if sock is not None:
            sock.shutdown(socket.SHUT_RDWR)  # wakes a read blocked in any layer (TLS included)

    def get(self, max_bytes: int) -> tuple[int, str, http.client.HTTPMessage, bytes]:
        key = _WATCHDOG.arm(self.deadline, self._fire)
        try:
            self.conn.request("GET", self.target, headers=dict(self.headers))
            if self.fired:  # connected after the watchdog fired (it found no socket to shut)
                raise TimeoutError()
            # Kept: getresponse() hands the socket to the response and clears conn.sock on "close".
            self.sock = self.conn.sock
            resp = self.conn.getresponse()
            body = b""
            if not 300 <= resp.status < 400:
                body = self._read(resp, max_bytes)
            return resp.status, resp.reason, resp.msg, body
        except (OSError, http.client.HTTPException, ValueError) as exc:
            # A socket timeout is the deadline too: every socket operation is bounded by what remains.
            if self.fired or isinstance(exc, TimeoutError) or time.monotonic() >= self.deadline:
                raise TimeoutError() from None
            kind = RefusedError if isinstance(exc, ConnectionRefusedError) else UnreachableError
            raise kind(f"{self.url}: scrape failed: {_reason_line(exc)}") from None
        finally:
            _WATCHDOG.disarm(key)
            self.conn.close()
            if self.fired:
                raise TimeoutError() from None  # a body cut short by the watchdog is not a body

    def _read(self, resp: http.client.HTTPResponse, max_bytes: int) -> bytes:
        encoding = (resp.getheader("Content-Encoding") or "identity").strip().lower()
        if encoding != "identity":
            raise InputError(f"{self.url}: unsupported Content-Encoding {encoding!r} (asked for identity)")
        length = resp.getheader("Content-Length")
        if length and length.isdigit() and int(length) > max_bytes:
            raise InputError(f"{self.url}: response exceeds {max_bytes} bytes (Content-Length {length})")
        parts: list[bytes] = []
        size = 0
        while True:
            chunk = resp.read(min(_CHUNK, max_bytes + 1 - size))
            if not chunk:
                return b"".join(parts)
            parts.append(chunk)
            size += len(chunk)
            if size > max_bytes:
                raise InputError(f"{self.url}: response exceeds {max_bytes} bytes")


def fetch(url: str, *, timeout_s: float, max_bytes: int, allow_redirects: bool | str = False,
          headers: Mapping[str, str] | None = None) -> bytes:
    """GET ``url`` within ``timeout_s`` seconds in total and at most ``max_bytes`` of body.

    Raises :class:`UnreachableError` (no answer, deadline, non-2xx) or InputError (too large,
    refused redirect, encoding), each with a one-line message that names ``url``.
    """
    policy = _redirect_policy(allow_redirects)
    if not timeout_s > 0 or max_bytes <= 0:
        raise ValueError("timeout_s and max_bytes must be positive")
    deadline = time.monotonic() + timeout_s
    merged = {**_DEFAULT_HEADERS, **(headers or {})}
    current = url
    for _hop in range(MAX_REDIRECTS + 1):
        try:
            status, reason, msg, body = _Attempt(current, deadline, merged).get(max_bytes)
        except TimeoutError:
            raise UnreachableError(f"{url}: no complete answer within {timeout_s:g} s (total deadline)") from None
        if 200 <= status < 300:
            return body
        if not 300 <= status < 400:
            raise UnreachableError(f"{url}: HTTP {status} {reason}".rstrip())
        location = msg.get("Location")
        if not location:
            raise UnreachableError(f"{url}: HTTP {status} without a Location")
        nxt = urljoin(current, location.strip())
        if policy == "none":
            raise InputError(f"{url}: redirected (HTTP {status}) to {nxt}; redirects are not allowed "
                             "(point the target at the final URL, or allow them)")
        if urlsplit(nxt).scheme not in ("http", "https"):
            raise InputError(f"{url}: redirected to {nxt}: not an http(s) URL")
        if policy == "same-origin" and _origin(nxt) != _origin(current):
            raise InputError(f"{url}: redirected to another origin ({nxt}); only same-origin redirects are allowed")
        current = nxt
    raise InputError(f"{url}: more than {MAX_REDIRECTS} redirects")


__all__ = ["MAX_REDIRECTS", "REDIRECT_POLICIES", "UnreachableError", "fetch"]
