"""The product, its docs and its code speak of the product only: no issue numbers, no work periods.

Measurement history lives in dated files under ``bench/results/``, which are exempt; a citation of
another project's issue tracker (``NVIDIA/dcgm-exporter issues #272``) is a fact from elsewhere and
allowed.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TEXT_SUFFIXES = {".py", ".md", ".lua", ".toml", ".txt", ".yml", ".yaml", ".cfg", ".sh", ".json"}
SKIP_DIRS = {".git", ".venv", "var", "node_modules", "__pycache__", ".pytest_cache", ".mypy_cache",
             ".ruff_cache", "data"}
EXEMPT = {Path("bench/results"), Path("tests/test_product_speaks_of_product.py")}

ORDINAL = r"(?:first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|this|last|previous|earlier|later|next)"
FORBIDDEN = [
    (re.compile(r"\b[Ii]ssues?\s+#?\d+"), "an issue number"),
    (re.compile(rf"\b{ORDINAL}\s+session\b", re.IGNORECASE), "a work session"),
    (re.compile(r"\bsession of 20\d\d", re.IGNORECASE), "a work session"),
    (re.compile(r"\bwork periods?\b", re.IGNORECASE), "a work period"),
]
# ``owner/repo issues #N``: a citation of another project's tracker.
FOREIGN_TRACKER = re.compile(r"[\w.-]+/[\w.-]+ (?:issues?|PRs?) #?\d+")


def _product_files() -> list[Path]:
    files = []
    for path in ROOT.rglob("*"):
        rel = path.relative_to(ROOT)
        if any(part in SKIP_DIRS or part.endswith(".egg-info") for part in rel.parts):
            continue
        if any(rel == ex or ex in rel.parents for ex in EXEMPT):
            continue
        if path.is_file() and (path.suffix in TEXT_SUFFIXES or path.name in {"Makefile", "run"}):
            files.append(path)
    return files


def find_history_talk(text: str) -> list[tuple[int, str]]:
    """(line number, what) for every place that speaks of issues or work periods (across a line break too)."""
    cleaned = FOREIGN_TRACKER.sub(lambda m: " " * len(m.group()), text.replace("\n", " "))
    found = set()
    for pattern, what in FORBIDDEN:
        for m in pattern.finditer(cleaned):
            found.add((text.count("\n", 0, m.start()) + 1, what))
    return sorted(found)


def test_the_patterns_catch_history_talk_and_spare_citations() -> None:
    assert find_history_talk("the targets of issue 21 are not met") == [(1, "an issue number")]
    assert find_history_talk("Issue 23 item 5: a slow body") == [(1, "an issue number")]
    assert find_history_talk("since the seventh session of 2026-12-06") != []
    assert find_history_talk("numbered by work period") == [(1, "a work period")]
    assert find_history_talk("after a step (issue\n19), so") == [(1, "an issue number")]
    assert find_history_talk("users posted in NVIDIA/dcgm-exporter issues #272, #317") == []
    assert find_history_talk("pytest's session fixture; HAProxy sessions; session_id") == []


def test_no_product_file_names_issues_or_work_periods() -> None:
    offenders = []
    for path in _product_files():
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        offenders += [f"{path.relative_to(ROOT)}:{line}: {what}" for line, what in find_history_talk(text)]
    assert not offenders, "history talk belongs in bench/results/:\n" + "\n".join(offenders)
