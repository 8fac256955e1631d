"""Shared pieces of the NCCL collectors: collective names, dtype sizes, bus factors, row building.

Bus bandwidth follows nccl-tests (doc/PERFORMANCE.md): ``busbw = algbw x factor`` with
AllReduce ``2(n-1)/n``; ReduceScatter, AllGather and AllToAll ``(n-1)/n``; Broadcast, Reduce,
Send/Recv ``1``. ``msg_bytes`` is nccl-tests' "size": for AllGather / ReduceScatter the
full (gathered) buffer, i.e. ``max(in_nelems, out_nelems) x dtype size``.
"""

from __future__ import annotations

import json
import math
import re
import time
from collections.abc import Iterable, Mapping
from typing import Any

from triscope.schema import qualified
from triscope.schema.nccl import NCCL_OPS
from triscope.store.base import Store

NAN = float("nan")
COLUMNS = NCCL_OPS.column_names()

# Canonical NCCL collective names keyed by a normalised spelling (lower case, no _ or -).
_CANONICAL = {
    "allreduce": "AllReduce", "allreducecoalesced": "AllReduce",
    "allgather": "AllGather", "allgatherbase": "AllGather", "allgatherintotensor": "AllGather",
    "allgatherintotensorcoalesced": "AllGather", "allgathercoalesced": "AllGather",
    "reducescatter": "ReduceScatter", "reducescatterbase": "ReduceScatter",
    "reducescattertensor": "ReduceScatter", "reducescattertensorcoalesced": "ReduceScatter",
    "alltoall": "AllToAll", "alltoallbase": "AllToAll", "alltoallv": "AllToAll",
    "broadcast": "Broadcast", "reduce": "Reduce",
    "sendrecv": "SendRecv", "send": "Send", "recv": "Recv", "recvanysource": "Recv",
    "barrier": "Barrier", "gather": "Gather", "scatter": "Scatter",
}
P2P = frozenset({"SendRecv", "Send", "Recv"})
_KERNEL_NAME = re.compile(r"^(?:void )?(?:nccl|rccl)(?:Dev)?Kernel_([A-Za-z]+)")
_BACKEND_PREFIX = re.compile(r"^(nccl|rccl|gloo|mpi|ucc|xccl):")

# Element sizes: c10 ScalarType names (record_param_comms, Flight Recorder) and C spellings.
_DTYPE_BYTES = {
    "float": 4, "float32": 4, "double": 8, "float64": 8, "half": 2, "float16": 2, "bfloat16": 2,
    "c10::half": 2, "c10::bfloat16": 2, "long": 8, "int64": 8, "long int": 8, "int": 4, "int32": 4,
    "short": 2, "int16": 2, "char": 1, "int8": 1, "signed char": 1, "byte": 1, "uint8": 1,
    "unsigned char": 1, "bool": 1, "complexfloat": 8, "complexdouble": 16, "complexhalf": 4,
    "float8_e4m3fn": 1, "float8_e5m2": 1, "float8_e4m3fnuz": 1, "float8_e5m2fnuz": 1, "uint16": 2,
    "uint32": 4, "uint64": 8, "int8_t": 1, "uint8_t": 1,
}


def canonical_collective(name: str) -> str:
    """``AllReduce`` for ``allreduce``, ``nccl:all_reduce``, ``ncclDevKernel_AllReduce_...``, ``gloo:all_reduce``; '' if unknown."""
    if not name:
        return ""
    kernel = _KERNEL_NAME.match(name)
    if kernel:
        name = kernel.group(1)
    name = _BACKEND_PREFIX.sub("", name)
    key = re.sub(r"[^a-z]", "", name.lower())
    return _CANONICAL.get(key, "")


def backend_of(name: str) -> str:
    """``nccl``/``rccl``/``gloo``/... from an op or kernel name prefix, '' when not visible."""
    match = _BACKEND_PREFIX.match(name)
    if match:
        return match.group(1)
    if re.match(r"^(?:void )?rccl", name):
        return "rccl"
    if re.match(r"^(?:void )?nccl", name):
        return "nccl"
    return ""


def dtype_bytes(dtype: str) -> float:
    """Bytes per element of a dtype name, NaN when unknown."""
    return float(_DTYPE_BYTES.get(dtype.strip().lower().replace("torch.", ""), NAN)) if dtype else NAN


def bus_factor(collective: str, nranks: int) -> float:
    """nccl-tests bus-bandwidth factor; NaN when it does not apply or ``nranks`` is unknown."""
    if collective in ("Broadcast", "Reduce", "SendRecv", "Send", "Recv"):
        return 1.0
    if nranks is None or nranks < 1:
        return NAN
    if collective == "AllReduce":
        return 2.0 * (nranks - 1) / nranks
    if collective in ("ReduceScatter", "AllGather", "AllToAll"):
        return (nranks - 1) / nranks
    return NAN


def bandwidths(msg_bytes: float, duration_seconds: float, collective: str, nranks: int) -> tuple[float, float]:
    """(algbw, busbw) in bytes per second; NaN when size or time is not known."""
    if not (math.isfinite(msg_bytes) and math.isfinite(duration_seconds)) or duration_seconds <= 0:
        return NAN, NAN
    alg = msg_bytes / duration_seconds
    return alg, alg * bus_factor(collective, nranks)


def ns_text(ns: int) -> str:
    """Epoch nanoseconds as the exact ``seconds.nanoseconds`` text a DateTime64(9) column parses."""
    ns = int(ns)
    return f"{ns // 1_000_000_000}.{ns % 1_000_000_000:09d}"


def new_row(**values: Any) -> dict[str, Any]:
    """A row with every column set: given values, else NaN / -1 / '' by type."""
    row: dict[str, Any] = {
        "ts": "0.000000000", "host": "", "run_id": "", "rank": -1, "source": "", "backend": "",
        "comm_id": "", "pg_desc": "", "collective": "", "op_name": "", "seq": -1, "is_p2p": 0,
        "nranks": -1, "msg_bytes": NAN, "count": NAN, "dtype": "", "redop": "", "variant": "",
        "device": -1, "duration_seconds": NAN, "algbw_bytes_per_second": NAN,
        "busbw_bytes_per_second": NAN, "state": "", "timeout_seconds": NAN, "wrong_count": -1,
        "detail_json": "", "ingested_at": time.time(),
    }
    unknown = set(values) - set(row)
    if unknown:
        raise KeyError(f"not nccl_ops columns: {sorted(unknown)}")
    row.update(values)
    if isinstance(row["detail_json"], Mapping):
        row["detail_json"] = json.dumps(row["detail_json"], default=str, sort_keys=True)
    row["is_p2p"] = int(bool(row["is_p2p"]) or row["collective"] in P2P)
    return row


def columns_of(rows: Iterable[Mapping[str, Any]]) -> dict[str, list[Any]]:
    """Row dicts to the column dict the store inserts."""
    out: dict[str, list[Any]] = {c: [] for c in COLUMNS}
    for row in rows:
        for c in COLUMNS:
            out[c].append(row[c])
    return out


def replace_rows(store: Store, rows: list[dict[str, Any]], source: str, run_id: str,
                 per_rank: bool = False) -> int:
    """Insert rows of (source, run_id), first deleting earlier rows so a re-ingest replaces them.

    ``per_rank``: delete only the ranks present in ``rows`` (one file per rank, e.g. Flight Recorder).
    """
    table = qualified(store, NCCL_OPS.name)
    where = "source = {source:String} AND run_id = {run_id:String}"
    params: dict[str, Any] = {"source": source, "run_id": run_id}
    if per_rank:
        where += " AND rank IN {ranks:Array(Int32)}"
        params["ranks"] = sorted({int(r["rank"]) for r in rows})
        if not rows:
            return 0
    if store.cluster:
        store.command(f"ALTER TABLE {table}_local ON CLUSTER `{store.cluster}` DELETE WHERE {where} "
                      "SETTINGS mutations_sync = 2", params)
    else:
        store.command(f"DELETE FROM {table} WHERE {where}", params)
    if rows:
        store.insert(table, columns_of(rows))
    return len(rows)
