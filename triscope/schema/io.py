"""Block-IO latency per device and window (bpftrace, bcc, ebpf_exporter, /proc/diskstats)."""

from triscope.schema.model import Column, Migration, Table, create_tables, set_codecs

DOMAIN = "io"

IO_LATENCY = Table(
    name="io_latency",
    columns=[
        Column("ts", "DateTime64(9, 'UTC')", "window start", codec="Delta, ZSTD(1)"),
        Column("host", "LowCardinality(String)"),
        Column("device", "LowCardinality(String)", "e.g. nvme0n1, or 259:0 when only numbers are known"),
        Column("source", "LowCardinality(String)", "bpftrace, bcc, ebpf_exporter, diskstats"),
        Column("op", "LowCardinality(String)", "read, write or all"),
        Column("window_seconds", "Float32"),
        Column("ios", "Float64", "completed requests in the window"),
        Column("p50_seconds", "Float64", codec="Gorilla, ZSTD(1)"),
        Column("p99_seconds", "Float64", codec="Gorilla, ZSTD(1)"),
        Column("mean_seconds", "Float64", codec="Gorilla, ZSTD(1)"),
        Column("queue_depth", "Float64", "requests in flight (mean over the window)", codec="Gorilla, ZSTD(1)"),
    ],
    order_by="host, device, op, ts",
    partition_by="toYYYYMMDD(ts)",
    retention="raw",
    codec="ZSTD(1)",
)

MIGRATIONS = [
    Migration(1, "io latency", create_tables(IO_LATENCY)),
    Migration(2, "io latency: per-column codecs", set_codecs(IO_LATENCY)),
]
