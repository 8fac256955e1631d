"""Board panel latencies over the fleet-day store (filled in below)."""

from __future__ import annotations

from typing import Any


def measure(store: Any, runs: int, fleet: Any) -> dict[str, Any]:
    return {}
