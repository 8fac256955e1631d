"""Reading a request's body within a bound, for every HTTP server of the process (:mod:`.httpserver`)."""

from __future__ import annotations

import http.server


class HttpError(Exception):
    """An HTTP error answer: ``status``, a one-line message and extra response headers."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message.replace("\n", " "))
        self.status = status
        self.headers = headers or {}


def read_body(handler: http.server.BaseHTTPRequestHandler, limit: int, *, required: bool = False,
              chunked: bool = False) -> bytes:
    """The request's body, at most ``limit`` bytes, else :class:`HttpError`: 411 chunked (unless ``chunked``,
    then read chunk by chunk within ``limit``) or no length when ``required``, 400 a bad or short length or
    chunk, 413 over ``limit`` (nothing more read). On an error the connection is marked to close: an unread
    body cannot be skipped."""
    try:
        if handler.headers.get("Transfer-Encoding", "identity").strip().lower() != "identity":
            if not chunked:
                raise HttpError(411, "chunked bodies are not accepted; send Content-Length")
            return _read_chunked(handler, limit)
        raw = handler.headers.get("Content-Length")
        if raw is None:
            if required:
                raise HttpError(411, "Content-Length is required")
            return b""
        try:
            length = int(raw)
        except ValueError:
            length = -1
        if length < 0:
            raise HttpError(400, f"bad Content-Length {raw!r}")
        if length > limit:
            raise HttpError(413, f"body of {length} bytes exceeds the limit of {limit}")
        body = handler.rfile.read(length) if length else b""
        if len(body) < length:
            raise HttpError(400, f"body ended after {len(body)} of {length} bytes")
        return body
    except HttpError:
        handler.close_connection = True
        raise


def _read_chunked(handler: http.server.BaseHTTPRequestHandler, limit: int) -> bytes:
    """A ``Transfer-Encoding: chunked`` body, never more than ``limit`` bytes held (trailers skipped)."""
    parts: list[bytes] = []
    total = 0
    while True:
        line = handler.rfile.readline(256)
        try:
            size = int(line.split(b";", 1)[0].strip(), 16)
        except ValueError:
            raise HttpError(400, f"bad chunk size line {line[:40]!r}") from None
        if size == 0:
            break
        total += size
        if total > limit:
            raise HttpError(413, f"body exceeds the limit of {limit}")
        chunk = handler.rfile.read(size)
        if len(chunk) < size or handler.rfile.read(2) != b"\r\n":
            raise HttpError(400, "body ended inside a chunk")
        parts.append(chunk)
    for _ in range(64):  # trailer lines up to the blank one
        if handler.rfile.readline(1024) in (b"\r\n", b"\n", b""):
            break
    return b"".join(parts)


__all__ = ["HttpError", "read_body"]
