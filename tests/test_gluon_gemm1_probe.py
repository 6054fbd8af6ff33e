"""scripts/gluon_gemm1_probe.py on the CPU: the script imports (its Gluon kernel is defined, not compiled),
its launcher refuses what the kernel does not take, and `--help` works. The kernel itself is checked by
`gluon_gemm1_probe.py --aot` (sm_90 compile) and on a GPU."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import load_script

pytest.importorskip("triton.experimental.gluon")

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gluon_gemm1_probe.py"


def test_imports_with_its_variants():
    mod = load_script("gluon_gemm1_probe")
    assert mod.GLUON_ERROR is None
    assert {"gluon", "gluon_s3", "gluon_s3c"} <= set(mod.VARIANTS)
    assert mod.TOKENS == (2048, 4096, 8192, 16384)
    assert mod.PRODUCER_WARPS == 4


def test_launcher_refuses_what_the_kernel_does_not_take():
    from moekit.align import align_block_size_torch

    mod = load_script("gluon_gemm1_probe")
    ids = torch.randint(0, 8, (16, 2), dtype=torch.int32)
    x = torch.empty(16, 256, dtype=torch.bfloat16)
    gate_up = torch.empty(8, 2 * 128, 256, dtype=torch.bfloat16)
    align = align_block_size_torch(ids, 8, 32)
    with pytest.raises(ValueError, match="block_m 32"):
        mod.gluon_gemm1(x, gate_up, align, 2, paired=False)
    align = align_block_size_torch(ids, 8, 128)
    with pytest.raises(ValueError, match="paired True"):
        mod.gluon_gemm1(x, gate_up, align, 2, paired=True)
    narrow = torch.empty(8, 2 * 96, 256, dtype=torch.bfloat16)     # I = 96: not a multiple of block_n
    with pytest.raises(ValueError, match="multiple of block_n"):
        mod.gluon_gemm1(x, narrow, align, 2, paired=False)


def test_help():
    done = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    for flag in ("--aot", "--out", "--tokens", "--variants", "--no-flush", "--unplaced"):
        assert flag in done.stdout
