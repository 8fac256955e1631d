"""``triscope weights haproxy-gate`` / ``haproxy-pick``: the HAProxy config lines of triscope's Lua
actions inside HAProxy (exporters/haproxy_gate.lua, exporters/haproxy_pick.lua), from the config."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from triscope.commands._common import add_common
from triscope.commands._common import config_from as _config_from


def register_haproxy(sub: argparse._SubParsersAction) -> None:
    """The ``haproxy-gate`` and ``haproxy-pick`` actions of ``triscope weights``."""
    gate = sub.add_parser("haproxy-gate", help="print the HAProxy lines of the per-request batch gate "
                                               "(classes with admit_batch_ratio)")
    gate.add_argument("--pool", action="append", default=[], metavar="CLASS=BACKEND",
                      help="the HAProxy backend carrying a class; list every pool over the same servers "
                           "(their requests in flight add up); default pool_CLASS for every class")
    gate.add_argument("--server", action="append", default=[], metavar="BACKEND=SERVER",
                      help="HAProxy server name of a triscope backend (default: the same name)")
    gate.add_argument("--lua-path", action="store_true", help="print only the Lua file's path")
    add_common(gate)
    gate.set_defaults(func=run_haproxy_gate)
    pick = sub.add_parser("haproxy-pick", help="print the HAProxy lines of triscope's per-request picker "
                                               "inside HAProxy (its table from [epp] table_port)")
    pick.add_argument("--backend", default="gpus", help="the HAProxy backend whose servers it picks (default gpus)")
    pick.add_argument("--table-url", help="where HAProxy polls the pick table (default: [epp] bind and table_port)")
    pick.add_argument("--poll-ms", type=int, default=50, help="table poll period (default 50 ms)")
    pick.add_argument("--stats-port", type=int, default=0,
                      help="also a frontend on 127.0.0.1:PORT answering the picker's counters (/metrics: Prometheus)")
    pick.add_argument("--lua-path", action="store_true", help="print only the Lua file's path")
    add_common(pick)
    pick.set_defaults(func=run_haproxy_pick)


def _weight_params(config: dict[str, Any]) -> Any:
    from triscope.analyzers.routing import WeightParams

    return WeightParams.from_config(config)


def _pairs(items: list[str], flag: str) -> dict[str, str]:
    from triscope.errors import InputError

    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip() or not value.strip():
            raise InputError(f"{flag} wants NAME=VALUE, not {item!r}")
        out[key.strip()] = value.strip()
    return out


def run_haproxy_gate(args: argparse.Namespace) -> int:
    """``triscope weights haproxy-gate``: the config lines of exporters/haproxy_gate.lua."""
    from triscope.commands._common import print_json
    from triscope.exporters.haproxy_gate import LUA_PATH, gate_limits, gate_snippet

    if args.lua_path:
        print(LUA_PATH)
        return 0
    params = _weight_params(_config_from(args))
    pools = _pairs(args.pool, "--pool") or {name: f"pool_{name}" for name in params.classes}
    servers = _pairs(args.server, "--server")
    limits = gate_limits(params, servers)
    snippet = gate_snippet(limits, pools)
    if args.json:
        print_json({"lua_path": str(LUA_PATH), "pools": pools, "limits": limits, "config": snippet})
    else:
        sys.stdout.write(snippet)
    return 0


def run_haproxy_pick(args: argparse.Namespace) -> int:
    """``triscope weights haproxy-pick``: the config lines of exporters/haproxy_pick.lua."""
    from triscope.commands._common import print_json
    from triscope.errors import InputError
    from triscope.exporters.epp_service import EppConfig, picker_backends
    from triscope.exporters.haproxy_pick import LUA_PATH, PICK_LOG_FORMAT, TABLE_PATH, pick_snippet

    if args.lua_path:
        print(LUA_PATH)
        return 0
    config = _config_from(args)
    params = _weight_params(config)
    cfg = EppConfig.from_config(config)
    url = args.table_url
    if not url:
        if cfg.table_port <= 0:
            raise InputError("[epp] table_port is not set to a fixed port: set it, or pass --table-url")
        host = "127.0.0.1" if cfg.bind in ("", "0.0.0.0") else cfg.bind
        url = f"http://{host}:{cfg.table_port}{TABLE_PATH}"
    servers = list(picker_backends(cfg, params))
    settings = cfg.haproxy_pick_settings()
    snippet = pick_snippet(url, args.backend, servers, settings, args.poll_ms, cfg.fallback, args.stats_port)
    if args.json:
        print_json({"lua_path": str(LUA_PATH), "table_url": url, "backend": args.backend, "servers": servers,
                    "settings": settings, "config": snippet, "log_format": PICK_LOG_FORMAT})
    else:
        sys.stdout.write(snippet)
    return 0
