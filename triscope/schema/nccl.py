"""Collective-communication operations (NCCL, RCCL, gloo) from every source triscope reads.

One row per collective operation as one rank saw it: a Kineto trace (GPU NCCL kernels joined to
their ``record_param_comms``, or host-side gloo collectives), an NCCL Inspector record, a PyTorch
Flight Recorder entry, or one row of an nccl-tests table. Values a source does not give are NaN
(floats), -1 (integers) or empty (strings). Bandwidths are bytes per second (GB/s x 1e9).
"""

from triscope.schema.model import Column, Migration, Table, create_tables

DOMAIN = "nccl"

NCCL_OPS = Table(
    name="nccl_ops",
    columns=[
        Column("ts", "DateTime64(9, 'UTC')", "op start (Kineto), creation (Flight Recorder), dump time (Inspector)"),
        Column("host", "LowCardinality(String)"),
        Column("run_id", "LowCardinality(String)", "trace run id, or the name given at ingest"),
        Column("rank", "Int32", "global rank, -1 when unknown"),
        Column("source", "LowCardinality(String)", "kineto, inspector, flight_recorder, nccl_tests"),
        Column("backend", "LowCardinality(String)", "nccl, rccl, gloo, or empty"),
        Column("comm_id", "String", "process group name / NCCL communicator id"),
        Column("pg_desc", "LowCardinality(String)", "process group description (default_pg, tp_group, ...)"),
        Column("collective", "LowCardinality(String)",
               "AllReduce, AllGather, ReduceScatter, AllToAll, Broadcast, Reduce, SendRecv, Send, Recv, "
               "Barrier, Gather, Scatter"),
        Column("op_name", "String", "the source's own name (kernel, profiling_name, ...)"),
        Column("seq", "Int64", "collective sequence number within comm_id; -1 when unknown"),
        Column("is_p2p", "UInt8"),
        Column("nranks", "Int32", "ranks in the communicator, -1 when unknown"),
        Column("msg_bytes", "Float64", "nccl-tests 'size': max(in, out) elements x dtype size"),
        Column("count", "Float64", "elements"),
        Column("dtype", "LowCardinality(String)"),
        Column("redop", "LowCardinality(String)"),
        Column("variant", "LowCardinality(String)", "nccl-tests: out_of_place or in_place"),
        Column("device", "Int32", "GPU index, -1 for host-side or unknown"),
        Column("duration_seconds", "Float64", "execution time (kernel, host op, Inspector exec time)"),
        Column("algbw_bytes_per_second", "Float64", "msg_bytes / duration"),
        Column("busbw_bytes_per_second", "Float64", "algbw x nccl-tests bus factor"),
        Column("state", "LowCardinality(String)", "completed, scheduled, started, ... (Flight Recorder)"),
        Column("timeout_seconds", "Float64"),
        Column("wrong_count", "Int64", "nccl-tests #wrong, -1 when unknown"),
        Column("detail_json", "String", "source fields without a column"),
        Column("ingested_at", "DateTime64(3, 'UTC')"),
    ],
    order_by="source, run_id, comm_id, rank, ts",
    partition_by="toYYYYMM(ts)",
    comment="collective operations per rank (NCCL/RCCL/gloo)",
)

MIGRATIONS = [Migration(1, "nccl ops", create_tables(NCCL_OPS))]
