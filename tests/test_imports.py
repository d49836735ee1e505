"""Habits a machine can check: no import cycle among our modules, and no import of another module's private name.

Both read the source (every `import` and `from … import`, at module level or inside a function: a function-level
import that closes a loop is still a loop, only hidden), so they cost no imports and name the offending lines."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("api", "core", "worker", "ops", "tests")


def our_modules() -> dict[str, Path]:
    modules = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def imports(path: Path, modules: dict[str, Path]) -> list[tuple[int, str, str | None]]:
    """(line, module, name) for each import of one of our modules; `name` is the imported name of a `from`."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name, None) for a in node.names if a.name in modules]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module in modules:
            for alias in node.names:
                child = f"{node.module}.{alias.name}"
                found.append((node.lineno, child, None) if child in modules else (node.lineno, node.module, alias.name))
    return found


def test_no_import_cycles_among_our_modules():
    """A module never imports, directly or through others, a module that imports it back (packages' __init__ excluded
    as targets: importing `worker.x` runs `worker/__init__`, which imports nothing of ours)."""
    modules = our_modules()
    graph = {
        m: sorted(
            {target for _, target, _ in imports(p, modules) if target != m and modules[target].name != "__init__.py"}
        )
        for m, p in modules.items()
    }
    cycles, state = [], {}

    def visit(module: str, path: list[str]) -> None:
        state[module] = "open"
        for target in graph[module]:
            if state.get(target) == "open":
                cycles.append(" -> ".join(path[path.index(target) :] + [target]))
            elif target not in state:
                visit(target, [*path, target])
        state[module] = "done"

    for module in graph:
        if module not in state:
            visit(module, [module])
    assert not cycles, "import cycles (break them by moving the shared code down a layer):\n" + "\n".join(cycles)


def test_no_module_imports_another_modules_private_names():
    """`from core.x import _helper` reaches into another module's internals: make the name public (and part of that
    module's contract) or move the code."""
    modules = our_modules()
    private = [
        f"{path.relative_to(ROOT)}:{line}: from {module} import {name}"
        for m, path in modules.items()
        for line, module, name in imports(path, modules)
        if name and name.startswith("_") and not name.startswith("__") and module != m
    ]
    assert not private, "imports of private names:\n" + "\n".join(private)
