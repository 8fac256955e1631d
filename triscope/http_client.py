"""``[<section>.http]``: the one typed client config of every scraper (dcgm, serving_metrics, blockio).

Each scraper's section holds an ``http`` sub-table read into a subclass of :class:`HttpClientConfig`
that only changes the defaults (a dcgm-exporter page is ~100 KiB and answers within 2 s; a serving
engine's may be larger and slower). :meth:`HttpClientConfig.get` is the bounded GET of
:mod:`triscope.http_fetch` with these settings; :class:`triscope.target_pool.TargetPool` runs many
of them on ``max_parallel`` threads.
"""

from __future__ import annotations

from dataclasses import dataclass

from triscope.component import ComponentConfig, positive
from triscope.errors import ConfigError
from triscope.http_fetch import REDIRECT_POLICIES, fetch

_ALLOW: dict[str, bool | str] = {"none": False, "same-origin": "same-origin", "any": "any"}

HTTP_ALIASES = {key: f"http.{key}" for key in ("timeout_s", "max_body_bytes", "redirects", "max_parallel")}
"""The flat keys of a scraper's section before ``[<section>.http]`` (accepted, with a warning)."""


@dataclass(frozen=True)
class HttpClientConfig(ComponentConfig):
    """How a scraper fetches: one total deadline, one body bound, a redirect policy, a thread bound."""

    section = ""
    """Each scraper's subclass names its sub-table (``dcgm.http``)."""
    timeout_s: float = 3.0
    """Total deadline of one fetch (connect, headers and body), not per socket read."""
    max_body_bytes: int = 16 << 20
    """A larger answer is the target's error (read stops there)."""
    redirects: str = "same-origin"
    """``none`` (a 3xx is the target's error), ``same-origin`` (same scheme, host and port) or ``any``."""
    max_parallel: int = 16
    """Fetch threads; a collect takes at most ceil(targets / max_parallel) x timeout_s (+ 1 s)."""

    def validate(self, where: str) -> None:
        positive(where, timeout_s=self.timeout_s, max_body_bytes=self.max_body_bytes, max_parallel=self.max_parallel)
        if self.redirects not in REDIRECT_POLICIES:
            raise ConfigError(f"{where} redirects must be one of {', '.join(REDIRECT_POLICIES)}, "
                              f"got {self.redirects!r}")

    @property
    def allow_redirects(self) -> bool | str:
        """``redirects`` as :func:`~triscope.http_fetch.fetch` takes it."""
        return _ALLOW[self.redirects]

    def get(self, url: str) -> bytes:
        """The body of ``url`` within ``timeout_s`` and ``max_body_bytes``; InputError (one line) otherwise."""
        return fetch(url, timeout_s=self.timeout_s, max_bytes=self.max_body_bytes,
                     allow_redirects=self.allow_redirects)


__all__ = ["HTTP_ALIASES", "HttpClientConfig"]
