"""The ``[ingest]`` config section: limits of trace ingest (docs/trace-breakdown.md, docs/reliability.md)."""

from __future__ import annotations

from dataclasses import dataclass

from triscope.component import ComponentConfig, positive

GIB = 1 << 30


@dataclass(frozen=True)
class TraceIngestConfig(ComponentConfig):
    """Limits of ``triscope ingest trace`` (and of every command that ingests traces)."""

    section = "ingest"

    max_decompressed_bytes: int = 8 * GIB
    """A ``.json.gz`` trace that decompresses to more than this is refused (a gzip bomb)."""
    same_job_within_s: float = 3600.0
    """Files of one run whose recorded times are further apart than this are different jobs."""

    def validate(self, where: str) -> None:
        positive(where, max_decompressed_bytes=self.max_decompressed_bytes, same_job_within_s=self.same_job_within_s)
