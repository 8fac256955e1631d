"""Stall classifier: why each window (default 100 ms) or profiler step of each GPU was slow.

Verdicts ``comm``, ``compute``, ``io``, ``host`` (launch/host-bound), ``idle`` or ``unclassified``, each with
its evidence (metric, value, threshold, comparison, source table); thresholds in ``[stalls]``. The rules
and data are described in docs/diagnose.md.

Modules: :mod:`.config` (``[stalls]``), :mod:`.readers` (SQL), :mod:`.metrics` (per-window measures),
:mod:`.rules` (the verdict), :mod:`.report` (the result), :mod:`.classifier` (``diagnose_stalls``).
"""

from triscope.analyzers.intervals import coverage as busy_ns
from triscope.analyzers.stalls.classifier import diagnose_runs, diagnose_stalls, parse_duration
from triscope.analyzers.stalls.config import CLASSES, UNCLASSIFIED, StallsConfig, stall_config
from triscope.analyzers.stalls.readers import trace_span
from triscope.analyzers.stalls.report import ACTIONS, Evidence, StallReport, Window
from triscope.analyzers.stalls.rules import classify_window

__all__ = ["ACTIONS", "CLASSES", "UNCLASSIFIED", "Evidence", "StallReport", "StallsConfig", "Window", "busy_ns",
           "classify_window", "diagnose_runs", "diagnose_stalls", "parse_duration", "stall_config", "trace_span"]
