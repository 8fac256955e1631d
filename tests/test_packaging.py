"""What the wheels hold: every package folder listed (a non-editable install would miss it otherwise), the
test bed kept out of the product, and runtime dependencies exactly what each distribution imports."""

from __future__ import annotations

import functools
import tomllib

from conftest import REPO

BED = REPO / "bed"

OPTIONAL_IMPORTS = {
    "torch": "the user's own build (CPU or CUDA) is never a dependency: collectors/torch_allocator.py "
             "reports 'torch is not installed' and `triscope demo` skips its live capture without it",
    "triscope_bed": "the test bed, a distribution of its own (bed/): only `triscope demo` imports it, and "
                    "without it the demo says how to install it (tests/test_demo.py)",
}
"""Imported by the product, deliberately not a runtime dependency: each is imported lazily, inside a
function, where its absence is handled."""


def _packages_found(mapping: dict[str, str], root) -> set[str]:
    found = set()
    for package, folder in mapping.items():
        base = root / folder
        for init in base.rglob("__init__.py"):
            rel = init.parent.relative_to(base)
            parts = [] if str(rel) == "." else list(rel.parts)
            found.add(".".join([package, *parts]))
    return found


def test_all_packages_are_listed():
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    found = _packages_found(config["package-dir"], REPO)
    listed = set(config["packages"])
    assert found <= listed, f"add to pyproject [tool.setuptools] packages: {sorted(found - listed)}"
    bed = tomllib.loads((BED / "pyproject.toml").read_text())["tool"]["setuptools"]
    found = _packages_found({"triscope_bed": "triscope_bed"}, BED)
    assert found <= set(bed["packages"]), f"add to bed/pyproject.toml packages: {sorted(found - set(bed['packages']))}"


def test_the_product_does_not_ship_the_test_bed():
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    shipped = set(config["packages"]) | set(config["package-dir"])
    assert not [p for p in shipped if p.startswith(("triscope.sim", "triscope_bed"))], shipped
    assert not (REPO / "sim").exists()


def _imports(path) -> list[tuple[str, bool]]:
    """(dotted module, inside a function) of every absolute import in a source file (``from a import b``: ``a.b``)."""
    import ast

    tree = ast.parse(path.read_text(), filename=str(path))
    lazy: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            lazy.update(id(n) for n in ast.walk(node) if n is not node)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, id(node) in lazy) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found += [(f"{node.module}.{alias.name}", id(node) in lazy) for alias in node.names]
    return found


def _normal(name: str) -> str:
    import re

    return re.sub(r"[-_.]+", "-", name).lower()


def _requirement_name(spec: str) -> str:
    import re

    return _normal(re.split(r"[\s<>=!~;\[]", spec.strip(), maxsplit=1)[0])


@functools.cache
def _files(dist: str) -> tuple[str, ...]:
    from importlib.metadata import distribution

    return tuple(str(f) for f in distribution(dist).files or [])


@functools.cache
def _top_levels() -> dict[str, list[str]]:
    from importlib.metadata import packages_distributions

    return packages_distributions()


def _distributions(module: str) -> set[str]:
    """The installed distributions that provide ``module``; for a namespace shared by several (``google``,
    ``opentelemetry``) the one whose files hold the deepest matching subpackage (``google/protobuf``)."""
    parts = module.split(".")
    candidates = {_normal(d) for d in _top_levels().get(parts[0], [])}
    if len(candidates) > 1:
        for depth in range(len(parts), 1, -1):
            prefix = "/".join(parts[:depth])
            owners = {d for d in candidates
                      if any(f.startswith(prefix + "/") or f == prefix + ".py" for f in _files(d))}
            if owners:
                return owners
    return candidates


def _third_party(folders, first_party: set[str]) -> dict[str, dict[str, bool]]:
    """top-level-qualified module -> {source file: imported only lazily there}, stdlib and first party left out."""
    import sys

    out: dict[str, dict[str, bool]] = {}
    for folder in folders:
        for source in sorted(folder.rglob("*.py")):
            for module, lazy in _imports(source):
                top = module.split(".")[0]
                if top in sys.stdlib_module_names or top in first_party | {"__future__"}:
                    continue
                where = out.setdefault(module, {})
                rel = str(source.relative_to(REPO))
                where[rel] = where.get(rel, True) and lazy
    return out


def test_runtime_dependencies_are_exactly_what_the_product_imports():
    """[project] dependencies == the distributions of the third-party modules the product imports (lazily too).

    CI installs only what pyproject declares, so an undeclared import fails there (this happened with
    orjson); a declared distribution nothing imports is weight every user installs for nothing (ijson
    was one, xxhash only the test bed's). Optional imports are listed in :data:`OPTIONAL_IMPORTS`, with
    the reason, and must be lazy.
    """
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    declared = {_requirement_name(d) for d in pyproject["project"]["dependencies"]}
    folders = {REPO / f for f in pyproject["tool"]["setuptools"]["package-dir"].values()}
    used: set[str] = set()
    missing: dict[str, list[str]] = {}
    eager_optional: list[str] = []
    for module, where in _third_party(folders, {"triscope"}).items():
        top = module.split(".")[0]
        if top in OPTIONAL_IMPORTS:
            eager_optional += [f"{path} imports {module} at module level" for path, lazy in where.items() if not lazy]
            continue
        dists = _distributions(module) & declared
        if not dists:
            missing[module] = sorted(where)
        used |= dists
    assert not missing, f"undeclared imports (add to [project] dependencies): {missing}"
    assert not declared - used, f"declared but never imported by the product: {sorted(declared - used)}"
    assert not eager_optional, "optional imports must be lazy:\n" + "\n".join(eager_optional)


def test_the_test_bed_declares_what_it_imports_beyond_the_product():
    """The bed's own imports come from its dependencies or, through ``triscope``, from the product's."""
    bed = tomllib.loads((BED / "pyproject.toml").read_text())["project"]
    product = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    declared = {_requirement_name(d) for d in bed["dependencies"]}
    assert "triscope" in declared
    available = declared | {_requirement_name(d) for d in product["dependencies"]}
    used: set[str] = set()
    missing: dict[str, list[str]] = {}
    for module, where in _third_party([BED / "triscope_bed"], {"triscope", "triscope_bed"}).items():
        dists = _distributions(module) & available
        if not dists:
            missing[module] = sorted(where)
        used |= dists
    assert not missing, f"undeclared imports (add to bed/pyproject.toml dependencies): {missing}"
    own = declared - {"triscope"}
    assert own <= used, f"declared by the bed but never imported: {sorted(own - used)}"


def test_data_files_of_packages_are_declared():
    """A non-Python file a package reads at run time (the HAProxy Lua gate) must be package data."""
    import fnmatch

    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    declared = config.get("package-data", {})
    for package, folder in config["package-dir"].items():
        for path in (REPO / folder).glob("*.lua"):
            patterns = declared.get(package, [])
            assert any(fnmatch.fnmatch(path.name, p) for p in patterns), f"{path.name}: add to package-data"
