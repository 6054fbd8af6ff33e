"""scripts/gluon_gemm2_probe.py on the CPU: the script imports (its Gluon kernel is defined, not compiled),
its launcher refuses what the kernel does not take, and `--help` works. The kernel itself is checked by
`gluon_gemm2_probe.py --aot` (sm_90 compile) and on a GPU."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import load_script

pytest.importorskip("triton.experimental.gluon")

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gluon_gemm2_probe.py"


def test_imports_with_its_variants():
    mod = load_script("gluon_gemm2_probe")
    assert mod.GLUON_ERROR is None
    assert {"gluon", "gluon_direct", "gluon_n128"} <= set(mod.VARIANTS)
    assert mod.TOKENS == (2048, 4096, 8192, 16384)
    assert mod.SUB_M_ROWS == 64


def test_launcher_refuses_other_alignments():
    from moekit.align import align_block_size_torch

    mod = load_script("gluon_gemm2_probe")
    ids = torch.randint(0, 8, (16, 2), dtype=torch.int32)
    weights = torch.rand(16, 2)
    down = torch.empty(8, 256, 64, dtype=torch.bfloat16)
    align = align_block_size_torch(ids, 8, 32)
    h = torch.empty(align.sorted_ids.numel(), 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="block_m 32"):
        mod.gluon_gemm2(h, down, weights, align, paired=False)
    align = align_block_size_torch(ids, 8, 128)
    with pytest.raises(ValueError, match="paired True"):
        mod.gluon_gemm2(h, down, weights, align, paired=True)


def test_help():
    done = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    for flag in ("--aot", "--out", "--tokens", "--variants", "--no-flush"):
        assert flag in done.stdout
