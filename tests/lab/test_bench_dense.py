"""The dense pair beside `moekit bench`'s backends (its gate, its rows, the report's "% of dense pair"
column), and the triton path's accounting (`moekit.bench.kernel_work`): useful FLOPs per kernel and
the rows its tiles compute per pair, against hand counts."""

from __future__ import annotations

import argparse
import math
from dataclasses import replace

import pytest
import torch

from moekit.bench import cli, runner
from moekit.bench.ceilings import Ceilings
from moekit.bench.dense import DENSE
from moekit.bench.kernel_work import (
    KernelFlops,
    RowsComputed,
    aligned_rows,
    forward_gemm_bytes,
    label_launches,
    padded_rows,
    triton_kernel_flops,
    triton_rows,
)
from moekit.bench.report import STUDY, fmt_pct, render, share_of_dense
from moekit.bench.results import read_csv, write_csv
from moekit.bench.roofline import traffic, training_traffic
from moekit.bench.runner import Options, for_backend, make_weights, make_workload, run_case
from moekit.experts.triton import auto_config
from moekit.shapes import PRESETS, MoEShape
from moekit.tuning import ExpertsConfig
from result_rows import make_row, sample_rows

TINY = PRESETS["tiny"]                # E=8, H=64, I=48, K=2
CEILINGS = Ceilings(copy_gbps=10.0, matmul_tflops=0.1)
FAST = Options(warmup=0, rep=2, flush_l2=False, routing_draws=8)
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def work():
    weights = make_weights(TINY, torch.float32, CPU, seed=0)
    return make_workload("tiny", TINY, 5, weights, torch.float32, CPU, routing_draws=8)


# --- useful FLOPs per kernel --------------------------------------------------------------------

def test_kernel_flops_match_a_hand_count():
    shape = MoEShape(8, 64, 48, 2)    # H = 64, I = 48; S = 10 pairs
    forward = triton_kernel_flops(shape, 10)
    fwd = {k.role: k.flops for k in forward if k.kernel.startswith("moe_") and "fp8" not in k.kernel}
    assert fwd == {"GEMM1: gate/up + SwiGLU": 2 * 10 * 64 * 96,     # 122,880
                   "GEMM2: down + weight": 2 * 10 * 48 * 64}         # 61,440
    assert sum(fwd.values()) == 184_320 == traffic(shape, 5, torch.zeros(5, 2, dtype=torch.int32),
                                                   torch.float32).flops   # the roofline's 2 S 3HI
    # the decode kernels and the FP8 GEMMs (one path a call) count the same GEMM FLOPs
    for path in (("decode_gemm1_swiglu_kernel", "decode_gemm2_sum_kernel"),
                 ("moe_gemm1_fp8_kernel", "moe_gemm2_fp8_kernel"),
                 ("gluon_gemm1_fp8_kernel", "gluon_gemm2_fp8_kernel")):
        assert [k.flops for k in forward if k.kernel in path] == list(fwd.values())
    # the weight gradients' other kernels (the range kernel, Hopper's Gluon kernel) stand in for
    # moe_wgrad_kernel's two launches: one of the three runs; Hopper's Gluon SwiGLU backward for
    # moe_swiglu_bwd_kernel (the same FLOPs)
    assert [k.flops for k in triton_kernel_flops(shape, 10, backward=True)
            if k.kernel == "gluon_swiglu_bwd_kernel"] == [2 * 10 * 64 * 48]
    alternatives = ("moe_wgrad_range_kernel", "gluon_wgrad_kernel", "gluon_swiglu_bwd_kernel")
    step = [k for k in triton_kernel_flops(shape, 10, backward=True) if k.kernel not in alternatives]
    bwd = [(k.kernel, k.flops) for k in step[len(forward):]]
    assert bwd == [("moe_swiglu_bwd_kernel", 2 * 10 * 64 * 48),       # g: 61,440
                   ("moe_gemm2_kernel", 2 * 10 * 96 * 64),            # dx: 122,880
                   ("moe_wgrad_kernel", 2 * 10 * 96 * 64),            # d gate_up: 122,880
                   ("moe_wgrad_kernel", 2 * 10 * 64 * 48)]            # d down: 61,440
    for kernel in alternatives[:2]:                                   # the same two launches
        assert [k.flops for k in triton_kernel_flops(shape, 10, backward=True) if k.kernel == kernel] \
            == [2 * 10 * 96 * 64, 2 * 10 * 64 * 48]
    # On Hopper the training step's Gluon d down gathers dout's rows itself up to 64 rows an expert
    # (800 Qwen3 tokens: 50), one launch; above (4,000 tokens: 250) it runs four times, on four column
    # chunks of its own sorted copy of dout, each a quarter of the FLOPs.
    qwen = MoEShape(128, 2048, 768, 8)
    quarter = ("d down_proj, 1 of 4 column chunks", 2 * 4000 * 8 * 2048 * 768 // 4)
    for tokens, launches in ((800, [("d down_proj", 2 * 800 * 8 * 2048 * 768)]), (4000, [quarter] * 4)):
        gluon = [(k.role, k.flops) for k in triton_kernel_flops(qwen, tokens * 8, backward=True)
                 if k.kernel == "gluon_wgrad_kernel"]
        assert gluon == [("d gate_up_proj", 2 * tokens * 8 * 1536 * 2048), *launches], tokens
    # The normal path's GEMMs of a training step: the roofline's 3x the forward (a, b saved).
    total = sum(k.flops for k in step if not k.kernel.startswith("decode_") and "fp8" not in k.kernel)
    train = training_traffic(shape, 5, torch.zeros(5, 2, dtype=torch.int32), torch.float32).flops
    assert total == 552_960 == train


def test_forward_gemm_bytes_and_floors_match_a_hand_count():
    """The least bytes of each forward GEMM launch: the weights of the experts hit (FP8: e4m3 data and
    one fp32 scale per 128 x 128 block), x read, h written (GEMM1), h read, y written (GEMM2); a
    launch's floor is the larger of its bytes over the copy ceiling and its FLOPs over the matmul
    ceiling, the FP8 one for the FP8 GEMMs (`moekit profile`'s floor_ms)."""
    from types import SimpleNamespace

    from moekit.bench.profile import gemm_floors

    shape = MoEShape(8, 128, 128, 2)
    # 3 tokens, 5 valid pairs (one id outside [0, E)), experts 0, 1, 2 hit
    ids = torch.tensor([[0, 1], [1, 2], [0, 9]])
    dense = forward_gemm_bytes(shape, 3, 5, 3, 2)
    gemm1 = 3 * 256 * 128 * 2 + (3 + 5) * 128 * 2           # weights of 3 experts, x (3 rows), h (5 rows)
    assert dense["moe_gemm1_swiglu_kernel"] == dense["decode_gemm1_swiglu_kernel"] == gemm1
    assert dense["moe_gemm2_kernel"] == dense["decode_gemm2_sum_kernel"] == 3 * 128 * 128 * 2 + 10 * 128 * 2
    fp8 = forward_gemm_bytes(shape, 3, 5, 3, 2, fp8=True)
    fp8_gemm1 = (3 * 256 * 128 + 3 * 2 * 4) + 8 * 128 * 2                  # data + scales, x, h
    assert fp8["moe_gemm1_fp8_kernel"] == fp8["gluon_gemm1_fp8_kernel"] == fp8_gemm1
    assert fp8["moe_gemm2_fp8_kernel"] == (3 * 128 * 128 + 3 * 4) + 10 * 128 * 2
    work = SimpleNamespace(shape=shape, tokens=3, x=torch.zeros(3, 128, dtype=torch.bfloat16),
                           traffic=traffic(shape, 3, ids, torch.bfloat16))
    gemm1_flops = 2 * 5 * 128 * 256
    by_bytes = gemm_floors(work, 5, Ceilings(copy_gbps=1000.0, matmul_tflops=100.0, fp8_tflops=200.0), True)
    assert by_bytes["moe_gemm1_fp8_kernel"] == pytest.approx(fp8["moe_gemm1_fp8_kernel"] / 1e12 * 1e3)
    by_flops = gemm_floors(work, 5, Ceilings(copy_gbps=1e9, matmul_tflops=100.0, fp8_tflops=200.0), True)
    assert by_flops["moe_gemm1_fp8_kernel"] == pytest.approx(gemm1_flops / 200e12 * 1e3)
    assert by_flops["moe_gemm1_swiglu_kernel"] == pytest.approx(gemm1_flops / 100e12 * 1e3)


def test_device_rows_sum_launches_and_give_each_gemm_its_floor():
    """`moekit profile`'s kernel rows from device intervals: launches and ms per kernel and role, the
    device-busy union, useful GFLOP by launch order, and floor_ms / pct_floor for the kernels given
    a floor (summed over their launches)."""
    from moekit.bench.profile import device_rows

    shape = MoEShape(8, 64, 48, 2)
    flops = triton_kernel_flops(shape, 10)
    events = [(0.0, 10.0, "align_hist_kernel"), (10.0, 110.0, "moe_gemm1_swiglu_kernel"),
              (105.0, 155.0, "moe_gemm2_kernel"), (200.0, 210.0, "moe_sum_kernel")]
    rows = device_rows(events, flops, {"moe_gemm1_swiglu_kernel": 0.05, "moe_gemm2_kernel": 0.01})
    busy, *kernels = rows
    assert busy == {"item": "(device busy)", "count": 4, "ms": pytest.approx(0.165)}   # 155 + 10 µs
    by = {r["item"]: r for r in kernels}
    assert [r["item"] for r in kernels][:2] == ["moe_gemm1_swiglu_kernel", "moe_gemm2_kernel"]
    g1, g2 = by["moe_gemm1_swiglu_kernel"], by["moe_gemm2_kernel"]
    assert (g1["count"], g1["ms"]) == (1, pytest.approx(0.1))
    assert g1["gflop"] == pytest.approx(2 * 10 * 64 * 96 / 1e9)
    assert (g1["floor_ms"], g1["pct_floor"]) == (0.05, pytest.approx(50.0))
    assert (g2["floor_ms"], g2["pct_floor"]) == (0.01, pytest.approx(20.0))
    assert "floor_ms" not in by["moe_sum_kernel"] and math.isnan(by["moe_sum_kernel"]["gflop"])
    twice = device_rows([(0.0, 30.0, "moe_gemm2_fp8_kernel"), (40.0, 50.0, "moe_gemm2_fp8_kernel")], (),
                        {"moe_gemm2_fp8_kernel": 0.01})[1]          # two launches: two floors, 40 µs
    assert (twice["count"], twice["floor_ms"], twice["pct_floor"]) == (2, 0.02, pytest.approx(50.0))


def test_launches_are_told_apart_by_their_order():
    flops = triton_kernel_flops(TINY, 4, backward=True)
    names = ["align_hist_kernel", "moe_gemm1_swiglu_kernel", "moe_gemm2_kernel", "moe_sum_kernel",
             "moe_swiglu_bwd_kernel", "moe_tile_sum_kernel", "moe_gemm2_kernel", "moe_sum_kernel",
             "moe_wgrad_kernel", "moe_wgrad_kernel", "moe_wgrad_kernel"]
    roles = [k.role if k else None for k in label_launches(names, flops)]
    assert roles == [None, "GEMM1: gate/up + SwiGLU", "GEMM2: down + weight", None,
                     "SwiGLU backward: g (a, b saved)", None, "dx: dpre @ gate_up", None,
                     "d gate_up_proj", "d down_proj", None]     # a third wgrad launch: none left


# --- rows computed per pair (padding) -----------------------------------------------------------

def test_rows_computed_reads_the_alignment_of_a_known_routing():
    # E = 4: expert 0 gets 17 pairs, expert 1 three, expert 3 one, expert 2 none; one id (4) is
    # outside [0, E) and is not a pair of this rank. block_m 16: 32 + 16 + 16 rows for 21 pairs.
    ids = torch.tensor([0] * 17 + [1] * 3 + [3] + [4], dtype=torch.int32).view(11, 2)
    rc = aligned_rows(ids, 4, ExpertsConfig(block_m=16))
    assert (rc.rows, rc.pairs, rc.block_m) == (64, 21, 16)
    assert rc.rows == padded_rows([17, 3, 0, 1], 16)
    assert rc.per_pair == pytest.approx(64 / 21) and rc.padding == pytest.approx(43 / 64)
    assert str(RowsComputed(124, 100)) == "1.24 rows computed per pair, 19% padding"
    assert str(RowsComputed(64, 64)) == "1.00 rows computed per pair, 0% padding"


def test_triton_rows_follow_the_calls_config_or_the_decode_path(work, monkeypatch):
    w = work.weights
    monkeypatch.setenv("MOEKIT_DECODE_DIRECT", "0")
    rc = triton_rows(work.x, w.gate_up_proj, work.topk_ids)
    block_m = auto_config(5, w.gate_up_proj, 2, torch.float32, CPU).block_m
    counts = torch.bincount(work.topk_ids.reshape(-1).long(), minlength=8).tolist()
    assert (rc.rows, rc.pairs, rc.block_m) == (padded_rows(counts, block_m), 10, block_m)
    monkeypatch.setenv("MOEKIT_DECODE_DIRECT", "1")
    # 10 pairs over 8 experts (1.6 pairs an expert hit): still aligned; one token: the direct path,
    # one row per pair.
    assert triton_rows(work.x, w.gate_up_proj, work.topk_ids) == rc
    assert triton_rows(work.x[:1], w.gate_up_proj, work.topk_ids[:1]) == RowsComputed(2, 2)
    assert triton_rows(work.x, w.gate_up_proj, work.topk_ids, grad=True) == rc   # training: aligned


# --- the dense pair's row ------------------------------------------------------------------------

def test_the_dense_pair_is_checked_then_timed(work):
    m = run_case(for_backend(work, DENSE), DENSE, "eager", CEILINGS, FAST)
    assert m.status == "ok", m.reason
    assert m.max_err <= m.tol and m.timing.n == 2
    assert m.floor_ms == run_case(work, "loop", "eager", CEILINGS, FAST).floor_ms   # the layer's floor
    assert m.launches.kernels == 2                        # the two linears (SwiGLU outside the call)
    # Against the layer's own reference (different routing, (T, H) not (T*K, H)) it is refused.
    assert run_case(work, DENSE, "eager", CEILINGS, FAST).status == "failed"


def test_a_dense_pair_without_silu_is_refused(work, monkeypatch):
    monkeypatch.setattr("moekit.bench.dense.swiglu_pass", lambda pre, inter: pre[:, :inter] * pre[:, inter:])
    monkeypatch.setattr(runner, "time_fn", lambda *a, **k: pytest.fail("a refused pair was timed"))
    m = run_case(for_backend(work, DENSE), DENSE, "eager", CEILINGS, FAST)
    assert m.status == "failed" and "max error" in m.reason


def bench(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    return cli.run(parser.parse_args(argv))


def test_bench_times_the_dense_pair_and_records_triton_padding(tmp_path, monkeypatch):
    monkeypatch.setenv("MOEKIT_DECODE_DIRECT", "0")    # the aligned path's padding at T = 1 and 4
    out = tmp_path / "run"
    assert bench(["--quick", "--tokens", "1,4", "--backends", "triton", "--device", "cpu", "--rep", "2",
                  "--dense", "--out", str(out)]) == 0
    rows = read_csv(out / "results.csv")
    assert [(r.tokens, r.backend, r.status) for r in rows] == [
        (1, "triton", "ok"), (1, DENSE, "ok"), (4, "triton", "ok"), (4, DENSE, "ok")]
    for t in (1, 4):
        tri, dense = (r for r in rows if r.tokens == t)
        assert tri.flops == dense.flops == 2 * t * 2 * 3 * 64 * 48     # the same FLOPs: 2 S 3HI
        assert dense.floor_ms == tri.floor_ms and math.isnan(dense.rows_per_pair)
        assert dense.tflops == pytest.approx(dense.flops / dense.median_ms / 1e9)
        block_m = auto_config(t, torch.empty(8, 96, 64), 2, torch.float32, CPU).block_m
        rows_computed = round(tri.rows_per_pair * 2 * t)
        assert rows_computed % block_m == 0 and 2 * t <= rows_computed <= 2 * t * block_m
        if t == 1:
            assert tri.rows_per_pair == block_m   # two pairs on two experts, each padded to a block
    table = (out / "report.md").read_text().split("### Median time per call")[1].split("###")[0]
    head = "| triton (eager) | dense (eager) | triton (eager): % of dense pair |"
    assert table.splitlines()[4].endswith(head)
    for t, line in zip((1, 4), table.splitlines()[6:8]):
        tri, dense = (r for r in rows if r.tokens == t)
        share = fmt_pct(100 * dense.median_ms / tri.median_ms)
        assert line.startswith(f"| {t} |") and line.endswith(f"| {share} |")
    padding = (out / "report.md").read_text().split("### Rows computed per pair")[1].split("###")[0]
    assert f"| 1 | {rows[0].rows_per_pair:.2f} |" in padding
    assert f"| 4 | {rows[2].rows_per_pair:.2f} |" in padding


def _plan(argv: list[str]):
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    return cli._resolve_plan(parser.parse_args(argv), cli.Console(quiet=True))[0]


def test_the_dense_pair_is_on_by_default_with_cuda_only(monkeypatch):
    assert DENSE not in _plan(["--device", "cpu"]).backends            # the CPU's noisiest rows: opt-in
    assert _plan(["--device", "cpu", "--dense", "--backends", "loop"]).backends == ("loop", DENSE)
    assert DENSE not in _plan(["--backward", "--device", "cpu"]).backends
    monkeypatch.setattr(cli.arg_types, "resolve_device", lambda device: torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (80 << 30, 80 << 30))  # its memory
    plan = _plan(["--backends", "triton"])
    assert plan.backends == ("triton", "layer", DENSE) and plan.modes == ("eager", "graph")
    assert _plan(["--backends", "triton", "--no-dense", "--no-layer"]).backends == ("triton",)


def test_no_dense_and_backward_leave_it_out(tmp_path, capsys):
    out = tmp_path / "run"
    assert bench(["--quick", "--tokens", "2", "--backends", "loop", "--device", "cpu", "--rep", "1",
                  "--out", str(out)]) == 0
    assert [r.backend for r in read_csv(out / "results.csv")] == ["loop"]
    assert "% of dense pair" not in (out / "report.md").read_text()
    assert bench(["--backward", "--dense", "--device", "cpu", "--out", str(tmp_path / "x")]) == 2
    assert "--dense: the dense pair is timed forward only" in capsys.readouterr().err


# --- the report -----------------------------------------------------------------------------------

def _timed(t: int, backend: str, mode: str, ms: float, **kw):
    return make_row(tokens=t, backend=backend, mode=mode, median_ms=ms, p20_ms=ms, p80_ms=ms, **kw)


def test_report_sets_triton_against_the_dense_pair_in_graph_mode():
    rows = [_timed(t, b, m, ms, rows_per_pair=rpp if b == "triton" else math.nan)
            for t, rpp in ((1024, 1.48), (4096, 1.24))
            for b, m, ms in (("triton", "eager", 3.0), ("triton", "graph", 2.0), ("grouped_mm", "graph", 5.0),
                             (DENSE, "eager", 1.8), (DENSE, "graph", 1.5 if t == 4096 else 0.5))]
    assert share_of_dense(rows) == ("graph", {1024: 25.0, 4096: 75.0})
    text = render(rows)
    table = text.split("### Median time per call")[1].split("###")[0]
    head = "| dense (eager) | dense (graph) | triton (graph): % of dense pair |"
    assert table.splitlines()[4].endswith(head)
    assert table.splitlines()[6].startswith("| 1024 |") and table.splitlines()[6].endswith("| 25% |")
    assert table.splitlines()[7].startswith("| 4096 |") and table.splitlines()[7].endswith("| 75% |")
    padding = text.split("### Rows computed per pair (triton's tiles)")[1].split("###")[0]
    assert "| 1024 | 1.48 | 32% |" in padding and "| 4096 | 1.24 | 19% |" in padding
    # A failed dense row leaves its T without a share ("–"); eager is used when no graph pair exists.
    lost = (1024, DENSE, "graph")
    failed = [replace(r, status="failed", median_ms=math.nan) if (r.tokens, r.backend, r.mode) == lost else r
              for r in rows]
    assert share_of_dense(failed) == ("graph", {4096: 75.0})
    table = render(failed).split("### Median time per call")[1].split("###")[0]
    assert table.splitlines()[6].endswith("| failed | – |")
    assert share_of_dense([r for r in rows if r.mode == "eager"]) == ("eager", {1024: 60.0, 4096: 60.0})


def test_report_without_dense_rows_or_padding_is_unchanged():
    text = render(sample_rows())
    assert "% of dense pair" not in text and "Rows computed per pair" not in text and "*dense*" not in text


def test_flops_are_not_claimed_for_other_kernels():
    flops = triton_kernel_flops(TINY, 4, backward=True)
    assert label_launches(["gemm_cutlass_xyz", "moe_sum_kernel"], flops) == [None, None]
    assert all(isinstance(k, KernelFlops) and k.flops > 0 for k in flops)


def test_rows_per_pair_round_trips_and_is_checked(tmp_path):
    path = tmp_path / "results.csv"
    write_csv([make_row(rows_per_pair=1.24), make_row(backend="loop")], path)
    a, b = STUDY.read(path)
    assert a.rows_per_pair == 1.24 and math.isnan(b.rows_per_pair)
    write_csv([make_row(rows_per_pair=0.5)], path)
    with pytest.raises(ValueError, match="column 'rows_per_pair' must be >= 1"):
        STUDY.read(path)
