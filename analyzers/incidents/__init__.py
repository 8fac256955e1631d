"""Serving incidents: where request classes broke their SLO, why, and what moved first (docs/diagnose.md).

``series`` (the fleet's signals per window, from the store), ``detect`` (breaches merged into
incidents, :func:`find_incidents`), ``causes`` (one cause with its evidence, runners-up, lead times),
``model`` (what is reported), ``config`` (``[incidents]``).
"""

from triscope.analyzers.incidents.config import IncidentsConfig
from triscope.analyzers.incidents.detect import IncidentReport, find_incidents
from triscope.analyzers.incidents.model import CAUSES, UNKNOWN, Cause, Incident

__all__ = ["CAUSES", "UNKNOWN", "Cause", "Incident", "IncidentReport", "IncidentsConfig", "find_incidents"]
