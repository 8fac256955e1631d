"""PyTorch Flight Recorder dumps (pickle or JSON, one file per rank) -> ``nccl_ops`` (source ``flight_recorder``).

A dump is ``{"version", "pg_config", "pg_status", "entries": [...]}``; each entry is one
collective or p2p op with ``collective_seq_id`` / ``p2p_seq_id``, ``process_group`` (name, desc),
``profiling_name`` (``nccl:all_reduce``, ``gloo:broadcast``), sizes, dtypes, ``state``
(scheduled / started / completed) and ``time_created_ns``. Pickles are read by an unpickler that
refuses every global except builtin containers and scalars, so a dump cannot run code.
"""

from __future__ import annotations

import io
import json
import math
import pickle
import re
from pathlib import Path
from typing import Any

from triscope.collectors.nccl.common import (
    NAN,
    backend_of,
    bandwidths,
    canonical_collective,
    dtype_bytes,
    new_row,
)
from triscope.errors import InputError
from triscope.schema import encode_ts

MAX_DUMP_BYTES = 2 << 30
_SAFE_BUILTINS = frozenset({"dict", "list", "tuple", "set", "frozenset", "str", "bytes", "bytearray",
                            "int", "float", "complex", "bool"})
_RANK_SUFFIX = re.compile(r"(\d+)(?:\.json)?$")


class _SafeUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module == "builtins" and name in _SAFE_BUILTINS:
            return getattr(__import__("builtins"), name)
        raise pickle.UnpicklingError(f"global {module}.{name} is not allowed in a Flight Recorder dump")


def safe_loads(data: bytes) -> Any:
    """Unpickle data holding only builtin containers and scalars; anything else raises UnpicklingError."""
    return _SafeUnpickler(io.BytesIO(data)).load()


def load_dump(path: Path) -> dict[str, Any]:
    """A dump file as a dict (JSON when it starts with ``{``, pickle otherwise)."""
    try:
        size = path.stat().st_size
        if size > MAX_DUMP_BYTES:
            raise InputError(f"{path}: {size} bytes is larger than the {MAX_DUMP_BYTES}-byte limit")
        data = path.read_bytes()
    except OSError as exc:
        raise InputError(f"{path}: cannot read ({exc.strerror})") from None
    try:
        dump = json.loads(data) if data.lstrip()[:1] == b"{" else safe_loads(data)
    except (pickle.UnpicklingError, ValueError, EOFError, TypeError, IndexError, AttributeError) as exc:
        raise InputError(f"{path}: not a Flight Recorder dump ({exc})") from None
    if not isinstance(dump, dict) or not isinstance(dump.get("entries", []), list):
        raise InputError(f"{path}: not a Flight Recorder dump (no 'entries' list)")
    return dump


def rank_from_path(path: Path) -> int | None:
    """Rank from the file name's trailing number (``fr_trace_rank_3``, ``nccl_trace_rank_3.json``)."""
    m = _RANK_SUFFIX.search(path.name)
    return int(m.group(1)) if m else None


def _numel(sizes: Any) -> int:
    total = 0
    for shape in sizes or []:
        total += math.prod(int(d) for d in shape) if isinstance(shape, (list, tuple)) else 0
    return total


def _pg_sizes(pg_config: Any) -> dict[str, int]:
    out: dict[str, int] = {}
    if not isinstance(pg_config, dict):
        return out
    for name, cfg in pg_config.items():
        ranks = cfg.get("ranks") if isinstance(cfg, dict) else None
        if isinstance(ranks, str):
            try:
                ranks = json.loads(ranks)
            except ValueError:
                ranks = None
        if isinstance(ranks, list) and ranks:
            out[str(name)] = len(ranks)
    return out


def _last_completed(pg_status: Any) -> dict[str, int]:
    if not isinstance(pg_status, dict):
        return {}
    return {str(k): int(v.get("last_completed_collective", -1)) for k, v in pg_status.items() if isinstance(v, dict)}


def dump_rows(dump: dict[str, Any], rank: int, run_id: str, host: str = "") -> list[dict[str, Any]]:
    """nccl_ops rows for the entries of one rank's dump."""
    sizes = _pg_sizes(dump.get("pg_config"))
    completed = _last_completed(dump.get("pg_status"))
    rows = []
    for e in dump.get("entries", []):
        if not isinstance(e, dict):
            continue
        pg = list(e.get("process_group") or ["", ""]) + ["", ""]
        pg_name, pg_desc = str(pg[0]), str(pg[1])
        name = str(e.get("profiling_name", ""))
        collective = canonical_collective(name)
        p2p = bool(e.get("is_p2p"))
        seq = int(e.get("p2p_seq_id" if p2p else "collective_seq_id", -1) or 0)
        dtypes = list(e.get("input_dtypes") or []) + list(e.get("output_dtypes") or [])
        dtype = str(dtypes[0]) if dtypes else ""
        nelems = max(_numel(e.get("input_sizes")), _numel(e.get("output_sizes")))
        msg_bytes = nelems * dtype_bytes(dtype) if nelems else NAN
        duration = NAN
        if e.get("duration_ms") is not None:
            duration = float(e["duration_ms"]) / 1e3
        elif e.get("time_discovered_completed_ns") and e.get("time_discovered_started_ns"):
            duration = (int(e["time_discovered_completed_ns"]) - int(e["time_discovered_started_ns"])) / 1e9
        nranks = sizes.get(pg_name, -1)
        alg, bus = bandwidths(msg_bytes, duration, collective, nranks)
        state = str(e.get("state", ""))
        last_done = completed.get(pg_name)
        done = state == "completed" or (not p2p and last_done is not None and 0 <= seq <= last_done)
        pending = not done and not bool(e.get("retired"))
        frames = [f"{f.get('filename', '')}:{f.get('line', '')} {f.get('name', '')}"
                  for f in (e.get("frames") or [])[:4] if isinstance(f, dict)]
        rows.append(new_row(
            ts=encode_ts(int(e.get("time_created_ns") or 0)), host=host, run_id=run_id, rank=rank,
            source="flight_recorder", backend=backend_of(name), comm_id=pg_name, pg_desc=pg_desc,
            collective=collective, op_name=name, seq=seq, is_p2p=p2p, nranks=nranks, msg_bytes=msg_bytes,
            count=float(nelems) if nelems else NAN, dtype=dtype, duration_seconds=duration,
            algbw_bytes_per_second=alg, busbw_bytes_per_second=bus, state=state,
            timeout_seconds=float(e["timeout_ms"]) / 1e3 if e.get("timeout_ms") is not None else NAN,
            detail_json={"pending": pending, "retired": bool(e.get("retired")), "record_id": e.get("record_id"),
                         "op_id": e.get("op_id"), "pg_id": e.get("pg_id"), "input_sizes": e.get("input_sizes"),
                         "output_sizes": e.get("output_sizes"), "pg_last_completed": last_done,
                         "version": dump.get("version"), "thread_name": e.get("thread_name"), "frames": frames},
        ))
    return rows


def parse_file(path: Path, run_id: str, rank: int | None = None, host: str = "") -> list[dict[str, Any]]:
    """Rows of one dump file; the rank comes from ``rank`` or the file name."""
    rank = rank if rank is not None else rank_from_path(path)
    if rank is None:
        raise InputError(f"{path}: cannot tell the rank from the file name; give --rank")
    return dump_rows(load_dump(path), rank, run_id, host)
