"""The README's Python blocks run as written, in order, in one fresh process (CPU here: the blocks
pick a tiny layer and float32 when there is no GPU). A block preceded by
`<!-- readme-test: skip (reason) -->` is left out; the reason names the test that covers it. The
README's backend table is the registry's own rendering of it, and its environment table
`moekit.env`'s."""

from __future__ import annotations

import re
import subprocess
import sys

from helpers import ROOT

README = ROOT / "README.md"
BLOCK = re.compile(r"(<!-- readme-test: skip[^>]*-->\s*\n)?```python\n(.*?)```", re.S)


def marked(name: str) -> str:
    """The README's text between `<!-- name -->` and `<!-- /name -->` (exactly one such span)."""
    spans = re.findall(rf"<!-- {name} -->\n(.*?)<!-- /{name} -->", README.read_text(encoding="utf-8"), re.S)
    assert len(spans) == 1, f"README needs one <!-- {name} --> ... <!-- /{name} --> span, found {len(spans)}"
    return spans[0]


def python_blocks() -> tuple[list[str], list[str]]:
    """(blocks to run, blocks skipped) in README order."""
    run, skipped = [], []
    for marker, code in BLOCK.findall(README.read_text(encoding="utf-8")):
        (skipped if marker else run).append(code)
    return run, skipped


def test_readme_python_blocks_run_as_written():
    run, skipped = python_blocks()
    assert run, "the README has no Python block to run"
    assert len(skipped) <= 2, "a skipped block must be the exception"
    res = subprocess.run([sys.executable, "-c", "\n".join(run)], capture_output=True, text=True,
                         timeout=600, cwd=README.parent)
    assert res.returncode == 0, res.stderr[-4000:]


def test_readme_backend_table_is_the_registrys():
    from moekit.experts.registry import capability_table  # its package registers the backends

    assert marked("backend-table") == capability_table()


def test_readme_env_table_is_moekit_envs():
    from moekit import env

    assert marked("env-table") == env.markdown_table().rstrip("\n") + "\n"
