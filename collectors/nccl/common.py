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
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from triscope.collectors import ingest_sink
from triscope.schema import NCCL_OPS, encode_ts
from triscope.store.base import Store

NAN = float("nan")

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


@dataclass
class Parsed:
    """Rows parsed from a file and one-line messages for the parts that could not be read."""

    rows: list[dict[str, Any]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def canonical_collective(name: str) -> str:
    """``AllReduce`` for ``allreduce``, ``nccl:all_reduce``, ``ncclDevKernel_AllReduce_...``,
    ``gloo:all_reduce``; '' if unknown."""
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


def _unknown(ch_type: str, default: Any) -> Any:
    """What a column holds when the source does not give it: NaN for floats, -1 for signed integers."""
    if ch_type.startswith("Float"):
        return NAN
    return -1 if ch_type.startswith("Int") else default


_UNKNOWN = {c.name: _unknown(c.type, NCCL_OPS.defaults()[c.name]) for c in NCCL_OPS.columns}


def new_row(**values: Any) -> dict[str, Any]:
    """A row with every ``nccl_ops`` column set: given values, else NaN / -1 / '' by type."""
    unknown = set(values) - set(_UNKNOWN)
    if unknown:
        raise KeyError(f"not {NCCL_OPS.name} columns: {sorted(unknown)}")
    row = {**_UNKNOWN, "ts": encode_ts(0), "ingested_at": time.time(), **values}
    if isinstance(row["detail_json"], Mapping):
        row["detail_json"] = json.dumps(row["detail_json"], default=str, sort_keys=True)
    row["is_p2p"] = int(bool(row["is_p2p"]) or row["collective"] in P2P)
    return row


def replace_rows(store: Store, rows: list[dict[str, Any]], source: str, run_id: str,
                 per_rank: bool = False) -> int:
    """Store rows of (source, run_id) through the file-ingest path (:mod:`~triscope.collectors.ingest_sink`),
    replacing earlier rows of the same key. ``per_rank``: replace only the ranks present in ``rows``
    (one file per rank, e.g. Flight Recorder)."""
    where = "source = {source:String} AND run_id = {run_id:String}"
    params: dict[str, Any] = {"source": source, "run_id": run_id}
    if per_rank:
        if not rows:
            return 0
        where += " AND rank IN {ranks:Array(Int32)}"
        params["ranks"] = sorted({int(r["rank"]) for r in rows})
    return ingest_sink.replace_rows(store, NCCL_OPS, where, params, NCCL_OPS.columns_of(rows))
