"""Every `moekit` subcommand refuses a bad argument, folder or input file with one error line that
names it, a non-zero exit and no traceback, before any work; nothing is left half-written; a study
in which no case succeeded exits non-zero; --out never replaces earlier results unless asked to."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import moekit._memory
from helpers import ROOT, error_line, run_cli
from moekit.bench import cli as bench_cli
from moekit.bench import imbalance, imbalance_report, report, study
from moekit.bench.args import UsageError, check_memory, out_dir
from moekit.bench.ceilings import Ceilings
from moekit.bench.imbalance_report import ImbalanceRow
from moekit.bench.layers import parse_shape
from moekit.bench.results import check_result_row, write_csv
from moekit.bench.runner import memory_bytes
from moekit.cli import main
from result_rows import imbalance_rows, make_row, sample_rows

NO_CUDA_INDEX = "cuda:999"   # refused with or without CUDA on this machine


@pytest.fixture
def no_work(monkeypatch):
    """Any measurement fails the test: every check must come before the ceilings are measured."""
    def measured(*args, **kwargs):
        raise AssertionError("the command started measuring")

    monkeypatch.setattr(study, "measure_ceilings", measured)


@pytest.fixture
def not_a_folder(tmp_path):
    path = tmp_path / "file"
    path.write_text("x")
    return path


BAD_ARGUMENTS = [
    ("bench", "--device", "nosuch"),
    ("bench", "--device", "cuda:abc"),
    ("bench", "--device", NO_CUDA_INDEX),
    ("bench", "--device", "cpu:1"),
    ("bench", "--warmup", "-1"),
    ("bench", "--warmup", "x"),
    ("bench", "--rep", "0"),
    ("bench", "--rep", "nan"),
    ("bench", "--tokens", ","),
    ("bench", "--tokens", "1,0"),
    ("bench", "--tokens", "1,inf"),
    ("bench", "--preset", "nope"),
    ("bench", "--preset", ""),
    ("bench", "--backends", "loop,warp"),
    ("bench", "--seed", "-1"),
    ("bench", "--seed", "1.5"),
    ("bench", "--seed", str(2**64)),
    ("bench", "--out", "/dev/null/x"),
    ("bench", "--out", "{file}"),
    ("imbalance", "--device", "nosuch"),
    ("imbalance", "--device", NO_CUDA_INDEX),
    ("imbalance", "--capacity-factors", "inf"),
    ("imbalance", "--capacity-factors", "1,nan"),
    ("imbalance", "--capacity-factors", "0"),
    ("imbalance", "--capacity-factors", "-1"),
    ("imbalance", "--capacity-factors", ","),
    ("imbalance", "--memory-limit-gb", "nan"),
    ("imbalance", "--memory-limit-gb", "inf"),
    ("imbalance", "--memory-limit-gb", "0"),
    ("imbalance", "--memory-limit-gb", "-1"),
    ("imbalance", "--tokens", "0"),
    ("imbalance", "--ep", "-1"),
    ("imbalance", "--spare-slots", "-1"),
    ("imbalance", "--rep", "0"),
    ("imbalance", "--warmup", "-1"),
    ("imbalance", "--threads", "0"),
    ("imbalance", "--seed", "-1"),
    ("imbalance", "--scenarios", ","),
    ("imbalance", "--backends", "fast"),
    ("imbalance", "--trace", "/nonexistent/t.npy"),
    ("imbalance", "--redraw", "/nonexistent"),
    ("imbalance", "--out", "/dev/null/x"),
    ("report", "/nonexistent/results.csv", None),
    ("report", "--out", "/dev/null/x"),
    ("ep-bench", "--tokens", "0"),
    ("ep-bench", "--spare-slots", "-1"),
    ("ep-bench", "--warmup", "-1"),
    ("ep-bench", "--iters", "0"),
    ("ep-bench", "--simulate", "0"),
    ("ep-bench", "--timeout", "0"),
    ("ep-bench", "--scenarios", ","),
    ("ep-bench", "--seed", "-1"),
    ("ep-bench", "--trace", "/nonexistent/t.npy"),
    ("ep-bench", "--redraw", "/nonexistent/ep.csv"),
    ("ep-bench", "--out", "/dev/null/x"),
    ("ep-bench", "--backends", "loop,triton"),
    ("ep-bench", "--backend", "warp"),
    ("ep-bench", "--rep", "0"),
    ("ep-bench", "--iters", "0"),
    ("ep-bench", "--overlap-chunks", "0"),
    ("ep-bench", "--overlap-chunks", "1,x"),
]


@pytest.mark.parametrize("command,flag,value", BAD_ARGUMENTS,
                         ids=[f"{c} {f} {v}" for c, f, v in BAD_ARGUMENTS])
def test_bad_argument_is_one_error_line_at_parse_time(command, flag, value, capsys, no_work, tmp_path,
                                                      not_a_folder):
    """(`moekit tune`'s arguments: tests/lab/test_tune.py.)"""
    argv = [command, flag, *([] if value is None else [value.format(file=not_a_folder)])]
    if command == "report" and flag == "--out":
        write_csv(sample_rows(), tmp_path / "results.csv")
        argv.append(str(tmp_path))
    assert run_cli(argv) == 2
    line = error_line(capsys, f"moekit {command}")
    assert (flag if value is not None else "path") in line
    assert not (tmp_path / "report.md").exists()


@pytest.mark.parametrize("value", ["nosuch", "cuda:abc", "cpu:1", "meta", "mps", ""])
def test_device_must_be_cpu_or_cuda(value, capsys):
    assert run_cli(["bench", "--device", value]) == 2
    line = error_line(capsys, "moekit bench")
    assert f"argument --device: expected cpu, cuda or cuda:N, got {value!r}" in line


def test_the_error_and_the_exit_status_reach_the_shell():
    done = subprocess.run([sys.executable, "-m", "moekit", "bench", "--device", "nosuch"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith("moekit bench: error: argument --device:")


@pytest.mark.parametrize("command,switch", [("bench", "MOEKIT_PDL"), ("report", "MOEKIT_EAGER_GRAPHS")],
                         ids=["read-at-each-call", "read-at-import"])
def test_a_malformed_switch_is_one_error_line_before_any_work(command, switch, tmp_path):
    """A MOEKIT_* flag set to something that is no flag value: the subcommand's one error line naming
    it, exit status 2, no traceback and no folder written, whenever moekit reads the switch."""
    out = tmp_path / "out"
    argv = {"bench": ["--device", "cpu", "--tokens", "1", "--out", str(out)],
            "report": [str(tmp_path)]}[command]
    done = subprocess.run([sys.executable, "-m", "moekit", command, *argv], capture_output=True, text=True,
                          timeout=300, env={**os.environ, switch: "maybe"})
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines()[-1] == (
        f"moekit {command}: error: ${switch} must be 1 or 0 (also true/false, yes/no, on/off), got 'maybe'")
    assert not out.exists()


# --out: checked before any work, never replacing earlier results without --overwrite.


@pytest.mark.parametrize("command,existing", [("bench", "results.csv"), ("bench", "report.md"),
                                              ("bench", "results.json"), ("imbalance", "results.csv"),
                                              ("imbalance", "imbalance.csv"), ("ep-bench", "report.md"),
                                              ("ep-bench", "ep_results.csv")])
def test_out_holding_results_is_refused_before_any_work(command, existing, tmp_path, capsys, no_work):
    (tmp_path / existing).write_text("earlier results\n")
    (tmp_path / "notes.txt").write_text("mine\n")
    device = ["--simulate", "2"] if command == "ep-bench" else ["--device", "cpu"]
    assert run_cli([command, *device, "--out", str(tmp_path)]) == 2
    if command == "ep-bench":   # its errors go to stdout (the distributed tests read them there)
        err = capsys.readouterr().out
        line = next(ln for ln in err.splitlines() if ln.startswith("moekit ep-bench: "))
    else:
        line = error_line(capsys, f"moekit {command}")
    assert str(tmp_path) in line and existing in line and "--overwrite" in line
    assert (tmp_path / existing).read_text() == "earlier results\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([existing, "notes.txt"])


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc")
@pytest.mark.parametrize("out", ["/proc/moekit-out", "/proc/self"])
def test_out_that_cannot_be_written_is_refused_before_any_work(out, tmp_path, capsys, no_work):
    """/proc refuses new folders and files whatever the permission bits say, and they do not bind
    root: the folder is tried, not judged by its mode."""
    assert run_cli(["bench", "--device", "cpu", "--out", out]) == 2
    assert f"argument --out: {out}: " in error_line(capsys, "moekit bench")
    write_csv(sample_rows(), tmp_path / "results.csv")
    assert run_cli(["report", str(tmp_path), "--out", f"{out}/report"]) == 2
    assert "argument --out: " in error_line(capsys, "moekit report")


def test_out_check_leaves_no_trace(tmp_path):
    """Trying a folder, new or existing, leaves nothing behind."""
    (tmp_path / "kept").mkdir()
    for out in (tmp_path / "new" / "deeper", tmp_path / "kept"):
        out_dir(str(out))
    assert [p.name for p in tmp_path.iterdir()] == ["kept"] and not list((tmp_path / "kept").iterdir())


def test_help_documents_the_overwrite_rule(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--overwrite" in text and "refused unless --overwrite" in text


def fake_sweep(rows):
    def sweep(plan, ceilings, prov, options, on_case=None):
        return [replace(r, run_id=prov.run_id) for r in rows]

    return sweep


@pytest.fixture
def fake_ceilings(monkeypatch):
    monkeypatch.setattr(study, "measure_ceilings", lambda *a, **k: Ceilings(20.0, 0.2))


def test_overwrite_replaces_earlier_results(tmp_path, monkeypatch, fake_ceilings):
    (tmp_path / "results.csv").write_text("earlier results\n")
    monkeypatch.setattr(bench_cli, "run_sweep", fake_sweep(sample_rows()))
    assert run_cli(["bench", "--device", "cpu", "--tokens", "1,4,16", "--out", str(tmp_path),
                    "--overwrite"]) == 0
    assert "earlier" not in (tmp_path / "results.csv").read_text()
    assert (tmp_path / "report.md").exists() and (tmp_path / "time_tiny.png").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


@pytest.mark.parametrize("given_out", [True, False], ids=["--out", "default-folder"])
def test_results_written_while_a_run_measured_are_never_replaced(given_out, tmp_path, monkeypatch, capsys,
                                                                 fake_ceilings):
    """Another run writes results into this run's folder while it measures (two runs given one --out,
    or started in the same second with the default folder): this run writes into the next free
    folder (`<folder>-2`) and says where; the other run's results stay as they were."""
    monkeypatch.chdir(tmp_path)
    rows = sample_rows()

    def sweep(plan, ceilings, prov, options, on_case=None):
        folder = tmp_path / "race" if given_out else tmp_path / "moekit-results" / prov.run_id
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "results.csv").write_text("the other run's results\n")
        (folder / "report.md").write_text("the other run's report\n")
        return [replace(r, run_id=prov.run_id) for r in rows]

    monkeypatch.setattr(bench_cli, "run_sweep", sweep)
    argv = ["bench", "--device", "cpu", "--tokens", "1,4,16", *(["--out", "race"] if given_out else [])]
    assert run_cli(argv) == 0
    first = tmp_path / "race" if given_out else min((tmp_path / "moekit-results").iterdir())
    assert (first / "results.csv").read_text() == "the other run's results\n"
    assert (first / "report.md").read_text() == "the other run's report\n"
    second = first.with_name(first.name + "-2")
    assert len(report.STUDY.read(second / "results.csv")) == len(rows) and (second / "report.md").exists()
    assert f"{second.name}/results.csv" in " ".join(capsys.readouterr().out.split())


def test_peers_without_transformers_names_the_extra_to_install(tmp_path, monkeypatch, capsys, fake_ceilings):
    """The console's hint keeps its brackets (rich would read `[transformers]` as a style and drop it)."""
    monkeypatch.setattr(bench_cli.peers, "transformers_version", lambda: None)
    monkeypatch.setattr(bench_cli, "run_sweep", fake_sweep(sample_rows()))
    argv = ["bench", "--device", "cpu", "--tokens", "1,4,16", "--peers", "--out", str(tmp_path / "r")]
    assert run_cli(argv) == 0
    assert "pip install 'moekit[transformers]'" in " ".join(capsys.readouterr().out.split())


# A study in which no case succeeded exits non-zero and says so.


def test_bench_with_every_case_failing_exits_nonzero(tmp_path, capsys, fake_ceilings):
    """The run of issue 16 (--warmup -1, now refused while parsing, here forced past the parser): every
    case errors while timing. The rows are still written, with their reasons; the exit status is 1."""
    parser = bench_cli.argparse.ArgumentParser()
    bench_cli.add_arguments(parser)
    args = parser.parse_args(["--quick", "--tokens", "1", "--backends", "loop", "--device", "cpu",
                              "--out", str(tmp_path / "run")])
    args.warmup = -1
    assert bench_cli.run(args) == 1
    line = error_line(capsys, "moekit bench")
    assert "no case succeeded" in line and "1 error" in line
    assert "warmup must be >= 0" in (tmp_path / "run" / "results.csv").read_text()


def test_bench_with_some_case_timed_exits_zero(tmp_path, monkeypatch, fake_ceilings):
    monkeypatch.setattr(bench_cli, "run_sweep", fake_sweep(sample_rows()))   # one of 7 failed
    assert run_cli(["bench", "--device", "cpu", "--tokens", "1,4,16", "--out", str(tmp_path)]) == 0


def test_imbalance_with_every_case_failing_exits_nonzero(tmp_path, monkeypatch, capsys, fake_ceilings):
    def study(cfg, ceilings, prov, progress=None):
        return [replace(r, status="error", reason="boom", median_ms=math.nan, step_ms=math.nan)
                for r in imbalance_rows()]

    monkeypatch.setattr(imbalance, "study_rows", study)
    assert run_cli(["imbalance", "--device", "cpu", "--out", str(tmp_path)]) == 1
    assert "no case succeeded (" in error_line(capsys, "moekit imbalance")
    assert (tmp_path / "results.csv").exists() and (tmp_path / "report.md").exists()


# Bad result CSVs: the whole file is checked before anything is drawn.


BAD_RESULT_CELLS = [
    ("copy_gbps", 0.0), ("copy_gbps", math.nan), ("copy_gbps", -1.0), ("copy_gbps", math.inf),
    ("matmul_tflops", 0.0), ("matmul_tflops", math.nan),
    ("num_experts", 0), ("hidden_size", 0), ("intermediate_size", -1), ("top_k", 0), ("top_k", 9),
    ("tokens", 0), ("dtype", "float99"), ("experts_expected", 0.0), ("median_ms", 0.0),
    ("median_ms", math.nan), ("p20_ms", math.inf), ("floor_ms", -1.0), ("n_rep", 0), ("kernels", -1),
    ("tokens", 10**23), ("n_rep", 2**63), ("experts_hit", 2**64),
]


@pytest.mark.parametrize("column,value", BAD_RESULT_CELLS, ids=[f"{c}={v}" for c, v in BAD_RESULT_CELLS])
def test_report_refuses_a_bad_cell_before_drawing(column, value, tmp_path, capsys):
    rows = sample_rows()
    rows[3] = replace(rows[3], **{column: value})        # line 5 of the file (header, then rows 0..2)
    csv_path = tmp_path / "results.csv"
    write_csv(rows, csv_path)
    assert run_cli(["report", str(tmp_path)]) == 2
    line = error_line(capsys, "moekit report")
    assert f"{csv_path}:5:" in line and column in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.csv"]   # no plot, no report


def test_report_to_an_unwritable_folder_fails_before_reading(tmp_path, capsys, not_a_folder):
    write_csv(sample_rows(), tmp_path / "results.csv")
    assert run_cli(["report", str(tmp_path / "results.csv"), "--out", str(not_a_folder / "sub")]) == 2
    assert "--out" in error_line(capsys, "moekit report")


def test_report_writes_nothing_when_rendering_fails(tmp_path, monkeypatch):
    def broken(rows, files):
        raise RuntimeError("rendering failed")

    write_csv(sample_rows(), tmp_path / "results.csv")
    monkeypatch.setattr(report, "render", broken)
    with pytest.raises(RuntimeError):
        main(["report", str(tmp_path)])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.csv"]


@pytest.mark.parametrize("column,value,experiment", [
    ("step_ms", 0.0, "ep_step"), ("mean_ms", math.nan, "ep_step"), ("slowest_over_mean", math.inf, "ep_step"),
    ("median_ms", 0.0, "one_gpu"), ("capacity_factor", math.inf, "capacity"), ("copy_gbps", 0.0, "ep"),
    ("num_experts", 0, "one_gpu"), ("experiment", "warp", "one_gpu"),
])
def test_imbalance_redraw_refuses_a_bad_cell_before_drawing(column, value, experiment, tmp_path, capsys):
    rows = imbalance_rows()
    i = next(i for i, r in enumerate(rows) if r.experiment == experiment)
    rows[i] = replace(rows[i], **{column: value})
    write_csv(rows, tmp_path / "imbalance.csv", ImbalanceRow)   # a folder of an earlier run
    out = tmp_path / "out"
    assert run_cli(["imbalance", "--redraw", str(tmp_path), "--out", str(out)]) == 2
    line = error_line(capsys, "moekit imbalance")
    assert f"imbalance.csv:{i + 2}:" in line and column in line
    assert not out.exists()
    assert run_cli(["report", str(tmp_path), "--out", str(out)]) == 2
    assert f"imbalance.csv:{i + 2}:" in error_line(capsys, "moekit report")
    assert not out.exists()


def test_imbalance_outputs_written_only_once_all_are_rendered(tmp_path, monkeypatch):
    def broken(*args):
        raise RuntimeError("rendering failed")

    monkeypatch.setattr(imbalance_report, "render_report", broken)
    with pytest.raises(RuntimeError):
        imbalance_report.STUDY.write(imbalance_rows(), tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_bench_row_check_accepts_the_rows_a_run_writes():
    rows = [*sample_rows(), make_row(status="skipped", median_ms=math.nan, floor_ms=math.nan),
            make_row(mode="graph", status="not_capturable", median_ms=0.0)]
    assert [check_result_row(r) for r in rows] == [""] * len(rows)


# --tokens: at most the pairs moekit.align sorts, refused while parsing.


@pytest.mark.parametrize("command", ["bench", "ablate", "profile", "sweep", "tune", "imbalance", "ep-bench"])
@pytest.mark.parametrize("tokens", ["99999999999999999999", str(2**31 - 1)])
def test_tokens_past_the_runtime_bound_are_refused_while_parsing(command, tokens, capsys, no_work, tmp_path):
    assert run_cli([command, "--tokens", tokens, "--out", str(tmp_path / "run")]) == 2
    line = error_line(capsys, f"moekit {command}")
    assert "argument --tokens: " in line and str(2**31 - 2) in line and tokens in line


# A layer whose weights cannot fit is refused while the arguments are resolved, before any work.


SMALL_SHAPE = ["--shape", "E=8,H=64,I=48,K=2", "--device", "cpu"]   # 0.3 MB of float32 weights


@pytest.mark.parametrize("command,layer", [
    ("bench", SMALL_SHAPE), ("imbalance", SMALL_SHAPE), ("profile", SMALL_SHAPE), ("sweep", SMALL_SHAPE),
    ("ablate", ["--preset", "tiny", "--ablations", "tile", "--device", "cpu"]),
    ("ep-bench", [*SMALL_SHAPE[:2], "--simulate", "2"]),
])
def test_layer_that_cannot_fit_is_refused_before_any_work(command, layer, monkeypatch, capsys, no_work,
                                                          tmp_path):
    monkeypatch.setattr(moekit._memory, "free_bytes", lambda device: 100_000)
    out = tmp_path / "run"
    assert run_cli([command, *layer, "--tokens", "4", "--out", str(out)]) == 2
    if command == "ep-bench":   # its errors go to stdout (the distributed tests read them there)
        line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("moekit ep-bench: "))
    else:
        line = error_line(capsys, f"moekit {command}")
    name = "tiny (E=8,H=64,I=48,K=2)" if command == "ablate" else "shape:E=8,H=64,I=48,K=2"
    assert f"layer {name} needs " in line and "T=4" in line
    assert "over the 8e-05 GB a run may take on " in line and " (80% of the 0.0001 GB free)" in line
    assert not out.exists()


def test_memory_check_counts_each_layer_and_the_largest_token_count(monkeypatch):
    """The bytes are the float32 weights (router, gate_up, down) with what the workload of the largest
    T keeps (x, the fp32 reference output, the top-k ids and weights); the first layer over is named."""
    e, h, i, k, t = 8, 64, 48, 2, 16
    need = 4 * (e * h + e * 2 * i * h + e * h * i) + t * (h * (4 + 4) + k * 8)
    monkeypatch.setattr(moekit._memory, "free_bytes", lambda device: math.ceil(need / 0.8))
    small, big = parse_shape(f"E={e},H={h},I={i},K={k}"), parse_shape(f"E={e},H={h},I={i + 1},K={k}")
    cpu = torch.device("cpu")
    check_memory([small], torch.float32, cpu, [1, t])
    with pytest.raises(UsageError, match=f"layer {big.name} needs"):
        check_memory([small, big], torch.float32, cpu, [t, 1])
    with pytest.raises(UsageError, match=f"T={t + 1}"):
        check_memory([small], torch.float32, cpu, [t + 1])


def test_memory_of_a_narrower_dtype_counts_its_fp32_draw():
    """make_weights draws gate_up (the largest tensor) in fp32 and casts it: both are held at once."""
    e, h, i = 8, 64, 48
    router, gate_up, down = e * h, e * 2 * i * h, e * h * i
    shape = parse_shape(f"E={e},H={h},I={i},K=2").shape
    assert memory_bytes(shape, torch.bfloat16) == 2 * router + (4 + 2) * gate_up
    assert memory_bytes(shape, torch.bfloat16, drawn_in_fp32=False) == 2 * (router + gate_up + down)


@pytest.mark.skipif(not Path("/proc/self/statm").is_file(), reason="needs Linux's /proc")
def test_bench_under_an_address_space_limit_refuses_a_layer_past_it(tmp_path):
    """`ulimit -v`: the layer's 2.4 GB of float32 weights are refused by name before anything is
    measured (not an allocator's traceback), with 1.5 GB of address space left to the process."""
    code = textwrap.dedent(f"""
        import resource, sys
        import torch
        from moekit.cli import main
        used = int(open("/proc/self/statm").read().split()[0]) * resource.getpagesize()
        hard = resource.getrlimit(resource.RLIMIT_AS)[1]
        resource.setrlimit(resource.RLIMIT_AS, (used + 1_500_000_000, hard))
        sys.exit(main(["bench", "--device", "cpu", "--shape", "E=64,H=2048,I=1536,K=2", "--tokens", "1",
                       "--backends", "loop", "--no-dense", "--quick", "--out", {str(tmp_path / "run")!r}]))
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    line = done.stderr.strip().splitlines()[-1]
    e, h, i, k = 64, 2048, 1536, 2
    need = 4 * (e * h + e * 2 * i * h + e * h * i) + h * (4 + 4) + k * 8      # float32 weights, T = 1
    assert line.startswith(f"moekit bench: error: layer shape:E={e},H={h},I={i},K={k} needs "
                           f"{need / 1e9:.3g} GB (float32 weights and the tensors of T=1), over the ")
    assert not (tmp_path / "run").exists()
