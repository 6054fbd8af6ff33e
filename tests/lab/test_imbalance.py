"""`moekit imbalance`: capacity counting by hand, the padded refusal, and the CLI end to end (CPU)."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from moekit import moe_experts
from moekit.bench.args import default_backends
from moekit.bench.imbalance import dropped_pairs, kept_mask, padded_refusal
from moekit.bench.imbalance_report import STUDY, ImbalanceRow
from moekit.bench.results import write_csv
from moekit.bench.scenarios import expert_loads, make_scenario, save_trace
from moekit.bench.study import CSV_NAME, REPORT_NAME
from moekit.cli import main
from moekit.experts.padded import capacity
from moekit.reference import moe_experts_ref
from moekit.shapes import PRESETS
from result_rows import imbalance_rows

# Hand example: E=4, K=2, T=6, S=12 pairs; expert 3 gets none. Pair order is t*K + k.
HAND_IDS = torch.tensor([[0, 1], [0, 2], [1, 0], [0, 2], [2, 0], [0, 1]])
# loads: expert 0 -> 6 pairs (p = 0, 2, 5, 6, 9, 10), expert 1 -> 3 (p = 1, 4, 11), expert 2 -> 3 (3, 7, 8)


@pytest.mark.parametrize(
    "c, cap, dropped, kept_rows",
    [
        # cap 3: expert 0 keeps pairs 0, 2, 5 (tokens 0, 1, 2), drops 6, 9, 10; experts 1 and 2 fit.
        (1.0, 3, 3, [[1, 1], [1, 1], [1, 1], [0, 1], [1, 0], [0, 1]]),
        # cap 4: expert 0 also keeps pair 6 (token 3, slot 0).
        (1.25, 4, 2, [[1, 1], [1, 1], [1, 1], [1, 1], [1, 0], [0, 1]]),
        (1.5, 5, 1, [[1, 1], [1, 1], [1, 1], [1, 1], [1, 1], [0, 1]]),
        (2.0, 6, 0, [[1, 1]] * 6),
    ],
    ids=["c1", "c1.25", "c1.5", "c2"],
)
def test_capacity_drops_match_a_hand_count(c, cap, dropped, kept_rows):
    e = 4
    assert capacity(HAND_IDS.numel(), e, c) == cap
    loads = expert_loads(HAND_IDS, e)
    assert loads.tolist() == [6, 3, 3, 0]
    assert dropped_pairs(loads, cap) == dropped
    kept = kept_mask(HAND_IDS, e, cap)
    assert kept.int().tolist() == kept_rows
    # The padded backend drops exactly these pairs, and computes the layer without them.
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(6, 16, generator=gen)
    gate_up, down = torch.randn(e, 2 * 12, 16, generator=gen), torch.randn(e, 16, 12, generator=gen)
    w = torch.rand(6, 2, generator=gen)
    stats: dict = {}
    out = moe_experts(x, gate_up, down, w, HAND_IDS, backend="padded", capacity_factor=c, stats=stats)
    assert stats["capacity"] == cap and int(stats["dropped"]) == dropped
    torch.testing.assert_close(out, moe_experts_ref(x, gate_up, down, w, torch.where(kept, HAND_IDS, -1)))


def test_kept_mask_ignores_invalid_ids():
    ids = torch.tensor([[0, -1], [0, 5], [0, 1]])
    assert kept_mask(ids, 2, 2).tolist() == [[True, False], [True, False], [False, True]]


def test_padded_refusal_is_predicted_from_the_shape():
    shape = PRESETS["tiny"]
    assert padded_refusal(shape, 64, torch.float32, torch.device("cpu")) == ""
    reason = padded_refusal(shape, 64, torch.float32, torch.device("cpu"), limit_bytes=1000)
    assert "padded buffers" in reason and "cap=64" in reason


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    """One small end-to-end CPU run of the CLI with every backend, EP and capacity part."""
    out = tmp_path_factory.mktemp("imbalance")
    trace = save_trace(out / "trace.npy", make_scenario("zipf-1.5", 40, 8, 2, seed=3)[1])
    code = main(["imbalance", "--preset", "tiny", "--tokens", "48", "--scenarios", "balanced,collapse",
                 "--trace", str(trace), "--ep", "4", "--spare-slots", "1", "--capacity-factors", "1,1.5",
                 "--rep", "1", "--warmup", "0", "--out", str(out)])
    return code, out


def test_cli_runs_on_cpu_and_writes_everything(study):
    code, out = study
    assert code == 0
    rows = STUDY.read(out / CSV_NAME)
    assert {r.scenario for r in rows} == {"balanced", "collapse", "file"}
    assert all(r.status == "ok" for r in rows), [(r.scenario, r.experiment, r.reason) for r in rows
                                                 if r.status != "ok"]
    one = [r for r in rows if r.experiment == "one_gpu"]
    assert {(r.scenario, r.backend) for r in one} == {
        (s, b) for s in ("balanced", "collapse", "file") for b in default_backends()}
    assert all(r.median_ms > 0 and r.commit is not None and r.device_type == "cpu" for r in one)
    for name in ("imbalance_one_gpu_tiny.png", "imbalance_ep_tiny.png", "imbalance_capacity_tiny.png",
                 REPORT_NAME):
        assert (out / name).stat().st_size > 0
    report = (out / REPORT_NAME).read_text()
    assert "## Load imbalance: tiny, T = 48" in report
    assert [line for line in report.splitlines() if line.startswith("> CPU run: ")] == [
        "> CPU run: Triton interpreted at a small T, so this shows the study's flow, not GPU performance."]


def test_cli_skew_ep_and_capacity_rows(study):
    _, out = study
    rows = STUDY.read(out / CSV_NAME)
    by = {r.scenario: r for r in rows if r.experiment == "one_gpu"}
    assert by["balanced"].busiest_over_mean == 1.0
    assert by["collapse"].busiest_over_mean == 4.0                      # E / K
    steps = {(r.scenario, r.placement): r for r in rows if r.experiment == "ep_step"}
    # Collapse puts experts 0 and 1, all 96 pairs, on rank 0 of 4: slowest / mean of pairs = 4.
    assert steps["collapse", "contiguous"].pairs_busiest_over_mean == 4.0
    for s in ("balanced", "collapse", "file"):
        before, after = steps[s, "contiguous"], steps[s, "replicated"]
        assert after.busiest_rank_pairs <= before.busiest_rank_pairs
        ranks = [r for r in rows if r.experiment == "ep" and r.scenario == s and r.placement == "contiguous"]
        assert sorted(r.rank for r in ranks) == [0, 1, 2, 3]
        assert sum(r.pairs for r in ranks) == 96
        assert before.step_ms == max(r.median_ms for r in ranks)
        assert math.isclose(before.slowest_over_mean, before.step_ms / before.mean_ms)
    collapse = steps["collapse", "replicated"], steps["collapse", "contiguous"]
    assert collapse[0].busiest_rank_pairs < collapse[1].busiest_rank_pairs
    for r in rows:
        if r.experiment == "capacity":
            _, ids = make_scenario(r.scenario, 48, 8, 2, seed=0, trace=out / "trace.npy")
            assert r.dropped == dropped_pairs(expert_loads(ids, 8), r.capacity)
            assert r.capacity == capacity(96, 8, r.capacity_factor)


def test_cli_redraw_from_csv(study, tmp_path):
    _, out = study
    assert main(["imbalance", "--redraw", str(out), "--out", str(tmp_path)]) == 0
    assert (tmp_path / REPORT_NAME).read_text() == (out / REPORT_NAME).read_text()
    bad = tmp_path / "bad.csv"
    bad.write_text("a,b\n1,2\n")
    assert main(["imbalance", "--redraw", str(bad)]) == 2


def test_report_of_two_runs_in_one_csv(tmp_path):
    """Two runs' rows concatenated in one results.csv (the same cases under two run ids): the report
    names both runs and shows each case once, from its last row."""
    first = imbalance_rows()
    second = [replace(r, run_id="20990101T000000Z", median_ms=3 * r.median_ms, p20_ms=3 * r.p20_ms,
                      p80_ms=3 * r.p80_ms) for r in first]
    write_csv([*first, *second], tmp_path / CSV_NAME, ImbalanceRow)
    assert main(["report", str(tmp_path)]) == 0
    text = (tmp_path / REPORT_NAME).read_text()
    assert f"run {first[0].run_id}, 20990101T000000Z," in text
    capacity = [ln for ln in text.splitlines() if ln.startswith("| collapse | ") and "dropped" in ln]
    assert capacity == ["| collapse | 3 ms | 6.2% dropped, 3 ms | 6.2% dropped, 3 ms |"]
    assert (tmp_path / "imbalance_capacity_tiny.png").is_file()


def test_cli_reports_a_padded_refusal_instead_of_crashing(tmp_path):
    code = main(["imbalance", "--preset", "tiny", "--tokens", "16", "--scenarios", "collapse",
                 "--backends", "padded,grouped_mm", "--ep", "0", "--capacity-factors", "1.0",
                 "--memory-limit-gb", "1e-6", "--rep", "1", "--warmup", "0", "--out", str(tmp_path)])
    assert code == 0
    rows = STUDY.read(tmp_path / CSV_NAME)
    status = {(r.experiment, r.backend): r for r in rows}
    assert status["one_gpu", "grouped_mm"].status == "ok"
    for key in (("one_gpu", "padded"), ("capacity", "padded")):
        assert status[key].status == "skipped" and "padded buffers" in status[key].reason
        assert math.isnan(status[key].median_ms)
    assert "padded buffers" in (tmp_path / REPORT_NAME).read_text()


def test_cli_help(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["imbalance", "--help"])
    assert exc.value.code == 0 and "--memory-limit-gb" in capsys.readouterr().out


@pytest.mark.parametrize("argv", [["--scenarios", "nope"], ["--ep", "9"], ["--trace", "/nonexistent/t.npy"],
                                  ["--backends", "fast"], ["--ep-backend", "fast"]],
                         ids=["scenario", "ep", "trace", "backend", "ep-backend"])
def test_cli_rejects_bad_arguments_before_measuring(argv, tmp_path, capsys):
    try:
        code = main(["imbalance", "--preset", "tiny", "--out", str(tmp_path), *argv])
    except SystemExit as exc:   # refused while parsing
        code = exc.code
    assert code == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1].startswith("moekit imbalance: error: ") and "Traceback" not in err
    assert not (tmp_path / CSV_NAME).exists()


def test_cli_unknown_ep_backend_names_the_flag(tmp_path, capsys):
    argv = ["imbalance", "--preset", "tiny", "--tokens", "8", "--rep", "1", "--backends", "loop"]
    assert main([*argv, "--ep-backend", "foo", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1].startswith("moekit imbalance: error: --ep-backend: ")
    assert "'foo'" in err and not (tmp_path / CSV_NAME).exists()


@pytest.mark.gpu
@pytest.mark.parametrize("extra", [[], ["--graph", "--backends", "padded,triton", "--placement", "strided"]],
                         ids=["eager", "graph"])
def test_cli_on_gpu_real_shape(extra, tmp_path):
    code = main(["imbalance", "--preset", "qwen3-30b-a3b", "--tokens", "512", "--scenarios",
                 "balanced,zipf-1.0,collapse", "--capacity-factors", "1,2", "--rep", "3", "--warmup", "1",
                 "--out", str(tmp_path), *extra])
    assert code == 0
    rows = STUDY.read(tmp_path / CSV_NAME)
    bad = [(r.scenario, r.experiment, r.backend, r.status, r.reason) for r in rows if r.status != "ok"]
    # The padded backend without a capacity factor syncs on the busiest count: not capturable.
    assert all(b[2] == "padded" and b[1] == "one_gpu" and b[3] == "not_capturable" for b in bad), bad
    steps = {(r.scenario, r.placement): r for r in rows if r.experiment == "ep_step"}
    base = "strided" if extra else "contiguous"
    # Collapse on 8 ranks: contiguous puts experts 0..7 (all pairs) on rank 0; strided one per rank.
    assert steps["collapse", base].pairs_busiest_over_mean == (1.0 if extra else 8.0)
    assert steps["collapse", "replicated"].busiest_rank_pairs <= steps["collapse", base].busiest_rank_pairs
    assert all(r.device_type == "cuda" and r.median_ms > 0 for r in rows if r.experiment == "one_gpu"
               and r.status == "ok")
