"""`moekit profile`, `sweep` and `e2e` on the CPU (tiny preset, Triton interpreted): each runs, writes
its rows and report, is redrawn by `moekit report`, and refuses bad arguments with one error line;
`moekit ep-bench --simulate` refuses what only a process group measures. Timings are never asserted."""

from __future__ import annotations

import pytest

from helpers import error_line, run_cli
from moekit.bench import e2e, ep_bench, profile, variants
from moekit.bench.study import find_results


def _read(out, study):
    found, csv_path = find_results(out)
    assert found.name == study.name
    rows = study.read(csv_path)
    assert (out / "report.md").is_file()
    return rows


def test_help_lists_the_subcommands_and_each_has_its_own(capsys):
    assert run_cli(["--help"]) == 0
    text = capsys.readouterr().out
    assert all(name in text for name in ("profile", "sweep", "e2e"))
    for name, flag in (("profile", "--what"), ("sweep", "--set"), ("e2e", "--impls")):
        assert run_cli([name, "--help"]) == 0
        assert flag in capsys.readouterr().out


def test_profile_kernels_and_host_write_rows_and_report(tmp_path):
    out = tmp_path / "p"
    argv = ["profile", "--what", "kernels,host", "--tokens", "2", "--rep", "2", "--out", str(out)]
    assert run_cli(argv) == 0
    rows = _read(out, profile.STUDY)
    assert {r.what for r in rows} == {"kernels", "host"} and all(r.status == "ok" for r in rows)
    assert any(r.item.startswith("aten::") for r in rows if r.what == "kernels")
    host = {r.item: r for r in rows if r.what == "host"}
    assert set(host) == {"router", "experts", "layer"}
    assert host["experts"].count >= 2 and host["experts"].ms > 0     # at least the two GEMMs, stubbed
    assert "## host: tiny triton fwd, T = 2" in (out / "report.md").read_text()
    (out / "report.md").unlink()
    assert run_cli(["report", str(out)]) == 0 and (out / "report.md").is_file()


def test_profile_on_fp8_weights(tmp_path, monkeypatch):
    """--weights fp8: the calls on the layer's weights in block-scaled FP8 (on the CPU the layer
    CPU_SHAPE, float16 stand-ins), rows marked fp8, the host phases without the whole layer's."""
    from moekit.bench.fp8 import CPU_SHAPE
    from moekit.bench.layers import parse_shape
    from moekit.quant import FP8_BLOCK, Fp8Weight

    made = []
    real = profile.fp8_factory
    monkeypatch.setattr(profile, "fp8_factory", lambda backend, experts: made.append(experts) or real(backend,
                                                                                                       experts))
    out = tmp_path / "p"
    argv = ["profile", "--weights", "fp8", "--what", "kernels,host", "--tokens", "2", "--rep", "2",
            "--out", str(out)]
    assert run_cli(argv) == 0
    rows = _read(out, profile.STUDY)
    assert rows and all(r.status == "ok" and r.weights == "fp8" for r in rows)
    layer = parse_shape(CPU_SHAPE)
    assert {(r.hidden_size, r.intermediate_size) for r in rows} == {(layer.shape.hidden_size,
                                                                     layer.shape.intermediate_size)}
    assert any(r.item.startswith("aten::") for r in rows if r.what == "kernels")
    host = {r.item: r for r in rows if r.what == "host"}
    assert set(host) == {"router", "experts"} and host["experts"].count >= 2     # the decode kernels, stubbed
    assert f"## kernels: {layer.name} triton fp8 fwd, T = 2" in (out / "report.md").read_text()
    e, i, h = layer.shape.num_experts, layer.shape.intermediate_size, layer.shape.hidden_size
    assert len(made) == 2 and all(isinstance(x.gate_up, Fp8Weight) for x in made)   # one call per what
    assert made[0].gate_up.scale.shape == (e, 2 * i // FP8_BLOCK, h // FP8_BLOCK)


def test_stubbed_launches_run_no_kernel_and_count_each_launch():
    import torch

    from moekit.experts import moe_experts

    x = torch.randn(3, 32)
    gate_up, down = torch.randn(4, 32, 32), torch.randn(4, 32, 16)
    w, ids = torch.full((3, 2), 0.5), torch.tensor([[0, 1], [1, 2], [2, 0]])
    sink: list = []
    with profile.stubbed_launches(sink):
        out = moe_experts(x, gate_up, down, w, ids, backend="triton", validate=False)
    assert len(sink) >= 3 and out.shape == x.shape
    sink.clear()
    moe_experts(x, gate_up, down, w, ids, backend="triton")
    assert sink == []      # restored on exit


def test_sweep_writes_one_row_per_variant_and_checks_each(tmp_path):
    out = tmp_path / "s"
    assert run_cli(["sweep", "--set", "hints,flush", "--tokens", "2", "--rep", "1", "--out", str(out)]) == 0
    rows = _read(out, variants.STUDY)
    hints, flush = ("plain", "evict", "pdl", "both"), ("write", "clean", "none")
    want = [("hints", v) for v in hints] + [("flush", v) for v in flush]
    assert [(r.variant_set, r.variant) for r in rows] == want
    assert all(r.status == "ok" and r.max_err >= 0 and r.n_rep == 1 for r in rows)
    assert rows[0].speedup == 1.0 and rows[4].speedup == 1.0      # each set against its first variant
    assert "## flush: tiny, T = 2 (eager)" in (out / "report.md").read_text()


def test_sweep_fp8_set_checks_each_variant_against_its_paths_oracle(tmp_path):
    """Dense first (the speed-up column is dense / FP8), then FP8 variants, each checked against the
    oracle of the path it runs: w8a8 tiles, and at decode sizes the decode kernels (w8a16)."""
    out = tmp_path / "f"
    assert run_cli(["sweep", "--set", "fp8", "--shape", "E=4,H=128,I=128,K=2", "--tokens", "1", "--rep", "1",
                    "--out", str(out)]) == 0
    rows = _read(out, variants.STUDY)
    grouped = ["dense", "fp8", "fp8 table", "fp8 tma", "fp8 no tma", "fp8 bm64 w4", "fp8 bm128 w8"]
    names = [r.variant for r in rows]
    assert names[:len(grouped)] == grouped and names[len(grouped)] == "fp8 direct 0"
    assert all(r.status == "ok" and r.max_err >= 0 for r in rows)
    assert "tma_weights=True" in next(r.tiles for r in rows if r.variant == "fp8 tma")


def test_sweep_rounds_time_every_variant_in_new_orders_and_take_the_medians(monkeypatch):
    """Each round times every variant once, later rounds in another order; a row's median, p20 and
    p80 are the medians of its rounds' own and spread_pct their medians' range; a variant that fails
    a round is reported so and not run again. run_case is stubbed: the order and arithmetic only."""
    import dataclasses
    import math
    import types

    from moekit.bench.results import LayerRow
    from moekit.bench.runner import Measurement
    from moekit.bench.timing import TimingStats

    names = [f"v{i}" for i in range(6)]
    ms = {"v0": [1.0, 3.0, 2.0], "v1": [4.0, 4.0, 10.0]}
    calls = []

    def fake_run_case(work, vname, mode, ceilings, opts, factory):
        calls.append(vname)
        if vname == "v5":
            return Measurement("failed", "too far off", 1.0, 0.1, 0.5, "memory")
        t = ms.get(vname, [1.0, 1.0, 1.0])[sum(c == vname for c in calls) - 1]
        return Measurement("ok", "", 0.01, 0.1, 0.5, "memory", timing=TimingStats(t, t - 0.5, t + 0.5, 7))

    stub = {n: variants.Variant(lambda _w: None) for n in names}
    monkeypatch.setitem(variants.SETS, "stub", lambda w: stub)
    monkeypatch.setattr(variants, "run_case", fake_run_case)
    head = {f.name: "x" for f in dataclasses.fields(LayerRow) if f.default is dataclasses.MISSING}
    work = types.SimpleNamespace(tokens=2)
    rows = variants.set_rows("stub", work, head, ("eager",), None, variants.CPU_OPTIONS, lambda m: None,
                             rounds=3, seed=1)
    assert calls[:6] == names and sorted(calls[6:11]) == names[:5] and sorted(calls[11:]) == names[:5]
    assert calls[6:11] != names[:5] or calls[11:] != names[:5]         # later rounds in another order
    by = {r.variant: r for r in rows}
    assert [r.variant for r in rows] == names                          # rows keep the set's order
    assert by["v0"].median_ms == 2.0 and by["v0"].p20_ms == 1.5 and by["v0"].p80_ms == 2.5
    assert by["v0"].spread_pct == 100.0 and by["v0"].n_rep == 21 and by["v0"].rounds == 3
    assert by["v1"].median_ms == 4.0 and by["v1"].spread_pct == 150.0 and by["v1"].speedup == 0.5
    assert by["v5"].status == "failed" and by["v5"].rounds == 1 and math.isnan(by["v5"].spread_pct)


def test_sweep_tile_sets_name_their_configs():
    import torch

    from moekit.bench.runner import make_weights, make_workload
    from moekit.shapes import PRESETS
    shape, dev = PRESETS["tiny"], torch.device("cpu")
    work = make_workload("tiny", shape, 8, make_weights(shape, torch.float16, dev), torch.float16, dev,
                         routing_draws=1)
    tiles = variants.tile_variants(work)
    assert list(tiles) == ["table", "persistent", "persistent+tma", "tma", "paired", "paired+tma", "packaged",
                           "default"]
    assert "persistent=True" in tiles["persistent"].tiles and "pair_blocks=2" in tiles["paired"].tiles
    group = variants.group_variants(work)
    assert "group_m=1" in group["group 1"].tiles and "block_m=32" in group["bm32"].tiles
    assert list(variants.wgrad_variants(work))[:2] == ["old", "default"]


def test_e2e_smoke_times_every_implementation_and_compares_tokens(tmp_path):
    pytest.importorskip("transformers")
    out = tmp_path / "e"
    assert run_cli(["e2e", "--impls", "moekit,free-experts", "--prompt", "8", "--new-tokens", "2",
                    "--out", str(out)]) == 0
    rows = _read(out, e2e.STUDY)
    assert {(r.impl, r.what) for r in rows} == {(i, w) for i in ("grouped_mm", "moekit", "free-experts")
                                                for w in ("prefill", "eager")}
    assert all(r.status == "ok" and r.n_rep == 1 for r in rows)
    assert all(r.median_ms > 0 for r in rows if r.what == "prefill")
    assert [r.tokens_match for r in rows if r.what == "eager"] == [1, 1, None]   # float32: no near-tie flips
    assert ("## eager: qwen3_moe (tiny stand-in: hidden 64, 8 experts), 1 layers, 2 tokens"
            in (out / "report.md").read_text())


@pytest.mark.parametrize("argv, message", [
    (["profile", "--what", "graph"], "--what graph needs a CUDA device"),
    (["profile", "--what", "flame"], "unknown profile 'flame'"),
    (["profile", "--weights", "fp8", "--backward"], "FP8 experts are inference only"),
    (["profile", "--weights", "fp8", "--backends", "triton,grouped_mm"], "--backends grouped_mm take no FP8"),
    (["profile", "--weights", "fp8", "--preset", "tiny"], "FP8 block scaling needs both divisible by 128"),
    (["sweep", "--set", "align"], "unknown set 'align'"),
    (["sweep", "--graph"], "--graph needs a CUDA device"),
    (["e2e", "--what", "compiled"], "--what compiled needs a CUDA device"),
    (["e2e", "--new-tokens", "1"], "argument --new-tokens"),
], ids=["profile-graph-cpu", "profile-what", "profile-fp8-backward", "profile-fp8-backends",
        "profile-fp8-shape", "sweep-set", "sweep-graph-cpu", "e2e-compiled-cpu", "e2e-new-tokens"])
def test_bad_arguments_get_one_error_line(argv, message, capsys, tmp_path):
    assert run_cli([*argv, "--out", str(tmp_path / "x")]) == 2
    assert message in error_line(capsys, f"moekit {argv[0]}")
    assert not (tmp_path / "x").exists()


def test_bench_says_once_that_interpreted_triton_times_the_interpreter(tmp_path, capsys):
    from moekit.bench.cli import INTERPRETER_NOTE

    argv = ["bench", "--tokens", "1", "--rep", "1", "--warmup", "0", "--no-layer", "--no-dense"]
    assert run_cli([*argv, "--backends", "triton", "--out", str(tmp_path / "a")]) == 0
    assert capsys.readouterr().out.replace("\n", " ").count(INTERPRETER_NOTE[:60]) == 1
    assert run_cli([*argv, "--backends", "loop", "--out", str(tmp_path / "b")]) == 0
    assert INTERPRETER_NOTE[:40] not in capsys.readouterr().out.replace("\n", " ")


class _Measuring(Exception):
    """Raised where ep-bench starts measuring (its provenance comes first)."""


def _stop_measuring(*args, **kwargs):
    raise _Measuring


EP_SIMULATE = ["ep-bench", "--simulate", "2", "--preset", "tiny", "--tokens", "4", "--scenarios", "balanced"]


@pytest.mark.parametrize("argv, message", [
    (["--modes", "low_latency"], "--modes low_latency needs a process group"),
    (["--modes", "normal,low_latency"], "--modes low_latency needs a process group"),
    (["--ll-tokens", "2"], "--ll-tokens needs a process group"),
    (["--a2a-mib", "3"], "--a2a-mib needs a process group"),
    (["--overlap-chunks", "1,2"], "--overlap-chunks needs a process group"),
], ids=["modes-ll", "modes-both", "ll-tokens", "a2a-mib", "overlap-chunks"])
def test_ep_bench_simulate_refuses_what_needs_a_process_group(argv, message, capsys, tmp_path, monkeypatch):
    """--simulate times no communication: these flags are one error line (stdout, like every ep-bench
    error) before anything is measured, not dropped from a run that exits 0."""
    monkeypatch.setattr(ep_bench, "measure_provenance", _stop_measuring)
    assert run_cli([*EP_SIMULATE, *argv, "--out", str(tmp_path / "x")]) == 2
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("moekit ep-bench: ")]
    assert len(lines) == 1 and message in lines[0], lines
    assert "(--simulate times no communication)" in lines[0]
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("argv", [[], ["--modes", "normal", "--overlap-chunks", "1"]],
                         ids=["unset", "normal"])
def test_ep_bench_simulate_takes_those_flags_unset_or_at_what_it_runs(argv, tmp_path, monkeypatch):
    monkeypatch.setattr(ep_bench, "measure_provenance", _stop_measuring)
    with pytest.raises(_Measuring):
        run_cli([*EP_SIMULATE, *argv, "--out", str(tmp_path / "x")])
