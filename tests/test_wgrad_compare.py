"""scripts/wgrad_compare.py on the CPU (the interpreter, a tiny shape): every variant is checked
against the error rule and accounted for in the rows; timings are never asserted."""

from __future__ import annotations

import json

import pytest
import torch

from helpers import aot_compile_check, load_script
from moekit.bench.wgrad import CANDIDATES, CPU_CANDIDATES, LAUNCHES, legacy_tiles
from moekit.tuning import ExpertsConfig, WgradConfig, shared_memory_limit


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU form of the script")
def test_wgrad_compare_smoke_on_cpu(tmp_path, capsys):
    out = tmp_path / "rows.jsonl"
    assert load_script("wgrad_compare").main(["--device", "cpu", "--tokens", "9", "--out", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["variant"] for r in rows] == ["old", "default"] + [t.label() for t in CPU_CANDIDATES]
    for r in rows:
        assert "error" not in r, r
        assert r["tokens"] == 9 and r["ms"] > 0 and r["pct_ceiling"] is None
        for k in LAUNCHES:
            assert r[f"err_{k}"] <= 2 * r[f"base_err_{k}"]
    text = capsys.readouterr().out
    assert "best first" in text and "NOT TIMED" not in text


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU form of the script")
def test_wgrad_compare_padding_zero_variants_on_cpu(tmp_path):
    out = tmp_path / "rows.jsonl"
    script = load_script("wgrad_compare")
    assert script.main(["--device", "cpu", "--tokens", "9", "--only", "0", "--padding-zero",
                        "--out", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    names = ["old", "default", CPU_CANDIDATES[0].label()]
    assert [r["variant"] for r in rows] == [n + s for n in names for s in ("", script.PZ)]
    only = tmp_path / "only.jsonl"
    assert script.main(["--device", "cpu", "--tokens", "9", "--only", "2", "--padding-zero", "only",
                        "--out", str(only)]) == 0
    rows += [json.loads(line) for line in only.read_text().splitlines()]
    names = ["old", "default", CPU_CANDIDATES[2].label()]      # the range kernel over 2 experts
    assert [r["variant"] for r in rows[6:]] == [n + script.PZ for n in names]
    # The gathered operands copied into sorted-row order first: every check passes, copies timed apart.
    presorted = tmp_path / "presorted.jsonl"
    assert script.main(["--device", "cpu", "--tokens", "9", "--only", "0", "--padding-zero", "only",
                        "--presorted", "--out", str(presorted)]) == 0
    more = [json.loads(line) for line in presorted.read_text().splitlines()]
    names = ["old", "default", CPU_CANDIDATES[0].label()]
    assert [r["variant"] for r in more] == [n + s + script.PZ for s in ("", script.XS) for n in names]
    for r in more:
        assert "error" not in r, r
        assert ("ms_copy_down" in r) is (script.XS in r["variant"])
    rows += more
    for r in rows:
        assert "error" not in r, r
        assert r["padding_zero"] is r["variant"].endswith(" pz")
        for k in LAUNCHES:
            assert r[f"err_{k}"] <= 2 * r[f"base_err_{k}"]


def test_candidates_are_distinct_and_launchable_on_hopper():
    assert len(set(CANDIDATES)) == len(CANDIDATES) and WgradConfig() in CANDIDATES
    assert all(t.pipeline_bytes(2) <= shared_memory_limit(None) for t in CANDIDATES)
    old = legacy_tiles(ExpertsConfig(block_m=128, block_n1=128, block_k1=64, block_n2=256, block_k2=64))
    assert old == dict.fromkeys(LAUNCHES, WgradConfig(64, 64, 64, 4, 3))


def test_wgrad_kernel_compiles_for_sm90_without_spills():
    """The old and the default tiles and a range-kernel candidate, every launch, through ptxas for
    sm_90 (skipped where this Triton has no CUDA backend or ptxas)."""
    ranged = str(CANDIDATES.index(WgradConfig(128, 128, 64, 8, 3, experts=8)))   # the range kernel
    out = aot_compile_check("--wgrad", f"old,default,{ranged}", "--regs")
    assert "3/3 wgrad variants compile" in out
    lines = [line for line in out.splitlines() if line.startswith("wgrad ")]
    assert len(lines) == 3 and all("r/" in line and " local " not in line for line in lines), lines


def test_gluon_wgrad_kernel_compiles_for_sm90_without_spills():
    """The Hopper Gluon weight gradient's two tiles (bf16 and fp16) and its row gather, through ptxas
    for sm_90 (skipped where this Triton has no Gluon, CUDA backend or ptxas)."""
    out = aot_compile_check("--gluon-wgrad", "--regs")
    assert "5/5 gluon wgrad kernels compile" in out
    lines = [line for line in out.splitlines() if line.startswith("gluon-wgrad ")]
    assert len(lines) == 5 and all(" OK " in line and "r " in line and " local " not in line
                                   for line in lines), lines


def test_gluon_swiglu_kernel_compiles_for_sm90():
    """The Hopper Gluon SwiGLU backward's two tiles (bf16 and fp16) and a launch storing dpre_w alone,
    through ptxas for sm_90, within the shared-memory limit (skipped where this Triton has no Gluon,
    CUDA backend or ptxas). The 128-column tiles spill loop counters (reported, allowed)."""
    out = aot_compile_check("--gluon-swiglu", "--regs")
    assert "5/5 gluon swiglu kernels compile" in out
    lines = [line for line in out.splitlines() if line.startswith("gluon-swiglu ")]
    assert len(lines) == 5 and all(" OK " in line and "r " in line for line in lines), lines
