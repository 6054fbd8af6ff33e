"""scripts/host_overhead.py in its smoke mode (a tiny shape, a few loops): every phase is reported,
the stubbed launches are counted, the kernels are restored afterwards. Timings are not asserted."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

from helpers import load_script

ROOT = Path(__file__).resolve().parents[1]


def _script():
    return load_script("host_overhead")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU form of the script")
@pytest.mark.parametrize("direct", ["0", "1"], ids=["normal-path", "direct-decode"])
def test_smoke_reports_every_phase_and_restores_the_kernels(capsys, monkeypatch, direct):
    """The phases of the normal path are timed either way; the experts call and the layer launch what
    the backend runs: 4 experts kernels on the normal path, 2 on the direct decode one (the default)."""
    monkeypatch.setenv("MOEKIT_DECODE_DIRECT", direct)
    mod = _script()
    runs = [vars(k).get("run") for k in mod.kernels()]
    assert mod.main(["--smoke", "--json", "--binder"]) == 0
    result = json.loads(capsys.readouterr().out.splitlines()[-1])["this tree"]
    for phase in (*mod.PHASES, "linear"):
        assert isinstance(result[phase], float)
    experts = 2 if direct == "1" else 4
    assert result["launches"] == {"router": 1, "prepare": 0, "align": 1, "gemm1": 1, "gemm2": 1, "sum": 1,
                                  "experts": experts, "layer": experts + 1}
    assert result["ops"]["layer"] and "empty" in result["ops"]["layer"]
    binder = result["binder"]
    if not binder.get("error"):     # a Triton without its CUDA backend says why instead
        launched = ({"topk_softmax_kernel", "decode_gemm1_swiglu_kernel", "decode_gemm2_sum_kernel"}
                    if direct == "1" else {"topk_softmax_kernel", "align_scatter_kernel",
                                           "moe_gemm1_swiglu_kernel", "moe_gemm2_kernel", "moe_sum_kernel"})
        assert set(binder["us_per_launch"]) == launched
    assert [vars(k).get("run") for k in mod.kernels()] == runs      # no stub left behind


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU form of the script")
def test_smoke_table_against_a_git_ref(capsys):
    inside = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True)
    if inside.returncode != 0:
        pytest.skip("not a git checkout")
    assert _script().main(["--smoke", "--baseline", "HEAD", "--rounds", "1"]) == 0
    text = capsys.readouterr().out
    header = next(line for line in text.splitlines() if line.startswith("phase"))
    assert "HEAD" in header and "this tree" in header and "change" in header
    for row in ("router (us)", "align (us)", "layer (us)", "layer torch ops/call", "layer Triton launches"):
        assert row in text


def test_host_helpers_match_triton():
    import triton

    from moekit._host import cdiv, next_power_of_2

    for n in range(-4, 4200):
        assert next_power_of_2(n) == triton.next_power_of_2(n)
        for d in (1, 3, 16, 64, 128):
            assert cdiv(n, d) == triton.cdiv(n, d)


@pytest.mark.parametrize("dtype", [torch.int32, torch.bfloat16, torch.float32])
def test_empty_parts_are_disjoint_and_16_byte_aligned(dtype):
    from moekit import _workspace

    sizes = (5, 0, 3, 129, 1)
    parts = _workspace.empty_parts(sizes, dtype=dtype, device="cpu")
    assert [p.numel() for p in parts] == list(sizes) and all(p.is_contiguous() for p in parts)
    assert all(p.data_ptr() % 16 == 0 for p in parts)
    spans = sorted((p.data_ptr(), p.data_ptr() + p.numel() * p.element_size()) for p in parts)
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))
    with _workspace.poisoning():
        poisoned = _workspace.empty_parts(sizes, dtype=dtype, device="cpu")
    fill = float("nan") if dtype.is_floating_point else torch.iinfo(dtype).min
    for p in poisoned:
        assert torch.equal(p, torch.full_like(p, fill)) if not dtype.is_floating_point else p.isnan().all()
