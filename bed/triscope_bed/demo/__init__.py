"""The small simulated fleet of ``triscope demo``: three simulated engines, load, spans, metrics, analysis."""
