"""Run mypy over the one ``triscope`` namespace, whose subpackages live in top-level folders.

pyproject maps ``triscope.collectors`` to ``collectors/`` (and so on); mypy cannot follow the
editable install's import hook, so this lays the namespace out as symlinks under
``var/typecheck`` and reports errors with the real paths. The test bed (``bed/triscope_bed``, a
package of its own) is checked in the same run, against the product's types.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MAPPED = {"collectors": "collectors", "analyzers": "analyzers", "exporters": "exporters",
          "dashboards": "dashboards"}


def build_tree(root: Path) -> Path:
    pkg = root / "triscope"
    if root.exists():
        shutil.rmtree(root)
    pkg.mkdir(parents=True)
    for entry in (REPO / "triscope").iterdir():
        if entry.name != "__pycache__":
            (pkg / entry.name).symlink_to(entry)
    for name, folder in MAPPED.items():
        if (REPO / folder / "__init__.py").exists():
            (pkg / name).symlink_to(REPO / folder)
    return root


def main() -> int:
    root = build_tree(REPO / "var" / "typecheck")
    env = {**os.environ, "MYPYPATH": os.pathsep.join([str(root), str(REPO / "bed")])}
    proc = subprocess.run([sys.executable, "-m", "mypy", "--config-file", str(REPO / "pyproject.toml"),
                           "-p", "triscope", "-p", "triscope_bed"], cwd=REPO, env=env, capture_output=True, text=True)
    out = proc.stdout.replace(str(root / "triscope") + "/", "")
    prefix = "var/typecheck/triscope/"
    lines = []
    for line in out.splitlines():
        if line.startswith(prefix):
            rest = line[len(prefix):]
            top = rest.split("/", 1)[0]
            line = rest if top in MAPPED else "triscope/" + rest
        lines.append(line)
    print("\n".join(lines))
    sys.stderr.write(proc.stderr)
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
