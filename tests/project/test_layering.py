"""The tree's two layers: the runtime core never imports the lab, matplotlib or rich, and no two
top-level modules of moekit import each other (directly or through others)."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import ROOT

SRC = ROOT / "src" / "moekit"
LAB = {"bench", "cli", "__main__"}          # the lab and its command line


def test_runtime_imports_with_the_lab_blocked():
    code = (
        "import sys\n"
        "BLOCKED = ('moekit.bench', 'moekit.cli', 'matplotlib', 'rich')\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if any(name == b or name.startswith(b + '.') for b in BLOCKED):\n"
        "            raise ImportError('blocked: ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "import moekit, moekit.layer, moekit.ops, moekit.parallel, moekit.placement, moekit.grouped_gemm\n"
        "import moekit.integrations.transformers\n"
        "import torch\n"
        "layer = moekit.MoELayer('tiny')\n"
        "with torch.no_grad():\n"
        "    y = layer(torch.randn(3, 64))\n"
        "assert y.shape == (3, 64)\n"
        "loaded = [m for m in sys.modules if any(m == b or m.startswith(b + '.') for b in BLOCKED)]\n"
        "assert not loaded, loaded\n"
        "print('ok')\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip().endswith("ok")


def _top(module: str) -> str | None:
    """moekit.X.Y -> X; None for anything outside moekit or the package root itself."""
    parts = module.split(".")
    return parts[1] if parts[0] == "moekit" and len(parts) > 1 else None


def _imports(path: Path) -> set[str]:
    """Top-level moekit modules imported anywhere in the file (function-level imports too)."""
    rel = path.relative_to(SRC.parent).with_suffix("")
    package = ".".join(rel.parts[:-1])
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            # `from moekit import ops` imports the module moekit.ops
            names = [f"{mod}.{a.name}" for a in node.names] if mod == "moekit" else [mod]
        else:
            continue
        found |= {t for t in map(_top, names) if t is not None}
    return found


def _graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for path in SRC.rglob("*.py"):
        rel = path.relative_to(SRC)
        if rel.parts == ("__init__.py",):
            continue                              # the package root re-exports the public API
        top = rel.parts[0].removesuffix(".py")
        graph.setdefault(top, set()).update(_imports(path) - {top})
    return graph


def test_core_never_imports_the_lab():
    offenders = {m: sorted(deps & LAB) for m, deps in _graph().items() if m not in LAB and deps & LAB}
    assert not offenders, f"runtime modules importing the lab: {offenders}"


def test_no_import_cycle_between_top_level_modules():
    graph = _graph()
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for d in sorted(graph.get(m, ())):
            if state.get(d) == 1:
                pytest.fail("import cycle: " + " -> ".join(stack[stack.index(d):] + [d]))
            if d not in state:
                visit(d)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)


def test_import_moekit_is_lazy():
    """`import moekit` (and so `moekit --help`) loads neither torch nor Triton; the API loads on use."""
    code = (
        "import sys, moekit\n"
        "assert 'torch' not in sys.modules and 'triton' not in sys.modules, 'eager import'\n"
        "assert moekit.__version__\n"
        "try:\n"
        "    moekit.nosuch\n"
        "except AttributeError as e:\n"
        "    assert 'nosuch' in str(e)\n"
        "assert moekit.MoELayer.__module__ == 'moekit.layer' and 'torch' in sys.modules\n"
        "print('ok')\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "ok"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter switch is for machines without CUDA")
def test_triton_path_runs_on_the_cpu_in_a_fresh_process():
    """The interpreter switch holds whatever moekit module is imported first (here align, which
    imports triton at once), not only through the test suite's conftest."""
    code = (
        "import torch\n"
        "import moekit.align\n"
        "import moekit\n"
        "from moekit.reference import moe_experts_ref\n"
        "x, gu, d = torch.randn(5, 32), torch.randn(4, 32, 32) / 6, torch.randn(4, 32, 16) / 4\n"
        "ids, w = torch.tensor([[0, 1], [2, 3], [1, 2], [3, 0], [0, 2]]), torch.rand(5, 2)\n"
        "with torch.no_grad():\n"
        "    out = moekit.moe_experts(x, gu, d, w, ids, backend='triton')\n"
        "ref = moe_experts_ref(x, gu, d, w, ids)\n"
        "assert ((out - ref).norm() / ref.norm()).item() < 1e-5\n"
        "print('ok')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip().endswith("ok")
