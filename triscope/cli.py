"""``triscope`` command line: one subcommand module per verb in ``triscope.commands``.

A module there defines ``register(subparsers)``, which adds its parser and sets
``func(args) -> int`` as the default. Errors derived from :class:`TriscopeError` print as one
line on stderr with exit status 2. A reader that goes away (``triscope ... --json | head``) ends the
command quietly with status 141, as a program stopped by SIGPIPE.
"""

from __future__ import annotations

import argparse
import importlib
import os
import pkgutil
import sys
from collections.abc import Sequence

from triscope import __version__, commands
from triscope.errors import TriscopeError

EXIT_BROKEN_PIPE = 141
"""128 + SIGPIPE: what a shell reports for a program whose reader went away."""


def build_parser() -> argparse.ArgumentParser:
    """The full parser, with every subcommand module registered."""
    parser = argparse.ArgumentParser(prog="triscope", description="GPU inference fleet telemetry.")
    parser.add_argument("--version", action="version", version=f"triscope {__version__}")
    parser.add_argument("-c", "--config", help="TOML config file (default: $TRISCOPE_CONFIG)")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for info in sorted(pkgutil.iter_modules(commands.__path__), key=lambda i: i.name):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{commands.__name__}.{info.name}")
        module.register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``triscope`` script."""
    try:
        try:
            return _run(argv)
        finally:
            sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's last flush
    except BrokenPipeError:
        # The reader left: send what is still buffered to /dev/null so the exit flush cannot fail too.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return EXIT_BROKEN_PIPE


def _run(argv: Sequence[str] | None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except TriscopeError as exc:
        print(f"triscope: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
