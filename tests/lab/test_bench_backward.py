"""`moekit bench --backward`: the flag, a CPU run end to end (CSV, report), the gradient gate refusing
a broken backward (never timed), CSVs from before the direction column, and on the GPU the timed
rows with their peak memory."""

from __future__ import annotations

import argparse
import csv
import math
from dataclasses import replace

import pytest
import torch

import moekit.experts.triton as triton_experts
from moekit.bench import backward, cli, runner, study
from moekit.bench.args import default_backends
from moekit.bench.ceilings import Ceilings
from moekit.bench.correctness import GRAD_NAMES, expected_grads
from moekit.bench.report import BACKWARD_BASELINE, STUDY, render
from moekit.bench.results import COLUMNS, read_csv, write_csv
from moekit.bench.runner import make_weights, make_workload
from moekit.bench.sweep import Plan
from moekit.experts import has_backward
from moekit.graphs import capture_graph
from moekit.shapes import PRESETS
from result_rows import make_row, sample_rows

CPU = torch.device("cpu")


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    return parser.parse_args(argv)


def bench(argv: list[str]) -> int:
    return cli.run(parse(argv))


@pytest.fixture
def fake_ceilings(monkeypatch):
    """The ceilings are not what these tests check: skip measuring them (a second or two each)."""
    monkeypatch.setattr(study, "measure_ceilings", lambda *a, **k: Ceilings(20.0, 0.2))


def test_the_flag_parses_and_defaults_follow_the_registry():
    assert parse(["--backward"]).backward and not parse([]).backward
    args = parse(["--backward", "--device", "cpu"])
    plan, _ = cli._resolve_plan(args, cli.Console(quiet=True))
    assert plan.direction == "fwd+bwd" and plan.modes == ("eager",)
    assert plan.tokens == cli.BACKWARD_CPU_TOKENS
    assert plan.backends == tuple(b for b in default_backends() if has_backward(b, CPU))
    forward, _ = cli._resolve_plan(parse(["--device", "cpu"]), cli.Console(quiet=True))
    assert forward.direction == "fwd" and forward.backends == default_backends()


@pytest.mark.parametrize("argv,message", [
    (["--peers"], "--backward: Transformers' experts"),
])
def test_backward_refuses_what_it_cannot_time(tmp_path, capsys, monkeypatch, argv, message):
    monkeypatch.setattr(cli.peers, "transformers_version", lambda: "5.0")
    assert bench(["--backward", *argv, "--device", "cpu", "--out", str(tmp_path / "x")]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_cpu_run_writes_fwd_bwd_rows_and_the_report(tmp_path, capsys, fake_ceilings):
    out = tmp_path / "run"
    assert bench(["--backward", "--tokens", "1,3", "--rep", "2", "--warmup", "0", "--device", "cpu",
                  "--out", str(out)]) == 0
    assert "forward + backward" in capsys.readouterr().out
    rows = read_csv(out / "results.csv")
    timed = [b for b in default_backends() if has_backward(b, CPU)]
    assert [(r.tokens, r.backend) for r in rows] == [(t, b) for t in (1, 3) for b in timed]
    shape = PRESETS["tiny"]
    for r in rows:
        assert r.status == "ok", r.reason
        assert r.direction == "fwd+bwd" and r.mode == "eager" and r.n_rep == 2
        assert math.isnan(r.peak_mib)                            # not measured on the CPU, never made up
        assert r.flops == 3 * r.tokens * shape.top_k * 2 * shape.params_per_expert
        assert r.pct_floor == pytest.approx(100 * r.floor_ms / r.median_ms)
        assert 0 <= r.max_err <= r.tol
    report = (out / "report.md").read_text()
    assert "forward + backward" in report and "peak MiB" in report
    assert f"Speed-up over {BACKWARD_BASELINE} = its time / this time" in report   # timed on the CPU too
    assert not list(out.glob("*.png"))                           # the plots draw forward rows only


def test_a_backend_without_a_backward_here_is_skipped(tmp_path, fake_ceilings):
    no_grad = [b for b in default_backends() if not has_backward(b, CPU)]
    if not no_grad:
        pytest.skip("every backend differentiates on the CPU")
    out = tmp_path / "run"
    assert bench(["--backward", "--tokens", "2", "--backends", f"loop,{no_grad[0]}", "--rep", "1",
                  "--warmup", "0", "--device", "cpu", "--out", str(out)]) == 0
    ok, skipped = read_csv(out / "results.csv")
    assert ok.status == "ok" and skipped.status == "skipped" and "no backward on cpu" in skipped.reason


def test_a_broken_backward_fails_the_gate_and_is_not_timed(tmp_path, monkeypatch, fake_ceilings):
    real = triton_experts.experts_triton_backward

    def zero_down_proj_grad(*args, **kwargs):
        dx, d_gu, d_down, d_w = real(*args, **kwargs)
        return dx, d_gu, torch.zeros_like(d_down), d_w

    monkeypatch.setattr(triton_experts, "experts_triton_backward", zero_down_proj_grad)
    out = tmp_path / "run"
    assert bench(["--backward", "--tokens", "2", "--backends", "loop,triton", "--rep", "1", "--warmup", "0",
                  "--device", "cpu", "--out", str(out)]) == 0
    loop, tri = read_csv(out / "results.csv")
    assert loop.status == "ok"
    assert tri.status == "failed" and tri.reason.startswith("d down_proj: max error")
    assert math.isnan(tri.median_ms) and tri.n_rep is None and tri.max_err > tri.tol
    assert f"T=2 triton (eager): **failed**: {tri.reason}" in (out / "report.md").read_text()


def test_the_gradient_check_names_what_is_wrong():
    shape = PRESETS["tiny"]
    work = make_workload("tiny", shape, 3, make_weights(shape, torch.float32, CPU), torch.float32, CPU)
    grad_out = torch.randn(3, shape.hidden_size)
    wt = work.weights
    expected = expected_grads(work.x, wt.gate_up_proj, wt.down_proj, work.topk_weights, work.topk_ids,
                              grad_out)
    good = [r.clone() for r in expected.refs]
    assert expected.check(good).ok and expected.check(good).max_err == 0
    for i, name in enumerate(GRAD_NAMES):
        assert expected.check(good[:i] + [None] + good[i + 1:]).reason == f"no gradient for {name}"
        nan = good[i].clone().view(-1).index_fill_(0, torch.tensor([0]), math.nan).view_as(good[i])
        assert expected.check(good[:i] + [nan] + good[i + 1:]).reason == f"d {name} has NaN or Inf"
    assert not expected.check(good[:3]).ok and not expected.check(good[0]).ok


def test_a_fwd_bwd_plan_takes_both_modes_and_the_gpu_default_graphs_the_step():
    layer = cli.arg_types.preset_layer("tiny")
    plan = Plan((layer,), (1,), ("triton",), ("eager", "graph"), torch.float32, CPU, direction="fwd+bwd")
    assert plan.num_cases == 2
    args = parse(["--backward", "--device", "cpu", "--graph"])
    assert cli._resolve_plan(args, cli.Console(quiet=True))[0].modes == ("eager", "graph")
    if torch.cuda.is_available():
        gpu, _ = cli._resolve_plan(parse(["--backward", "--device", "cuda"]), cli.Console(quiet=True))
        assert gpu.modes == ("eager", "graph")
    with pytest.raises(ValueError, match="direction must be one of"):
        Plan((layer,), (1,), ("triton",), ("eager",), torch.float32, CPU, direction="backward")


def test_a_csv_from_before_the_direction_column_still_reads(tmp_path):
    path = tmp_path / "results.csv"
    write_csv(sample_rows(), path)
    keep = COLUMNS.index("threads")                          # older still: before --threads too
    lines = list(csv.reader(path.read_text().splitlines()))
    assert lines[0][keep:] == ["threads", "direction", "peak_mib", "cache", "rows_per_pair", "weights"]
    path.write_text("\n".join(",".join(f'"{c}"' if "," in c else c for c in line[:keep]) for line in lines)
                    + "\n")
    rows = STUDY.read(path)
    assert len(rows) == len(sample_rows())
    assert all(r.direction == "fwd" and math.isnan(r.peak_mib) and r.threads is None and r.cache == ""
               and math.isnan(r.rows_per_pair) for r in rows)


def test_a_bad_direction_is_refused_naming_the_column(tmp_path):
    path = tmp_path / "results.csv"
    write_csv([make_row(direction="backwards")], path)
    with pytest.raises(ValueError, match="column 'direction'") as info:
        STUDY.read(path)
    assert str(path) in str(info.value)


def test_report_of_forward_and_backward_rows():
    fwd = sample_rows()
    train = [make_row(direction="fwd+bwd", backend=b, tokens=t, median_ms=ms * t, peak_mib=mib)
             for t in (4, 16) for b, ms, mib in ((BACKWARD_BASELINE, 4.0, 30.0), ("triton", 2.0, 10.0))]
    train.append(make_row(direction="fwd+bwd", backend="loop", tokens=16, status="failed",
                          reason="d hidden_states: max error 1 > 0.1", median_ms=math.nan))
    text = render(fwd + train)
    assert "### Median time per call, ms (% of floor)" in text           # the forward section is kept
    section = text.split(": forward + backward")[1]
    assert f"speed-up over {BACKWARD_BASELINE} |" in section
    for t in (4, 16):
        base = next(r for r in train if r.tokens == t and r.backend == BACKWARD_BASELINE)
        tri = next(r for r in train if r.tokens == t and r.backend == "triton")
        line = next(ln for ln in section.splitlines() if ln.startswith(f"| triton | eager | {t} |"))
        assert line.endswith(f"| {tri.peak_mib:.0f} | {base.median_ms / tri.median_ms:.2f}× |"), line
    assert "- T=16 loop (eager): **failed**: d hidden_states: max error 1 > 0.1" in section
    assert "CUDA graph" not in section                                    # no graph rows: not mentioned
    assert "3 × the forward's" in text


def test_report_sets_graph_rows_against_the_baseline_of_their_own_mode():
    train = [make_row(direction="fwd+bwd", backend=b, tokens=8, mode=m, median_ms=ms,
                      peak_mib=mib if m == "eager" else math.nan)
             for m, scale in (("eager", 1.0), ("graph", 0.5))
             for b, ms, mib in ((BACKWARD_BASELINE, 6.0 * scale, 30.0), ("triton", 2.0 * scale, 10.0))]
    section = render(train).split(": forward + backward")[1]
    assert "recorded in one CUDA graph" in section
    eager = next(ln for ln in section.splitlines() if ln.startswith("| triton | eager | 8 |"))
    graph = next(ln for ln in section.splitlines() if ln.startswith("| triton | graph | 8 |"))
    assert eager.endswith("| 10 | 3.00× |") and graph.endswith("| 3.00× |"), (eager, graph)
    assert "| 10 |" not in graph                       # no peak for a graph row: its pool holds memory


def test_graph_rows_on_the_cpu_are_not_capturable_and_say_why(tmp_path, fake_ceilings):
    out = tmp_path / "run"
    assert bench(["--backward", "--graph", "--tokens", "2", "--backends", "loop", "--rep", "1",
                  "--warmup", "0", "--device", "cpu", "--out", str(out)]) == 0
    eager, graph = read_csv(out / "results.csv")
    assert (eager.mode, eager.status) == ("eager", "ok")
    assert (graph.mode, graph.status) == ("graph", "not_capturable")
    assert "CUDA device" in graph.reason and math.isnan(graph.median_ms)
    assert f"T=2 loop (graph): **not capturable**: {graph.reason}" in (out / "report.md").read_text()


def test_peak_memory_is_not_measured_on_the_cpu():
    shape = PRESETS["tiny"]
    work = backward.training_workload(make_workload("tiny", shape, 2, make_weights(shape, torch.float32, CPU),
                                                    torch.float32, CPU))
    step = backward.TrainingStep(work, "loop")
    assert math.isnan(backward.peak_mib(step, CPU))
    grads = step()
    assert work.expected.check(grads).ok
    assert all(g is not None for g in grads) and step.leaves[0].grad is grads[0]
    with pytest.raises(ValueError, match="fwd\\+bwd workload"):
        backward.TrainingStep(replace(work, grad_out=None), "loop")


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "grouped_mm"])
def test_gpu_rows_are_timed_with_their_peak_memory(backend):
    """Qwen3-30B-A3B bf16 at T = 1024: the gate passes, the step is timed, and its peak holds at least
    the weight gradients it returns (all E experts, in bf16)."""
    device = torch.device("cuda")
    shape = PRESETS["qwen3-30b-a3b"]
    weights = make_weights(shape, torch.bfloat16, device)
    work = backward.training_workload(make_workload("qwen3-30b-a3b", shape, 1024, weights, torch.bfloat16,
                                                    device, routing_draws=1))
    m = backward.run_training_case(work, backend, Ceilings(4000.0, 700.0), cli.QUICK)
    assert m.status == "ok", m.reason
    assert math.isfinite(m.median_ms) and m.median_ms > 0
    grad_bytes = shape.num_experts * shape.expert_bytes(torch.bfloat16)
    assert m.peak_mib * backward.MIB >= grad_bytes


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "grouped_mm"])
def test_gpu_the_step_in_a_cuda_graph_is_checked_and_timed(backend):
    """Qwen3-30B-A3B bf16 at T = 1024, the whole step in one CUDA graph: the replay's gradients
    (poisoned first) pass the fp32 gate and the replays are timed; triton's equal its eager
    step's bit for bit (deterministic kernels, same alignment), and a second replay gives them
    again."""
    device = torch.device("cuda")
    shape = PRESETS["qwen3-30b-a3b"]
    weights = make_weights(shape, torch.bfloat16, device)
    work = backward.training_workload(make_workload("qwen3-30b-a3b", shape, 1024, weights, torch.bfloat16,
                                                    device, routing_draws=1))
    m = backward.run_training_case(work, backend, Ceilings(4000.0, 700.0), cli.QUICK, mode="graph")
    assert m.status == "ok", m.reason
    assert math.isfinite(m.median_ms) and m.median_ms > 0 and math.isnan(m.peak_mib)
    if backend != "triton":
        return
    step = backward.TrainingStep(work, backend)
    eager = [g.clone() for g in step()]
    graph, grads = capture_graph(step, device)
    for g in grads:
        g.fill_(math.nan)
    for _ in range(2):
        graph.replay()
        torch.cuda.synchronize()
        for name, a, b in zip(GRAD_NAMES, grads, eager):
            assert torch.equal(a, b), f"d {name}: the graph's gradient differs from the eager step's"


def test_a_graphs_static_gradients_are_poisoned_before_its_first_replay():
    """The graph mode's static output is a training step's tuple of gradients: every float tensor
    in it is NaN-filled (so a gradient a replay never writes fails the check), nothing else."""
    grads = (torch.ones(3), None, torch.ones(2, 2, dtype=torch.float16))
    ids = torch.arange(4)
    runner._poison((*grads, ids))
    assert torch.isnan(grads[0]).all() and torch.isnan(grads[2]).all()
    assert torch.equal(ids, torch.arange(4))
    single = torch.zeros(5)
    runner._poison(single)
    assert torch.isnan(single).all()
