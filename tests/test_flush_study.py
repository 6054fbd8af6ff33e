"""scripts/flush_study.py on the CPU (the interpreter, a tiny shape): every case is checked against
the error rule and timed under the three flushes; timings are never asserted."""

from __future__ import annotations

import json

import pytest
import torch

from helpers import load_script


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU form of the script")
def test_flush_study_smoke_on_cpu(tmp_path):
    script = load_script("flush_study")
    out = tmp_path / "rows.jsonl"
    argv = ["--device", "cpu", "--tokens", "3", "--rep", "1", "--decode", "4", "--out", str(out)]
    assert script.main(argv) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["case"] for r in rows] == ["read probe", "triton", "grouped_mm", "direct 4"]
    for r in rows:
        assert "error" not in r and r["tokens"] == 3 and r["bytes"] > 0
        assert all(r[f"{m}_ms"] > 0 for m in ("write", "clean", "none"))
    assert all(r["err_vs_fp32"] <= 1e-5 for r in rows[1:])     # fp32 on the CPU
