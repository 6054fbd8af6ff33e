"""`moekit bench --weights fp8` and the fp8 ablation: FP8 rows beside the dense ones in one CPU run,
the FP8 floor (FP8 bytes, the FP8 roof), the gate of each FP8 path against its own oracle, the FP8
ceiling, old CSVs, and one-line errors for combinations that cannot run."""

from __future__ import annotations

import argparse
import contextlib
import csv
import io
import json
import math
from dataclasses import replace

import pytest
import torch

from moekit.bench import cli, study
from moekit.bench.ablate_report import STUDY as ABLATE_STUDY
from moekit.bench.ablate_report import AblateRow
from moekit.bench.ablate_variants import NotApplicable, Setup, build
from moekit.bench.ceilings import Ceilings, fp8_ceiling, measure_fp8_tflops
from moekit.bench.fp8 import Fp8Workloads, decode_path, quantize_layer
from moekit.bench.layers import parse_shape
from moekit.bench.report import STUDY
from moekit.bench.results import COLUMNS, FP8, check_result_row, write_csv
from moekit.bench.roofline import bound_of, floor_ms_of, fp8_expert_bytes, fp8_traffic, traffic
from moekit.bench.runner import Options, make_weights, make_workload, run_case
from moekit.bench.study import CSV_NAME, REPORT_NAME
from moekit.cli import main
from moekit.experts import moe_experts
from moekit.grouped_gemm.fp8 import experts_fp8_torch
from moekit.shapes import PRESETS

SHAPE = "E=8,H=128,I=128,K=2"
TOKENS = (1, 4)          # T = 1: triton's decode path (w8a16); T = 4: the grouped w8a8 path
CPU = torch.device("cpu")
QWEN3 = PRESETS["qwen3-30b-a3b"]
# One Qwen3 expert in FP8: e4m3 data (3 * 2048 * 768 bytes) and one fp32 scale per 128 x 128 block:
# gate_up (1536 / 128) x (2048 / 128) = 192 blocks, down 16 x 6 = 96.
QWEN3_FP8_EXPERT = 3 * 2048 * 768 + 4 * (12 * 16 + 16 * 6)


def bench(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    return cli.run(parser.parse_args(argv))


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One CPU run: triton and loop on the dense and the FP8 weights at T = 1 and 4, one timed call each."""
    out = tmp_path_factory.mktemp("fp8") / "run"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = bench(["--weights", "fp8", "--shape", SHAPE, "--tokens", ",".join(map(str, TOKENS)),
                      "--backends", "triton,loop", "--device", "cpu", "--rep", "1", "--warmup", "0",
                      "--out", str(out)])
    return code, out, printed.getvalue()


@pytest.fixture(scope="module")
def layer():
    """(the 128-wide layer's workloads at T = 1 and 4, its FP8 experts), fp32 on the CPU."""
    spec = parse_shape(SHAPE)
    weights = make_weights(spec.shape, torch.float32, CPU)
    works = {t: make_workload(spec.name, spec.shape, t, weights, torch.float32, CPU, routing_draws=1)
             for t in TOKENS}
    return works, quantize_layer(weights)


def test_weights_flag_parses():
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    assert parser.parse_args([]).weights == "dtype"
    assert parser.parse_args(["--weights", "fp8"]).weights == FP8
    with pytest.raises(SystemExit):
        parser.parse_args(["--weights", "fp4"])


def test_fp8_rows_stand_beside_the_dense_ones(run):
    code, out, printed = run
    assert code == 0
    rows = STUDY.read(out / CSV_NAME)
    assert [(r.tokens, r.backend, r.weights) for r in rows] == [
        (t, b, w) for t in TOKENS for b in ("triton", "loop") for w in ("float32", FP8)]
    assert all(r.status == "ok" and r.median_ms > 0 for r in rows), [(r.series, r.reason) for r in rows]
    assert all(math.isnan(r.fp8_tflops) for r in rows)                  # the CPU measures no FP8 roof
    assert "FP8 ceiling not measured on the CPU" in printed
    shape = parse_shape(SHAPE).shape
    for r in rows:
        dense = next(d for d in rows if (d.tokens, d.backend, d.weights) == (r.tokens, r.backend, "float32"))
        if r.on_fp8:
            weight_bytes = r.experts_hit * fp8_expert_bytes(shape)
            assert r.bytes == dense.bytes - r.experts_hit * shape.expert_bytes(torch.float32) + weight_bytes
            assert r.series == f"{r.backend} fp8" and r.flops == dense.flops and r.floor_ms < dense.floor_ms
    report = (out / REPORT_NAME).read_text()
    assert "### FP8 weights vs float32" in report and "triton fp8 (eager)" in report
    assert "Against vLLM's published block-FP8 Triton fused-MoE design" in report   # where it stands
    for f in (r for r in rows if r.on_fp8):
        d = next(d for d in rows if (d.tokens, d.backend, d.weights) == (f.tokens, f.backend, "float32"))
        assert f"| {f.backend} | eager | {f.tokens} | " in report
        assert f"{d.median_ms / f.median_ms:.2f}×" in report                # the speed-up column
    console = " ".join(printed.split())                                   # rich wraps the title
    assert "FP8 weights vs float32: fp8 ms / float32 ms / speed-up / % of FP8 floor" in console
    doc = json.loads((out / "results.json").read_text())
    assert [r["weights"] for r in doc["rows"]] == [r.weights for r in rows]


def test_report_redraws_and_a_csv_before_the_fp8_columns_reads(run, tmp_path):
    _, out, _ = run
    assert main(["report", str(out), "--out", str(tmp_path / "again")]) == 0
    assert (tmp_path / "again" / REPORT_NAME).read_text() == (out / REPORT_NAME).read_text()
    lines = list(csv.reader((out / CSV_NAME).read_text().splitlines()))
    drop = {lines[0].index("fp8_tflops"), lines[0].index("weights")}
    old = tmp_path / "old.csv"
    kept = [[c for i, c in enumerate(line) if i not in drop] for line in lines
            if line[lines[0].index("weights")] != FP8]
    old.write_text("\n".join(",".join(f'"{c}"' if "," in c else c for c in line) for line in kept) + "\n")
    rows = STUDY.read(old)
    assert rows and all(r.weights == "" and r.series == r.backend and math.isnan(r.fp8_tflops) for r in rows)


def test_fp8_floor_counts_fp8_bytes_and_the_fp8_roof():
    ids = torch.tensor([[0, 5, 17, 33, 64, 90, 101, 127]], dtype=torch.int32)
    assert fp8_expert_bytes(QWEN3) == QWEN3_FP8_EXPERT == 4_719_744
    dense, t = traffic(QWEN3, 1, ids, torch.bfloat16), fp8_traffic(QWEN3, 1, ids, torch.bfloat16)
    assert t.fp8 and not dense.fp8 and t.experts_hit == 8
    assert t.weight_bytes == 8 * QWEN3_FP8_EXPERT
    assert (t.io_bytes, t.routing_bytes, t.flops) == (dense.io_bytes, dense.routing_bytes, dense.flops)
    roofs = Ceilings(copy_gbps=4000.0, matmul_tflops=800.0, fp8_tflops=1600.0)
    assert floor_ms_of(t, roofs) == pytest.approx(t.bytes / 4000e9 * 1e3, rel=1e-12)     # memory-bound
    every = torch.arange(128, dtype=torch.int32).repeat(300).view(-1, 8)                 # T = 4,800
    big, big_dense = (f(QWEN3, 4800, every, torch.bfloat16) for f in (fp8_traffic, traffic))
    assert floor_ms_of(big, roofs) == pytest.approx(big.flops / 1600e12 * 1e3, rel=1e-12)  # the FP8 roof
    assert floor_ms_of(big_dense, roofs) == pytest.approx(big.flops / 800e12 * 1e3, rel=1e-12)
    # Intensity 300 FLOP/byte at T = 2,400: compute-bound on the dtype's ridge (200), not on FP8's (400).
    mid = fp8_traffic(QWEN3, 2400, every[:2400], torch.bfloat16)
    assert roofs.ridge() < mid.intensity < roofs.ridge(fp8=True) and bound_of(mid, roofs) == "memory"
    unmeasured = Ceilings(4000.0, 800.0)
    assert floor_ms_of(big, unmeasured) == pytest.approx(big.flops / 800e12 * 1e3, rel=1e-12)


def test_each_fp8_path_is_gated_by_its_own_oracle(layer):
    """T = 1 runs triton's w8a16 decode kernels, T = 4 the w8a8 grouped path (loop: w8a8 always). The
    real calls pass their path's gate; a wrong row, the dense weights' output and the other path's
    oracle are refused."""
    works, experts = layer
    for t, work in works.items():
        twins = Fp8Workloads(work, experts)
        assert decode_path("triton", work) == (t == 1) and not decode_path("loop", work)
        for backend in ("triton", "loop"):
            case = twins.for_backend(backend)
            out = twins.factory(backend)(case)()
            assert case.expected.check(out).ok, (t, backend, case.expected.check(out).reason)
            wrong = out.clone()
            wrong[0] *= 2
            assert not case.expected.check(wrong).ok
            assert case.traffic.fp8 and case.traffic.weight_bytes < work.traffic.weight_bytes
        args = (work.x, work.weights.gate_up_proj, work.weights.down_proj, work.topk_weights, work.topk_ids)
        assert not twins.w8a8.expected.check(moe_experts(*args, backend="loop")).ok     # dense weights
    one = Fp8Workloads(works[1], experts)
    w8a8_out = experts_fp8_torch(one.work.x, experts.gate_up, experts.down, one.work.topk_weights,
                                 one.work.topk_ids)
    assert not one.w8a16.expected.check(w8a8_out).ok          # the decode path quantizes no activation


def test_the_fp8_gate_refuses_before_timing(layer, monkeypatch):
    """run_case on an FP8 workload: a wrong call is a failed row, never timed; its floor is the FP8 one."""
    from moekit.bench import runner

    works, experts = layer
    twins = Fp8Workloads(works[4], experts)
    case = twins.for_backend("triton")
    monkeypatch.setattr(runner, "time_fn", lambda *a, **k: pytest.fail("a refused case was timed"))
    right = twins.factory("triton")(case)()
    roofs = Ceilings(10.0, 0.1)
    m = run_case(case, "triton", "eager", roofs, Options(warmup=0, rep=1), lambda _w: (lambda: right * 1.01))
    assert m.status == "failed" and "max error" in m.reason and m.timing is None
    assert m.floor_ms == floor_ms_of(fp8_traffic(case.shape, 4, case.topk_ids, torch.float32), roofs)


def test_fp8_ceiling_is_measured_on_cuda_only():
    value, why = fp8_ceiling(CPU)
    assert math.isnan(value) and "not measured on the CPU" in why
    assert measure_fp8_tflops(CPU, 128, rep=1) > 0              # torch._scaled_mm runs anywhere it exists
    with pytest.raises(ValueError, match="fp8_tflops"):
        Ceilings(1.0, 1.0, fp8_tflops=0.0)
    assert Ceilings(1.0, 2.0).compute_tflops(fp8=True) == 2.0          # not measured: the dtype's roof
    assert Ceilings(1.0, 2.0, 3.0).ridge(fp8=True) == 3e3


@pytest.mark.gpu
def test_fp8_ceiling_on_cuda():
    value, why = fp8_ceiling(torch.device("cuda"))
    assert why == "" and value > 0


def _no_measuring(*args, **kwargs):
    pytest.fail("the command started measuring")


@pytest.mark.parametrize("argv,message", [
    (["--backward"], "--weights fp8: FP8 experts are inference only; drop --backward"),
    (["--preset", "tiny"], "layer 'tiny' has H=64, I=48: FP8 block scaling needs both divisible by 128"),
    (["--shape", "E=8,H=128,I=96,K=2"], "I=96"),
    (["--backends", "grouped_mm,padded"], "none of --backends grouped_mm,padded takes FP8 weights"),
], ids=["backward", "tiny", "shape", "backends"])
def test_a_combination_fp8_cannot_run_is_one_usage_line(argv, message, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(study, "measure_ceilings", _no_measuring)
    out = tmp_path / "x"
    assert main(["bench", "--weights", "fp8", "--device", "cpu", *argv, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("moekit bench: error: ") and message in err and len(err.splitlines()) == 1
    assert not out.exists()


def test_a_row_on_fp8_weights_must_be_a_forward(tmp_path):
    from result_rows import make_row

    assert check_result_row(make_row(weights=FP8)) == ""
    assert "inference only" in check_result_row(make_row(weights=FP8, direction="fwd+bwd"))
    assert "column 'weights'" in check_result_row(make_row(weights="int4"))
    path = tmp_path / CSV_NAME
    write_csv([make_row(weights="bfloat16")], path)                # the run's dtype is float32
    with pytest.raises(ValueError, match="column 'weights'"):
        STUDY.read(path)
    assert COLUMNS[-1] == "weights" and COLUMNS.index("fp8_tflops") == COLUMNS.index("matmul_tflops") + 1


def test_the_fp8_ablation_times_the_layer_on_fp8_weights(layer, tmp_path):
    """The fp8 variant is `moekit bench`'s triton fp8 case: its gate, its FP8 traffic; the tiny layer
    cannot run it. Its report section sets it against the dense layer, each on its own floor."""
    works, _ = layer
    setup = Setup(works[4])
    case = build("fp8", setup)
    assert case.traffic.fp8 and case.expected.check(case.call()).ok
    wrong = case.call().clone()
    wrong[1] *= -1
    assert not case.expected.check(wrong).ok
    tiny = PRESETS["tiny"]
    tiny_work = make_workload("tiny", tiny, 3, make_weights(tiny, torch.float32, CPU), torch.float32, CPU,
                              routing_draws=1)
    with pytest.raises(NotApplicable, match="divisible by 128"):
        build("fp8", Setup(tiny_work))
    from result_rows import PROVENANCE

    head = dict(PROVENANCE, device_type="cuda", fp8_tflops=1500.0, preset="qwen3-30b-a3b", num_experts=128,
                hidden_size=2048, intermediate_size=768, top_k=8, tokens=64, seed=0, mode="graph",
                status="ok", p20_ms=1.0, p80_ms=1.0, n_rep=1)
    rows = [AblateRow(**head, variant="layer", median_ms=0.2, floor_ms=0.1, pct_floor=50.0),
            AblateRow(**head, variant="fp8", median_ms=0.1, floor_ms=0.05, pct_floor=50.0)]
    write_csv(rows, tmp_path / CSV_NAME, AblateRow)
    assert main(["report", str(tmp_path)]) == 0
    text = (tmp_path / REPORT_NAME).read_text()
    assert "## Dense weights vs block-scaled FP8 weights" in text
    assert "| 64 | graph | 0.2 | 0.1 (−50%) |" in text
    assert "the layer on FP8 weights took −50% against the dense weights" in text
    assert "| 64 | graph | 50% | 50% |" in text
    assert [r.fp8_tflops for r in ABLATE_STUDY.read(tmp_path / CSV_NAME)] == [1500.0, 1500.0]


def test_report_of_a_gpu_run_names_the_fp8_ceiling(run, tmp_path):
    _, out, _ = run
    gpu = [replace(r, device_type="cuda", device_name="NVIDIA H200", fp8_tflops=1500.0)
           for r in STUDY.read(out / CSV_NAME)]
    write_csv(gpu, tmp_path / CSV_NAME)
    assert main(["report", str(tmp_path)]) == 0
    text = (tmp_path / REPORT_NAME).read_text()
    assert "FP8 matmul **1,500.00 TFLOP/s** (`torch._scaled_mm`" in text
    assert "FLOPs over the FP8 matmul ceiling (1,500 TFLOP/s" in text
