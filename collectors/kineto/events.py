"""The event structs msgspec decodes a trace into, and the checks that an event can be stored."""

from __future__ import annotations

from decimal import ROUND_HALF_UP, Decimal
from typing import Any

import msgspec


class EventArgs(msgspec.Struct, frozen=True):
    """The ``args`` keys triscope uses; all others are skipped by the decoder.

    Values are kept as decoded (any JSON type): an odd type in one event (a boolean, an object)
    is read as the column default by the ingest rules, not as a corrupt trace.
    """

    external_id: Any = msgspec.field(default=None, name="External id")
    external_id_legacy: Any = msgspec.field(default=None, name="external id")
    correlation: Any = None
    stream: Any = None
    device: Any = None
    collective: Any = msgspec.field(default=None, name="Collective name")
    in_nelems: Any = msgspec.field(default=None, name="In msg nelems")
    out_nelems: Any = msgspec.field(default=None, name="Out msg nelems")
    group_size: Any = msgspec.field(default=None, name="Group size")
    dtype: Any = None
    pg_name: Any = msgspec.field(default=None, name="Process Group Name")
    pg_ranks: Any = msgspec.field(default=None, name="Process Group Ranks")


class TraceEvent(msgspec.Struct, frozen=True):
    """One Chrome-trace event (only the fields triscope stores)."""

    ph: str = ""
    cat: str = ""
    name: str = ""
    pid: int | str = 0
    tid: int | str = 0
    # Decimal keeps the exact text: epoch microseconds with 3 decimals exceed float64 precision.
    ts: Decimal = Decimal(0)
    dur: Decimal = Decimal(0)
    # Anything else than an object (an array, a string, a number) carries none of the keys used:
    # read like ClickHouse's JSONExtract reads it, as absent (see :func:`event_args`).
    args: EventArgs | list[Any] | str | int | float | bool | None = None


def event_args(event: TraceEvent) -> EventArgs | None:
    """The event's ``args`` when it is an object, else None."""
    return event.args if isinstance(event.args, EventArgs) else None


INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
# Microsecond timestamps whose nanoseconds surely fit Int64 (larger ones are checked exactly).
_SAFE_US = Decimal(9_000_000_000_000_000)


def us_to_ns(us: Decimal) -> int:
    """Exact nanoseconds of a microsecond timestamp (half away from zero, as ClickHouse's round)."""
    return int((us * 1000).to_integral_value(rounding=ROUND_HALF_UP))


def _ns_out_of_range(us: Decimal) -> bool:
    if not us.is_finite():
        return True
    if -_SAFE_US < us < _SAFE_US:
        return False
    return not INT64_MIN <= us_to_ns(us) <= INT64_MAX


def event_problem(event: TraceEvent) -> str | None:
    """Why a complete (``ph: X``) event cannot be stored, or None: a time outside Int64
    nanoseconds, or a string with a lone UTF-16 surrogate (``"\\ud800"``, which ClickHouse
    refuses too). Other events are not stored and not checked."""
    if event.ph != "X":
        return None
    for key, us in (("ts", event.ts), ("dur", event.dur)):
        if _ns_out_of_range(us):
            return f"{key} {us} us is outside the Int64 nanosecond range"
    args = event_args(event)
    texts = [event.cat, event.name, event.pid, event.tid]
    if args is not None:
        texts += [args.collective, args.dtype, args.pg_name, args.pg_ranks]
    for text in texts:
        if isinstance(text, str):
            try:
                text.encode("utf-8")
            except UnicodeEncodeError:
                return "a string holds a lone UTF-16 surrogate"
    return None
