"""The weight feed's ``weights_history`` rows: what every update told the load balancers, handed to
the writer (``context.submit``) so ``triscope weights show --at`` and the boards can read it back."""

from __future__ import annotations

import logging

from triscope.analyzers.routing import WeightsResult, history_columns
from triscope.component import Submit
from triscope.exporters.feed_http import one_line
from triscope.schema import WEIGHTS_HISTORY

log = logging.getLogger("triscope.exporters.feed")


class History:
    """Submits the history rows of each result; a refused submit costs those rows, never the update."""

    def __init__(self, submit: Submit) -> None:
        self.submit = submit
        self.rows_submitted = 0
        self.rows_dropped = 0
        self._error = ""

    def record(self, result: WeightsResult) -> None:
        columns = history_columns(result)
        try:
            self.rows_submitted += self.submit(WEIGHTS_HISTORY, columns)
            self._error = ""
        except Exception as exc:
            self.rows_dropped += len(columns["ts"])
            if one_line(exc) != self._error:
                log.warning("weights history rows not submitted: %s", one_line(exc))
            self._error = one_line(exc)
