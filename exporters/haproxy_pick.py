"""triscope's per-request picker inside HAProxy (``haproxy_pick.lua``): its table, server and config lines.

The Envoy ext_proc path (:mod:`.epp`) costs a gateway and a Python process per request; the Lua
action makes the same choice inside HAProxy, with HAProxy's own count of requests in flight as the
ledger. What only triscope knows, each engine's last scrape, reaches it as a small text table that
``[epp]`` serves at ``GET /v1/pick-table`` (``table_port``) and the action's task polls; see the Lua
file's header and docs/epp.md ("Inside HAProxy").
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from triscope.analyzers.routing.picker import HeadroomPicker, PickerParams
from triscope.errors import ConfigError
from triscope.exporters.epp import Fallback
from triscope.exporters.feed_http import JSON_TYPE, json_error
from triscope.exporters.feed_server import FeedHTTPServer, encode
from triscope.exporters.haproxy_gate import check_haproxy_names, is_haproxy_name

LUA_PATH = Path(__file__).resolve().parent / "haproxy_pick.lua"
"""The Lua actions to ``lua-load`` in HAProxy's ``global`` section."""
TABLE_PATH = "/v1/pick-table"
TABLE_HEADER = "triscope-pick-table 1"
URL_ENV = "TRISCOPE_PICK_TABLE_URL"
POLL_ENV = "TRISCOPE_PICK_TABLE_POLL_MS"
SERVER_VAR = "txn.triscope_server"
REFUSED_VAR = "txn.triscope_refused"
"""Set by the action to the admission level that refused the request (``degrade``, ``limit``, ``break``)."""
FACTORS_VAR = "txn.triscope_pick_factors"
"""Set by the action to every server's standing, one word: ``NAME:BUSY+EXTERNAL:FIT:SCORE`` joined by ``|``."""
CLASS_VAR = "txn.triscope_class"
NEED_VAR = "txn.triscope_need"
"""The request's estimated KV need in tokens, as the action weighed it."""
CLASS_LINE = "@class"
PICK_LOG_TAG = "triscope-pick"
PICK_LOG_FORMAT = (f"{PICK_LOG_TAG} %Ts.%ms %s %ST %Tw %Tc %Tr %Ta "
                   f"%[var({CLASS_VAR})] %[var({NEED_VAR})] %[var({FACTORS_VAR})]")
"""A ``log-format`` with each pick's factors: accept time, server, status, HAProxy's timers (ms: queue,
connect, to response headers, whole request) and the class, KV need and factors the action set."""


def pick_table(picker: HeadroomPicker, now: float | None = None) -> bytes:
    """What each backend's last scrape said, one line per backend (the Lua file's format): ages are
    relative to ``now`` (monotonic) so that no clock need be shared, -1 stands for an unknown figure. Then one
    line per class with the weight engine's admission level (``@class NAME LEVEL SHED_RATIO ADMIT_RATIO``)."""
    now = time.monotonic() if now is None else now
    rows = picker.explain(now)
    # a class outside HAProxy's name characters is no token the Lua action could match; the Python picker
    # still applies its drains
    class_drains = {name: [c for c in classes if is_haproxy_name(c)] for name, classes in picker.class_drains().items()}
    lines = [TABLE_HEADER]
    for name, row in rows.items():
        if not is_haproxy_name(name):
            continue
        fresh_left = row["fresh_for_s"] - row["scrape_age_s"] if row["scrape_age_s"] is not None else -1.0
        load = row["engine_requests"]
        free = row["free_kv_tokens"]
        if math.isfinite(free):
            free = free if row["kv_short"] else free + row["unseen_tokens"]  # the Lua action counts its own
        drained = row["drained"] or not row["weight"] > 0
        lines.append(" ".join([
            name, _flag(row["healthy"]), _flag(drained), _num(fresh_left), _num(load),
            _num(free if math.isfinite(free) else -1.0), _num(row["reserve_tokens"]), _flag(row["kv_short"]),
            _num(row["scrape_age_s"]), _num(row["scrape_sent_age_s"]), ",".join(class_drains[name]) or "-",
            _flag(row["refused"]), _num(row["engine_waiting"])]))
    view = picker.engine
    for request_class, level in sorted(view.class_levels.items() if view is not None else ()):
        if is_haproxy_name(request_class):
            lines.append(f"{CLASS_LINE} {request_class} {level.level} {_plain(level.shed_ratio)} "
                         f"{_plain(level.admit_ratio)}")
    return ("\n".join(lines) + "\n").encode()


def _flag(value: object) -> str:
    return "1" if value else "0"


def _num(value: float | None) -> str:
    return "-1" if value is None or not math.isfinite(value) else f"{max(value, -1.0):.4f}".rstrip("0").rstrip(".")


def pick_settings(params: PickerParams, chars_per_token: float, default_output_tokens: float,
                  levels_window_s: float = 10.0) -> str:
    """The action's second argument: the picker's settings of ``[epp]`` (work counted in requests) and the
    window over which a limited class's arrival rate is counted."""
    if params.work_unit != "requests":
        raise ConfigError("haproxy pick: work_unit must be 'requests' (HAProxy counts requests in flight)")
    for key, value in (("misfit_penalty", params.misfit_penalty), ("short_penalty", params.short_penalty)):
        if not math.isfinite(value):
            raise ConfigError(f"haproxy pick: {key} must be finite (a large value, say 1000, for 'never')")
    values = {"cpt": chars_per_token, "out": default_output_tokens, "ew": params.external_weight,
              "mp": params.misfit_penalty, "sp": params.short_penalty, "vis": params.visible_after_s,
              "stale": params.unready_after_s, "size": params.default_request_tokens, "win": levels_window_s}
    return ",".join(f"{key}={_plain(value)}" for key, value in values.items())


def _plain(value: float) -> str:
    """A number as the Lua action parses it (digits and a point: no exponent)."""
    return f"{value:.6f}".rstrip("0").rstrip(".")


def pick_globals(table_url: str, poll_ms: int = 50) -> list[str]:
    """The ``global`` section's lines: where the table is, how often to poll it, the Lua file."""
    if not table_url.startswith("http://"):
        raise ConfigError(f"haproxy pick: the table URL must be http:// (HAProxy's Lua client), got {table_url!r}")
    if not 10 <= poll_ms <= 10_000:
        raise ConfigError(f"haproxy pick: poll period must be 10-10000 ms, got {poll_ms}")
    return [f"setenv {URL_ENV} {table_url}", f"setenv {POLL_ENV} {poll_ms}", f"lua-load {LUA_PATH}"]


def pick_rules(pools: Iterable[str], server_names: Iterable[str], settings: str,
               fallback: Fallback | None = None) -> list[str]:
    """The lines for one HAProxy backend: buffer the body, run the picker, answer ``fallback`` to a request
    its class's admission level refused, note each answer, and send the request to the server it chose
    (none chosen: the backend's own balance). ``pools``: every backend holding the same servers, whose
    requests in flight add up."""
    pools = sorted(set(pools))
    names = list(server_names)
    check_haproxy_names([*pools, *names], "haproxy pick")
    if not pools or not names:
        raise ConfigError("haproxy pick: no pools or no servers")
    fallback = fallback or Fallback()
    if any(c in fallback.body for c in "'\r\n") or not 400 <= fallback.status <= 599:
        raise ConfigError("haproxy pick: the fallback answer needs a 4xx/5xx status and a one-line body "
                          "without single quotes (HAProxy's quoting)")
    return (["option http-buffer-request", f"http-request lua.triscope_pick {','.join(pools)} {settings}",
             f"http-request return status {fallback.status} content-type application/json "
             f"string '{fallback.body}' if {{ var({REFUSED_VAR}) -m found }}",
             "http-response lua.triscope_pick_end"]
            + [f"use-server {name} if {{ var({SERVER_VAR}) -m str {name} }}" for name in names])


def pick_snippet(table_url: str, backend: str, server_names: Iterable[str], settings: str, poll_ms: int = 50,
                 fallback: Fallback | None = None, stats_port: int = 0) -> str:
    """HAProxy config text: the ``global`` lines, those of ``backend`` (before its server lines), with a
    ``stats_port`` a frontend on 127.0.0.1 answering the action's counters (JSON; Prometheus on /metrics),
    and, as a comment, the ``log-format`` that logs each pick's factors."""
    lines = ["global", *("    " + line for line in pick_globals(table_url, poll_ms)),
             f"backend {backend}", "    balance leastconn",
             *("    " + line for line in pick_rules([backend], server_names, settings, fallback))]
    if stats_port:
        lines += pick_stats_frontend(stats_port)
    lines += ["# each pick's factors in HAProxy's log: in the frontend (with a log target)",
              f'#     log-format "{PICK_LOG_FORMAT}"']
    return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class Standing:
    """One server's standing in a logged pick (:data:`FACTORS_VAR`)."""

    busy: float
    external: float
    fit: str
    """fit, misfit, short, nofit or stale (the Lua file's ``factors``)."""
    score: float | None
    """None: the server was up but no candidate (drained, unhealthy, closed to the class)."""


@dataclass(frozen=True)
class PickLogRecord:
    """One request's line of :data:`PICK_LOG_FORMAT`."""

    accepted_s: float
    server: str
    status: int
    queue_ms: int
    connect_ms: int
    response_ms: int
    active_ms: int
    request_class: str
    need_tokens: int
    standings: dict[str, Standing]


def _int(word: str) -> int:
    return int(word) if word.lstrip("-").isdigit() else -1


def parse_pick_log_line(line: str) -> PickLogRecord | None:
    """A :data:`PICK_LOG_FORMAT` line, or None for any other line (HAProxy's own messages share the log)."""
    words = line.split()
    if len(words) < 11 or words[0] != PICK_LOG_TAG:
        return None
    try:
        accepted = float(words[1])
    except ValueError:
        return None
    standings = {}
    for part in words[10].split("|") if words[10] != "-" else []:
        fields = part.split(":")
        if len(fields) != 4 or "+" not in fields[1]:
            return None
        busy, _, external = fields[1].partition("+")
        try:
            standings[fields[0]] = Standing(float(busy), float(external), fields[2],
                                            None if fields[3] == "out" else float(fields[3]))
        except ValueError:
            return None
    return PickLogRecord(accepted, words[2], _int(words[3]), _int(words[4]), _int(words[5]), _int(words[6]),
                         _int(words[7]), "" if words[8] == "-" else words[8], _int(words[9]), standings)


def pick_stats_frontend(port: int) -> list[str]:
    """A frontend on 127.0.0.1:``port`` answering the action's counters (JSON; Prometheus on /metrics)."""
    if not 0 < port < 65536:
        raise ConfigError(f"haproxy pick: stats port must be 1-65535, got {port}")
    return ["frontend triscope_pick_stats", f"    bind 127.0.0.1:{port}",
            "    http-request use-service lua.triscope_pick_stats"]


class PickTableServer(FeedHTTPServer):
    """``GET /v1/pick-table`` (and ``/healthz``) on ``bind:port``: the table of :func:`pick_table`, written
    afresh for each request (HAProxy polls it every 50 ms or so; a few backends' lines)."""

    thread_name = "triscope-pick-table"

    def __init__(self, picker: HeadroomPicker, bind: str, port: int, max_connections: int = 64) -> None:
        self.picker = picker
        self.served_total = 0
        super().__init__(None, bind, port, max_connections)

    @property
    def max_body_bytes(self) -> int:
        return 0

    def response(self, method: str, path: str, body: bytes, close: bool) -> bytes:
        path = path.split("?", 1)[0]
        if method not in ("GET", "HEAD"):
            answer = encode(405, JSON_TYPE, json_error(f"{method} not allowed: GET {TABLE_PATH}"), close)
        elif path == TABLE_PATH:
            self.served_total += 1
            answer = encode(200, "text/plain; charset=utf-8", pick_table(self.picker), close)
        elif path == "/healthz":
            answer = encode(200, "text/plain; charset=utf-8", b"ok\n", close)
        else:
            answer = encode(404, JSON_TYPE, json_error(f"no route {path}: GET {TABLE_PATH}"), close)
        if method == "HEAD":
            return answer[: answer.index(b"\r\n\r\n") + 4]
        return answer
