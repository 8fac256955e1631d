"""The component contract: what the daemon drives, how components are configured and created.

Every collector and exporter is a package-level ``create(config, context)`` factory:

* ``config`` is the whole configuration (``dict``); the component reads its own section through
  its typed config class, a :class:`ComponentConfig` subclass (defaults written once, types
  checked, unknown keys rejected with a one-line :class:`~triscope.errors.ConfigError`).
* ``context`` (:class:`Context`) carries what the daemon provides: the store opener, the
  writer's ``submit`` (the one write path, see :mod:`triscope.writer`) and the live counters.

The daemon (:mod:`triscope.daemon`) types what it holds with :class:`Collector` and
:class:`Exporter`, and the optional features it looks for with :class:`RowsAfterClose`,
:class:`ReportsGaps`, :class:`ReportsErrors` and :class:`ReportsStats`; the registry of names
usable in ``[run]`` lives in :mod:`triscope.registry`.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, Self, TypeVar, runtime_checkable

from triscope.errors import ConfigError

if TYPE_CHECKING:  # triscope.schema imports the store, whose config imports this module
    from triscope.schema.model import Table

log = logging.getLogger(__name__)

Rows = Mapping[str, Sequence[Any]]
"""Column-oriented rows: ``{column: values}``, every sequence the same length."""

Submit = Callable[["Table", Rows], int]
"""Hands rows for one table of :mod:`triscope.schema` (the ``Table`` object, not its name) to the
writer, spooled before it returns; returns the row count. A table the schema does not have is an
:class:`~triscope.errors.InputError`."""


@runtime_checkable
class Collector(Protocol):
    """A source of rows for one or more tables, polled by the daemon every ``interval_s``.

    Long-running sources (bpftrace, an OTLP receiver) buffer between calls or submit through
    ``context.submit`` themselves. Optional features the daemon looks for, each a protocol below:
    :class:`RowsAfterClose`, :class:`ReportsGaps`, :class:`ReportsErrors`.
    """

    name: str
    interval_s: float

    def start(self) -> None:
        """Acquire resources (open NVML, spawn a subprocess, bind a port). May raise TriscopeError."""

    def collect(self) -> Mapping[Table, Rows]:
        """Rows since the last call, keyed by :mod:`triscope.schema` table; ``{}`` when there is nothing new.

        Must not raise for a transient source failure: record it (e.g. a ``state`` column) instead.
        """

    def close(self) -> None:
        """Release resources; safe to call twice."""


@runtime_checkable
class Exporter(Protocol):
    """Serves or pushes what the store holds (a weight feed, a Prometheus endpoint)."""

    def start(self) -> None:
        """Bind ports, start threads. May raise TriscopeError."""

    def close(self) -> None:
        """Stop serving; safe to call twice."""


@runtime_checkable
class RowsAfterClose(Protocol):
    """A collector whose ``close()`` yields last rows (bpftrace's END probe prints the window
    still open): with ``ROWS_AFTER_CLOSE = True`` the daemon calls ``collect()`` once more after
    ``close()`` and submits what it returns."""

    ROWS_AFTER_CLOSE: bool


@runtime_checkable
class ReportsGaps(Protocol):
    """A collector that knows where its rows fall short (lost probe events, unparsed lines)."""

    def gaps(self) -> Mapping[str, int]:
        """Running counts by kind of gap; the daemon's counters (and ``/metrics``) show them."""
        ...


@runtime_checkable
class ReportsErrors(Protocol):
    """A collector with many sources (scrape targets) that still returns rows when some fail."""

    def take_errors(self) -> list[str]:
        """One message per source failure since the last call (the collector logs each once per
        change of state); the daemon counts them as the collector's errors, the last one shown."""
        ...


@runtime_checkable
class ReportsStats(Protocol):
    """An exporter with live counters of its own (the per-request picker's): the daemon's
    ``stats()`` includes them under ``exporters``, by ``[run] exporters`` name, which is how
    they reach the ``prometheus`` exporter without one exporter importing another."""

    def stats(self) -> Mapping[str, Any]:
        """Counters and gauges, JSON-friendly."""
        ...


def _no_submit(table: Table, rows: Rows) -> int:
    raise ConfigError(f"no writer in this context to take rows for {getattr(table, 'name', table)!r}")


def _no_store() -> Any:
    raise ConfigError("no store in this context")


def _no_stats() -> dict[str, Any]:
    return {}


@dataclass(frozen=True)
class Context:
    """What a component gets from whoever runs it (the daemon, the CLI, a test)."""

    open_store: Callable[[], Any] = _no_store
    """Opens a :class:`~triscope.store.base.Store` (a new connection per call)."""
    submit: Submit = _no_submit
    """The writer's :meth:`~triscope.writer.Writer.submit`."""
    stats: Callable[[], dict[str, Any]] = _no_stats
    """The pipeline's live counters (:meth:`triscope.daemon.Daemon.stats`)."""


Factory = Callable[[dict[str, Any], Context], Any]
"""``create(config, context)``: returns a :class:`Collector` or an :class:`Exporter`."""


# ---------------------------------------------------------------------------- typed configs

C = TypeVar("C", bound="ComponentConfig")


def _type_name(tp: Any) -> str:
    if isinstance(tp, type):
        return {"str": "a string", "int": "an integer", "float": "a number", "bool": "true or false",
                "list": "a list", "dict": "a table"}.get(tp.__name__, tp.__name__)
    origin = typing.get_origin(tp)
    if origin in (types.UnionType, typing.Union):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is list or origin is tuple:
        return "a list"
    if origin is dict or origin is Mapping:
        return "a table"
    return str(tp)


def _coerce(value: Any, tp: Any, where: str) -> Any:
    """``value`` checked against (and, for numbers, converted to) the annotation ``tp``."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin in (types.UnionType, typing.Union):
        if value is None and type(None) in typing.get_args(tp):
            return None
        for arg in typing.get_args(tp):
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, where)
            except ConfigError:
                continue
        raise ConfigError(f"{where} must be {_type_name(tp)}, got {value!r}")
    if origin is list or origin is tuple or tp in (list, tuple):
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{where} must be a list, got {value!r}")
        args = typing.get_args(tp)
        item = args[0] if args else Any
        items = [_coerce(v, item, f"{where}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if (origin is tuple or tp is tuple) else items
    if origin is dict or tp is dict or origin is Mapping:
        if not isinstance(value, Mapping):
            raise ConfigError(f"{where} must be a table, got {value!r}")
        args = typing.get_args(tp)
        vt = args[1] if len(args) == 2 else Any
        return {str(k): _coerce(v, vt, f"{where}.{k}") for k, v in value.items()}
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{where} must be true or false, got {value!r}")
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{where} must be a number, got {value!r}")
        if not math.isfinite(value):
            raise ConfigError(f"{where} must be a finite number, got {value!r}")
        return float(value)
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                return int(value)
            raise ConfigError(f"{where} must be an integer, got {value!r}")
        return value
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where} must be a string, got {value!r}")
        return value
    if isinstance(tp, type) and dataclasses.is_dataclass(tp) and issubclass(tp, ComponentConfig):
        return tp.from_mapping(value, where)
    if isinstance(tp, type) and not isinstance(value, tp):
        raise ConfigError(f"{where} must be {_type_name(tp)}, got {value!r}")
    return value


@dataclass(frozen=True)
class ComponentConfig:
    """Base of every typed config section.

    Subclasses are frozen dataclasses whose fields hold the defaults; ``section`` names the TOML
    table (``[nvml]``), ``aliases`` maps a renamed key to its current name, or a removed key to
    ``""`` (either is accepted for one release with a warning; a removed key's value is ignored).
    :meth:`validate` checks ranges after types are checked.
    """

    section: ClassVar[str] = ""
    aliases: ClassVar[dict[str, str]] = {}
    flattened: ClassVar[dict[str, tuple[str, ...]]] = {}
    """Fields holding a nested config whose keys are written flat in this section: field -> those keys
    (``[epp]`` holds the picker's ``PickerParams`` this way)."""

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any] | None, where: str | None = None) -> Self:
        """The config in ``data`` (one section's keys); ConfigError naming the key on any mistake."""
        where = where or f"[{cls.section}]"
        if data is None:
            data = {}
        if not isinstance(data, Mapping):
            raise ConfigError(f"{where} must be a table, got {data!r}")
        hints = typing.get_type_hints(cls)
        flat = {key: name for name, keys in cls.flattened.items() for key in keys}
        names = [f.name for f in dataclasses.fields(cls) if f.init and f.name not in cls.flattened]
        nested: dict[str, dict[str, Any]] = {name: {} for name in cls.flattened}
        values: dict[str, Any] = {}
        unknown: list[str] = []
        data = cls._moved(data, where)
        for key, value in data.items():
            name = cls.aliases.get(key, key)
            if not name:
                log.warning("%s %s is no longer used and is ignored; remove it", where, key)
                continue
            if name != key:
                log.warning("%s %s is deprecated; use %s", where, key, name)
                if name in data:
                    continue  # the current name wins over its alias
            if name in flat:
                nested[flat[name]][name] = value
                continue
            if name not in names:
                unknown.append(str(key))
                continue
            sub = hints[name]
            if isinstance(sub, type) and issubclass(sub, ComponentConfig):  # a sub-table: its own errors
                inner = f"{where[:-1]}.{name}]" if where.endswith("]") else f"{where}.{name}"
                values[name] = sub.from_mapping(value, inner)
                continue
            try:
                values[name] = _coerce(value, hints[name], name)
            except ConfigError as exc:  # one shape for every section: names the key, says what it takes
                key, _, why = str(exc).partition(" must be ")
                raise ConfigError(f"{where} has a bad value for {key}: must be {why}") from None
        if unknown:
            raise ConfigError(f"{where} has unknown keys: {', '.join(sorted(unknown))} "
                              f"(known: {', '.join(sorted([*names, *flat]))})")
        for name, section in nested.items():
            values[name] = hints[name].from_mapping(section, where)
        try:
            config = cls(**values)
        except TypeError as exc:
            raise ConfigError(f"{where}: {exc}") from None
        config.validate(where)
        return config

    @classmethod
    def _moved(cls, data: Mapping[str, Any], where: str) -> Mapping[str, Any]:
        """``data`` with keys aliased into a sub-table (``aliases = {"timeout_s": "http.timeout_s"}``)
        moved there; a key already in the sub-table wins over its old name."""
        moved = {key: name for key, name in cls.aliases.items() if "." in name and key in data}
        if not moved:
            return data
        out = {k: v for k, v in data.items() if k not in moved}
        for key, name in moved.items():
            table, _, sub = name.partition(".")
            inner = out.get(table, {})
            if not isinstance(inner, Mapping):
                continue  # reported as a bad sub-table below
            log.warning("%s %s is deprecated; use [%s.%s] %s", where, key, where.strip("[]"), table, sub)
            out[table] = {sub: data[key], **inner}
        return out

    @classmethod
    def from_config(cls, config: Mapping[str, Any] | None) -> Self:
        """This component's section of the whole configuration."""
        return cls.from_mapping((config or {}).get(cls.section))

    def validate(self, where: str) -> None:
        """Range checks; raise ConfigError with ``where`` and the key. Default: none."""

    def replace(self, **changes: Any) -> Self:
        """A copy with ``changes`` applied (validated like a section)."""
        out = dataclasses.replace(self, **changes)
        out.validate(f"[{self.section}]")
        return out

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def positive(where: str, **values: float) -> None:
    """ConfigError unless every value is > 0 (``positive(where, interval_s=...)``)."""
    for key, value in values.items():
        if not value > 0:
            raise ConfigError(f"{where} {key} must be > 0, got {value!r}")


def non_negative(where: str, **values: float) -> None:
    """ConfigError unless every value is >= 0."""
    for key, value in values.items():
        if not value >= 0:
            raise ConfigError(f"{where} {key} must be >= 0, got {value!r}")


MAX_INTERVAL_S = 86_400.0


def interval(where: str, **values: float) -> None:
    """ConfigError unless every value is a period in (0, one day] seconds."""
    for key, value in values.items():
        if not 0 < value <= MAX_INTERVAL_S:
            raise ConfigError(f"{where} {key} must be > 0 and at most {MAX_INTERVAL_S:g} s, got {value!r}")


def port(where: str, key: str, value: int) -> None:
    """ConfigError unless ``value`` is a TCP port (0 picks a free one)."""
    if not 0 <= value <= 65535:
        raise ConfigError(f"{where} {key} must be a port 0-65535, got {value}")


def config_field(default: Any) -> Any:
    """A dataclass field with a mutable default (a list or table), copied per instance."""
    return field(default_factory=lambda: typing.cast(Any, type(default))(default))
