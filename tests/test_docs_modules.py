"""docs/modules.md has a line for every module under shoal/ (every .py but an `__init__.py`,
which may have one), and names no module that is not there. A module is named by its path in a row's first column; a bare
file name after a path in the same cell is a sibling (`shoal/a/b.py`, `c.py`). Rows for a whole
folder (`shoal/kernels/`) are overviews beside the modules' own lines."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def listed_modules(text: str) -> set[str]:
    listed = set()
    for line in text.splitlines():
        if not line.startswith("| `"):
            continue
        folder = ""
        for name in re.findall(r"`([^`]+)`", line.split("|")[1]):
            if "/" in name:
                folder, path = name.rsplit("/", 1)[0], name
            else:
                path = f"{folder}/{name}"
            if path.startswith("shoal/") and path.endswith(".py"):
                listed.add(path)
    return listed


def test_every_module_has_its_line_in_docs_modules() -> None:
    files = {p.relative_to(ROOT).as_posix() for p in (ROOT / "shoal").rglob("*.py")}
    modules = {path for path in files if not path.endswith("/__init__.py")}
    listed = listed_modules((ROOT / "docs" / "modules.md").read_text())
    assert sorted(modules - listed) == [], "modules without a line in docs/modules.md"
    assert sorted(listed - files) == [], "lines in docs/modules.md for modules that do not exist"


def test_the_rule_reads_sibling_names() -> None:
    rows = "| `shoal/a/b.py`, `c.py` | two |\n| `shoal/d/` | a folder |\n| `csrc/` | not python |"
    assert listed_modules(rows) == {"shoal/a/b.py", "shoal/a/c.py"}
