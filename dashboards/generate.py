"""Write the generated boards: ``python -m triscope.dashboards.generate [--out DIR] [--check]``.

The default output is ``dashboards/json`` next to this module, the folder Grafana's file
provider reads (mounted at /var/lib/grafana/dashboards). ``--check`` writes nothing and exits 1
when a file is missing, stale or extra.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from triscope.dashboards.boards import all_boards

DEFAULT_OUT = Path(__file__).resolve().parent / "json"


def render(board: dict[str, Any]) -> str:
    """The JSON text of one board, as committed (sorted keys, 2-space indent, final newline)."""
    return json.dumps(board, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def expected_files() -> dict[str, str]:
    """``{file name: text}`` of every board."""
    return {f"{stem}.json": render(board) for stem, board in all_boards().items()}


def stale_files(out: Path) -> list[str]:
    """Names of files in ``out`` that differ from the generator (missing, changed or extra ``*.json``)."""
    want = expected_files()
    have = {p.name for p in out.glob("*.json")} if out.is_dir() else set()
    bad = [n for n, text in want.items() if not (out / n).is_file() or (out / n).read_text() != text]
    return sorted(bad + [n for n in have - set(want)])


def write(out: Path) -> list[Path]:
    """Write every board to ``out`` (created if needed) and delete stale ``*.json`` there; returns the paths."""
    out.mkdir(parents=True, exist_ok=True)
    want = expected_files()
    for extra in set(p.name for p in out.glob("*.json")) - set(want):
        (out / extra).unlink()
    paths = []
    for name, text in want.items():
        path = out / name
        if not path.is_file() or path.read_text() != text:
            path.write_text(text)
        paths.append(path)
    return paths


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m triscope.dashboards.generate", description=__doc__)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"output folder (default {DEFAULT_OUT})")
    parser.add_argument("--check", action="store_true", help="only check that the files are up to date")
    args = parser.parse_args(argv)
    if args.check:
        bad = stale_files(args.out)
        for name in bad:
            print(f"stale: {args.out / name}", file=sys.stderr)
        return 1 if bad else 0
    for path in write(args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
