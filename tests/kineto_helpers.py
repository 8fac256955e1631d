"""Independent reading of Kineto traces with the stdlib, to check the collector against."""

from __future__ import annotations

import gzip
import json
from decimal import Decimal
from pathlib import Path
from typing import Any

GPU_CATEGORIES = {"kernel", "gpu_memcpy", "gpu_memset", "Kernel", "Memcpy", "Memset", "mtia_ccp_events"}


def load_json(path: Path, exact: bool = False) -> dict[str, Any]:
    """The whole document; ``exact`` reads numbers with decimals as Decimal."""
    raw = path.read_bytes()
    if raw[:2] == b"\x1f\x8b":
        raw = gzip.decompress(raw)
    return json.loads(raw, parse_float=Decimal) if exact else json.loads(raw)


def complete_events(doc: dict[str, Any]) -> list[dict[str, Any]]:
    return [e for e in doc["traceEvents"] if e.get("ph") == "X"]


def write_trace(path: Path, events: list[dict[str, Any]], compact: bool = False, **top: Any) -> Path:
    """Write a trace file the way Kineto does (or compact, on one line)."""
    doc = {"schemaVersion": 1, **top, "traceEvents": events}
    text = json.dumps(doc, separators=(",", ":")) if compact else json.dumps(doc, indent=2)
    if path.name.endswith(".gz"):
        path.write_bytes(gzip.compress(text.encode()))
    else:
        path.write_text(text)
    return path


def kernel(name: str, ts: float, dur: float, stream: int = 7, correlation: int = 0, cat: str = "kernel",
           **args: Any) -> dict[str, Any]:
    return {"ph": "X", "cat": cat, "name": name, "pid": 0, "tid": stream, "ts": ts, "dur": dur,
            "args": {"device": 0, "stream": stream, "correlation": correlation, **args}}


def runtime(name: str, ts: float, dur: float, correlation: int, cat: str = "cuda_runtime") -> dict[str, Any]:
    return {"ph": "X", "cat": cat, "name": name, "pid": 100, "tid": 100, "ts": ts, "dur": dur,
            "args": {"correlation": correlation, "External id": correlation}}


def cpu(name: str, ts: float, dur: float, cat: str = "cpu_op", **args: Any) -> dict[str, Any]:
    return {"ph": "X", "cat": cat, "name": name, "pid": 100, "tid": 100, "ts": ts, "dur": dur, "args": args}
