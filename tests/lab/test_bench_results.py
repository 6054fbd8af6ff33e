"""CSV schema, round trips, clear errors for bad files, and reports rebuilt from a CSV alone."""

from __future__ import annotations

import argparse
import csv
import json
import math
from dataclasses import replace

import pytest

from moekit.bench import plots, report_cli
from moekit.bench.report import crossover_of, render
from moekit.bench.results import COLUMNS, read_csv, write_csv, write_json
from result_rows import sample_rows

PROVENANCE = ("run_id", "date", "commit", "device_type", "device_name", "torch_version", "triton_version",
              "transformers_version", "dtype", "copy_gbps", "matmul_tflops")
CASE = ("preset", "tokens", "backend", "mode", "status", "reason")
STATS = ("median_ms", "p20_ms", "p80_ms", "n_rep", "floor_ms", "pct_floor", "gbps", "tflops", "kernels",
         "busy_ms", "idle_pct", "experts_hit", "experts_hit_mean", "experts_expected")


def test_schema_has_provenance_case_and_stats():
    for name in PROVENANCE + CASE + STATS:
        assert name in COLUMNS
    assert len(set(COLUMNS)) == len(COLUMNS)


def test_csv_round_trip_and_header(tmp_path):
    rows = sample_rows()
    path = tmp_path / "results.csv"
    write_csv(rows, path)
    with path.open() as f:
        header = next(csv.reader(f))
    assert tuple(header) == COLUMNS
    back = read_csv(path)
    assert len(back) == len(rows)
    for a, b in zip(rows, back):
        for c in COLUMNS:
            va, vb = getattr(a, c), getattr(b, c)
            if isinstance(va, float) and math.isnan(va):
                assert math.isnan(vb), c
            else:
                assert va == vb, c
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]   # atomic: no leftovers


def _strict(constant: str):
    raise ValueError(f"not JSON: {constant}")


def test_json_copy(tmp_path):
    rows = sample_rows()
    rows[-1] = replace(rows[-1], max_err=math.inf)              # a NaN output's error
    write_json(rows, tmp_path / "results.json")
    doc = json.loads((tmp_path / "results.json").read_text(), parse_constant=_strict)
    assert doc["columns"] == list(COLUMNS) and len(doc["rows"]) == len(rows)
    failed = doc["rows"][-1]
    assert failed["status"] == "failed" and failed["median_ms"] is None and failed["max_err"] is None


def _write_broken(tmp_path, mutate) -> object:
    path = tmp_path / "results.csv"
    write_csv(sample_rows(), path)
    lines = path.read_text().splitlines()
    path.write_text("\n".join(mutate(lines)) + "\n")
    return path


@pytest.mark.parametrize("case,mutate,message", [
    ("empty", lambda ls: [], "empty"),
    ("missing-column", lambda ls: [ln.split(",", 1)[1] for ln in ls], "missing columns"),
    ("bad-number", lambda ls: [ls[0], ls[1].replace(",float32,20.0,", ",float32,fast,"), *ls[2:]],
     "copy_gbps"),
    ("bad-status", lambda ls: [ls[0], ls[1].replace(",ok,", ",great,"), *ls[2:]], "status"),
    ("short-line", lambda ls: [ls[0], ls[1].rsplit(",", 3)[0], *ls[2:]], "fields"),
    ("header-only", lambda ls: ls[:1], "no result rows"),
])
def test_malformed_csv_names_the_file(tmp_path, case, mutate, message):
    path = _write_broken(tmp_path, mutate)
    with pytest.raises(ValueError, match=message) as info:
        read_csv(path)
    assert str(path) in str(info.value)


def test_report_cli_rejects_a_bad_csv_cleanly(tmp_path, capsys):
    path = _write_broken(tmp_path, lambda ls: ["not,a,results,file", "1,2,3,4"])
    assert report_cli.run(argparse.Namespace(path=tmp_path, out=None)) == 2
    err = capsys.readouterr().err
    assert err.startswith("moekit report: error: ") and len(err.strip().splitlines()) == 1
    assert "missing columns" in err and str(path) in err
    assert not (tmp_path / "report.md").exists()


def test_report_is_rebuilt_from_the_csv_alone(tmp_path):
    write_csv(sample_rows(), tmp_path / "results.csv")      # nothing else in the folder
    assert report_cli.run(argparse.Namespace(path=tmp_path, out=None)) == 0
    for name in ("report.md", "time_tiny.png", "floor_pct_tiny.png", "launches_tiny.png"):
        assert (tmp_path / name).stat().st_size > 0
    assert (tmp_path / "time_tiny.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = (tmp_path / "report.md").read_text()
    cross = crossover_of(sample_rows()[0])
    assert f"≈ {cross:,.0f} tokens" in text                   # the crossover is stated
    assert "max error 1 > 0.1" in text                          # the failed backend, with its reason
    assert "![time per call](time_tiny.png)" in text
    # Regenerating again gives the same report (it depends on the rows only).
    first = text
    report_cli.run(argparse.Namespace(path=tmp_path / "results.csv", out=tmp_path / "again"))
    assert (tmp_path / "again" / "report.md").read_text() == first


def test_report_tables_show_launches_and_distinct_experts():
    text = render(sample_rows())
    launches = text.split("### Kernel launches per call")[1].split("###")[0]
    assert "| 16 | 174 | 8 |" in launches                     # loop grows per expert, triton stays at 8
    distinct = text.split("### Distinct experts hit")[1].split("###")[0]
    assert "| 4 | 5 | 5.40 | 5.47 | -1.3% |" in distinct


def test_failed_rows_are_never_drawn_as_times():
    rows = sample_rows()
    drawn = plots.series(rows, "tiny")
    assert ("padded", "eager") not in drawn                   # failed: no point on any plot
    assert set(drawn) == {("loop", "eager"), ("triton", "eager")}
    assert [r.tokens for r in drawn[("loop", "eager")]] == [1, 4, 16]


def test_switches_are_recorded_and_named_in_the_report(tmp_path):
    rows = [replace(r, switches="MOEKIT_GLUON_FP8=1") for r in sample_rows()]
    path = tmp_path / "results.csv"
    write_csv(rows, path)
    assert read_csv(path)[0].switches == "MOEKIT_GLUON_FP8=1"
    assert "switches set away from their defaults: `MOEKIT_GLUON_FP8=1`" in render(read_csv(path))
    assert "switches set away" not in render(sample_rows())
    # A file written before the column reads, with no switches.
    with path.open() as f:
        table = list(csv.reader(f))
    col = table[0].index("switches")
    path.write_text("\n".join(",".join(c for i, c in enumerate(line) if i != col) for line in table) + "\n")
    assert read_csv(path)[0].switches == ""


@pytest.mark.parametrize("tracked", [True, False], ids=["moekit-tracked", "inside-another-repo"])
def test_commit_is_moekit_s_own_never_an_enclosing_repo_s(tracked, tmp_path, monkeypatch):
    """An installed moekit inside another project's git tree (`myproject/.venv/...`, untracked) records
    no commit, not that project's; a source tree whose moekit git tracks records its commit."""
    import subprocess

    from moekit.bench import results

    def git(*args):
        return subprocess.run(["git", "-C", str(tmp_path), *args], check=True, capture_output=True,
                              text=True).stdout.strip()

    git("init", "-q")
    (tmp_path / "README").write_text("another project\n")
    pkg = tmp_path / ".venv" / "site-packages" / "moekit" / "bench"
    pkg.mkdir(parents=True)
    (pkg / "results.py").write_text("# installed\n")
    git("add", "README", *(["-f", str(pkg / "results.py")] if tracked else []))
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "x")
    monkeypatch.delenv("MOEKIT_COMMIT", raising=False)
    monkeypatch.setattr(results, "__file__", str(pkg / "results.py"))
    assert results.git_commit() == (git("rev-parse", "--short=12", "HEAD") if tracked else "")
