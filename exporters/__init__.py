"""triscope exporters."""
