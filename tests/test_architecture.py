"""The architecture's rules, checked on the source: imports go downhill, modules stay small.

Rooms (docs/architecture.md): core (``triscope/``: store, schema, writer, config, component
contract, ...) <- collectors, analyzers <- exporters <- the daemon (core plus components by
registry name) and commands / CLI; product code never imports bench or tests. Every module
under ``triscope/`` is in exactly one room; the HAProxy Lua files have line budgets of their own.
The test bed (``bed/``, ``triscope_bed``) is a package of its own: it may import the product, the
product imports it only in ``triscope demo`` (lazily), and its own layers go downhill too
(:data:`BED_LAYERS`).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
ROOMS = {"collectors": "collectors", "analyzers": "analyzers", "exporters": "exporters",
         "dashboards": "dashboards"}
BED = REPO / "bed" / "triscope_bed"
BED_LAYERS: dict[str, set[str]] = {
    "base": set(),  # procs, ports, paths, stats: the bed's plumbing
    "engines": {"base"},
    "workloads": {"base", "engines"},
    "peers": {"base", "engines", "workloads"},
    "reports": {"base", "engines", "workloads"},
    "fleet": {"base", "engines", "workloads", "peers", "reports"},
    "demo": {"base", "engines"},  # the demo runs simulated engines only, never a peer or a vLLM client
}
"""The bed's layers (a subpackage each, ``base`` for its top-level modules) -> the layers it may import."""
BED_IMPORT_ALLOWED = {"triscope/commands/demo.py"}
"""The one product module that imports the test bed: ``triscope demo``, lazily, saying how to install it."""
MAX_LINES = 400

# room -> prefixes of triscope modules it must never import
FORBIDDEN: dict[str, tuple[str, ...]] = {
    "collectors": ("triscope.analyzers", "triscope.exporters", "triscope.commands", "triscope.cli",
                   "triscope_bed", "triscope.dashboards", "triscope.daemon"),
    "analyzers": ("triscope.exporters", "triscope.commands", "triscope.cli", "triscope_bed",
                  "triscope.dashboards", "triscope.daemon"),
    "exporters": ("triscope.commands", "triscope.cli", "triscope_bed", "triscope.collectors",
                  "triscope.dashboards", "triscope.daemon"),
    "dashboards": ("triscope.commands", "triscope.cli", "triscope_bed", "triscope.collectors",
                   "triscope.exporters", "triscope.daemon"),
    "core": ("triscope.collectors", "triscope.analyzers", "triscope.exporters", "triscope_bed",
             "triscope.commands", "triscope.cli", "triscope.dashboards", "triscope.daemon"),
}
CORE_MODULES = ("store", "schema", "writer", "spool", "component", "config", "errors", "registry",
                "conn_budget", "prom_text", "http_fetch", "store_link", "collector_loop",
                "query_endpoint", "query_discovery", "http_body", "http_client", "target_pool",
                "loop_server", "loop_http", "ticker", "tick_clock", "console", "backlog")
"""Modules and packages of ``triscope/`` in the core room: what every room may import."""
DAEMON_MODULES = ("daemon",)
"""``triscope run``: the core and the components the registry names, never a room above by import."""
CLI_MODULES = ("cli", "commands", "__init__", "__main__")
"""The ``triscope`` CLI: may use every room (never bench or tests)."""
FORBIDDEN["daemon"] = tuple(m for m in FORBIDDEN["core"] if m != "triscope.daemon")
FORBIDDEN["commands"] = ()

LUA_BUDGETS = {
    # The action HAProxy runs per request plus its table poll: one job, the same budget as a Python
    # module; its helpers below were split out of it.
    "haproxy_pick.lua": 400,
    # Each helper is one small piece loaded by the action (a time-stamped ring, the counters and their
    # service, class admission); past 150 lines it has taken on a second job and wants its own file.
    "haproxy_pick_ring.lua": 150,
    "haproxy_pick_stats.lua": 150,
    "haproxy_pick_admission.lua": 150,
    # The batch gate is one lookup per request against HAProxy's in-flight counts: it stays small so the
    # per-request path an operator has to audit stays short.
    "haproxy_gate.lua": 150,
}
"""Line budget of each Lua file under ``exporters/``, and why; a new file needs a budget here."""


def triscope_room(path: Path) -> str:
    """The room of a module under ``triscope/`` (``unclassified`` when no list names it)."""
    top = path.relative_to(REPO / "triscope").parts[0].removesuffix(".py")
    if top in CORE_MODULES:
        return "core"
    if top in DAEMON_MODULES:
        return "daemon"
    if top in CLI_MODULES:
        return "commands"
    return "unclassified"


def product_files() -> list[tuple[str, Path]]:
    """(room, path) of every product module; room ``core`` for the store/schema/writer layer."""
    out: list[tuple[str, Path]] = []
    for room, folder in ROOMS.items():
        if (REPO / folder).is_dir():
            out += [(room, p) for p in sorted((REPO / folder).rglob("*.py"))]
    out += [(triscope_room(p), p) for p in sorted((REPO / "triscope").rglob("*.py"))]
    return out


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """Every module an ``import`` statement names (lazy imports inside functions too)."""
    tree = ast.parse(path.read_text(), str(path))
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
            found += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
    return found


def bed_files() -> list[tuple[str, Path]]:
    """(layer, path) of every module of the test bed."""
    out = []
    for p in sorted(BED.rglob("*.py")):
        rel = p.relative_to(BED).parts
        out.append(("base" if len(rel) == 1 else rel[0], p))
    return out


def bed_layer(module: str) -> str | None:
    """The layer of a ``triscope_bed`` module (None: not the bed)."""
    parts = module.split(".")
    if parts[0] != "triscope_bed":
        return None
    if len(parts) > 1 and parts[1] in BED_LAYERS and (BED / parts[1]).is_dir():
        return parts[1]
    return "base"


def _local_names(folder: str) -> set[str]:
    return {p.stem for p in (REPO / folder).glob("*.py")} | {"bench", "tests", "conftest"}


@pytest.mark.parametrize("room", sorted(FORBIDDEN))
def test_imports_go_downhill(room: str) -> None:
    wrong = []
    for file_room, path in product_files():
        if file_room != room:
            continue
        for line, module in imported_modules(path):
            if module.startswith(FORBIDDEN[room]) and module.split(".")[:2] != ["triscope", room]:
                wrong.append(f"{path.relative_to(REPO)}:{line} imports {module}")
    assert not wrong, f"{room} imports uphill:\n" + "\n".join(wrong)


def test_product_code_never_imports_bench_or_tests() -> None:
    test_helpers = _local_names("tests") | _local_names("bench")
    wrong = [f"{path.relative_to(REPO)}:{line} imports {module}"
             for _room, path in product_files() + bed_files() for line, module in imported_modules(path)
             if module.split(".")[0] in test_helpers]
    assert not wrong, "\n".join(wrong)


def test_product_never_imports_the_test_bed() -> None:
    wrong = [f"{path.relative_to(REPO)}:{line} imports {module}"
             for _room, path in product_files() for line, module in imported_modules(path)
             if module.split(".")[0] == "triscope_bed" and str(path.relative_to(REPO)) not in BED_IMPORT_ALLOWED]
    assert not wrong, "the product imports the test bed:\n" + "\n".join(wrong)
    for allowed in BED_IMPORT_ALLOWED:  # and where it does, only inside a function (lazily)
        tree = ast.parse((REPO / allowed).read_text())
        eager = [n.lineno for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))
                 and any(m.startswith("triscope_bed") for m in ([a.name for a in n.names] if isinstance(n, ast.Import)
                                                                else [n.module or ""]))]
        assert not eager, f"{allowed}: the test bed imported at module level, lines {eager}"


def test_the_bed_layers_import_downhill() -> None:
    wrong = []
    for layer, path in bed_files():
        for line, module in imported_modules(path):
            target = bed_layer(module)
            if target is not None and target != layer and target not in BED_LAYERS[layer]:
                wrong.append(f"{path.relative_to(REPO)}:{line} ({layer}) imports {module} ({target})")
    assert not wrong, "the test bed imports uphill:\n" + "\n".join(wrong)
    layers = {layer for layer, _p in bed_files()}
    assert layers <= set(BED_LAYERS), f"a bed subpackage without a layer in BED_LAYERS: {layers - set(BED_LAYERS)}"


def test_the_bed_uses_absolute_imports() -> None:
    """Relative imports would slip past the layer check."""
    wrong = [f"{path.relative_to(REPO)}:{node.lineno}" for _layer, path in bed_files()
             for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.ImportFrom) and node.level]
    assert not wrong, "relative imports in the bed: " + ", ".join(wrong)


def test_no_sys_path_insert_between_tests_and_bench() -> None:
    wrong = [str(p.relative_to(REPO)) for folder in ("tests", "bench", "tools")
             for p in sorted((REPO / folder).rglob("*.py")) if "sys.path.insert" in p.read_text()
             and p.name != "test_architecture.py"]
    assert not wrong, "sys.path.insert in: " + ", ".join(wrong)


def test_product_and_bed_modules_stay_under_the_line_budget() -> None:
    long = [f"{path.relative_to(REPO)}: {n} lines" for _room, path in product_files() + bed_files()
            if (n := len(path.read_text().splitlines())) > MAX_LINES]
    assert not long, f"modules over {MAX_LINES} lines:\n" + "\n".join(long)


def test_every_triscope_module_is_in_a_room() -> None:
    loose = [str(path.relative_to(REPO)) for room, path in product_files() if room == "unclassified"]
    assert not loose, ("modules under triscope/ in no room (add them to CORE_MODULES, DAEMON_MODULES or "
                       "CLI_MODULES, and docs/architecture.md):\n" + "\n".join(loose))
    assert not set(CORE_MODULES) & set(DAEMON_MODULES + CLI_MODULES)
    named = {p.name.removesuffix(".py") for p in (REPO / "triscope").iterdir() if p.suffix == ".py" or p.is_dir()}
    assert set(CORE_MODULES + DAEMON_MODULES + CLI_MODULES) <= named | {"__pycache__"}, "a room lists a module gone"


def test_lua_files_stay_under_their_budgets() -> None:
    files = {p.name: len(p.read_text().splitlines()) for p in sorted((REPO / "exporters").glob("*.lua"))}
    assert set(files) == set(LUA_BUDGETS), f"Lua files without a budget (or budgets without a file): " \
                                           f"{sorted(set(files) ^ set(LUA_BUDGETS))}"
    long = [f"exporters/{name}: {n} lines (budget {LUA_BUDGETS[name]})" for name, n in files.items()
            if n > LUA_BUDGETS[name]]
    assert not long, "\n".join(long)


def test_the_rules_catch_an_uphill_import(tmp_path: Path) -> None:
    """The checker itself: a collector importing an exporter, lazily, is found."""
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from triscope.exporters.feed import create\n")
    assert (2, "triscope.exporters.feed") in imported_modules(bad)
    assert "triscope.exporters.feed".startswith(FORBIDDEN["collectors"])
    assert triscope_room(REPO / "triscope" / "new_helper.py") == "unclassified"
    assert triscope_room(REPO / "triscope" / "commands" / "x.py") == "commands"


def test_the_rules_catch_an_uphill_import_in_the_bed() -> None:
    """The bed's checker itself: the demo reaching for a peer, or an engine for the load generator, is uphill."""
    assert bed_layer("triscope_bed.peers.haproxy") not in BED_LAYERS["demo"]
    assert bed_layer("triscope_bed.workloads.driver") not in BED_LAYERS["engines"]
    assert bed_layer("triscope_bed.ports") in BED_LAYERS["engines"] and bed_layer("triscope.store") is None
