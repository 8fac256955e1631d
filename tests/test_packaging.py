"""Every package folder is listed in pyproject (a non-editable install would miss it otherwise)."""

from __future__ import annotations

import tomllib

from conftest import REPO


def test_all_packages_are_listed():
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    mapping = config["package-dir"]
    found = set()
    for package, folder in mapping.items():
        root = REPO / folder
        for init in root.rglob("__init__.py"):
            rel = init.parent.relative_to(root)
            parts = [] if str(rel) == "." else list(rel.parts)
            found.add(".".join([package, *parts]))
    assert found <= listed, f"add to pyproject [tool.setuptools] packages: {sorted(found - listed)}"


def _top_level_imports(path) -> set[str]:
    """Absolute top-level module names a source file imports (anywhere, lazily included)."""
    import ast

    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def _requirement_name(spec: str) -> str:
    import re

    return re.split(r"[\s<>=!~;\[]", spec.strip(), maxsplit=1)[0].lower().replace("_", "-")


def test_every_third_party_import_is_a_declared_dependency():
    """A module imported by the package (even lazily) must come from a declared dependency.

    CI installs only what pyproject declares; an undeclared import that happens to be in a
    developer's venv fails there (this happened with orjson).
    """
    import sys
    from importlib.metadata import packages_distributions

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    declared = {_requirement_name(d) for d in project["dependencies"]}
    dist_of = {mod: {d.lower().replace("_", "-") for d in dists}
               for mod, dists in packages_distributions().items()}
    folders = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"].values()
    missing: dict[str, set[str]] = {}
    for folder in set(folders):
        for source in (REPO / folder).rglob("*.py"):
            for name in _top_level_imports(source):
                if name in sys.stdlib_module_names or name in {"triscope", "__future__"}:
                    continue
                dists = dist_of.get(name, set())
                if not dists & declared and name not in {"torch"}:
                    # torch: the user's own install (CPU or CUDA build); collectors using it handle absence.
                    missing.setdefault(name, set()).add(str(source.relative_to(REPO)))
    assert not missing, f"undeclared imports (add to [project] dependencies): {missing}"


def test_data_files_of_packages_are_declared():
    """A non-Python file a package reads at run time (the HAProxy Lua gate) must be package data."""
    import fnmatch

    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    declared = config.get("package-data", {})
    for package, folder in config["package-dir"].items():
        for path in (REPO / folder).glob("*.lua"):
            patterns = declared.get(package, [])
            assert any(fnmatch.fnmatch(path.name, p) for p in patterns), f"{path.name}: add to package-data"
