"""The examples under examples/ run as their docstrings say, on the CPU: each exits 0 and prints its
own check's verdict (generation: moekit's tokens identical to Transformers' eager experts; fine-tuning:
the loss curve within its bound of eager's at every step)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from helpers import ROOT

pytest.importorskip("transformers")


def _run(script: str, *args: str) -> str:
    done = subprocess.run([sys.executable, str(ROOT / "examples" / script), "--device", "cpu", *args],
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return done.stdout


def test_generate_example_matches_eager_token_for_token():
    out = _run("qwen3_moe_generate.py", "--new-tokens", "8")
    assert "identical outputs: True" in out


def test_finetune_example_trains_as_eager_does():
    out = _run("qwen3_moe_finetune.py", "--steps", "4")
    assert out.strip().splitlines()[-1].startswith("verdict: PASS")
