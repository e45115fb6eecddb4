"""The package's import picture (issue 17): three rooms joined only by the engine, no circle.

Every ``import`` of a ``dkfac`` module is read from the source with ``ast``, including
imports deferred into functions and those under ``TYPE_CHECKING``, so a cycle cannot hide.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = SRC / "dkfac"

ROOMS = ("dkfac.blocks", "dkfac.solvers", "dkfac.distributed")
"""The three axes: each imports nothing of the package outside itself."""
LIBRARY_ROOT = {"__init__", "__main__", "config", "preconditioner", "optimizer"}
"""The public faces at the package root (``config`` is a package of its groups)."""
PACKAGES = {"app", "bench", "blocks", "config", "costmodel", "distributed", "engine", "solvers"}


def _module_name(path: Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports() -> dict[str, set[str]]:
    """Module -> the dkfac modules it imports anywhere in its source."""
    graph: dict[str, set[str]] = {}
    modules = {_module_name(p) for p in PACKAGE.rglob("*.py")}
    for path in PACKAGE.rglob("*.py"):
        name = _module_name(path)
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                # "from dkfac.x import y" may name a submodule y.
                targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            found.update(t for t in targets if t in modules and t.startswith("dkfac"))
        graph[name] = found - {name}
    return graph


GRAPH = _imports()


def _room(module: str) -> str | None:
    return next((r for r in ROOMS if module == r or module.startswith(r + ".")), None)


def test_the_package_root_holds_only_the_public_faces() -> None:
    loose = {p.stem for p in PACKAGE.glob("*.py")}
    packages = {p.parent.name for p in PACKAGE.glob("*/__init__.py")}
    assert loose | {"config"} == LIBRARY_ROOT
    assert packages == PACKAGES


@pytest.mark.parametrize("room", ROOMS)
def test_a_room_imports_nothing_of_the_package_outside_itself(room: str) -> None:
    outside = {
        (module, target)
        for module, targets in GRAPH.items()
        if _room(module) == room
        for target in targets
        if _room(target) != room and target != "dkfac"
    }
    assert not outside, f"{room} reaches outside: {sorted(outside)}"


def test_the_library_never_imports_the_app_or_the_benchmarks() -> None:
    front = ("dkfac.app", "dkfac.bench")
    bad = {
        (module, target)
        for module, targets in GRAPH.items()
        if not module.startswith(front)
        for target in targets
        if target.startswith(front) and module != "dkfac.__main__"
    }
    assert not bad, sorted(bad)


def test_no_import_cycle() -> None:
    # Package __init__ files re-export their submodules; an edge into a package's
    # __init__ from its own submodule is not followed (Python imports the package first).
    def edges(module: str) -> set[str]:
        return {t for t in GRAPH[module] if not module.startswith(t + ".")}

    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(module: str) -> None:
        state[module] = 1
        stack.append(module)
        for target in sorted(edges(module)):
            if state.get(target) == 1:
                cycle = [*stack[stack.index(target) :], target]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if target not in state:
                visit(target)
        stack.pop()
        state[module] = 2

    for module in sorted(GRAPH):
        if module not in state:
            visit(module)
