"""Where the bed finds the repository's tools (setup scripts, the tiny model's maker) and shared data."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
"""The repository (the bed runs from its checkout: ``pip install -e ./bed``)."""
