"""Configuration: one TOML file plus ``TRISCOPE_*`` environment overrides.

Override keys map to dotted paths with ``__`` as the separator, e.g.
``TRISCOPE_STORE__URL=http://127.0.0.1:8123`` sets ``[store] url``.
Values are parsed as TOML scalars when possible (``10`` is an int, ``true`` a bool),
otherwise kept as strings; credentials and names (``password``, ``username``, ``token``, ...)
are always taken verbatim, so a password such as ``123456`` or ``"x"`` arrives unchanged.
"""

from __future__ import annotations

import copy
import difflib
import os
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from triscope.errors import ConfigError
from triscope.store import StoreConfig

ENV_PREFIX = "TRISCOPE_"
# Variables with the prefix that are flags for the test-suite, not configuration.
_NON_CONFIG_ENV = {"TRISCOPE_REQUIRE_ALL", "TRISCOPE_CONFIG"}
# Keys whose override value is never parsed as TOML.
VERBATIM_KEYS = {"password", "username", "user", "token", "bearer_token", "secret", "api_key", "database"}

DEFAULTS: dict[str, Any] = {
    "store": StoreConfig().as_dict(),  # the defaults are StoreConfig's; here so config["store"][k] works
    "analysis": {"window_ms": 100},
}


SECTIONS = ("analysis", "blockio", "dcgm", "epp", "heatmap", "host", "incidents", "ingest", "nvml", "otlp",
            "prometheus", "query", "run", "serving_metrics", "stalls", "store", "torch_allocator", "weights",
            "writer")
"""Every top-level table the product reads; ``tests/test_config_mistakes.py`` checks each component's
section is here. A misspelt section must not run silently with defaults (``[otpl] token`` would leave
OTLP unauthenticated)."""


def check_sections(config: Mapping[str, Any], where: str = "config") -> None:
    """ConfigError (one line) for a top-level table no component reads, with the nearest known name.
    Skipped when ``[run]`` names a component outside triscope (``package.module:create``): its
    section cannot be known here."""
    run = config.get("run")
    names = [*(run.get("collectors") or []), *(run.get("exporters") or [])] if isinstance(run, Mapping) else []
    if any(isinstance(n, str) and ":" in n for n in names):
        return
    for key in config:
        if key in SECTIONS:
            continue
        near = difflib.get_close_matches(key.lower(), SECTIONS, n=1, cutoff=0.6)
        hint = f"; did you mean [{near[0]}]?" if near else ""
        raise ConfigError(f"{where} has an unknown section [{key}]{hint} (known: {', '.join(SECTIONS)})")


def deep_merge(base: dict[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    """A deep copy of ``base`` with ``extra`` laid over it: nested tables merge key by key, any
    other value (lists included) replaces the base's. Neither argument is modified."""
    out = copy.deepcopy(base)
    for key, value in extra.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


_deep_merge = deep_merge  # the former private name


def _parse_scalar(text: str) -> Any:
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def env_overrides(environ: dict[str, str] | None = None) -> dict[str, Any]:
    """Return the nested dict described by ``TRISCOPE_A__B=value`` variables."""
    environ = dict(os.environ if environ is None else environ)
    tree: dict[str, Any] = {}
    for name, raw in environ.items():
        if not name.startswith(ENV_PREFIX) or name in _NON_CONFIG_ENV:
            continue
        path = [part.lower() for part in name[len(ENV_PREFIX):].split("__") if part]
        if len(path) < 2:
            continue
        node = tree
        for part in path[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"environment variable {name} conflicts with another override")
        node[path[-1]] = raw if path[-1] in VERBATIM_KEYS else _parse_scalar(raw)
    return tree


def load_config(path: str | os.PathLike[str] | None = None,
                environ: dict[str, str] | None = None) -> dict[str, Any]:
    """Load defaults, then the TOML file (``path`` or ``$TRISCOPE_CONFIG``), then env overrides."""
    env = os.environ if environ is None else environ
    path = path or env.get("TRISCOPE_CONFIG")
    config = copy.deepcopy(DEFAULTS)
    if path:
        file = Path(path)
        try:
            data = tomllib.loads(file.read_bytes().decode("utf-8"))
        except FileNotFoundError:
            raise ConfigError(f"config file not found: {file}") from None
        except IsADirectoryError:
            raise ConfigError(f"config file {file} is a directory") from None
        except OSError as exc:
            raise ConfigError(f"config file {file} cannot be read: {exc.strerror or exc}") from None
        except UnicodeDecodeError as exc:
            raise ConfigError(f"config file {file} is not UTF-8 text (byte {exc.start})") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {file} is not valid TOML: {exc}") from None
        check_sections(data, f"config file {file}")
        config = deep_merge(config, data)
    overrides = env_overrides(dict(env))
    check_sections({**config, **overrides}, "TRISCOPE_* environment")
    return deep_merge(config, overrides)
