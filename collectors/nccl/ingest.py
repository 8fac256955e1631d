"""Detect the format of an NCCL-related file and load it into ``nccl_ops``.

Formats: NCCL Inspector JSON lines or Prometheus text, PyTorch Flight Recorder dumps (pickle or
JSON; a directory holds one per rank), nccl-tests stdout. Re-ingesting the same run id and
source replaces the earlier rows. Rows go straight to the store (:mod:`triscope.collectors.ingest_sink`),
not through the writer: a re-ingest must replace them before the command returns.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from triscope.collectors.nccl import flight_recorder, inspector, tests_output
from triscope.collectors.nccl.common import replace_rows
from triscope.errors import InputError
from triscope.store.base import Store

FORMATS = ("auto", "inspector", "flight-recorder", "nccl-tests")
SOURCE_OF = {"inspector": "inspector", "flight-recorder": "flight_recorder", "nccl-tests": "nccl_tests"}


@dataclass
class NcclIngestResult:
    """What one path produced."""

    path: str
    format: str
    run_id: str
    rows: int = 0
    errors: list[str] = field(default_factory=list)


def detect_format(path: Path) -> str:
    """``inspector``, ``flight-recorder`` or ``nccl-tests`` from a file's first bytes."""
    if path.is_dir():
        return "flight-recorder"
    try:
        with path.open("rb") as fh:
            head = fh.read(65536)
    except OSError as exc:
        raise InputError(f"{path}: cannot read ({exc.strerror})") from None
    if head[:1] == b"\x80":
        return "flight-recorder"
    text = head.decode("utf-8", "replace")
    stripped = text.lstrip()
    if stripped.startswith("{"):
        first = stripped.splitlines()[0]
        if '"coll_perf"' in first or '"p2p_perf"' in first or '"inspector_output_format_version"' in first:
            return "inspector"
        if '"entries"' in text or '"pg_config"' in text or '"version"' in text:
            return "flight-recorder"
    if "_perf" in text and "busbw" in text:
        return "nccl-tests"
    if "nccl_bus_bandwidth_gbs" in text or "nccl_collective_exec_time_microseconds" in text \
            or "nccl_p2p_bus_bandwidth_gbs" in text:
        return "inspector"
    raise InputError(f"{path}: not a recognised NCCL Inspector, Flight Recorder or nccl-tests file")


def _fr_files(path: Path) -> list[Path]:
    if not path.is_dir():
        return [path]
    files = sorted(p for p in path.iterdir() if p.is_file() and flight_recorder.rank_from_path(p) is not None)
    if not files:
        raise InputError(f"{path}: no Flight Recorder dumps (files ending in a rank number) in this directory")
    pickles = [p for p in files if not p.name.endswith(".json")]
    # A directory holding both the pickle and the JSON dump of each rank: read each rank once.
    return pickles or files


def ingest_path(store: Store, path: str | Path, fmt: str = "auto", run_id: str | None = None,
                rank: int | None = None, collective: str = "") -> NcclIngestResult:
    """Load one file (or a Flight Recorder directory); bad parts are listed in ``errors``."""
    path = Path(path)
    if not path.exists():
        raise InputError(f"{path}: no such file or directory")
    fmt = detect_format(path) if fmt == "auto" else fmt
    if fmt not in SOURCE_OF:
        raise InputError(f"unknown NCCL format {fmt!r} (choose from {', '.join(FORMATS)})")
    run_id = run_id or (path.resolve().name if path.is_dir() else path.name.split(".")[0])
    result = NcclIngestResult(str(path), fmt, run_id)
    if fmt == "flight-recorder":
        rows = []
        seen: set[int] = set()
        for file in _fr_files(path):
            try:
                file_rows = flight_recorder.parse_file(file, run_id, rank=rank if not path.is_dir() else None)
            except InputError as exc:
                result.errors.append(str(exc))
                continue
            r = file_rows[0]["rank"] if file_rows else -1
            if r in seen:
                result.errors.append(f"{file}: rank {r} already read from another dump, skipped")
                continue
            seen.add(r)
            rows.extend(file_rows)
    elif fmt == "inspector":
        parsed = inspector.parse_file(path, run_id)
        rows, result.errors = parsed.rows, parsed.errors
    else:
        parsed = tests_output.parse_file(path, run_id, collective)
        rows, result.errors = parsed.rows, parsed.errors
    if not rows and result.errors:
        raise InputError(result.errors[0])
    result.rows = replace_rows(store, rows, SOURCE_OF[fmt], run_id, per_rank=fmt == "flight-recorder")
    return result
