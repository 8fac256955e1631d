"""Shared pieces of the OTLP receiver tests."""

from __future__ import annotations

import http.client
from typing import Any


def post(rx: Any, body: bytes, content_type: str = "application/x-protobuf", token: str | None = None,
         headers: dict[str, str] | None = None, timeout: float = 60) -> tuple[int, dict, bytes]:
    """POST ``body`` to the receiver's /v1/traces; (status, headers, body)."""
    host, port = rx.address
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    hdrs = {"Content-Type": content_type, **(headers or {})}
    if token is not None:
        hdrs["Authorization"] = f"Bearer {token}"
    try:
        conn.request("POST", "/v1/traces", body=body, headers=hdrs)
        resp = conn.getresponse()
        return resp.status, dict(resp.getheaders()), resp.read()
    finally:
        conn.close()
