"""triscope analyzers."""
