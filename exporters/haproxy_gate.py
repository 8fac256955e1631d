"""HAProxy configuration for triscope's per-request batch gate (``haproxy_gate.lua``).

The feed's agent closes a backend to a class from scraped gauges, a scrape and an update
behind a burst. The gate applies the same class limit, ``admit_batch_ratio x max_num_seqs``,
inside HAProxy to every request at once, on HAProxy's own count of requests in flight per
backend (every pool summed); see the Lua file's header and docs/weights.md ("Per-request gate").
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from pathlib import Path

from triscope.analyzers.routing import WeightParams
from triscope.errors import ConfigError

LUA_PATH = Path(__file__).resolve().parent / "haproxy_gate.lua"
"""The Lua action to ``lua-load`` in HAProxy's ``global`` section."""
SERVER_VAR = "txn.triscope_server"
"""The transaction variable the action sets to the chosen server's name."""
_NAME = re.compile(r"^[A-Za-z0-9_.:-]+$")  # HAProxy's allowed characters for proxy and server names


def is_haproxy_name(name: str) -> bool:
    """Whether ``name`` is valid as an HAProxy proxy or server name (and so as a token of an action's argument)."""
    return bool(_NAME.match(name))


def check_haproxy_names(names: Iterable[str], component: str) -> None:
    """ConfigError naming the first of ``names`` HAProxy would refuse."""
    for name in names:
        if not is_haproxy_name(name):
            raise ConfigError(f"{component}: {name!r} is not a valid HAProxy name (letters, digits, - _ . :)")


def gate_limits(params: WeightParams, servers: Mapping[str, str] | None = None) -> dict[str, dict[str, float]]:
    """{class: {HAProxy server: limit}} for every class with an ``admit_batch_ratio``, over the
    backends with a ``max_num_seqs``; ``servers`` maps a triscope backend name to its HAProxy
    server name (default: the same name)."""
    servers = dict(servers or {})
    unknown = sorted(set(servers) - set(params.backends))
    if unknown:
        raise ConfigError(f"haproxy gate: no [weights.backends] entry for {', '.join(unknown)}")
    sized = {name: b.max_num_seqs for name, b in params.backends.items() if b.max_num_seqs > 0}
    out: dict[str, dict[str, float]] = {}
    for cls_name, cls in params.classes.items():
        if not cls.has_batch_limit:
            continue
        if not sized:
            raise ConfigError(f"haproxy gate: class {cls_name} has admit_batch_ratio but no backend has "
                              "[weights.backends.NAME] max_num_seqs")
        out[cls_name] = {servers.get(name, name): round(cls.admit_batch_ratio * seqs, 6)
                         for name, seqs in sorted(sized.items())}
    return out


def gate_rules(pools: Iterable[str], limits: Mapping[str, float], server_names: Iterable[str]) -> list[str]:
    """The lines for one class's HAProxy backend: run the gate, answer 503 when it found no server,
    else send the request to the server it chose. ``pools``: every backend (pool) holding the same
    servers, whose requests in flight add up."""
    pools = sorted(set(pools))
    names = list(server_names)
    check_haproxy_names([*pools, *names, *limits], "haproxy gate")
    if not pools:
        raise ConfigError("haproxy gate: no pools")
    spec = ",".join(f"{name}={limit:g}" for name, limit in sorted(limits.items()))
    return ([f"http-request lua.triscope_gate {','.join(pools)} {spec or '-'}",
             f"http-request deny deny_status 503 if !{{ var({SERVER_VAR}) -m found }}"]
            + [f"use-server {name} if {{ var({SERVER_VAR}) -m str {name} }}" for name in names])


def gate_snippet(limits: Mapping[str, Mapping[str, float]], pools: Mapping[str, str]) -> str:
    """HAProxy config text for the gate: the ``lua-load`` line and, for each gated class of
    ``limits`` (from :func:`gate_limits`), the lines of its pool (``pools``: class -> the HAProxy
    backend carrying it)."""
    if not limits:
        raise ConfigError("haproxy gate: no class has admit_batch_ratio ([weights.classes.NAME])")
    missing = sorted(set(limits) - set(pools))
    if missing:
        raise ConfigError(f"haproxy gate: no pool given for class {', '.join(missing)}")
    lines = ["global", f"    lua-load {LUA_PATH}"]
    for cls_name, per_server in limits.items():
        lines += [f"# class {cls_name}: in its backend, before the server lines", f"backend {pools[cls_name]}"]
        lines += ["    " + line for line in gate_rules(pools.values(), per_server, per_server)]
    return "\n".join(lines) + "\n"
