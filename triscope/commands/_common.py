"""Helpers shared by subcommands: config and store from parsed arguments, JSON output, times."""

from __future__ import annotations

import argparse
import json
import sys
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from triscope.errors import InputError

if TYPE_CHECKING:
    from triscope.store import Store

# Config and store are imported when a command runs: every command module imports this one to build
# the parser, and `triscope --help` should load no more than argparse needs.


def config_from(args: argparse.Namespace) -> dict[str, Any]:
    """Config for this invocation (``--config`` file, then environment overrides)."""
    from triscope.config import load_config

    return load_config(getattr(args, "config", None))


def store_from(args: argparse.Namespace) -> Store:
    """Open and migrate the configured store."""
    from triscope.store import open_store

    return open_store(config_from(args))


def add_json_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print machine-readable JSON on stdout")


def print_json(value: Any) -> None:
    json.dump(value, sys.stdout, indent=2, default=str)
    sys.stdout.write("\n")


def add_common(parser: argparse.ArgumentParser, json_flag: bool = True) -> None:
    """``--config`` (also accepted after the subcommand) and, optionally, ``--json``."""
    parser.add_argument("-c", "--config", default=argparse.SUPPRESS,
                        help="TOML config file (default: $TRISCOPE_CONFIG)")
    if json_flag:
        add_json_flag(parser)


def parse_when(text: str, now_ns: int, epoch_seconds: bool = True, flag: str = "") -> int:
    """Epoch ns of an ISO-8601 time (UTC unless it has an offset) or a duration ago (``10m``).

    A bare number is epoch seconds with ``epoch_seconds``, else seconds ago (a duration). ``flag``
    prefixes the error message (``--until: ...``)."""
    from triscope.analyzers.stalls import parse_duration

    t = text.strip()
    try:
        if epoch_seconds and t.replace(".", "", 1).isdigit():
            return int(float(t) * 1e9)
        return now_ns - int(parse_duration(t) * 1e9)
    except InputError:
        pass
    try:
        moment = datetime.fromisoformat(t.replace("Z", "+00:00"))
    except ValueError:
        forms = "an ISO-8601 time, epoch seconds or duration" if epoch_seconds else "a duration or ISO-8601 time"
        raise InputError(f"{flag + ': ' if flag else ''}not {forms}: {text!r}") from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return int(moment.timestamp() * 1e9)


def since_start(since: str | None, end_ns: int, default: str = "10m") -> int:
    """Start of the last ``since`` (a duration, ``default`` when not given) before ``end_ns``."""
    from triscope.analyzers.stalls import parse_duration

    return end_ns - int(parse_duration(since or default) * 1e9)


def time_range(since: str | None, start: str | None, end: str | None, now_ns: int, *, epoch_seconds: bool = True,
               end_flag: str = "--to") -> tuple[int, int]:
    """``[start, end)`` in epoch ns from ``--since DURATION`` (default 10m) or ``--from WHEN``, ending at
    ``end`` (the ``end_flag`` option; default now). InputError (one line) for both starts, a bad time or an
    empty range."""
    if since and start:
        raise InputError("use either --since or --from, not both")
    end_ns = parse_when(end, now_ns, epoch_seconds, flag=end_flag) if end else now_ns
    start_ns = parse_when(start, now_ns, epoch_seconds, flag="--from") if start else since_start(since, end_ns)
    if end_ns <= start_ns:
        raise InputError(f"empty time range: {utc_text(start_ns)} .. {utc_text(end_ns)} UTC "
                         f"({end_flag} must be after --from)")
    return start_ns, end_ns


def utc_text(ns: int) -> str:
    """``YYYY-MM-DD HH:MM:SS.mmm`` (UTC) of epoch ns, for tables and messages."""
    return datetime.fromtimestamp(ns / 1e9, UTC).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]
