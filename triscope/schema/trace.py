"""Kineto (PyTorch Profiler) trace tables.

Times are integer nanoseconds on the trace's own clock (``ts_ns``); the UTC epoch time of an
event is ``ts_ns + trace_runs.base_time_ns`` (``base_time_ns`` is 0 for traces whose
timestamps are already absolute epoch microseconds).
"""

from triscope.schema.model import Column, Migration, Table, create_tables

DOMAIN = "trace"

TRACE_RUNS = Table(
    name="trace_runs",
    columns=[
        Column("run_id", "String", "one profiling run; ranks of a multi-rank job share it"),
        Column("rank", "Int32"),
        Column("source_path", "String"),
        Column("source_bytes", "UInt64", "size of the file as stored (compressed when .gz)"),
        Column("host", "String"),
        Column("base_time_ns", "Int64", "add to ts_ns for UTC epoch nanoseconds"),
        Column("time_base", "LowCardinality(String)", "relative (baseTimeNanoseconds) or absolute"),
        Column("event_count", "UInt64", "complete (ph=X) events stored"),
        Column("gpu_event_count", "UInt64"),
        Column("status", "LowCardinality(String)", "complete, or partial when the file was cut short"),
        Column("error", "String", "why a partial ingest stopped"),
        Column("metadata_json", "String", "top-level trace keys other than traceEvents"),
        Column("ingested_at", "DateTime64(3, 'UTC')"),
    ],
    order_by="run_id, rank",
    engine="ReplacingMergeTree(ingested_at)",
    comment="one row per ingested trace file (rank)",
)

TRACE_EVENTS = Table(
    name="trace_events",
    columns=[
        Column("run_id", "LowCardinality(String)"),
        Column("rank", "Int32"),
        Column("kind", "LowCardinality(String)",
               "kernel, memcpy, memset, runtime, cpu_op, user_annotation, gpu_user_annotation, sync, python, "
               "profiler_range, device_other, other"),
        Column("category", "LowCardinality(String)", "the trace's own cat"),
        Column("kernel_class", "LowCardinality(String)", "GPU work only: compute, comm, memory"),
        Column("name", "String"),
        Column("pid", "LowCardinality(String)"),
        Column("tid", "LowCardinality(String)"),
        Column("device", "Int32", "-1 for host events"),
        Column("stream", "Int64", "-1 when absent"),
        Column("ts_ns", "Int64", "start, trace clock nanoseconds"),
        Column("dur_ns", "Int64"),
        Column("correlation", "Int64", "runtime launch <-> GPU activity; 0 when absent"),
        Column("external_id", "Int64", "CPU op <-> runtime; 0 when absent"),
        Column("collective", "LowCardinality(String)", "record_param_comms / NCCL kernel 'Collective name'"),
        Column("in_nelems", "Int64"),
        Column("out_nelems", "Int64"),
        Column("group_size", "Int32"),
        Column("dtype", "LowCardinality(String)"),
        Column("pg_name", "LowCardinality(String)", "Process Group Name"),
        Column("pg_ranks", "String", "Process Group Ranks"),
        Column("ingest_block", "UInt32", "internal: block of the file it came in (0 = decoded in Python)"),
    ],
    order_by="run_id, rank, kind, ts_ns",
    comment="complete (ph=X) events of Kineto traces",
)

MIGRATIONS = [
    Migration(1, "trace runs and events", create_tables(TRACE_RUNS, TRACE_EVENTS)),
]
