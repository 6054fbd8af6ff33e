"""The weight-gradient kernel's tiles under study (`moekit.bench.wgrad`, `moekit sweep --set wgrad`):
the candidates launch on Hopper, and the kernels compile for sm_90 (`tools/aot_compile_check.py`)."""

from __future__ import annotations

from helpers import aot_compile_check
from moekit.bench.wgrad import CANDIDATES, LAUNCHES, legacy_tiles
from moekit.tuning import ExpertsConfig, WgradConfig, shared_memory_limit


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
