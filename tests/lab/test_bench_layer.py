"""The whole layer beside `moekit bench`'s backends (backend "layer": `MoELayer`, router included, as a
user calls it; on a GPU its eager calls of at most 16 tokens replay its eager graphs)."""

from __future__ import annotations

import argparse

import pytest
import torch

from helpers import run_cli
from moekit.bench import cli
from moekit.bench.ceilings import Ceilings
from moekit.bench.results import read_csv
from moekit.bench.runner import LAYER, backend_factory, make_weights, make_workload, run_case
from moekit.shapes import PRESETS


def _plan(argv: list[str]):
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    return cli._resolve_plan(parser.parse_args(argv), cli.Console(quiet=True))[0]


def test_the_layer_is_on_by_default_with_cuda_only(monkeypatch, capsys):
    assert LAYER not in _plan(["--device", "cpu"]).backends
    assert _plan(["--device", "cpu", "--layer", "--backends", "loop"]).backends == ("loop", LAYER)
    monkeypatch.setattr(cli.arg_types, "resolve_device", lambda device: torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (80 << 30, 80 << 30))  # its memory
    assert LAYER in _plan(["--backends", "triton"]).backends
    assert LAYER not in _plan(["--backends", "triton", "--no-layer"]).backends
    assert LAYER not in _plan(["--backward", "--backends", "triton"]).backends


def test_the_layer_is_refused_with_backward(tmp_path, capsys):
    assert run_cli(["bench", "--backward", "--layer", "--device", "cpu", "--out", str(tmp_path / "x")]) == 2
    assert "--layer: the layer is timed forward only" in capsys.readouterr().err


def test_the_layer_shares_the_weights_routes_the_same_and_passes_the_check():
    shape = PRESETS["tiny"]
    weights = make_weights(shape, torch.float32, torch.device("cpu"))
    work = make_workload("tiny", shape, 7, weights, torch.float32, torch.device("cpu"), routing_draws=2)
    call = backend_factory(LAYER)(work)
    layer = call.func
    assert layer.gate_up_proj.data_ptr() == weights.gate_up_proj.data_ptr()
    assert layer.router_weight.data_ptr() == weights.router_weight.data_ptr()
    assert not layer.gate_up_proj.requires_grad
    out = call()
    check = work.expected.check(out)
    assert check.ok, check.reason
    m = run_case(work, LAYER, "eager", Ceilings(10.0, 0.1))
    assert m.status == "ok" and m.max_err <= m.tol


def test_bench_times_the_layer_and_the_report_says_what_it_is(tmp_path):
    out = tmp_path / "run"
    assert run_cli(["bench", "--quick", "--tokens", "4", "--backends", "triton", "--layer", "--device", "cpu",
                     "--rep", "1", "--out", str(out)]) == 0
    rows = read_csv(out / "results.csv")
    assert [(r.backend, r.status) for r in rows] == [("triton", "ok"), (LAYER, "ok")]
    assert rows[1].floor_ms == pytest.approx(rows[0].floor_ms)
    text = (out / "report.md").read_text()
    assert "*layer* is the whole `MoELayer`" in text and "| layer (eager) |" in text
