"""scripts/gluon_swiglu_bwd_probe.py on the CPU: the script imports (its Gluon kernel is defined, not
compiled), its variants fit sm_90's shared memory and tile Qwen3-30B-A3B's I, and `--help` works. The
kernel itself is checked by `gluon_swiglu_bwd_probe.py --aot` (a Triton 3.6 install) and on a GPU."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from helpers import load_script

pytest.importorskip("triton.experimental.gluon")

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gluon_swiglu_bwd_probe.py"


def test_imports_with_its_variants():
    mod = load_script("gluon_swiglu_bwd_probe")
    assert mod.GLUON_ERROR is None
    assert {"pp_64x128", "pp_64x128_s5", "pp_64x64"} <= set(mod.VARIANTS)
    # the runtime's tiles are among the variants timed (the kernel is the runtime's)
    from moekit.grouped_gemm.gluon_swiglu_bwd import gluon_swiglu_bwd_kernel
    from moekit.tuning import GLUON_SWIGLU_64, GLUON_SWIGLU_128

    assert mod.gluon_swiglu_bwd_kernel is gluon_swiglu_bwd_kernel
    assert {GLUON_SWIGLU_128, GLUON_SWIGLU_64} <= set(mod.VARIANTS.values())
    for name, tiles in mod.VARIANTS.items():
        assert mod.smem_bytes(name) <= mod.SMEM_LIMIT, name
        assert 768 % tiles.block_n == 0 and 2048 % mod.BK == 0 and 2048 // mod.BK > mod.PRE_STEP, name
        assert tiles.stages >= 2 and tiles.producer_regs + 2 * tiles.consumer_regs <= 512, name


def test_help():
    done = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert "--aot" in done.stdout and "--out" in done.stdout and "--tokens" in done.stdout
