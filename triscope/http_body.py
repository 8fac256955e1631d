"""An HTTP error answer raised by a request's handler (its status, a one-line message, extra headers)."""

from __future__ import annotations


class HttpError(Exception):
    """An HTTP error answer: ``status``, a one-line message and extra response headers."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message.replace("\n", " "))
        self.status = status
        self.headers = headers or {}


__all__ = ["HttpError"]
