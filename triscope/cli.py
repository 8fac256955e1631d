"""``triscope`` command line: one subcommand module per verb in ``triscope.commands``.

A module there defines ``register(subparsers)``, which adds its parser and sets
``func(args) -> int`` as the default. Errors derived from :class:`TriscopeError` print as one
line on stderr with exit status 2. A reader that goes away (``triscope ... --json | head``) ends the
command quietly with status 141, as a program stopped by SIGPIPE.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import pkgutil
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

from triscope import __version__, commands
from triscope.errors import TriscopeError

EXIT_BROKEN_PIPE = 141
"""128 + SIGPIPE: what a shell reports for a program whose reader went away."""


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The parser with every subcommand module registered, or just ``only`` when it names one (the
    command being run: its parser and help are the same, and the other modules are not imported)."""
    parser = argparse.ArgumentParser(prog="triscope", description="GPU inference fleet telemetry.")
    parser.add_argument("--version", action="version", version=f"triscope {__version__}")
    parser.add_argument("-c", "--config", help="TOML config file (default: $TRISCOPE_CONFIG)")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    names = sorted(info.name for info in pkgutil.iter_modules(commands.__path__) if not info.name.startswith("_"))
    for name in [only] if only in names else names:
        module = importlib.import_module(f"{commands.__name__}.{name}")
        module.register(subparsers)
    return parser


def entry() -> NoReturn:
    """The ``triscope`` script (and ``python -m triscope``): :func:`main`, then the process exits.

    A short store command (the table below) leaves without the interpreter's and chDB's teardown (30-80 ms:
    modules, the engine's thread pools): by then it has closed its store, so every insert is on disk and
    a merge still running is one the engine restarts (it is built for a kill at any point)."""
    code = main()
    invocation = _Invocation(sys.argv[1:])
    if _short_store_command(invocation):
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError):
                stream.flush()
        os._exit(code)
    sys.exit(code)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``triscope`` script."""
    # triscope's numpy work is elementwise, no BLAS: OpenBLAS's thread pool would only spin up at import
    # (~90 ms of CPU, which a 2-CPU machine takes from chDB's parser threads during an ingest).
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
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


_OPENS_EMBEDDED_STORE: dict[str, frozenset[str] | None] = {
    "demo": None, "diagnose": None, "heatmap": None, "ingest": None, "nccl": None,
    "weights": frozenset({"show", "explain"}),
}
"""Commands (and verbs; None: every verb) that open the store and answer at once: chDB loads while they start."""


class _Invocation:
    """What a first look at the arguments tells before argparse runs: the words, ``--config``, help."""

    def __init__(self, argv: Sequence[str]) -> None:
        self.words: list[str] = []
        self.config_path: str | None = None
        self.asks_help = False
        expect_config = False
        for word in argv:
            if expect_config:
                self.config_path, expect_config = word, False
            elif word in ("-h", "--help", "--version"):
                self.asks_help = True
            elif word in ("-c", "--config"):
                expect_config = True
            elif word.startswith("--config="):
                self.config_path = word.split("=", 1)[1]
            elif not word.startswith("-"):
                self.words.append(word)

    @property
    def command(self) -> str | None:
        return self.words[0] if self.words else None


def _load_store_engine_early(invocation: _Invocation) -> None:
    """Start loading chDB on a worker thread when this command will open the embedded store.

    The engine's library load (~40 ms of the ~0.2 s chDB start-up) then overlaps the parser and the
    command's imports: part of what keeps a query on a small store near 0.3 s (bench/cli_e2e.py)."""
    if _short_store_command(invocation) and _store_backend_hint(invocation.config_path) == "embedded":
        from triscope.store.chdb_engine import start_loading

        start_loading()


def _short_store_command(invocation: _Invocation) -> bool:
    """True for a command (and verb) of ``_OPENS_EMBEDDED_STORE`` that is not asking for help."""
    if invocation.asks_help or invocation.command not in _OPENS_EMBEDDED_STORE:
        return False
    verbs = _OPENS_EMBEDDED_STORE[invocation.command]
    return verbs is None or (len(invocation.words) > 1 and invocation.words[1] in verbs)


def _store_backend_hint(config_path: str | None) -> str | None:
    """The configured store backend, read without importing the config machinery (which the library load
    should overlap). Only a hint: a wrong answer costs time, never behaviour; None when unreadable."""
    backend = os.environ.get("TRISCOPE_STORE__BACKEND")
    if backend is not None:
        return backend.strip()
    path = config_path or os.environ.get("TRISCOPE_CONFIG")
    if not path:
        return "embedded"
    import tomllib

    try:
        store = tomllib.loads(Path(path).read_text(encoding="utf-8")).get("store", {})
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
        return None  # the command reports it
    return str(store.get("backend", "embedded")) if isinstance(store, dict) else None


def _run(argv: Sequence[str] | None) -> int:
    invocation = _Invocation(sys.argv[1:] if argv is None else argv)
    _load_store_engine_early(invocation)
    parser = build_parser(only=invocation.command)
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
    entry()
