"""The pull interface every periodic collector implements, so ``triscope run`` can drive any of them.

A collector owns its source (a library handle, a subprocess, an HTTP endpoint) and returns the
rows gathered since the previous call; the daemon hands them to the writer. Long-running
sources (bpftrace, an OTLP receiver) buffer internally between calls.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

Rows = Mapping[str, Sequence[Any]]
"""Column-oriented rows: ``{column: values}``, every sequence the same length."""


@runtime_checkable
class Collector(Protocol):
    """A source of rows for one or more tables."""

    name: str
    interval_s: float

    def start(self) -> None:
        """Acquire resources (open NVML, spawn a subprocess, bind a port). May raise TriscopeError."""

    def collect(self) -> dict[str, Rows]:
        """Rows since the last call, keyed by unqualified table name; ``{}`` when there is nothing new.

        Must not raise for a transient source failure: record it (e.g. a ``state`` column) instead.
        """

    def close(self) -> None:
        """Release resources; safe to call twice."""
