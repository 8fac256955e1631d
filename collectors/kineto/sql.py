"""The SQL path: ``INSERT ... SELECT`` doing in ClickHouse what :func:`.decode.append_block` does in Python.

ClickHouse's own JSON reader parses the events (``json_input``, replaced by the store with a file,
a named pipe or ``input()``); ``args`` are extracted with one ``JSONExtract`` per row into a named
tuple, ints and texts read as :func:`.decode.arg_int` / :func:`.decode.arg_text` read them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from triscope.collectors.kineto import classify
from triscope.collectors.kineto.classify import (
    DEVICE_KINDS,
    GPU_WORK_KINDS,
    KIND_BY_CATEGORY,
    OFF_STREAM_KIND,
    PROFILER_RANGE_SUFFIX,
    RUNTIME_SUFFIXES,
)
from triscope.schema import TRACE_EVENTS

JSON_STRUCTURE = ("ph String, cat String, name String, pid String, tid String, "
                  "ts Decimal(38, 6), dur Decimal(38, 6), args String")
"""The event fields ClickHouse reads (Decimal keeps the exact microseconds)."""

# args keys read in ClickHouse -> the value stored when absent or unreadable (as in decode.append_block)
_ARG_INTS = {"device": -1, "stream": -1, "correlation": 0, "External id": 0, "external id": 0}
_COMM_INTS = {"In msg nelems": 0, "Out msg nelems": 0, "Group size": 0}
_COMM_TEXTS = ("Collective name", "dtype", "Process Group Name", "Process Group Ranks")
_ARG_DEFAULTS: dict[str, int | str] = {**_ARG_INTS, **_COMM_INTS, **dict.fromkeys(_COMM_TEXTS, "")}


def _tuple_type(ints: Mapping[str, int], texts: tuple[str, ...] = ()) -> str:
    fields = [f"`{k}` Nullable(Int64)" for k in ints] + [f"`{k}` Nullable(String)" for k in texts]
    return f"Tuple({', '.join(fields)})"


def _args_tuple(ints: Mapping[str, int], texts: tuple[str, ...] = ()) -> str:
    """One ``JSONExtract`` of several ``args`` keys as a named tuple: the JSON is parsed once per
    row instead of once per key."""
    return f"JSONExtract(object_args, '{_tuple_type(ints, texts)}')"


def _arg(tuple_name: str, key: str) -> str:
    """One key of an extracted args tuple, its default when absent."""
    default = _ARG_DEFAULTS[key]
    return f"ifNull(tupleElement({tuple_name}, '{key}'), {default if isinstance(default, int) else repr(default)})"


def kernel_class_sql(kind: str) -> str:
    """SQL of :func:`.classify.kernel_class` for the kind expression ``kind`` (parameter ``comm_re``)."""
    gpu = ", ".join(f"'{k}'" for k in sorted(GPU_WORK_KINDS))
    return (f"multiIf({kind} NOT IN ({gpu}), '', {kind} != 'kernel' OR match(name, '^(Memcpy|Memset|dma)'), "
            "'memory', match(replaceRegexpOne(name, '^void ', ''), {comm_re:String}), 'comm', 'compute')")


def insert_sql(table: str) -> str:
    """The INSERT into ``table`` (qualified ``trace_events``); parameters: :func:`insert_params`."""
    gpu = ", ".join(f"'{k}'" for k in sorted(GPU_WORK_KINDS))
    device_kinds = ", ".join(f"'{k}'" for k in sorted(DEVICE_KINDS))
    runtime = " OR ".join(f"endsWith(lower(cat), '{s}')" for s in RUNTIME_SUFFIXES)
    comm = _args_tuple(_COMM_INTS, _COMM_TEXTS)
    return f"""
INSERT INTO {table} ({", ".join(TRACE_EVENTS.column_names())})
SELECT run_id, rank, kind, category, kernel_class, name, pid, tid, device, stream, ts_ns, dur_ns,
       correlation, external_id, collective, in_nelems, out_nelems, group_size, dtype, pg_name, pg_ranks,
       ingest_block
FROM (
  SELECT
    {{run_id:String}} AS run_id,
    {{rank:Int32}} AS rank,
    {{block:UInt32}} AS ingest_block,
    transform(lower(cat), {{cats:Array(String)}}, {{kinds:Array(String)}},
              multiIf({runtime}, 'runtime', endsWith(lower(cat), '{PROFILER_RANGE_SUFFIX}'), 'profiler_range',
                      'other')) AS cat_kind,
    -- device work on no stream that no runtime call launched is not the program's (classify.stream_kind)
    if(cat_kind IN ({gpu}) AND isNull(tupleElement(a, 'stream')) AND isNull(tupleElement(a, 'correlation')),
       '{OFF_STREAM_KIND}', cat_kind) AS kind,
    cat AS category,
    {kernel_class_sql("kind")} AS kernel_class,
    name, pid, tid,
    -- args that are not an object carry no keys (JSONExtract would read an array's items as the tuple's)
    if(startsWith(trimLeft(args), '{{'), args, '') AS object_args,
    {_args_tuple(_ARG_INTS)} AS a,
    -- device activity without a device argument (MTIA) ran on the device its pid names (classify.pid_device)
    toInt32(if(kind IN ({device_kinds}) AND isNull(tupleElement(a, 'device')), toInt32OrDefault(pid, toInt32(-1)),
               {_arg("a", "device")})) AS device,
    {_arg("a", "stream")} AS stream,
    toInt64(round(ts * 1000)) AS ts_ns,
    toInt64(round(dur * 1000)) AS dur_ns,
    {_arg("a", "correlation")} AS correlation,
    ifNull(tupleElement(a, 'External id'), {_arg("a", "external id")}) AS external_id,
    position(object_args, 'Collective name') > 0 AS has_comm,  -- skip parsing comm args on other events
    if(has_comm, {comm}, CAST(NULL, 'Nullable({_tuple_type(_COMM_INTS, _COMM_TEXTS)})')) AS c,
    {_arg("c", "Collective name")} AS collective,
    {_arg("c", "In msg nelems")} AS in_nelems,
    {_arg("c", "Out msg nelems")} AS out_nelems,
    toInt32({_arg("c", "Group size")}) AS group_size,
    {_arg("c", "dtype")} AS dtype,
    {_arg("c", "Process Group Name")} AS pg_name,
    {_arg("c", "Process Group Ranks")} AS pg_ranks
  FROM json_input
  WHERE ph = 'X'
)"""


def insert_params(run_id: str) -> dict[str, Any]:
    """The file's parameters of :func:`insert_sql`; ``rank`` and ``block`` are set as ingest goes."""
    return {"run_id": run_id, "cats": list(KIND_BY_CATEGORY), "kinds": list(KIND_BY_CATEGORY.values()),
            "comm_re": classify.comm_kernel_pattern()}
