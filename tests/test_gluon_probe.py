"""scripts/gluon_probe.py on the CPU: the script imports (its Gluon kernels are defined, none is compiled)
and `--help` works. The kernels themselves are checked by `gluon_probe.py --aot` and on a GPU."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from helpers import load_script

pytest.importorskip("triton.experimental.gluon")

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gluon_probe.py"


def test_imports_with_its_variants():
    mod = load_script("gluon_probe")
    assert mod.GLUON_ERROR is None
    assert {"gluon_ws", "gluon_pipe", "triton", "torch"} <= set(mod.DENSE_VARIANTS)
    assert mod._ws_maxnreg(2) == 168 and mod._ws_maxnreg(1) == 256


def test_help():
    done = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert "--aot" in done.stdout and "--out" in done.stdout
