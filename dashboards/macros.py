"""Expand a panel's SQL the way Grafana and the ClickHouse plugin do, for the ClickHouse dialect.

Three passes, in the order a query takes through Grafana and ``grafana-clickhouse-datasource``:

1. ``$__conditionalAll(condition, $var)`` (plugin, in the browser): ``1=1`` when ``$var`` has
   *All* (``$__all``) or nothing selected, else ``condition``.
2. Grafana template variables (``$var``, ``${var}``, ``${var:format}``, ``[[var]]``) and the
   global ``$__from`` / ``$__to`` / ``$__interval`` / ``$__interval_ms`` / ``$__range_s``. Without a
   format the plugin writes a multi-value variable as ``'a','b'`` and a single value as it is;
   ``singlequote`` escapes ``'`` as ``\\'``, ``sqlstring`` doubles it. *All* without a custom
   all-value stands for every option. Unknown names are left alone (Grafana does the same).
3. The plugin's backend macros: ``$__timeFilter(col)`` -> ``col >= toDateTime(from) AND col <=
   toDateTime(to)`` (seconds), ``$__timeFilter_ms`` (``fromUnixTimestamp64Milli``), ``$__dateFilter``,
   ``$__dateTimeFilter`` / ``$__dt``, ``$__fromTime`` / ``$__toTime`` (``_ms``),
   ``$__timeInterval(col)`` -> ``toStartOfInterval(toDateTime(col), INTERVAL n second)`` with
   n = max(1, interval), ``$__timeInterval_ms``, ``$__interval_s``. Any other ``$__name`` left after
   pass 2 raises :class:`MacroError` (the real server would fail on it too).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from urllib.parse import quote

from triscope.errors import InputError

ALL = "$__all"


class MacroError(InputError):
    """A macro with the wrong arguments, or an unknown macro."""


@dataclass
class Var:
    """A variable's state: selected value(s) (``[ALL]`` for All) and the options it offers."""

    selected: list[str] | str
    options: Sequence[str] = ()
    multi: bool = True
    all_value: str | None = None

    def is_all(self) -> bool:
        return self.selected == ALL or (isinstance(self.selected, list) and ALL in self.selected)

    def current(self) -> list[str] | str:
        """The value Grafana hands to the formatter (All resolved to every option)."""
        if self.is_all():
            return list(self.options)
        return self.selected


@dataclass
class Context:
    """Time range, interval and variables of one query."""

    start: datetime
    end: datetime
    interval_s: float = 1.0
    variables: Mapping[str, Var] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("start", "end"):
            value = getattr(self, name)
            if value.tzinfo is None:
                setattr(self, name, value.replace(tzinfo=UTC))


def macro_args(sql: str, open_index: int) -> tuple[list[str], int] | None:
    """Arguments of the call whose ``(`` is at ``open_index`` (top-level commas split) and the
    index just past its ``)``; None when the parentheses do not close."""
    depth, start, args = 0, open_index + 1, []
    for i in range(open_index, len(sql)):
        ch = sql[i]
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
            if depth == 0:
                args.append(sql[start:i])
                return args, i + 1
        elif ch == "," and depth == 1:
            args.append(sql[start:i])
            start = i + 1
    return None


_VAR_IN_ARG = re.compile(r"(?<=\$\{)\w+(?=\})|(?<=\$)\w+")


def apply_conditional_all(sql: str, variables: Mapping[str, Var]) -> str:
    """Pass 1: resolve every ``$__conditionalAll(cond, $var)`` (innermost-last, as the plugin does)."""
    macro = "$__conditionalAll("
    index = sql.rfind(macro)
    while index != -1:
        parsed = macro_args(sql, index + len(macro) - 1)
        if parsed is None or len(parsed[0]) != 2:
            raise MacroError(f"$__conditionalAll needs (condition, $variable) at: {sql[index:index + 60]!r}")
        (condition, var_arg), end = parsed
        phrase = condition
        found = _VAR_IN_ARG.search(var_arg.strip())
        if found:
            var = variables.get(found.group(0))
            value = "" if var is None else _js_string(var.selected)
            if value in ("", ALL):
                phrase = "1=1"
        sql = sql[:index] + phrase + sql[end:]
        index = sql.rfind(macro)
    return sql


def _js_string(value: list[str] | str) -> str:
    return ",".join(value) if isinstance(value, list) else value


_GRAFANA_VAR = re.compile(r"\$(\w+)|\[\[(\w+?)(?::(\w+))?\]\]|\$\{(\w+)(?:\.([^:^}]+))?(?::([^}]+))?\}")


def _format(name: str, value: list[str] | str, fmt: str | None) -> str:
    values = value if isinstance(value, list) else [value]
    if fmt is None:  # the plugin's format(): arrays quoted and joined, scalars as they are
        return "'" + "','".join(values) + "'" if isinstance(value, list) else value
    if fmt == "singlequote":
        return ",".join("'" + v.replace("'", "\\'") + "'" for v in values)
    if fmt == "doublequote":
        return ",".join('"' + v.replace('"', '\\"') + '"' for v in values)
    if fmt == "sqlstring":
        return ",".join("'" + v.replace("'", "''") + "'" for v in values)
    if fmt in ("csv", "raw", "text"):
        return ",".join(values)
    if fmt == "pipe":
        return "|".join(values)
    if fmt == "regex":
        escaped = [re.escape(v) for v in values]
        return escaped[0] if len(escaped) == 1 else "(" + "|".join(escaped) + ")"
    if fmt == "queryparam":
        return "&".join(f"var-{name}={quote(v, safe='')}" for v in values)
    if fmt == "percentencode":
        return quote(",".join(values), safe="")
    raise MacroError(f"unsupported variable format ${{{name}:{fmt}}}")


def _hms(ms: int) -> str:
    """Grafana's interval text: 200ms, 30s, 5m, 2h, 1d (the largest unit that divides it)."""
    if ms % 1000:
        return f"{ms}ms"
    seconds = ms // 1000
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds % size == 0:
            return f"{seconds // size}{unit}"
    return f"{seconds}s"


def _globals(ctx: Context) -> dict[str, str]:
    from_ms = int(ctx.start.timestamp() * 1000)
    to_ms = int(ctx.end.timestamp() * 1000)
    interval_ms = max(1, int(ctx.interval_s * 1000))
    return {"__from": str(from_ms), "__to": str(to_ms), "__interval_ms": str(interval_ms),
            "__interval": _hms(interval_ms),
            "__range_s": str((to_ms - from_ms) // 1000), "__range_ms": str(to_ms - from_ms)}


def interpolate(sql: str, ctx: Context) -> str:
    """Pass 2: Grafana's template-variable replacement."""
    builtins = _globals(ctx)

    def repl(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(2) or m.group(4)
        fmt = m.group(3) or m.group(6)
        if name in builtins:
            return builtins[name]
        var = ctx.variables.get(name)
        if var is None:
            return m.group(0)
        if var.is_all() and var.all_value is not None and fmt not in ("text", "queryparam"):
            return var.all_value
        value = var.current()
        if isinstance(value, list) and not var.multi and not var.is_all():
            value = value[0] if value else ""
        return _format(name, value, fmt)

    return _GRAFANA_VAR.sub(repl, sql)


def _dt(t: datetime) -> str:
    return f"toDateTime({math.floor(t.timestamp())})"


def _dt64(t: datetime) -> str:
    return f"fromUnixTimestamp64Milli({math.floor(t.timestamp() * 1000)})"


def _date(t: datetime) -> str:
    return f"toDate('{t.astimezone(UTC).strftime('%Y-%m-%d')}')"


def _one(name: str, args: list[str], n: int = 1) -> list[str]:
    if len(args) != n:
        raise MacroError(f"$__{name} expects {n} argument(s), got {len(args)}")
    return args


def _backend_macro(name: str, args: list[str] | None, ctx: Context) -> str:
    a = [x.strip() for x in args] if args is not None else []
    if a == [""]:
        a = []  # "$__name()" has no arguments
    seconds = int(max(ctx.interval_s, 1))
    millis = int(max(ctx.interval_s * 1000, 1))
    if name == "fromTime":
        return _dt(ctx.start)
    if name == "toTime":
        return _dt(ctx.end)
    if name == "fromTime_ms":
        return _dt64(ctx.start)
    if name == "toTime_ms":
        return _dt64(ctx.end)
    if name == "interval_s":
        return str(seconds)
    if name in ("timeFilter", "timeFilter_ms"):
        (col,) = _one(name, a)
        conv = _dt if name == "timeFilter" else _dt64
        return f"{col} >= {conv(ctx.start)} AND {col} <= {conv(ctx.end)}"
    if name == "dateFilter":
        (col,) = _one(name, a)
        return f"{col} >= {_date(ctx.start)} AND {col} <= {_date(ctx.end)}"
    if name in ("dateTimeFilter", "dt"):
        dcol, tcol = _one(name, a, 2)
        return (f"({dcol} >= {_date(ctx.start)} AND {dcol} <= {_date(ctx.end)}) AND "
                f"({tcol} >= {_dt(ctx.start)} AND {tcol} <= {_dt(ctx.end)})")
    if name == "timeInterval":
        (col,) = _one(name, a)
        return f"toStartOfInterval(toDateTime({col}), INTERVAL {seconds} second)"
    if name == "timeInterval_ms":
        (col,) = _one(name, a)
        return f"toStartOfInterval(toDateTime64({col}, 3), INTERVAL {millis} millisecond)"
    raise MacroError(f"unknown macro $__{name}")


BACKEND_MACROS = ("fromTime", "toTime", "fromTime_ms", "toTime_ms", "timeFilter", "timeFilter_ms",
                  "dateFilter", "dateTimeFilter", "dt", "timeInterval", "timeInterval_ms", "interval_s")
_MACRO = re.compile(r"\$__(\w+)")


def apply_macros(sql: str, ctx: Context) -> str:
    """Pass 3: the plugin's server-side macros."""
    out, pos = [], 0
    for m in _MACRO.finditer(sql):
        if m.start() < pos:
            continue
        name, end, args = m.group(1), m.end(), None
        if name not in BACKEND_MACROS:
            raise MacroError(f"unknown macro $__{name}")
        if end < len(sql) and sql[end] == "(":
            parsed = macro_args(sql, end)
            if parsed is None:
                raise MacroError(f"$__{name}: unbalanced parentheses")
            args, end = parsed
        out.append(sql[pos:m.start()])
        out.append(_backend_macro(name, args, ctx))
        pos = end
    out.append(sql[pos:])
    result = "".join(out)
    return apply_macros(result, ctx) if _MACRO.search(result) else result


def expand(sql: str, ctx: Context) -> str:
    """All three passes: the SQL the ClickHouse server finally runs."""
    return apply_macros(interpolate(apply_conditional_all(sql, ctx.variables), ctx), ctx)


def referenced_variables(sql: str) -> set[str]:
    """Names of template variables a query uses (``$__`` globals and macros excluded)."""
    names = set()
    for m in _GRAFANA_VAR.finditer(sql):
        name = m.group(1) or m.group(2) or m.group(4)
        if not name.startswith("__"):
            names.add(name)
    return names
