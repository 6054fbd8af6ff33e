"""scripts/swiglu_bwd_compare.py on the CPU (the interpreter, a tiny shape): every variant is checked
against the error rule and accounted for in the rows; timings are never asserted."""

from __future__ import annotations

import json

import pytest
import torch

from helpers import load_script
from moekit.grouped_gemm.backward import SAVED_TILES, SAVED_TILES_64, saved_tiles


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU form of the script")
def test_swiglu_bwd_compare_smoke_on_cpu(tmp_path, capsys):
    script = load_script("swiglu_bwd_compare")
    out = tmp_path / "rows.jsonl"
    assert script.main(["--device", "cpu", "--tokens", "9", "--out", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["variant"] for r in rows] == ["default"] + [t.label() for t in script.CPU_CANDIDATES]
    assert rows[0]["tiles"] == saved_tiles(rows[0]["block_m"]).label()
    for r in rows:
        assert "error" not in r, r
        assert r["tokens"] == 9 and r["ms"] > 0
        for k in script.OUTPUTS:
            assert r[f"err_{k}"] <= 2 * r[f"base_err_{k}"], (r["variant"], k)
    text = capsys.readouterr().out
    assert "best first" in text and "NOT TIMED" not in text


def test_gpu_candidates_are_distinct_saved_tiles():
    script = load_script("swiglu_bwd_compare")
    assert len(set(script.GPU_CANDIDATES)) == len(script.GPU_CANDIDATES)
    assert all(not t.recompute for t in script.GPU_CANDIDATES) and SAVED_TILES in script.GPU_CANDIDATES
    assert SAVED_TILES_64 in script.GPU_CANDIDATES
