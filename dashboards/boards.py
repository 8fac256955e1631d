"""Every triscope board, built from code: ``all_boards()`` -> ``{file stem: dashboard JSON}``."""

from __future__ import annotations

from typing import Any

from triscope.dashboards import fleet, heatmap, incidents, io, nccl, stalls, weights
from triscope.dashboards.model import Board

MODULES = (fleet, incidents, heatmap, stalls, nccl, io, weights)


def boards() -> list[Board]:
    """The boards as :class:`Board` objects, in menu order."""
    return [m.board() for m in MODULES]


def all_boards() -> dict[str, dict[str, Any]]:
    """Dashboard JSON per file stem (the board uid without the ``triscope-`` prefix)."""
    return {b.uid.removeprefix("triscope-"): b.to_json() for b in boards()}
