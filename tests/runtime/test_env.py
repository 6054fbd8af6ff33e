"""moekit.env: the table of environment switches and its parser; the runtime reads MOEKIT_* nowhere else."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from moekit import env

SRC = Path(env.__file__).resolve().parent
FLAGS = [s.name for s in env.SWITCHES if s.type == "flag"]
NAME = re.compile(r"MOEKIT_[A-Z0-9_]+")
READERS = ("os.environ.get", "os.getenv")


def test_the_table_names_each_switch_once_with_a_meaning():
    names = [s.name for s in env.SWITCHES]
    assert len(names) == len(set(names))
    for s in env.SWITCHES:
        assert NAME.fullmatch(s.name) and s.meaning and s.read in ("import", "call")
        if s.type == "flag":
            assert s.default in ("0", "1") and s.blank in ("0", "1")


@pytest.mark.parametrize("name", FLAGS)
@pytest.mark.parametrize("value", ["2", "maybe", "1 0", "-1"])
def test_a_bad_flag_value_is_an_error_naming_the_variable(monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=re.escape(f"${name}") + ".*" + re.escape(repr(value))):
        env.flag(name)


@pytest.mark.parametrize("value, on", [("1", True), ("0", False), (" 0 ", False), ("yes", True),
                                       ("TRUE", True), ("on", True), ("off", False), ("No", False),
                                       ("false", False)])
def test_flag_values(monkeypatch, value, on):
    for name in FLAGS:
        monkeypatch.setenv(name, value)
        assert env.flag(name) is on, name


def test_unset_is_the_default_and_empty_the_blank_value(monkeypatch):
    for s in env.SWITCHES:
        if s.type != "flag":
            continue
        monkeypatch.delenv(s.name, raising=False)
        assert env.flag(s.name) is (s.default == "1"), s.name
        monkeypatch.setenv(s.name, "")
        assert env.flag(s.name) is (s.blank == "1"), s.name
    # As the modules read them before the table: empty keeps the direct decode path on, PDL off.
    assert env.flag("MOEKIT_DECODE_DIRECT") and not env.flag("MOEKIT_PDL")


def test_text_switches_are_stripped_and_empty_when_unset(monkeypatch):
    monkeypatch.delenv("MOEKIT_WGRAD_TILES", raising=False)
    assert env.text("MOEKIT_WGRAD_TILES") == ""
    monkeypatch.setenv("MOEKIT_WGRAD_TILES", "  block_m=32 ")
    assert env.text("MOEKIT_WGRAD_TILES") == "block_m=32"


def test_names_and_types_are_checked():
    with pytest.raises(KeyError, match="MOEKIT_NO_SUCH"):
        env.flag("MOEKIT_NO_SUCH")
    with pytest.raises(TypeError, match="MOEKIT_CONFIG_DIR"):
        env.flag("MOEKIT_CONFIG_DIR")
    with pytest.raises(TypeError, match="MOEKIT_PDL"):
        env.text("MOEKIT_PDL")


def test_markdown_table_has_a_row_per_switch():
    lines = env.markdown_table().splitlines()
    assert lines[0].startswith("| Variable |") and len(lines) == len(env.SWITCHES) + 2
    for s, line in zip(env.SWITCHES, lines[2:]):
        assert line.startswith(f"| `{s.name}` | {s.type} |") and s.meaning in line


def _runtime_modules() -> list[Path]:
    """Every module of the package but the lab's (`moekit.bench`, which reads its own switches)."""
    return [p for p in sorted(SRC.rglob("*.py")) if "bench" not in p.relative_to(SRC).parts]


def test_every_switch_the_runtime_names_is_in_the_table():
    names = {s.name for s in env.SWITCHES}
    for path in _runtime_modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and NAME.fullmatch(node.value):
                # A prefix (the torch / Triton path switches' "MOEKIT_EP") names the switches under it.
                assert node.value in names or any(n.startswith(node.value + "_") for n in names), (
                    f"{path.relative_to(SRC)} names {node.value}, which moekit.env.SWITCHES lacks")


def _environment_reads(tree: ast.AST):
    """The name argument of every read of os.environ in tree (get, getenv, [name], name in)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and ast.unparse(node.func).lstrip("_") in READERS:
            yield node.args[0]
        elif isinstance(node, ast.Subscript) and ast.unparse(node.value).lstrip("_") == "os.environ":
            yield node.slice
        elif isinstance(node, ast.Compare) and any(ast.unparse(c).lstrip("_") == "os.environ"
                                                   for c in node.comparators):
            yield node.left


def test_only_env_reads_the_environment_for_a_moekit_switch():
    """Outside moekit.env the runtime reads only other programs' variables, by a literal name."""
    for path in _runtime_modules():
        if path == SRC / "env.py":
            continue
        for arg in _environment_reads(ast.parse(path.read_text())):
            literal = isinstance(arg, ast.Constant) and isinstance(arg.value, str)
            assert literal and not arg.value.startswith("MOEKIT_"), (
                f"{path.relative_to(SRC)} reads {ast.unparse(arg)} from os.environ; read it with moekit.env")


def test_changed_lists_only_switches_set_away_from_their_default(monkeypatch):
    for s in env.SWITCHES:
        monkeypatch.delenv(s.name, raising=False)
    assert env.changed() == ""
    monkeypatch.setenv("MOEKIT_GLUON_FP8", "no")             # default on: a change
    monkeypatch.setenv("MOEKIT_PDL", " 1 ")                  # the default: not a change
    monkeypatch.setenv("MOEKIT_DECODE_DIRECT", "")           # empty stands for 1, the default
    monkeypatch.setenv("MOEKIT_WGRAD_TILES", " block_m=32 ")
    monkeypatch.setenv("MOEKIT_COMMIT", "abc1234")           # recorded as the commit instead
    assert env.changed() == "MOEKIT_GLUON_FP8=0 MOEKIT_WGRAD_TILES=block_m=32"
    monkeypatch.setenv("MOEKIT_GLUON_FP8", "1")
    assert env.changed() == "MOEKIT_WGRAD_TILES=block_m=32"
