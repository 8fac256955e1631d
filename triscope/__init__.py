"""triscope: telemetry pipeline for GPU inference fleets."""

__version__ = "0.1.0"
