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
    assert {"pp_64x128", "pp_64x64"} <= set(mod.VARIANTS)
    for name, (block_n, stages, _tma_epi, (producer_regs, consumer_regs)) in mod.VARIANTS.items():
        assert mod.smem_bytes(name) <= mod.SMEM_LIMIT, name
        assert 768 % block_n == 0 and 2048 % mod.BK == 0 and 2048 // mod.BK > mod.PRE_STEP, name
        assert stages >= 2 and producer_regs + 2 * consumer_regs <= 512, name


def test_help():
    done = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert "--aot" in done.stdout and "--out" in done.stdout and "--tokens" in done.stdout
