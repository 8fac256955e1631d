"""nccl-tests (``all_reduce_perf`` & co.) stdout -> ``nccl_ops`` (source ``nccl_tests``).

Each data row gives size (bytes), count (elements), type, redop, root, then time (us), algbw and
busbw (GB/s) and #wrong for the out-of-place and the in-place run; older builds have no root
column. Every row becomes two ``nccl_ops`` rows, ``variant`` out_of_place and in_place.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from triscope.collectors.nccl.common import NAN, Parsed, canonical_collective, new_row
from triscope.errors import InputError
from triscope.schema import encode_ts

_BINARY = re.compile(r"\b([a-z_]+?)_perf(?:_mpi)?\b")
_RANK_LINE = re.compile(r"^#\s+Rank\s+(\d+)\s+Group\s+\d+\s+Pid\s+\d+\s+on\s+(\S+)\s+device\s+(\d+)")
_AVG = re.compile(r"^#\s*Avg bus bandwidth\s*:\s*([0-9.]+)")
_NUMBER = re.compile(r"^\d+$")


def _num(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        return NAN  # "N/A" when a check was disabled


def parse_text(text: str, source: str, run_id: str, ts_ns: int, collective: str = "") -> Parsed:
    """Parse one nccl-tests output; unreadable data rows are reported by line number."""
    out = Parsed()
    binary = _BINARY.search(text)
    collective = collective or (canonical_collective(binary.group(1)) if binary else "")
    ranks: dict[int, tuple[str, int]] = {}
    avg = NAN
    pending: list[tuple[int, list[str]]] = []
    for number, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        rank = _RANK_LINE.match(stripped)
        if rank:
            ranks[int(rank.group(1))] = (rank.group(2), int(rank.group(3)))
            continue
        m = _AVG.match(stripped)
        if m:
            avg = float(m.group(1))
            continue
        if not stripped or stripped.startswith(("#", ">")):
            continue
        fields = stripped.split()
        if _NUMBER.match(fields[0]) and len(fields) in (12, 13):
            pending.append((number, fields))
        elif _NUMBER.match(fields[0]):
            out.errors.append(f"{source}:{number}: expected 12 or 13 columns, found {len(fields)}")
    if not collective:
        raise InputError(f"{source}: cannot tell which collective this nccl-tests run measured; give --collective")
    nranks = len(ranks) or -1
    hosts = sorted({h for h, _ in ranks.values()})
    for number, f in pending:
        root = f[4] if len(f) == 13 else "-1"
        rest = f[5:] if len(f) == 13 else f[4:]
        for variant, (t, alg, bus, wrong) in (("out_of_place", rest[0:4]), ("in_place", rest[4:8])):
            detail: dict[str, Any] = {"line": number, "root": int(_num(root)) if _num(root) == _num(root) else -1,
                                      "hosts": hosts, "avg_busbw_gbs": avg}
            wrong_n = _num(wrong)
            out.rows.append(new_row(
                ts=encode_ts(ts_ns), host=hosts[0] if len(hosts) == 1 else "", run_id=run_id, source="nccl_tests",
                backend="nccl", collective=collective, op_name=binary.group(0) if binary else collective,
                nranks=nranks, msg_bytes=_num(f[0]), count=_num(f[1]), dtype=f[2], redop=f[3], variant=variant,
                duration_seconds=_num(t) / 1e6, algbw_bytes_per_second=_num(alg) * 1e9,
                busbw_bytes_per_second=_num(bus) * 1e9, state="completed",
                wrong_count=int(wrong_n) if wrong_n == wrong_n else -1, detail_json=detail,
            ))
    if not out.rows:
        raise InputError(f"{source}: no nccl-tests result rows found")
    return out


def parse_file(path: Path, run_id: str, collective: str = "") -> Parsed:
    """Parse an nccl-tests output file (its mtime is the rows' timestamp)."""
    try:
        text = path.read_text(errors="replace")
    except OSError as exc:
        raise InputError(f"{path}: cannot read ({exc.strerror})") from None
    return parse_text(text, str(path), run_id, int(path.stat().st_mtime * 1e9), collective)
