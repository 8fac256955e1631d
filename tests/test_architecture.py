"""The architecture's rules, checked on the source: imports go downhill, modules stay small.

Rooms (docs/architecture.md): core (``triscope/``: store, schema, writer, config, component
contract) <- collectors, analyzers <- exporters <- commands / CLI; the simulator serves demo,
bench and tests and is never imported by the store, schema or writer; product code never
imports bench or tests.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
ROOMS = {"collectors": "collectors", "analyzers": "analyzers", "exporters": "exporters",
         "dashboards": "dashboards", "sim": "sim"}
MAX_LINES = 400

# room -> prefixes of triscope modules it must never import
FORBIDDEN: dict[str, tuple[str, ...]] = {
    "collectors": ("triscope.analyzers", "triscope.exporters", "triscope.commands", "triscope.cli",
                   "triscope.sim", "triscope.dashboards", "triscope.daemon"),
    "analyzers": ("triscope.exporters", "triscope.commands", "triscope.cli", "triscope.sim",
                  "triscope.dashboards", "triscope.daemon"),
    "exporters": ("triscope.commands", "triscope.cli", "triscope.sim", "triscope.collectors",
                  "triscope.dashboards", "triscope.daemon"),
    "dashboards": ("triscope.commands", "triscope.cli", "triscope.sim", "triscope.collectors",
                   "triscope.exporters", "triscope.daemon"),
    "core": ("triscope.collectors", "triscope.analyzers", "triscope.exporters", "triscope.sim",
             "triscope.commands", "triscope.cli", "triscope.dashboards", "triscope.daemon"),
}
CORE_MODULES = ("store", "schema", "writer", "spool", "component", "config", "errors", "registry",
                "conn_budget", "prom_text", "http_fetch", "store_link", "collector_loop",
                "query_endpoint", "query_discovery", "http_body", "http_client", "target_pool",
                "loop_server", "loop_http")


def product_files() -> list[tuple[str, Path]]:
    """(room, path) of every product module; room ``core`` for the store/schema/writer layer."""
    out: list[tuple[str, Path]] = []
    for room, folder in ROOMS.items():
        if (REPO / folder).is_dir():
            out += [(room, p) for p in sorted((REPO / folder).rglob("*.py"))]
    for p in sorted((REPO / "triscope").rglob("*.py")):
        top = p.relative_to(REPO / "triscope").parts[0].removesuffix(".py")
        out.append(("core" if top in CORE_MODULES else "triscope", p))
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
             for _room, path in product_files() for line, module in imported_modules(path)
             if module.split(".")[0] in test_helpers]
    assert not wrong, "\n".join(wrong)


def test_no_sys_path_insert_between_tests_and_bench() -> None:
    wrong = [str(p.relative_to(REPO)) for folder in ("tests", "bench", "tools")
             for p in sorted((REPO / folder).rglob("*.py")) if "sys.path.insert" in p.read_text()
             and p.name != "test_architecture.py"]
    assert not wrong, "sys.path.insert in: " + ", ".join(wrong)


def test_product_modules_stay_under_the_line_budget() -> None:
    long = [f"{path.relative_to(REPO)}: {n} lines" for _room, path in product_files()
            if (n := len(path.read_text().splitlines())) > MAX_LINES]
    assert not long, f"modules over {MAX_LINES} lines:\n" + "\n".join(long)


def test_the_rules_catch_an_uphill_import(tmp_path: Path) -> None:
    """The checker itself: a collector importing an exporter, lazily, is found."""
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from triscope.exporters.feed import create\n")
    assert (2, "triscope.exporters.feed") in imported_modules(bad)
    assert "triscope.exporters.feed".startswith(FORBIDDEN["collectors"])
