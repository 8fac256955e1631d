"""triscope dashboards."""
