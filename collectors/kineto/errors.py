"""Why a trace file was refused: nothing of it is kept (a damaged trace keeps its events and is not refused)."""

from __future__ import annotations

from triscope.errors import InputError


class RefusedTraceError(InputError):
    """Nothing of the file was ingested and no run was recorded for it (exit status 2 in the CLI)."""


class NotATraceError(RefusedTraceError):
    """The file is not a Kineto trace (an execution trace, a memory dump, other JSON, empty).

    In a directory such a file is skipped with a warning (:class:`SkippedTraceError`)."""


class SkippedTraceError(NotATraceError):
    """A file of a directory that is not a Kineto trace: skipped, reported as a warning."""


class TraceTooLargeError(RefusedTraceError):
    """The file decompresses to more than ``[ingest] max_decompressed_bytes``."""


class OtherJobError(RefusedTraceError):
    """The file belongs to another job than the other files of its run (world size, time)."""


class RankTakenError(RefusedTraceError):
    """Two files of one batch are the same rank of the same run; the second is not ingested."""
