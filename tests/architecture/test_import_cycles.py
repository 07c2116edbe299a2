"""No import cycle among the project's own Python modules (issue 36), type-checking imports included.

Every ``import`` and ``from ... import`` statement in ``src/gpufleet`` and ``src/gpufleet_harness`` counts,
wherever it stands: at module level, under ``if TYPE_CHECKING:``, in a ``try``, or inside a function (a
deferred import hides a loop from the interpreter, not from a reader). Each becomes an edge from the module
it stands in to the project module it names: ``from a.b import c`` goes to ``a.b.c`` when that is a module,
else to ``a.b``; relative imports are resolved against the importing module's package. Importing a module
does not count as importing its parent packages (an ``__init__`` that re-exports its submodules would
otherwise be a cycle with each of them).

Run as a script (``python tests/architecture/test_import_cycles.py``) it prints every cycle it finds.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"
PACKAGES = ("gpufleet", "gpufleet_harness")


def project_modules(src: Path = SRC, packages: tuple[str, ...] = PACKAGES) -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` file under the given top-level packages."""
    modules: dict[str, Path] = {}
    for package in packages:
        for path in sorted((src / package).rglob("*.py")):
            parts = list(path.relative_to(src).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


def _imported_names(tree: ast.AST, module: str, is_package: bool) -> Iterator[str]:
    """Every absolute dotted name an import in ``tree`` may refer to (a module, or a module + '.' + name)."""
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = package.split(".")
                if node.level - 1 >= len(base_parts):
                    raise ValueError(f"{module}: relative import (level {node.level}) beyond its top package")
                base = ".".join(base_parts[: len(base_parts) - (node.level - 1)])
                base = f"{base}.{node.module}" if node.module else base
            else:
                base = node.module or ""
            for alias in node.names:
                yield f"{base}.{alias.name}" if alias.name != "*" else base


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The longest prefix of ``name`` that is a project module, or None (stdlib, third party)."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        candidate = ".".join(parts[:end])
        if candidate in modules:
            return candidate
    return None


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the project modules it imports (self-edges dropped)."""
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        names = _imported_names(tree, module, is_package=path.name == "__init__.py")
        targets = {_resolve(name, modules) for name in names}
        graph[module] = {t for t in targets if t is not None and t != module}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan's algorithm, iterative), each
    sorted, the list sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work: list[tuple[str, Iterator[str]]] = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, successors = work[-1]
            for succ in successors:
                if succ not in index:
                    index[succ] = low[succ] = counter
                    counter += 1
                    stack.append(succ)
                    on_stack.add(succ)
                    work.append((succ, iter(sorted(graph[succ]))))
                    break
                if succ in on_stack:
                    low[node] = min(low[node], index[succ])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return sorted(found)


# -- the walker's own rules, on a small tree written here --------------------------------------------------
def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_the_walker_finds_type_checking_relative_and_deferred_imports(tmp_path: Path) -> None:
    _write(
        tmp_path,
        {
            "pkg/__init__.py": "from pkg import a\n",
            "pkg/a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.b import B\n",
            "pkg/b.py": "from . import c\n",
            "pkg/c.py": "def f():\n    from .a import x\n",
            "pkg/sub/__init__.py": "",
            "pkg/sub/d.py": "from ..e import y\nimport os.path\n",
            "pkg/e.py": "from .sub import d\n",
            "pkg/f.py": "import pkg.a\n",
        },
    )
    modules = project_modules(tmp_path, ("pkg",))
    graph = import_graph(modules)
    assert graph["pkg"] == {"pkg.a"}
    assert graph["pkg.a"] == {"pkg.b"}  # under TYPE_CHECKING
    assert graph["pkg.b"] == {"pkg.c"}  # `from . import c`: the submodule, not the package
    assert graph["pkg.c"] == {"pkg.a"}  # inside a function
    assert graph["pkg.sub.d"] == {"pkg.e"}  # two levels up; os.path is not the project's
    assert graph["pkg.e"] == {"pkg.sub.d"}
    assert graph["pkg.f"] == {"pkg.a"}  # no edge to the parent package `pkg`
    assert cycles(graph) == [["pkg.a", "pkg.b", "pkg.c"], ["pkg.e", "pkg.sub.d"]]


# The cycles left, each to be removed, never added to (none since session 17: k8s_build and k8s_modbuild share
# k8s_cache instead of importing each other).
KNOWN_CYCLES: list[list[str]] = []


def test_no_import_cycle_in_the_project_but_the_known_ones() -> None:
    modules = project_modules()
    assert "gpufleet_harness.cluster.node" in modules and "gpufleet.extender.scheduling" in modules
    graph = import_graph(modules)
    assert "gpufleet_harness.cluster.cluster" in graph["gpufleet_harness.cluster.cli"]  # edges are found
    assert "gpufleet_harness.cluster.cluster" not in graph["gpufleet_harness.cluster.node"]  # issue 36's loop
    found = cycles(graph)
    assert found == KNOWN_CYCLES, "import cycles (each a strongly connected component):\n" + "\n".join(
        " <-> ".join(component) for component in found
    )


if __name__ == "__main__":
    components = cycles(import_graph(project_modules()))
    for component in components:
        print(" <-> ".join(component), "(known)" if component in KNOWN_CYCLES else "(NEW)")
    sys.exit(1 if components != KNOWN_CYCLES else 0)
