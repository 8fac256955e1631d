"""NCCL Inspector plugin output -> ``nccl_ops`` (source ``inspector``).

Two formats: the JSON-lines dump (``inspector_output_format_version`` v4.0: ``header``,
``metadata``, ``coll_perf`` per line) and the Prometheus text the plugin exposes
(``nccl_bus_bandwidth_gbs``, ``nccl_collective_exec_time_microseconds`` and their ``nccl_p2p_*``
twins, one series per communicator / collective / message-size bucket). GB/s are 1e9 bytes/s.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from triscope.collectors.nccl.common import NAN, Parsed, bus_factor, canonical_collective, new_row
from triscope.errors import InputError
from triscope.prom_text import scan
from triscope.schema import encode_ts

MAX_LINE_BYTES = 1 << 20
_GB = 1e9
_PER_RANK_SIZE = frozenset({"AllGather", "ReduceScatter"})


def _float(value: Any) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return NAN


def _jsonl_row(record: dict[str, Any], run_id: str) -> dict[str, Any] | None:
    header = record.get("header") or {}
    meta = record.get("metadata") or {}
    perf = record.get("coll_perf")
    p2p = False
    if perf is None:
        perf, p2p = record.get("p2p_perf"), True
    if not isinstance(perf, dict) or not isinstance(header, dict) or not isinstance(meta, dict):
        return None
    name = str(perf.get("coll") or perf.get("p2p_op") or "")
    collective = canonical_collective(name)
    nranks = int(header.get("n_ranks", -1))
    trace_ts = perf.get("event_trace_ts") or {}
    start_us = trace_ts.get("coll_start_ts") if isinstance(trace_ts, dict) else None
    ts_us: Any = start_us if start_us is not None else meta.get("dump_timestamp_us", 0)
    duration = _float(perf.get("coll_exec_time_us", perf.get("p2p_exec_time_us"))) / 1e6
    busbw = _float(perf.get("coll_busbw_gbs", perf.get("p2p_busbw_gbs"))) * _GB
    algbw = _float(perf.get("coll_algobw_gbs", perf.get("p2p_algobw_gbs"))) * _GB
    if algbw != algbw and busbw == busbw:
        algbw = busbw / bus_factor(collective, nranks)
    raw_bytes = _float(perf.get("coll_msg_size_bytes", perf.get("p2p_msg_size_bytes")))
    # Inspector gives the per-rank buffer of AllGather/ReduceScatter (its algbw uses n x that);
    # nccl_ops holds nccl-tests' "size", the full buffer.
    msg_bytes = raw_bytes * nranks if collective in _PER_RANK_SIZE and nranks > 0 else raw_bytes
    seq: Any = perf.get("coll_sn", perf.get("p2p_sn", -1))
    return new_row(
        ts=encode_ts(int(ts_us) * 1000), host=str(meta.get("hostname", "")), run_id=run_id,
        rank=int(header.get("rank", -1)), source="inspector", backend="nccl", comm_id=str(header.get("id", "")),
        collective=collective, op_name=name, seq=int(seq), is_p2p=p2p,
        nranks=nranks, msg_bytes=msg_bytes,
        duration_seconds=duration, algbw_bytes_per_second=algbw, busbw_bytes_per_second=busbw, state="completed",
        detail_json={"format_version": meta.get("inspector_output_format_version"), "pid": meta.get("pid"),
                     "nnodes": header.get("nnodes"), "rec_mechanism": meta.get("rec_mechanism"),
                     "timing_source": perf.get("coll_timing_source"), "coll_msg_size_bytes": raw_bytes,
                     "ts_basis": "coll_start_ts" if start_us is not None else "dump_timestamp_us"},
    )


def parse_jsonl(lines: Iterable[bytes | str], source: str, run_id: str) -> Parsed:
    """Parse Inspector JSON lines; a bad line is reported by number and the rest still load."""
    out = Parsed()
    for number, raw in enumerate(lines, 1):
        text = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else raw
        if not text.strip():
            continue
        if len(text) > MAX_LINE_BYTES:
            out.errors.append(f"{source}:{number}: line longer than {MAX_LINE_BYTES} bytes, skipped")
            continue
        try:
            record = json.loads(text)
            row = _jsonl_row(record, run_id) if isinstance(record, dict) else None
        except (ValueError, TypeError) as exc:
            out.errors.append(f"{source}:{number}: not an Inspector record ({exc})")
            continue
        if row is None:
            out.errors.append(f"{source}:{number}: no coll_perf/p2p_perf object")
            continue
        out.rows.append(row)
    return out


_METRICS = {
    "nccl_bus_bandwidth_gbs": ("busbw", False), "nccl_collective_exec_time_microseconds": ("time", False),
    "nccl_algorithm_bandwidth_gbs": ("algbw", False),
    "nccl_p2p_bus_bandwidth_gbs": ("busbw", True), "nccl_p2p_exec_time_microseconds": ("time", True),
}


def parse_prometheus(lines: Iterable[str], source: str, run_id: str, ts_ns: int) -> Parsed:
    """Parse the Inspector's Prometheus text: one row per (series labels), joining time and bandwidth."""
    out = Parsed()
    series: dict[tuple[tuple[str, str], ...], dict[str, Any]] = {}
    page = scan("\n".join(line.strip() for line in lines), _METRICS)
    out.errors += [f"{source}:{number}: not a Prometheus sample" for number in page.bad_numbers]
    for name, labels, value in page.samples:
        what, p2p = _METRICS[name]
        key = tuple(sorted(labels.items()))
        entry = series.setdefault(key, {"labels": labels, "p2p": p2p})
        entry[what] = value
    for entry in series.values():
        labels = entry["labels"]
        name = labels.get("p2p_operation") if entry["p2p"] else labels.get("collective", "")
        collective = canonical_collective(name or "")
        nranks = int(_float(labels.get("nranks")) if labels.get("nranks") else -1)
        gpu = re.search(r"(\d+)$", labels.get("gpu", ""))
        busbw = entry.get("busbw", NAN) * _GB
        algbw = entry.get("algbw", NAN) * _GB
        if algbw != algbw and busbw == busbw:
            algbw = busbw / bus_factor(collective, nranks)
        out.rows.append(new_row(
            ts=encode_ts(ts_ns), host=labels.get("node", ""), run_id=run_id, source="inspector", backend="nccl",
            comm_id=labels.get("comm_name", ""), collective=collective, op_name=name or "", is_p2p=entry["p2p"],
            nranks=nranks, device=int(gpu.group(1)) if gpu else -1,
            duration_seconds=entry.get("time", NAN) / 1e6, algbw_bytes_per_second=algbw,
            busbw_bytes_per_second=busbw, state="completed",
            detail_json={"message_size_bucket": labels.get("message_size"), "algo_proto": labels.get("algo_proto"),
                         "slurm_job_id": labels.get("slurm_job_id"), "inspector_version": labels.get("version"),
                         "n_nodes": labels.get("n_nodes"), "aggregated": True},
        ))
    return out


def parse_file(path: Path, run_id: str) -> Parsed:
    """Either format, chosen by content (a line starting with ``{`` is JSON lines)."""
    try:
        text = path.read_text(errors="replace")
    except OSError as exc:
        raise InputError(f"{path}: cannot read ({exc.strerror})") from None
    first = next((ln for ln in text.splitlines() if ln.strip() and not ln.startswith("#")), "")
    if first.lstrip().startswith("{"):
        return parse_jsonl(text.splitlines(), str(path), run_id)
    return parse_prometheus(text.splitlines(), str(path), run_id, int(path.stat().st_mtime * 1e9))
