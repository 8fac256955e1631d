"""The rich console reports print to: full width on a terminal, 160 columns when piped."""

from __future__ import annotations

from rich.console import Console

PIPED_WIDTH = 160
"""Columns used when stdout is not a terminal (rich would assume 80 and wrap every table)."""


class _ReportConsole(Console):
    def on_broken_pipe(self) -> None:
        # rich would exit 1 here; raise instead so triscope.cli ends every command the same quiet way (141).
        self.quiet = True
        raise BrokenPipeError


def report_console(piped_width: int = PIPED_WIDTH) -> Console:
    """A console for human-readable reports on stdout (``piped_width`` columns when stdout is not a terminal)."""
    console = _ReportConsole()
    return console if console.is_terminal else _ReportConsole(width=piped_width)
