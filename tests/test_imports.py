"""The package's import graph, read from the source (ast; nothing is imported or run): no cycle
between modules, and no command module importing the entry module that mounts it. Imports inside
functions count (they are arrows too, only later); those under `if TYPE_CHECKING:` do not."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# The installed package's modules and where their source lives (pyproject's package-dir).
PACKAGES = {"cachedoctor": ROOT / "cachedoctor", "cachedoctor.checks": ROOT / "checks",
            "cachedoctor.fixtures": ROOT / "fixtures"}
ENTRY = "cachedoctor.cli"  # the entry module: only `python -m cachedoctor` imports it


def modules() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for package, folder in PACKAGES.items():
        for path in sorted(folder.rglob("*.py")):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join([package, *parts])] = path
    return found


def _runtime_nodes(tree: ast.AST) -> list[ast.AST]:
    """Every node outside `if TYPE_CHECKING:` blocks."""
    out: list[ast.AST] = []
    todo = [tree]
    while todo:
        node = todo.pop()
        out.append(node)
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                todo.extend(child.orelse)
            else:
                todo.append(child)
    return out


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The package's modules `name` imports (a name imported from a package is its module when
    it is one, else the package)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in _runtime_nodes(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            for alias in node.names:
                out.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base)
    return {m for m in out if m in known and m != name}


def graph() -> dict[str, set[str]]:
    found = modules()
    return {name: imports_of(name, path, set(found)) for name, path in found.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return out


def test_the_walk_sees_the_package_and_its_arrows() -> None:
    edges = graph()
    assert {"cachedoctor.cli", "cachedoctor.checks.unsafe_pickle", "cachedoctor.repair.apply"} <= set(edges)
    assert "cachedoctor.cli_usage" in edges["cachedoctor.cli"]
    assert "cachedoctor.fix_kinds" in edges["cachedoctor.repair.apply"]


def test_no_import_cycle_between_modules() -> None:
    assert cycles(graph()) == []


def test_no_module_imports_the_entry_module() -> None:
    importers = sorted(name for name, targets in graph().items() if ENTRY in targets)
    assert importers == ["cachedoctor.__main__"]


@pytest.mark.parametrize(("edges", "expected"), [
    ({"a": {"b"}, "b": {"c"}, "c": set()}, []),
    ({"a": {"b"}, "b": {"a"}, "c": {"a"}}, [["a", "b"]]),
    ({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"d"}}, [["a", "b", "c"]]),
])
def test_the_cycle_finder_finds_cycles(edges: dict[str, set[str]], expected: list[list[str]]) -> None:
    assert cycles(edges) == expected
