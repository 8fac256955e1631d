"""Host signals of the serving engines: per-engine CPU run and run-queue wait, RSS; host PSI and OOM kills."""

from triscope.schema.model import Column, Migration, Table, create_tables, set_codecs

DOMAIN = "host"

HOST_SAMPLES = Table(
    name="host_samples",
    columns=[
        Column("ts", "DateTime64(9, 'UTC')", "window start", codec="Delta, ZSTD(1)"),
        Column("host", "LowCardinality(String)"),
        Column("backend", "LowCardinality(String)",
               "the engine's address (its serving_metrics backend); '' = host-wide"),
        Column("processes", "UInt32", "the engine's processes (the one listening and its descendants)",
               codec="T64, ZSTD(1)"),
        Column("window_seconds", "Float64"),
        Column("cpu_seconds", "Float64", "CPU time its processes ran in the window (/proc/PID/schedstat)"),
        Column("wait_seconds", "Float64", "time its threads waited runnable on a run queue in the window"),
        Column("rss_bytes", "Float64", "resident memory of its processes at the end of the window"),
        Column("psi_cpu_some", "Float64", "host share of the window some task waited for CPU (/proc/pressure)"),
        Column("psi_memory_some", "Float64"),
        Column("psi_memory_full", "Float64"),
        Column("psi_io_some", "Float64"),
        Column("psi_io_full", "Float64"),
        Column("oom_kills", "Float64", "OOM kills on the host in the window (/proc/vmstat oom_kill)"),
    ],
    order_by="host, backend, ts",
    partition_by="toYYYYMMDD(ts)",
    retention="raw",
    codec="ZSTD(1)",
)

MIGRATIONS = [
    Migration(1, "host samples", create_tables(HOST_SAMPLES)),
    Migration(2, "host samples: per-column codecs", set_codecs(HOST_SAMPLES)),
]
