"""The import graph follows the process order: the engine core is plain Python, and the workers
and executors see only the step's wire (`shoal/step.py`), never the engine core.

Read from the source with `ast`: every import statement counts for "who imports whom"; for
"does it load torch", only the imports that run when a module is imported (not those inside a
function, nor under `if TYPE_CHECKING:`), followed through the package.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import shoal

PACKAGE_DIR = Path(shoal.__file__).parent
NO_TORCH = ("shoal.engine_core", "shoal.step", "shoal.protocol")


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in PACKAGE_DIR.rglob("*.py")}


def modules_under(package: str) -> list[str]:
    return sorted(name for name in MODULES if name == package or name.startswith(package + "."))


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _import_nodes(body: list[ast.stmt], at_import_time: bool) -> Iterator[ast.Import | ast.ImportFrom]:
    """The import statements of `body`; with `at_import_time`, only those that run when the
    module is imported (not in functions or classes' methods, not under TYPE_CHECKING)."""
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif at_import_time and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        elif at_import_time and isinstance(node, ast.If) and _is_type_checking(node):
            yield from _import_nodes(node.orelse, at_import_time)
        else:
            for field in ("body", "orelse", "finalbody", "handlers"):
                children = getattr(node, field, None)
                if isinstance(children, list):
                    yield from _import_nodes(children, at_import_time)


def _with_parents(name: str) -> set[str]:
    parts = name.split(".")
    return {".".join(parts[: i + 1]) for i in range(len(parts))}


@cache
def imports_of(module: str, at_import_time: bool) -> frozenset[str]:
    """The modules `module` imports (absolute names; a package's parents count, as Python
    imports them too)."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names: set[str] = set()
    for node in _import_nodes(ast.parse(path.read_text()).body, at_import_time):
        if isinstance(node, ast.Import):
            for alias in node.names:
                names |= _with_parents(alias.name)
            continue
        base = node.module or ""
        if node.level:
            anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
            base = f"{anchor}.{base}" if base else anchor
        names |= _with_parents(base)
        for alias in node.names:
            if f"{base}.{alias.name}" in MODULES:  # `from package import module`
                names.add(f"{base}.{alias.name}")
    return frozenset(names)


def loaded_at_import(module: str) -> set[str]:
    """Every module importing `module` loads, following shoal's own modules."""
    seen, todo = set(), [module, *_with_parents(module)]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        if name in MODULES:
            todo.extend(imports_of(name, at_import_time=True))
    return seen


def test_workers_and_executors_do_not_import_the_engine_core() -> None:
    offenders = {
        module: sorted(
            name for name in imports_of(module, at_import_time=False) if name.startswith("shoal.engine_core")
        )
        for package in ("shoal.workers", "shoal.executors")
        for module in modules_under(package)
    }
    assert {module: names for module, names in offenders.items() if names} == {}


def test_the_engine_core_loads_no_torch_by_its_imports() -> None:
    modules = [m for package in NO_TORCH for m in modules_under(package)]
    assert "shoal.engine_core.engine_core" in modules and "shoal.engine_core.scheduler" in modules
    offenders = {}
    for module in modules:
        heavy = sorted(name for name in loaded_at_import(module) if name.split(".")[0] == "torch")
        if heavy:
            offenders[module] = heavy
    assert offenders == {}


def test_importing_the_engine_core_leaves_torch_unloaded() -> None:
    modules = [m for package in NO_TORCH for m in modules_under(package)]
    code = "import importlib, sys\n"
    code += "".join(f"importlib.import_module({m!r})\n" for m in modules)
    code += "print('torch' in sys.modules)\n"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert result.stdout.strip() == "False"


def test_the_parser_tells_import_time_from_later_imports() -> None:
    source = (
        "from typing import TYPE_CHECKING\n"
        "import torch\n"
        "from shoal.engine_core import scheduler\n"
        "if TYPE_CHECKING:\n    import numpy\n"
        "def f():\n    import zmq\n"
    )
    body = ast.parse(source).body
    at_import = {a.name for n in _import_nodes(body, True) if isinstance(n, ast.Import) for a in n.names}
    every = {a.name for n in _import_nodes(body, False) if isinstance(n, ast.Import) for a in n.names}
    assert at_import == {"torch"}
    assert every == {"torch", "numpy", "zmq"}
