"""Helpers shared by subcommands: config and store from parsed arguments, JSON output."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from triscope.config import load_config
from triscope.store import Store, open_store


def config_from(args: argparse.Namespace) -> dict[str, Any]:
    """Config for this invocation (``--config`` file, then environment overrides)."""
    return load_config(getattr(args, "config", None))


def store_from(args: argparse.Namespace) -> Store:
    """Open and migrate the configured store."""
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
