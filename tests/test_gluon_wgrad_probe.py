"""scripts/gluon_wgrad_probe.py on the CPU: the script imports (moekit's Gluon kernel, defined, not
compiled), its variants fit sm_90's shared memory, and `--help` works. The kernel itself is checked
by `gluon_wgrad_probe.py --aot` or `aot_compile_check.py --gluon-wgrad` and on a GPU
(tests/test_gluon_wgrad.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from helpers import load_script

pytest.importorskip("triton.experimental.gluon")

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gluon_wgrad_probe.py"


def test_imports_with_its_variants():
    from moekit.grouped_gemm.gluon_wgrad import gluon_wgrad_kernel
    from moekit.tuning import GLUON_COOP_WGRAD, GLUON_PP_WGRAD

    mod = load_script("gluon_wgrad_probe")
    assert mod.GLUON_ERROR is None
    assert mod.gluon_wgrad_kernel is gluon_wgrad_kernel            # moekit's kernel, not a copy
    assert {"coop_128x256", "pp_128x128", "pp_64x256"} <= set(mod.VARIANTS)
    assert {GLUON_COOP_WGRAD, GLUON_PP_WGRAD} <= set(mod.VARIANTS.values())   # the runtime's tiles
    for name, tiles in mod.VARIANTS.items():
        assert mod.smem_bytes(name) <= mod.SMEM_LIMIT, name
        # the tiles divide both launches' (N, C): gate_up (1536, 2048), down (2048, 768)
        assert all(n % tiles.block_n == 0 and c % tiles.block_c == 0
                   for n, c in ((1536, 2048), (2048, 768))), name


def test_help():
    done = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert "--aot" in done.stdout and "--out" in done.stdout and "--tokens" in done.stdout
