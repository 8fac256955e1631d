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
