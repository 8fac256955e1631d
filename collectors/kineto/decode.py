"""The Python path: decoded events as ``trace_events`` columns, read exactly as the SQL path reads them.

Used for blocks ClickHouse refuses (and with ``use_clickhouse_json=False``). ``args`` values follow
ClickHouse's ``JSONExtract`` rules so both paths store identical rows (see :mod:`.sql`).
"""

from __future__ import annotations

import json
import math
import re
from decimal import Decimal
from typing import Any, TypeVar

from triscope.collectors.kineto.classify import DEVICE_KINDS, event_kind, kernel_class, pid_device, stream_kind
from triscope.collectors.kineto.events import INT64_MAX, INT64_MIN, EventArgs, TraceEvent, event_args, us_to_ns

D = TypeVar("D", int, None)
_DECIMAL_TEXT = re.compile(r"[+-]?\d+")
_NUMBER_TEXT = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?")


def arg_int(value: Any, default: D) -> int | D:
    """An ``args`` value as Int64 the way ClickHouse's ``JSONExtract(..., 'Nullable(Int64)')`` reads it.

    Integers in range as they are (booleans as 0/1), floats and numeric text truncated toward zero,
    anything out of Int64 range, other text (hex, padded with spaces), objects, arrays and null
    -> ``default``. (ClickHouse reads the text "nan" as Int64 min; here it is ``default``.)
    """
    if isinstance(value, int):
        if INT64_MIN <= value <= INT64_MAX:
            return value
        value = float(value)  # ClickHouse's JSON parser reads integers beyond Int64 as doubles
    elif isinstance(value, str):
        if _DECIMAL_TEXT.fullmatch(value):
            number = int(value)
            return number if INT64_MIN <= number <= INT64_MAX else default
        if not _NUMBER_TEXT.fullmatch(value):
            return default
        value = float(value)
    elif not isinstance(value, float):
        return default
    if not math.isfinite(value):
        return default
    out = int(value)
    return out if INT64_MIN <= out <= INT64_MAX else default


def arg_text(value: Any) -> str:
    """An ``args`` value as text the way ClickHouse's ``JSONExtractString`` reads it: strings as they
    are, null as empty, other values as their JSON text (``7``, ``true``, ``{"a":1}``; an object's
    or a float's text is re-serialized here, so its spacing or digits may differ from the file)."""
    if isinstance(value, str):
        return value
    if value is None:
        return ""
    if isinstance(value, Decimal):
        return str(value)
    return json.dumps(value, separators=(",", ":"), default=str)


def _device(args: EventArgs | None, kind: str, pid: int | str) -> int:
    """The ``device`` argument; for device activity without one (MTIA), the device its pid names."""
    device = arg_int(args.device, None) if args else None
    if device is None:
        return pid_device(pid) if kind in DEVICE_KINDS else -1
    return device


def append_block(cols: dict[str, list[Any]], events: list[TraceEvent], run_id: str, rank: int) -> None:
    """Append the complete (ph=X) events of one block to ``cols`` (``TRACE_EVENTS.empty_columns()``)."""
    xs = [e for e in events if e.ph == "X"]
    if not xs:
        return
    d = cols
    args = [event_args(e) for e in xs]
    kinds = [stream_kind(event_kind(e.cat), arg_int(a.stream, None) if a else None,
                         arg_int(a.correlation, None) if a else None) for e, a in zip(xs, args, strict=True)]
    names = [e.name for e in xs]
    n = len(xs)
    d["run_id"].extend([run_id] * n)
    d["rank"].extend([rank] * n)
    d["kind"].extend(kinds)
    d["category"].extend([e.cat for e in xs])
    d["kernel_class"].extend([kernel_class(k, nm) for k, nm in zip(kinds, names, strict=True)])
    d["name"].extend(names)
    d["pid"].extend([str(e.pid) for e in xs])
    d["tid"].extend([str(e.tid) for e in xs])
    d["ts_ns"].extend([us_to_ns(e.ts) for e in xs])
    d["dur_ns"].extend([us_to_ns(e.dur) for e in xs])
    d["device"].extend([_device(a, k, e.pid) for a, k, e in zip(args, kinds, xs, strict=True)])
    d["stream"].extend([arg_int(a.stream, -1) if a else -1 for a in args])
    d["correlation"].extend([arg_int(a.correlation, 0) if a else 0 for a in args])
    d["external_id"].extend([
        arg_int(a.external_id if a.external_id is not None else a.external_id_legacy, 0) if a else 0 for a in args
    ])
    d["collective"].extend([arg_text(a.collective) if a else "" for a in args])
    d["in_nelems"].extend([arg_int(a.in_nelems, 0) if a else 0 for a in args])
    d["out_nelems"].extend([arg_int(a.out_nelems, 0) if a else 0 for a in args])
    d["group_size"].extend([arg_int(a.group_size, 0) if a else 0 for a in args])
    d["dtype"].extend([arg_text(a.dtype) if a else "" for a in args])
    d["pg_name"].extend([arg_text(a.pg_name) if a else "" for a in args])
    d["pg_ranks"].extend([arg_text(a.pg_ranks) if a else "" for a in args])
    d["ingest_block"].extend([0] * n)
