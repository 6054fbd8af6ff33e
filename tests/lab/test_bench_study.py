"""The study scaffold: `moekit report DIR` finds and redraws a folder of every study, in the format
each one commits (tests/data/results: cut from recorded H200 runs, an ep-bench folder
written by the code before the scaffold, and a stub-timed tune run), the recorded H200 results
themselves redraw to the same report, and the command line stays light."""

from __future__ import annotations

import shutil
import subprocess
import sys
from dataclasses import replace

import pytest

from helpers import DATA, ROOT
from moekit.bench import study
from moekit.bench.imbalance_report import ImbalanceRow
from moekit.bench.results import write_csv
from moekit.cli import main
from result_rows import imbalance_rows

RESULTS = DATA / "results"
RECORDED = ROOT / "benchmarks" / "results" / "h200"
# recorded run folders the docs cite, each redrawn by `moekit report`
RECORDED_RUNS = {"bench": RECORDED / "2026-11-29_04afad1" / "bench-peers",
                 "imbalance": RECORDED / "2026-12-02_072e8e0" / "imbalance"}
PNG = b"\x89PNG\r\n\x1a\n"

# study folder -> (its CSV, the report and plots a redraw writes, a line of the report)
COMMITTED = {
    "bench": ("results.csv", ["report.md", "time_qwen3-30b-a3b.png", "floor_pct_qwen3-30b-a3b.png",
                              "launches_qwen3-30b-a3b.png"], "# moekit bench: NVIDIA H200"),
    "imbalance": ("imbalance.csv", ["imbalance.md", "imbalance_one_gpu_qwen3-30b-a3b.png",
                                    "imbalance_ep_qwen3-30b-a3b.png", "imbalance_capacity_qwen3-30b-a3b.png"],
                  "## Load imbalance: qwen3-30b-a3b, T = 4096"),
    "ep-bench": ("ep_results.csv", ["ep_report.md", "ep_tiny.png"],
                 "# moekit ep-bench: tiny, 2 ranks (simulated)"),
    "tune": ("results.csv", ["report.md", "tune_tiny.png"], "# moekit tune: tiny on stub timer"),
}


@pytest.mark.parametrize("name", list(COMMITTED))
def test_report_redraws_a_committed_folder_of_every_study(name, tmp_path, capsys):
    csv_name, outputs, line = COMMITTED[name]
    folder = tmp_path / name
    shutil.copytree(RESULTS / name, folder)
    assert study.find_results(folder)[0].name == name
    assert main(["report", str(folder)]) == 0
    assert f"{name} rows from {folder / csv_name}" in " ".join(capsys.readouterr().out.split())
    for out in outputs:
        assert (folder / out).stat().st_size > 0, out
    for png in outputs[1:]:
        assert (folder / png).read_bytes()[:8] == PNG
    report = (folder / outputs[0]).read_text()
    assert line in report
    assert (folder / csv_name).read_bytes() == (RESULTS / name / csv_name).read_bytes()   # never rewritten
    again = tmp_path / "again"
    assert main(["report", str(folder / csv_name), "--out", str(again)]) == 0        # a CSV file works too
    assert (again / outputs[0]).read_text() == report                                   # rows alone decide


@pytest.mark.parametrize("name", list(COMMITTED))
def test_every_study_report_names_the_switches_its_run_set(name, tmp_path):
    """A run made with MOEKIT_* switches away from their defaults says so under its provenance, in the
    report of every study; a run with none says nothing."""
    found, csv_path = study.find_results(RESULTS / name)
    rows = found.read(csv_path)
    plain = found.write(rows, tmp_path / "plain")[-1].read_text()
    switched = [replace(r, switches="MOEKIT_PDL=0 MOEKIT_GLUON_FP8=0") for r in rows]
    report = found.write(switched, tmp_path / "switched")[-1].read_text()
    assert "- switches set away from their defaults: `MOEKIT_PDL=0 MOEKIT_GLUON_FP8=0`" in report
    assert "switches set away" not in plain


@pytest.mark.parametrize("name", list(RECORDED_RUNS))
def test_recorded_h200_results_redraw_to_the_same_report(name, tmp_path):
    """benchmarks/results/h200: copies of recorded runs redraw to their committed report.md and the
    same set of files."""
    recorded = RECORDED_RUNS[name]
    folder = tmp_path / name
    shutil.copytree(recorded, folder)
    before = (folder / "report.md").read_text()
    assert main(["report", str(folder)]) == 0
    assert (folder / "report.md").read_text() == before
    assert sorted(p.name for p in folder.iterdir()) == sorted(p.name for p in recorded.iterdir())


def test_new_folders_use_results_csv_and_report_md_for_every_study(tmp_path):
    rows = imbalance_rows()
    written = study.studies()[1].write(rows, tmp_path)
    assert [p.name for p in written][:1] == ["results.csv"] and written[-1].name == "report.md"
    assert study.find_results(tmp_path)[0].name == "imbalance"
    text = (tmp_path / "report.md").read_text()
    assert "Data: `results.csv`" in text and "`moekit report <this folder>`" in text


def test_a_csv_is_recognised_by_its_columns_whatever_its_name(tmp_path):
    path = tmp_path / "anything.csv"
    write_csv(imbalance_rows(), path, ImbalanceRow)
    found, src = study.find_results(path)
    assert found.name == "imbalance" and src == path
    assert main(["report", str(path)]) == 0 and (tmp_path / "report.md").exists()


def test_a_folder_without_results_is_one_error_line(tmp_path, capsys):
    assert main(["report", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("moekit report: error: ") and "results.csv" in err and len(err.splitlines()) == 1


def test_every_study_is_registered_once_with_distinct_columns():
    names = [s.name for s in study.studies()]
    assert names == ["bench", "imbalance", "ep-bench", "tune", "ablate", "profile", "sweep", "e2e"]
    from moekit.bench.results import columns
    sets = [set(columns(s.row_type)) for s in study.studies()]
    for i, a in enumerate(sets):
        for b in sets[i + 1:]:
            assert not a <= b and not b <= a   # no study's columns hide inside another's


def _imported_after(code: str) -> set[str]:
    done = subprocess.run([sys.executable, "-c", code + "\nimport sys\nprint(' '.join(sorted(sys.modules)))"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return set(done.stdout.split())


def test_help_and_version_import_no_study_plotting_or_console_code():
    mods = _imported_after("from moekit.cli import main\n"
                           "for argv in (['--help'], ['--version']):\n"
                           "    try:\n        main(argv)\n    except SystemExit:\n        pass")
    assert not {m for m in mods if m.startswith("moekit.bench")}
    assert "matplotlib" not in mods and "rich" not in mods


def test_version(capsys):
    import moekit

    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0 and capsys.readouterr().out.strip() == f"moekit {moekit.__version__}"


BLOCK_LAB = """
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in ("matplotlib", "rich") or name.startswith("moekit.bench"):
            raise ImportError("blocked: " + name)
sys.meta_path.insert(0, Block())
"""


def test_the_runtime_imports_no_lab_plotting_or_console_code():
    mods = _imported_after(BLOCK_LAB + "import moekit, moekit.layer, moekit.parallel, moekit.placement, "
                           "moekit.routing, moekit.tuning, moekit.ops, moekit.integrations.transformers")
    assert "moekit.parallel" in mods and not {m for m in mods if m.startswith("moekit.bench")}


def test_shared_flags_parse_alike_and_old_spellings_still_work():
    from moekit.cli import build_parser

    parser = build_parser()
    for command in ("bench", "imbalance"):
        for flag, want in (("--graph", True), ("--no-graph", False)):
            assert parser.parse_args([command, flag]).graph is want
        assert parser.parse_args([command]).graph is None          # the study's own default
    for command in ("bench", "imbalance", "ep-bench", "tune"):
        args = parser.parse_args([command, "--preset", "tiny", "--seed", "3", "--out", "x"])
        assert (args.preset in ("tiny", ["tiny"])) and args.seed == 3 and str(args.out) == "x"
    old = parser.parse_args(["ep-bench", "--iters", "3", "--backend", "loop"])
    assert old.rep == 3 and old.backends == "loop"
    assert parser.parse_args(["imbalance", "--backends", "loop,triton"]).backends == ["loop", "triton"]
