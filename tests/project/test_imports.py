"""The package's module graph: every module imports in a fresh interpreter, and the imports made at
module level (not inside functions) form no cycle."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import moekit

SRC = Path(moekit.__file__).resolve().parent


def module_names() -> dict[str, Path]:
    """{dotted name: file} of every module of the package."""
    names = {}
    for path in sorted(SRC.rglob("*.py")):
        parts = ("moekit", *path.relative_to(SRC).with_suffix("").parts)
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def _top_level_imports(tree: ast.Module):
    """The import statements that run when the module is imported: outside any function or class
    body and any `if TYPE_CHECKING:` block (inside another if / try / with at module level they count)."""
    todo = list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
        elif isinstance(node, ast.If) and ast.unparse(node.test).endswith("TYPE_CHECKING"):
            todo.extend(node.orelse)
        elif not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            todo.extend(child for child in ast.iter_child_nodes(node) if isinstance(child, ast.stmt))


def import_graph() -> dict[str, set[str]]:
    """{module: the moekit modules its module-level imports load}."""
    modules = module_names()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges = graph.setdefault(name, set())
        for node in _top_level_imports(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:
                    base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1]
                                    + ([base] if base else []))
                # `from pkg import sub` loads pkg.sub when sub is a module, else pkg alone
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                           for alias in node.names]
            edges.update(t for t in targets if t in modules and t != name)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One cycle of graph as [a, b, ..., a], or [] when it is acyclic."""
    state: dict[str, int] = {}       # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return []

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return []


def test_the_module_level_imports_form_no_cycle():
    graph = import_graph()
    assert "moekit.align" in graph["moekit.grouped_gemm"]          # the graph sees real edges
    assert find_cycle(graph) == [], " -> ".join(find_cycle(graph))


def test_find_cycle_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) == []


def test_every_module_imports_in_a_fresh_interpreter():
    names = sorted(set(module_names()) - {"moekit.__main__"})       # that one runs the CLI
    code = f"import importlib\nfor name in {names!r}:\n    importlib.import_module(name)\n"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(SRC.parent)})
    assert done.returncode == 0, done.stderr[-3000:]
