"""One budget of server connections for the whole process, within its file-descriptor limit.

Every server of the daemon (OTLP, Prometheus, the weight feed and its agent, the EPP's gRPC port and
pick table) takes a slot from :data:`BUDGET` for each connection it accepts and gives it back when the
connection closes; a server whose own limits still have room but finds the budget empty evicts one of
its slow or idle connections, or refuses the new one. The budget is the soft ``RLIMIT_NOFILE`` less a
reserve (a quarter, at least 256) kept for everything else the process opens: the writer's spool
files, store connections, scrapes. So no client, however many sockets it opens on however many ports,
can take the descriptors the writer needs.
"""

from __future__ import annotations

import logging
import resource
import threading

log = logging.getLogger(__name__)

MIN_RESERVE = 256
FD_CEILING = 1 << 20


def raise_fd_limit() -> int:
    """Raise the soft ``RLIMIT_NOFILE`` to the hard one (at most 2**20), as Go programs do at start;
    returns the soft limit in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = min(hard if hard != resource.RLIM_INFINITY else FD_CEILING, FD_CEILING)
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
        except (ValueError, OSError) as exc:
            log.debug("cannot raise RLIMIT_NOFILE to %d: %s", want, exc)
    return int(soft if soft != resource.RLIM_INFINITY else FD_CEILING)


def default_limit() -> int:
    """Connections the process may hold: the soft descriptor limit less the reserve."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    soft = FD_CEILING if soft == resource.RLIM_INFINITY else int(soft)
    return max(16, soft - max(MIN_RESERVE, soft // 4))


class ConnectionBudget:
    """A counted pool of connection slots shared by every server of the process (thread-safe)."""

    def __init__(self, limit: int | None = None) -> None:
        self._lock = threading.Lock()
        self._limit = limit
        self.open = 0
        self.refused_total = 0
        """Connections some server could not admit because the budget was empty and it had no victim."""

    @property
    def limit(self) -> int:
        return self._limit if self._limit is not None else default_limit()

    def set_limit(self, limit: int | None) -> None:
        """A fixed limit (tests, or a config), or None: follow the descriptor limit."""
        with self._lock:
            self._limit = limit

    def try_acquire(self, n: int = 1) -> bool:
        with self._lock:
            if self.open + n > self.limit:
                return False
            self.open += n
            return True

    def claim(self, wanted: int) -> int:
        """Take up to ``wanted`` slots at once (a server whose library accepts for it, such as gRPC, sizes
        its own cap with this); returns how many, at least 1."""
        with self._lock:
            n = max(1, min(wanted, self.limit - self.open))
            self.open += n
            return n

    def release(self, n: int = 1) -> None:
        with self._lock:
            self.open = max(0, self.open - n)

    def refused(self) -> None:
        with self._lock:
            self.refused_total += 1

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return {"open": self.open, "limit": self.limit, "refused_total": self.refused_total}


BUDGET = ConnectionBudget()
"""The process's budget (every server uses this one)."""

__all__ = ["BUDGET", "ConnectionBudget", "default_limit", "raise_fd_limit"]
