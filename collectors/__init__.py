"""Collectors: turn traces, samples, spans and scrapes into rows of the triscope schema."""
