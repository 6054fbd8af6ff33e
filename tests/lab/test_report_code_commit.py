"""Reports say how moekit's code works only for rows that code measured: a sentence describing the
code (the FP8 design paragraph of `moekit bench`, how `moekit ablate`'s Triton align launches) is
written where the rows' commit is the commit of the code drawing the report (a fresh run, or a
redraw at the run's commit), and otherwise replaced by one line saying why it is left out. The
recorded runs' numbers are redrawn as before."""

from __future__ import annotations

from dataclasses import replace

import pytest

import moekit
from helpers import ROOT
from moekit.bench import ablate_report, report
from moekit.bench.study import code_lines, find_results, same_commit

RECORDED = ROOT / "benchmarks" / "results" / "h200"
FP8_RUN = RECORDED / "2026-12-04_a71f27d" / "bench-fp8-qwen3-30b-a3b"     # before the vLLM paragraph
ABLATE_RUN = RECORDED / "2026-11-30_027de41" / "ablate"                    # its align: 1,024 pairs
CODE = "4c51b291faeb"                                                      # the code drawing the report
LEFT_OUT = "A description of moekit's code is left out here"
GLUON = "Where the align block is 64 or 128 rows moekit's FP8 GEMMs are Hopper Gluon kernels"


def _rows(folder):
    found, csv_path = find_results(folder)
    return found.read(csv_path)


@pytest.mark.parametrize("run, code, same", [
    ("027de4167670", "027de4167670", True), ("027de41", "027de4167670", True),   # short and long hash
    ("027de4167670", "027de41", True), ("4c51b29+dirty", "4c51b291faeb+dirty", True),
    ("027de4167670", CODE, False), ("036c94c+s21-wip", "036c94c", False), ("4c51b29", "4c51b29+dirty", False),
    ("", "", False), ("", CODE, False), ("027de41", "", False), ("027de", "027de4167670", False),
])
def test_same_commit(run, code, same):
    assert same_commit(run, code) is same


def test_an_old_fp8_bench_run_redrawn_gets_no_fp8_design_paragraph(monkeypatch):
    monkeypatch.setenv("MOEKIT_COMMIT", CODE)
    rows = _rows(FP8_RUN)
    old = report.render(rows)
    assert "Against vLLM's published block-FP8" not in old and GLUON not in old
    left_out = [line for line in old.splitlines() if LEFT_OUT in line]
    assert len(left_out) == 1 and "`a71f27d`" in left_out[0] and f"`{CODE}`" in left_out[0]
    fresh = report.render([replace(r, commit=CODE) for r in rows])     # rows this code measured
    assert "Against vLLM's published block-FP8" in fresh and GLUON in fresh and LEFT_OUT not in fresh
    design = f"{report.VLLM_FP8_DESIGN} {report.GLUON_FP8_DESIGN}"
    assert old.replace(left_out[0], design) == fresh.replace(f"`{CODE}`", "`a71f27d`")


def test_a_run_with_the_gluon_fp8_gemms_off_is_not_said_to_run_them(monkeypatch):
    """The design paragraph names the kernels the run's switches ran: Triton's where it set
    MOEKIT_GLUON_FP8=0."""
    monkeypatch.setenv("MOEKIT_COMMIT", CODE)
    rows = [replace(r, commit=CODE) for r in _rows(FP8_RUN)]
    off = report.render([replace(r, switches="MOEKIT_PDL=0 MOEKIT_GLUON_FP8=0") for r in rows])
    assert GLUON not in off and report.TRITON_FP8_DESIGN in off
    assert GLUON in report.render(rows) and report.TRITON_FP8_DESIGN not in report.render(rows)


def test_an_old_ablate_run_redrawn_does_not_state_todays_align_limit(monkeypatch):
    monkeypatch.setenv("MOEKIT_COMMIT", CODE)
    rows = _rows(ABLATE_RUN)
    old = ablate_report.render(rows, {})
    assert "one Triton launch up to" not in old
    assert sum(LEFT_OUT in line for line in old.splitlines()) == 1
    fresh = ablate_report.render([replace(r, commit=CODE[:7]) for r in rows], {})
    assert "one Triton launch up to 4,096 pairs, three above" in fresh and LEFT_OUT not in fresh
    assert "- `align_triton`: align_block_size(backend='triton')" in old     # the legend itself stays


def test_code_lines_need_every_row_at_the_code_commit(monkeypatch):
    monkeypatch.setenv("MOEKIT_COMMIT", CODE)
    rows = _rows(ABLATE_RUN)[:2]
    assert code_lines([replace(r, commit=CODE) for r in rows], "a", "b") == ["a", "b"]
    mixed = [replace(rows[0], commit=CODE), rows[1]]
    (line,) = code_lines(mixed, "a", "b")
    assert LEFT_OUT in line and "`027de4167670`" in line and f"`{CODE}`" in line
    assert code_lines(rows) == []                                   # nothing to describe: no line
    monkeypatch.setattr("moekit.bench.study.git_commit", lambda: "")   # outside git, no MOEKIT_COMMIT
    (line,) = code_lines([replace(r, commit="", moekit_version="0.0.1") for r in rows], "a")
    assert LEFT_OUT in line and "unknown" in line
    # Both unknown (an installed wheel): the code's version decides, as for a fresh run's rows.
    assert code_lines([replace(r, commit="", moekit_version=moekit.__version__) for r in rows], "a") == ["a"]
    one_known = [replace(rows[0], commit="", moekit_version=moekit.__version__),
                 replace(rows[1], moekit_version=moekit.__version__)]          # 027de41's commit kept
    (line,) = code_lines(one_known, "a")
    assert LEFT_OUT in line
