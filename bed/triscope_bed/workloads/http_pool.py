"""A minimal HTTP/1.1 keep-alive client (GET and JSON POST), enough for the bench's small answers."""

from __future__ import annotations

import asyncio
import contextlib

MAX_RESPONSE_BYTES = 1 << 20


class _Conn:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer


class HttpPool:
    """Minimal HTTP/1.1 keep-alive client (GET and JSON POST), enough for the bench's tiny responses."""

    def __init__(self, host: str, port: int, max_idle: int = 512) -> None:
        self.host = host
        self.port = port
        self.idle: list[_Conn] = []
        self.max_idle = max_idle

    async def _connect(self) -> _Conn:
        reader, writer = await asyncio.open_connection(self.host, self.port, limit=1 << 20)
        return _Conn(reader, writer)

    async def get(self, path: str) -> tuple[int, dict[str, str], bytes]:
        """One GET; retries once on a stale pooled connection."""
        return await self.request("GET", path)

    async def request(self, method: str, path: str, body: bytes = b"") -> tuple[int, dict[str, str], bytes]:
        """One request (a JSON body when given); retries once on a stale pooled connection."""
        for attempt in range(2):
            conn = self.idle.pop() if self.idle else await self._connect()
            try:
                return await self._exchange(conn, method, path, body)
            except (ConnectionError, asyncio.IncompleteReadError, OSError):
                with contextlib.suppress(Exception):
                    conn.writer.close()
                if attempt:
                    raise
            except asyncio.CancelledError:  # client timeout: hang up, as a real client would
                with contextlib.suppress(Exception):
                    conn.writer.close()
                raise
        raise ConnectionError("unreachable")

    async def _exchange(self, conn: _Conn, method: str, path: str, body: bytes) -> tuple[int, dict[str, str], bytes]:
        request = f"{method} {path} HTTP/1.1\r\nHost: {self.host}\r\n"
        if body or method == "POST":
            request += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
        conn.writer.write((request + "\r\n").encode() + body)
        await conn.writer.drain()
        head = await conn.reader.readuntil(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split(" ", 2)[1])
        headers = {}
        for line in lines[1:]:
            if ":" in line:
                k, v = line.split(":", 1)
                headers[k.strip().lower()] = v.strip()
        length = int(headers.get("content-length", "0") or 0)
        if not 0 <= length <= MAX_RESPONSE_BYTES:  # a peer's answer is small; never buffer an unbounded one
            raise ValueError(f"response of {length} bytes")
        body = await conn.reader.readexactly(length)
        if headers.get("connection", "").lower() == "close" or len(self.idle) >= self.max_idle:
            conn.writer.close()
        else:
            self.idle.append(conn)
        return status, headers, body

    def close(self) -> None:
        for conn in self.idle:
            with contextlib.suppress(Exception):
                conn.writer.close()
        self.idle.clear()
