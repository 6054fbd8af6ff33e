"""scripts/kernel_breakdown.py on the CPU: the tables are written, every backend row is accounted for,
a backend without a backward on the device is reported as not run, not silently dropped; the triton
case's padding line; and, from hand-made device activities, each GEMM kernel's useful FLOPs and
achieved TFLOP/s (the GPU's table, which only a GPU profile fills)."""

from __future__ import annotations

import math
import re

import pytest
import torch

from helpers import load_script
from moekit.bench.kernel_work import padded_rows, triton_kernel_flops, triton_rows
from moekit.shapes import PRESETS


def _script():
    return load_script("kernel_breakdown")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU form of the script")
def test_breakdown_tables_on_cpu(tmp_path, capsys):
    out = tmp_path / "b.md"
    args = ["--backward", "--tokens", "5", "--backends", "loop,grouped_mm", "--out", str(out)]
    assert _script().main(args) == 0
    text = out.read_text()
    assert text.strip() == capsys.readouterr().out.strip()
    assert "## loop, T = 5: wall" in text
    assert "| kernel | count | ms | share | useful GFLOP | TFLOP/s |" in text
    assert "## grouped_mm, T = 5: not run" in text      # no backward on the CPU: said, not skipped silently
    shares = [int(line.split("|")[4].strip().rstrip("%")) for line in text.splitlines()
              if line.startswith("| `aten::") or " others |" in line]
    assert shares and 97 <= sum(shares) <= 103          # rounded shares of the whole
    # The layer's useful FLOPs of a training step: 3 x 2 S 3HI, S = 10 pairs of the tiny preset.
    assert f"Useful FLOPs per call: {3 * 2 * 10 * 3 * 64 * 48 / 1e9:.3g} GFLOP" in text


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU form of the script")
def test_steady_line_per_case(capsys, monkeypatch):
    script = _script()
    calls = []
    real = script._call
    monkeypatch.setattr(script, "_call", lambda *a: (lambda f: lambda: calls.append(1) or f())(real(*a)))
    assert script.main(["--tokens", "5", "--backends", "loop", "--backward", "--steady"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("Steady: ")]
    assert len(lines) == 1
    values = [float(v) for v in re.findall(r"([0-9.]+) ms", lines[0])]
    assert len(values) == 3 and all(v > 0 for v in values)
    assert len(calls) == 4 + 3 + 10 + 20       # breakdown (3 warm + 1), steady (3 warm, 10 alone, 20 looped)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU form of the script")
def test_triton_case_states_its_padding(capsys, monkeypatch):
    monkeypatch.setenv("MOEKIT_DECODE_DIRECT", "0")     # the aligned path
    script = _script()
    counted = []                                         # the pairs each case's FLOPs are counted for
    monkeypatch.setattr(script, "triton_kernel_flops", lambda shape, pairs, backward:
                        counted.append(pairs) or triton_kernel_flops(shape, pairs))
    assert script.main(["--tokens", "5", "--backends", "triton"]) == 0
    assert counted == [10]
    text = capsys.readouterr().out
    x, gate_up, _, _, ids, _ = script._inputs("tiny", 5, torch.float32, torch.device("cpu"))
    rc = triton_rows(x, gate_up, ids)
    counts = torch.bincount(ids.reshape(-1).long(), minlength=8).tolist()
    assert rc.rows == padded_rows(counts, rc.block_m) and rc.pairs == 10
    assert (f"Padding: {rc.per_pair:.2f} rows computed per pair, {rc.padding:.0%} padding ({rc.rows} rows "
            f"computed for 10 pairs, block_m {rc.block_m}).") in text


def test_gemm_kernels_get_their_flops_and_rate_by_launch_order():
    script = _script()
    shape = PRESETS["tiny"]                 # H = 64, I = 48; S = 10 pairs
    launches = [("align_hist_kernel", 0.002), ("moe_gemm1_swiglu_kernel", 0.004), ("moe_gemm2_kernel", 0.002),
                ("moe_sum_kernel", 0.001), ("moe_swiglu_bwd_kernel", 0.006), ("moe_gemm2_kernel", 0.003),
                ("moe_sum_kernel", 0.001), ("moe_wgrad_kernel", 0.005), ("moe_wgrad_kernel", 0.002)]
    rows = script.aggregate(launches, triton_kernel_flops(shape, 10, backward=True))
    by = {(r.name, r.role): r for r in rows}
    gemm1 = by["moe_gemm1_swiglu_kernel", "GEMM1: gate/up + SwiGLU"]
    assert (gemm1.count, gemm1.flops) == (1, 2 * 10 * 64 * 96)
    assert gemm1.tflops == pytest.approx(122_880 / 4e-6 / 1e12)          # 0.0307 TFLOP/s
    assert by["moe_gemm2_kernel", "dx: dpre @ gate_up"].flops == 122_880     # the second GEMM2 launch
    assert by["moe_gemm2_kernel", "GEMM2: down + weight"].tflops == pytest.approx(61_440 / 2e-6 / 1e12)
    assert by["moe_wgrad_kernel", "d down_proj"].flops == 61_440
    sums = by["moe_sum_kernel", ""]
    assert (sums.count, sums.flops, sums.ms) == (2, None, pytest.approx(0.002)) and math.isnan(sums.tflops)
    assert [r.ms for r in rows] == sorted((r.ms for r in rows), reverse=True)
    lines = script.table(rows, top=3)           # of 0.026 ms in all
    assert lines[2] == ("| `moe_swiglu_bwd_kernel` SwiGLU backward: g (a, b saved) | 1 | 0.006 "
                        "| 23% | 6.14e-05 | 0.0102 |")                 # 61,440 FLOPs in 6 µs
    assert lines[3] == "| `moe_wgrad_kernel` d gate_up_proj | 1 | 0.005 | 19% | 0.000123 | 0.0246 |"
    assert lines[-1] == "| 5 others | 6 | 0.011 | 42% | | |"
    counted = 122_880 + 61_440 + 61_440 + 122_880 + 122_880 + 61_440       # 552,960 in 0.022 ms
    assert script.summary(rows, busy=0.025, layer_flops=552_960) == [
        "Useful FLOPs per call: 0.000553 GFLOP, 0.0221 TFLOP/s over the device-busy time.",
        f"GEMM kernels: {counted / 1e9:.3g} GFLOP useful in 0.022 ms, 0.0251 TFLOP/s."]
    assert script.summary(rows, busy=math.nan, layer_flops=552_960) == [
        "Useful FLOPs per call: 0.000553 GFLOP (no device timeline on the CPU)."]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU form of the script")
def test_host_profile_times_forward_and_backward_apart(monkeypatch):
    """--host-profile's lines: the forward's and the backward's host ms (both called on this thread,
    the backward with every gradient asked for), then cProfile's table with the asked-for rows."""
    monkeypatch.setenv("MOEKIT_DECODE_DIRECT", "0")
    script = _script()
    called = []
    real = script.experts_triton_backward
    monkeypatch.setattr(script, "experts_triton_backward",
                        lambda *a, **kw: called.append(a[8]) or real(*a, **kw))
    inputs = script._inputs("tiny", 5, torch.float32, torch.device("cpu"))
    lines = script.host_profile(inputs, torch.device("cpu"), loop=2, top=5)
    assert len(called) == 3 + 2 + 2 and set(called) == {(True, True, True, True)}   # warm, timed, profiled
    head = re.fullmatch(r"Host, called on this thread: forward ([0-9.]+) ms, backward ([0-9.]+) ms a step "
                        r"\(median of 2\); cProfile over 2 steps, top 5 by own time:", lines[0])
    assert head and float(head[1]) > 0 and float(head[2]) > 0
    table = lines[lines.index("```") + 1:-1]
    assert lines[-1] == "```" and table[0].split()[:2] == ["ncalls", "tottime"] and len(table) == 1 + 5
