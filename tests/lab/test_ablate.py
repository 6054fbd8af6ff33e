"""`moekit ablate`: the CPU run end to end, the redraw from the CSV alone, the fp32 gate of every
variant against planted bugs (a refused variant is recorded as failed, never timed), padding counted
by hand, the Nsight Compute parsing, and one-line errors for bad arguments."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from moekit.align import Alignment, align_block_size
from moekit.bench import ablate_variants, runner, study
from moekit.bench.ablate_bytes import find_ncu, ncu_problem, parse_ncu_csv
from moekit.bench.ablate_report import ABLATIONS, BYTES_VARIANT, STUDY, TILE_VARIANTS, VARIANTS, AblateRow
from moekit.bench.ablate_variants import BUILDERS, MEASURED, Setup, build
from moekit.bench.ceilings import Ceilings
from moekit.bench.kernel_work import padded_rows, padding_fraction
from moekit.bench.results import write_csv
from moekit.bench.runner import Options, make_weights, make_workload, run_case
from moekit.bench.study import CSV_NAME, REPORT_NAME
from moekit.cli import main
from moekit.experts import moe_experts
from moekit.experts.triton import experts_triton
from moekit.grouped_gemm import gemm2_weighted
from moekit.shapes import PRESETS

PNG = b"\x89PNG\r\n\x1a\n"
CEILINGS = Ceilings(10.0, 0.1)
ONE_CALL = Options(warmup=0, rep=1, routing_draws=1)
TOKENS = (1, 5)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One CPU run of the CLI: every ablation at T = 1 and 5, one timed call per case."""
    out = tmp_path_factory.mktemp("ablate")
    code = main(["ablate", "--tokens", ",".join(map(str, TOKENS)), "--rep", "1", "--warmup", "0",
                 "--out", str(out)])
    return code, out


@pytest.fixture(scope="module")
def setup():
    """The tiny layer at T = 5 (one expert left without a pair by this seed's router, checked below)."""
    shape = PRESETS["tiny"]
    weights = make_weights(shape, torch.float32, torch.device("cpu"), seed=0)
    work = make_workload("tiny", shape, 5, weights, torch.float32, torch.device("cpu"), routing_draws=1)
    return Setup(work)


def test_cli_writes_csv_report_and_a_figure_per_ablation(run):
    code, out = run
    assert code == 0
    rows = STUDY.read(out / CSV_NAME)
    timed = {(r.variant, r.tokens) for r in rows if r.variant != BYTES_VARIANT}
    assert timed == {(v, t) for v in MEASURED for t in TOKENS}
    assert all(r.status == "ok" and r.median_ms > 0 and r.mode == "eager" for r in rows
               if r.variant not in (BYTES_VARIANT, "fp8")), [(r.variant, r.reason) for r in rows
                                                            if r.status != "ok"]
    fp8 = [r for r in rows if r.variant == "fp8"]          # tiny's H = 64: no 128 x 128 blocks
    assert fp8 and all(r.status == "skipped" and "divisible by 128" in r.reason for r in fp8)
    skipped = [r for r in rows if r.variant == BYTES_VARIANT]
    assert {r.tokens for r in skipped} == {1, 64} and all(r.status == "skipped" for r in skipped)
    assert all("CPU" in r.reason for r in skipped)
    for key in ABLATIONS:
        if key != "bytes":                 # no counters on the CPU: no figure, a skip in the report
            assert (out / f"ablate_{key}_tiny.png").read_bytes()[:8] == PNG, key
    report = (out / REPORT_NAME).read_text()
    for title, _ in ABLATIONS.values():
        assert f"## {title}" in report
    assert report.count("(interpreter timings, not GPU ones)") >= 5
    assert report.count("The article") >= len(ABLATIONS)
    assert "no Nsight Compute counters on the CPU" in report
    assert "`align_triton` at this commit: one Triton launch up to" in report   # a fresh run: this code's


def test_report_redraws_the_folder_from_the_csv_alone(run, tmp_path, capsys):
    _, out = run
    assert study.find_results(out)[0].name == "ablate"
    assert main(["report", str(out / CSV_NAME), "--out", str(tmp_path)]) == 0
    assert "ablate rows" in capsys.readouterr().out
    assert (tmp_path / REPORT_NAME).read_text() == (out / REPORT_NAME).read_text()
    drawn = sorted(p.name for p in out.iterdir() if p.name != CSV_NAME)
    assert sorted(p.name for p in tmp_path.iterdir()) == drawn


def test_a_run_of_some_ablations_reports_those_alone(run, tmp_path):
    """Rows of the fp8 ablation alone (its `layer` baseline and its `fp8` rows) give the fp8 section and
    figure, and the graph one (`layer` eager and replayed), but none of the other comparisons against
    `layer` (SwiGLU, weight, masked), whose own variants never ran."""
    _, out = run
    rows = [r for r in STUDY.read(out / CSV_NAME) if r.variant in ("layer", "fp8")]
    write_csv(rows, tmp_path / CSV_NAME, AblateRow)
    assert main(["report", str(tmp_path)]) == 0
    report = (tmp_path / REPORT_NAME).read_text()
    shown = {key for key, (title, _) in ABLATIONS.items() if f"## {title}" in report}
    assert shown == {"graph", "fp8"}
    assert sorted(p.name for p in tmp_path.glob("*.png")) == ["ablate_fp8_tiny.png", "ablate_graph_tiny.png"]


def test_the_report_names_the_switches_its_run_set(run, tmp_path):
    _, out = run
    rows = [replace(r, switches="MOEKIT_PDL=0") for r in STUDY.read(out / CSV_NAME)]
    report = STUDY.write(rows, tmp_path)[-1].read_text()
    assert "- switches set away from their defaults: `MOEKIT_PDL=0`" in report
    assert "switches set away" not in (out / REPORT_NAME).read_text()


def test_tile_rows_count_their_padding(run):
    """Paired tiles compute the rows of their block_m; the rows' padding is the hand count's."""
    _, out = run
    rows = {(r.variant, r.tokens): r for r in STUDY.read(out / CSV_NAME)}
    for t in TOKENS:
        for bm in (16, 32, 64, 128):
            single, paired = rows[f"tile_{bm}", t], rows[f"tile_{bm}x2", t]
            assert (single.block_m, single.pair_blocks, paired.pair_blocks) == (bm, 1, 2)
            assert single.padded_rows == paired.padded_rows and single.pairs == paired.pairs == 2 * t
            assert single.padded_rows % bm == 0 and single.padded_rows >= single.pairs


# Hand example: E=4, T=6, K=2, S=12 pairs; loads [6, 3, 3, 0] (expert 3 gets none).
HAND_IDS = torch.tensor([[0, 1], [0, 2], [1, 0], [0, 2], [2, 0], [0, 1]])


@pytest.mark.parametrize("block_m, rows, frac",
                         [(1, 12, 0.0), (2, 14, 2 / 14), (4, 16, 0.25), (16, 48, 0.75)],
                         ids=["bm1", "bm2", "bm4", "bm16"])
def test_padding_fraction_matches_a_hand_count(block_m, rows, frac):
    # bm 2: 6 + 4 + 4 + 0 = 14 rows; bm 4: 8 + 4 + 4 = 16; bm 16: one block of 16 per busy expert.
    counts = torch.bincount(HAND_IDS.reshape(-1), minlength=4).tolist()
    assert counts == [6, 3, 3, 0]
    assert padded_rows(counts, block_m) == rows
    assert math.isclose(padding_fraction(counts, block_m), frac)
    assert int(align_block_size(HAND_IDS, 4, block_m, backend="torch").num_padded) == rows
    assert AblateRow(**_row_head(), variant="tile_16", mode="eager", status="ok", padded_rows=rows,
                     pairs=12).padding_frac == pytest.approx(frac)


def test_every_variant_has_a_builder_and_a_description():
    assert set(BUILDERS) == set(VARIANTS) - {BYTES_VARIANT}
    assert all(v in VARIANTS for _, variants in ABLATIONS.values() for v in variants)
    assert set(TILE_VARIANTS) == {v for v in VARIANTS if v.startswith("tile_")}


def test_layer_variant_is_the_triton_backend(setup):
    """`layer` times what moe_experts(backend='triton') runs: the same output, bit for bit."""
    x, gate_up, down, w, ids = setup.args
    triton_backend = experts_triton(x, gate_up, down, w, ids, config=setup.config)
    assert torch.equal(build("layer", setup).call(), triton_backend)
    assert 0 in setup.counts and sum(setup.counts) == ids.numel()        # an expert left idle


def _row_head() -> dict:
    from result_rows import PROVENANCE

    return dict(PROVENANCE, preset="tiny", num_experts=8, hidden_size=64, intermediate_size=48, top_k=2,
                tokens=5, seed=0)


@pytest.fixture
def never_timed(monkeypatch):
    """time_fn raises: a case that reaches it is an "error" row, so a "failed" row was never timed."""
    def timed(*args, **kwargs):
        raise AssertionError("a refused variant was timed")

    monkeypatch.setattr(runner, "time_fn", timed)


def _gate(setup: Setup, name: str, corrupt=None) -> runner.Measurement:
    case = build(name, setup)
    call = case.call if corrupt is None else (lambda: corrupt(case.call()))
    return run_case(replace(setup.work, expected=case.expected), name, "eager", CEILINGS, ONE_CALL,
                    lambda _work: call)


def _one_row_wrong(out):
    """A wrong output of any variant: one pair's row scaled (tensors), one pair left out (alignments)."""
    if isinstance(out, Alignment):
        ids = out.sorted_ids.clone()
        ids[int(torch.nonzero(ids < out.num_pairs)[0])] = out.num_pairs
        return replace(out, sorted_ids=ids)
    out = out.clone()
    out[0] *= 2
    return out


@pytest.mark.parametrize("name", [v for v in MEASURED if v != "fp8"])    # fp8: tests/test_bench_fp8.py
def test_every_variants_gate_refuses_a_wrong_row(name, setup, never_timed):
    m = _gate(setup, name, _one_row_wrong)
    assert m.status == "failed" and "max error" in m.reason and m.timing is None
    assert math.isnan(m.median_ms)


def _no_weight(y, weights):
    return y


def _gate_up_without_silu(pre, inter):
    return pre[:, :inter] * pre[:, inter:]


# A bug planted in one piece of the separate passes or of the kernels' launches (a name in
# ablate_variants, or a dotted path), and the variants it must sink.
PLANTED = {
    "weight_pass drops the routing weight": ("weight_pass", _no_weight, ["weight_separate"]),
    "swiglu_pass forgets silu": ("swiglu_pass", _gate_up_without_silu, ["swiglu_separate"]),
    "the dense pair's swiglu_pass forgets silu": ("moekit.bench.dense.swiglu_pass", _gate_up_without_silu,
                                                   ["dense"]),
    "unpermute_index_add drops the weight": (
        "unpermute_index_add",
        lambda y, p, t: torch.zeros(t, y.shape[1], dtype=y.dtype).index_add_(0, p.token, y), ["index_add"]),
    "unpermute_gather_sum sums one slot": (
        "unpermute_gather_sum",
        lambda y, p, t: (y * p.weight[:, None]).index_select(0, p.position).view(t, -1, y.shape[1])[:, 0],
        ["gather_sum"]),
    "permute gathers the next token": (
        "permute", lambda x, p: x.index_select(0, (p.token + 1) % x.shape[0]),
        ["gemms", "index_add", "gather_sum"]),
    "GEMM2 launched without the weights": (
        "gemm2_weighted", lambda h, down, w, align, cfg: gemm2_weighted(h, down, None, align, cfg),
        ["fused", "layer", "swiglu_separate", "tile_32x2", "grouped_gemms"]),
    "the masked backend drops pairs": (
        "moe_experts", lambda *args, backend: moe_experts(*args, backend=backend, capacity_factor=0.5),
        ["masked"]),
}


@pytest.mark.parametrize("bug", list(PLANTED))
def test_a_planted_bug_is_refused_by_each_variant_it_reaches(bug, setup, monkeypatch, never_timed):
    target, replacement, victims = PLANTED[bug]
    if "." in target:
        monkeypatch.setattr(target, replacement)
    else:
        monkeypatch.setattr(ablate_variants, target, replacement)
    for name in victims:
        m = _gate(setup, name)
        assert m.status == "failed" and m.timing is None, (bug, name, m.status, m.reason)


def test_a_refused_variant_is_a_failed_row_and_listed_untimed(tmp_path, monkeypatch):
    monkeypatch.setattr(ablate_variants, "weight_pass", _no_weight)
    assert main(["ablate", "--ablations", "weight", "--tokens", "3", "--rep", "1", "--warmup", "0",
                 "--out", str(tmp_path)]) == 0
    rows = {r.variant: r for r in STUDY.read(tmp_path / CSV_NAME)}
    assert set(rows) == {"layer", "weight_separate"} and rows["layer"].status == "ok"
    bad = rows["weight_separate"]
    assert bad.status == "failed" and math.isnan(bad.median_ms) and bad.n_rep is None and bad.kernels is None
    assert "- T=3 weight_separate (eager): **failed**: max error" in (tmp_path / REPORT_NAME).read_text()


HEADER = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Device","CC",'
          '"dram__bytes_read.sum","dram__bytes_write.sum"')
NCU_LOG = """==PROF== Connected to process 4242 (/usr/bin/python3.11)
==PROF== Profiling "align_scatter_kernel": 0%....50%....100% - 2 passes
""" + HEADER + """
"","","","","","","","","","byte","byte"
"0","4242","python3.11","h200","align_scatter_kernel","1","7","0","9.0","2,048","1,024"
"1","4242","python3.11","h200","moe_gemm1_swiglu_kernel","1","7","0","9.0","50,331,648","24,576"
"2","4242","python3.11","h200","moe_gemm2_kernel","1","7","0","9.0","25165824","32768"
==PROF== Disconnected from process 4242
"""


def test_ncu_raw_csv_is_parsed_per_kernel():
    kernels = parse_ncu_csv(NCU_LOG)
    assert [(k.kernel, k.read, k.write) for k in kernels] == [
        ("align_scatter_kernel", 2048, 1024), ("moe_gemm1_swiglu_kernel", 50_331_648, 24_576),
        ("moe_gemm2_kernel", 25_165_824, 32_768)]
    with pytest.raises(ValueError, match="no CSV table"):
        parse_ncu_csv("==PROF== nothing profiled\n")


def test_unreadable_counters_are_a_clear_reason():
    text = ("==ERROR== ERR_NVGPUCTRPERM - The user does not have permission to access NVIDIA GPU "
            "Performance Counters")
    assert "ERR_NVGPUCTRPERM" in ncu_problem(text, 1) and "administrators" in ncu_problem(text, 1)
    assert ncu_problem("==ERROR== Failed to profile\n", 1) == "ncu: Failed to profile"
    assert ncu_problem(NCU_LOG, 0) == "" and ncu_problem("", 3) == "ncu exited with status 3"
    assert find_ncu("/nonexistent/ncu") is None


def _no_measuring(*args, **kwargs):
    pytest.fail("the command started measuring")


@pytest.mark.parametrize("argv", [
    ["--ablations", "nope"], ["--ablations", ","], ["--tokens", "0"], ["--tokens", "1,x"],
    ["--masked-max-tokens", "0"], ["--rep", "0"], ["--warmup", "-1"], ["--preset", "nope"], ["--seed", "-1"],
    ["--device", "nosuch"], ["--out", "/dev/null/x"], ["--dtype", "int8"],
], ids=lambda a: " ".join(a))
def test_bad_argument_is_one_error_line(argv, capsys, monkeypatch):
    monkeypatch.setattr(study, "measure_ceilings", _no_measuring)
    with pytest.raises(SystemExit) as exc:
        main(["ablate", *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("moekit ablate: error: ")]
    assert len(lines) == 1 and "Traceback" not in err and argv[0] in lines[0]


@pytest.mark.skipif(torch.cuda.is_available(), reason="--graph is refused only without CUDA")
def test_graph_without_cuda_and_an_out_holding_results_are_refused(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(study, "measure_ceilings", _no_measuring)
    assert main(["ablate", "--graph", "--out", str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip() == "moekit ablate: error: --graph needs a CUDA device"
    (tmp_path / CSV_NAME).write_text("earlier results\n")
    assert main(["ablate", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("moekit ablate: error: --out") and "--overwrite" in err
    assert len(err.splitlines()) == 1


def test_redraw_refuses_a_bad_row_with_one_line(tmp_path, capsys):
    rows = [AblateRow(**_row_head(), variant="layer", mode="eager", status="ok", median_ms=1.0, p20_ms=1.0,
                      p80_ms=1.0, n_rep=1),
            AblateRow(**_row_head(), variant="nope", mode="eager", status="ok", median_ms=1.0, p20_ms=1.0,
                      p80_ms=1.0, n_rep=1)]
    write_csv(rows, tmp_path / CSV_NAME, AblateRow)
    assert main(["report", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"{CSV_NAME}:3:" in err and "variant" in err
    assert not (tmp_path / REPORT_NAME).exists()


def test_a_gpu_run_renders_graph_speed_ups_and_dram_bytes(run, tmp_path):
    """The GPU-only branches of the report, from the CPU run's rows made to look like a GPU's: graph
    rows at half the time, busy time, and Nsight Compute rows for two kernels at T = 1."""
    _, out = run
    cpu = STUDY.read(out / CSV_NAME)
    gpu = [replace(r, device_type="cuda", device_name="NVIDIA H200") for r in cpu
           if r.variant != BYTES_VARIANT]
    gpu += [replace(r, mode="graph", median_ms=r.median_ms / 2, p20_ms=r.p20_ms / 2, p80_ms=r.p80_ms / 2,
                    busy_ms=r.median_ms / 4, idle_pct=50.0) for r in gpu]
    byte_rows = [r for r in cpu if r.variant == BYTES_VARIANT]
    kernels = (("moe_gemm1_swiglu_kernel", 4000), ("moe_gemm2_kernel", 2000))
    gpu += [replace(byte_rows[0], device_type="cuda", status="ok", reason="", kernel=k, dram_read_bytes=n,
                    dram_write_bytes=n // 8) for k, n in kernels]
    gpu += [replace(byte_rows[1], device_type="cuda", reason="ncu: ERR_NVGPUCTRPERM, counters restricted")]
    write_csv(gpu, tmp_path / CSV_NAME, AblateRow)
    assert main(["report", str(tmp_path)]) == 0
    report = (tmp_path / REPORT_NAME).read_text()
    assert "| 1 | " in report and "2×" in report                      # the graph speed-up column
    assert "(interpreter timings" not in report and "at T = 5 (graph)" in report
    assert "- T = 1: 6,000 bytes read from DRAM" in report and "moe_gemm2_kernel 2,000 B read" in report
    assert "- T = 64: **skipped**: ncu: ERR_NVGPUCTRPERM" in report
    assert (tmp_path / "ablate_bytes_tiny.png").read_bytes()[:8] == PNG


def test_ablate_refuses_a_shape_it_cannot_measure(capsys):
    from moekit.cli import main

    assert main(["ablate", "--shape", "E=8,H=64,I=48,K=2", "--out", "/tmp/moekit-ablate-shape"]) != 0
    assert "--preset" in capsys.readouterr().err
