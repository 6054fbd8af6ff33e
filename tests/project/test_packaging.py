"""Packaging: the lab's console and plots are the `bench` extra (the runtime never needs them), the
README's two set-up commands install everything `moekit bench` and the suite need, and a missing
extra is one error line that names it."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from helpers import ROOT
from moekit.bench.results import write_csv
from result_rows import sample_rows

BENCH = {"rich", "matplotlib"}


def _name(requirement: str) -> str:
    return re.split(r"[\s<>=!~;\[]", requirement, maxsplit=1)[0].lower()


@pytest.fixture(scope="module")
def project() -> dict:
    tomllib = pytest.importorskip("tomllib")
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def test_the_bench_extra_holds_the_lab_s_console_and_plots(project):
    extras = project["optional-dependencies"]
    assert {_name(r) for r in extras["bench"]} == BENCH
    assert not BENCH & {_name(r) for r in project["dependencies"]}         # the runtime does without
    assert BENCH <= {_name(r) for r in extras["test"]}                      # the suite runs the lab
    assert "pytest-timeout" in {_name(r) for r in extras["test"]}           # pyproject's `timeout`


def test_transformers_is_bounded_and_safetensors_is_gone(project):
    (req,) = project["optional-dependencies"]["transformers"]
    assert _name(req) == "transformers" and ">=5.0" in req and "<6" in req
    extras = project["optional-dependencies"].values()
    everything = [*project["dependencies"], *(r for rs in extras for r in rs)]
    assert "safetensors" not in {_name(r) for r in everything}


def test_the_readme_s_two_set_up_commands_install_the_lab(project):
    readme = (ROOT / "README.md").read_text()
    setup = readme.split("## Install", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    commands = [line for line in setup.strip().splitlines() if line.strip()]
    assert len(commands) == 2
    extras = project["optional-dependencies"]
    for line, tail in zip(commands, ("moekit bench", "pytest"), strict=True):
        (names,) = re.findall(r'pip install -e "\.\[([a-z,]+)\]"', line)
        installed = {_name(r) for r in project["dependencies"]} | \
            {_name(r) for n in names.split(",") for r in extras[n]}
        assert BENCH <= installed, line
        assert line.split("#")[0].strip().endswith(f"&& {tail}")
    assert "pip install torch --index-url https://download.pytorch.org/whl/cpu" in readme


BLOCK = """
import sys
BLOCKED = {blocked!r}
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.partition('.')[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
sys.meta_path.insert(0, Block())
from moekit.cli import main
sys.exit(main({argv!r}))
"""


def run_without(blocked: set[str], argv: list[str]) -> subprocess.CompletedProcess:
    code = BLOCK.format(blocked=sorted(blocked), argv=argv)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          cwd=ROOT, env={"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin"})


@pytest.mark.parametrize("blocked,argv,missing", [
    ({"rich", "matplotlib"}, ["bench", "--device", "cpu"], "rich"),
    ({"rich"}, ["imbalance", "--help"], "rich"),
    ({"matplotlib"}, ["report", "{folder}"], "matplotlib"),
    ({"matplotlib"}, ["bench", "--quick", "--tokens", "1", "--backends", "loop", "--device", "cpu",
                      "--out", "{folder}/run"], "matplotlib"),
], ids=["bench", "imbalance-help", "report", "bench-plots"])
def test_a_missing_extra_is_one_line_naming_it(tmp_path, blocked, argv, missing):
    write_csv(sample_rows(), tmp_path / "results.csv")
    done = run_without(blocked, [a.format(folder=tmp_path) for a in argv])
    assert done.returncode == 2, done.stdout + done.stderr
    err = done.stderr.strip().splitlines()
    assert err == [f"moekit {argv[0]}: error: {missing} is not installed; the lab needs the bench extra: "
                   "pip install 'moekit[bench]'"], done.stderr
    assert not (tmp_path / "report.md").exists()


def test_help_and_the_measuring_modules_need_no_extra():
    """`moekit --help` and the lab's measuring modules import without rich and matplotlib: only the
    console (the subcommands' run) and the plots (the report modules) use them."""
    done = run_without(BENCH, ["--help"])
    assert done.returncode == 0 and "bench" in done.stdout, done.stderr
    code = BLOCK.split("from moekit.cli")[0].format(blocked=sorted(BENCH), argv=[]) + (
        "import moekit.bench, moekit.bench.args, moekit.bench.layers, moekit.bench.study\n"
        "import moekit.bench.results, moekit.bench.runner, moekit.bench.sweep, moekit.bench.scenarios\n"
        "import moekit.bench.simulate\n"
        "print('ok')\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


def test_the_report_modules_need_no_console():
    """Reports and plots are drawn without rich (only a study's console summary uses it)."""
    code = BLOCK.split("from moekit.cli")[0].format(blocked=["rich"], argv=[]) + (
        "from moekit.bench.study import studies\n"
        "assert [s.name for s in studies()] == ['bench', 'imbalance', 'ep-bench', 'tune', 'ablate', "
        "'profile', 'sweep', 'e2e']\n"
        "print('ok')\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


def test_the_declared_license_ships_its_text(project):
    """pyproject declares Apache-2.0; the repository (and so the sdist and the wheel's metadata, which
    setuptools fills from LICENSE*) holds that license's text."""
    assert project["license"] == {"text": "Apache-2.0"}
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text
