"""PyTorch Profiler (Kineto) trace collector."""

from triscope.collectors.kineto.ingest import IngestResult, ingest_paths, ingest_trace
from triscope.collectors.kineto.reader import TraceHeader, read_trace

__all__ = ["IngestResult", "TraceHeader", "ingest_paths", "ingest_trace", "read_trace"]
