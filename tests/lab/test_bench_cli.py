"""`moekit bench` end to end on the CPU: every output file, one row per case, rows that read back."""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys

import pytest
import torch

from helpers import ROOT
from moekit.bench import cli
from moekit.bench.results import read_csv


def bench(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    return cli.run(parser.parse_args(argv))


def test_bench_quick_writes_csv_json_plots_and_report(tmp_path, capsys):
    out = tmp_path / "run"
    assert bench(["--quick", "--tokens", "1,4", "--backends", "loop,triton", "--device", "cpu",
                  "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "'tiny' preset on the CPU" in printed               # the one-line note on the default
    for name in ("results.csv", "results.json", "report.md", "time_tiny.png", "floor_pct_tiny.png",
                 "launches_tiny.png"):
        assert (out / name).stat().st_size > 0, name
    rows = read_csv(out / "results.csv")
    assert [(r.tokens, r.backend, r.mode) for r in rows] == [
        (1, "loop", "eager"), (1, "triton", "eager"), (4, "loop", "eager"), (4, "triton", "eager")]
    for r in rows:
        assert r.status == "ok", r.reason
        assert r.preset == "tiny" and r.device_type == "cpu" and r.dtype == "float32"
        assert r.copy_gbps > 0 and r.matmul_tflops > 0 and r.torch_version and r.triton_version
        assert r.n_rep == cli.QUICK.rep and r.p20_ms <= r.median_ms <= r.p80_ms
        assert r.pct_floor == pytest.approx(100 * r.floor_ms / r.median_ms)
        assert r.kernels and r.kernels > 0 and math.isnan(r.busy_ms)
        assert r.cache == "warm"                                # no 64 MB flush before a CPU call
    assert len({(r.copy_gbps, r.matmul_tflops, r.run_id) for r in rows}) == 1   # measured once per run
    report = (out / "report.md").read_text()
    assert "crossover" in report and "time_tiny.png" in report
    assert "Calls timed with warm caches" in report


def test_graph_flag_on_cpu_records_not_capturable(tmp_path):
    out = tmp_path / "run"
    assert bench(["--quick", "--tokens", "2", "--backends", "grouped_mm", "--device", "cpu", "--graph",
                  "--rep", "2", "--out", str(out)]) == 0
    rows = read_csv(out / "results.csv")
    assert [(r.mode, r.status) for r in rows] == [("eager", "ok"), ("graph", "not_capturable")]
    assert "CUDA" in rows[1].reason and math.isnan(rows[1].median_ms)


@pytest.mark.parametrize("argv,message", [
    (["--preset", "nope"], "argument --preset: unknown preset 'nope'"),
    (["--backends", "loop,warp"], "argument --backends: unknown backend 'warp'"),
])
def test_bad_arguments_are_reported(tmp_path, capsys, argv, message):
    with pytest.raises(SystemExit) as exc:
        bench([*argv, "--device", "cpu", "--out", str(tmp_path / "x")])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_tokens_must_be_positive_integers():
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(["--tokens", "1,0"])
    with pytest.raises(SystemExit):
        parser.parse_args(["--tokens", "1,x"])
    assert parser.parse_args(["--tokens", "1, 8"]).tokens == [1, 8]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter switch is for machines without CUDA")
def test_the_command_runs_triton_interpreted_on_the_cpu(tmp_path):
    """`moekit bench` in a fresh process (not under this suite's conftest, which imports moekit.kernels
    first): Triton must be switched to its interpreter before anything imports it."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT / "src")
    done = subprocess.run([sys.executable, "-m", "moekit", "bench", "--preset", "tiny", "--quick", "--tokens",
                           "1", "--backends", "triton", "--device", "cpu", "--out", str(tmp_path / "run")],
                          capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    (row,) = read_csv(tmp_path / "run" / "results.csv")
    assert row.status == "ok", row.reason


def test_flush_choice_reaches_the_options_and_the_rows():
    """--flush clean: the GPU's calls are timed after a clean flush and the rows say so; the CPU
    keeps warm caches whatever is asked; a mode outside the choices is refused by the parser."""
    from moekit.bench.sweep import CACHE_LABELS

    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    for flush, want in (("write", "write"), ("clean", "clean")):
        args = p.parse_args(["--flush", flush])
        assert cli._options(args, torch.device("cuda")).flush_l2 == want
        assert cli._options(args, torch.device("cpu")).flush_l2 is False
    assert cli._options(p.parse_args([]), torch.device("cuda")).flush_l2 == "write"
    assert [CACHE_LABELS[m] for m in ("write", "clean", False, True)] == [
        "flushed", "flushed clean", "warm", "flushed"]
    with pytest.raises(SystemExit):
        p.parse_args(["--flush", "cold"])
