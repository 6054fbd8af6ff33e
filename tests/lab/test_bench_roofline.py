"""Floor arithmetic against hand-computed values, and the measured ceilings."""

from __future__ import annotations

import math

import pytest
import torch

from moekit.bench.ceilings import Ceilings, measure_ceilings
from moekit.bench.roofline import bound_of, crossover_tokens, floor_ms, traffic, training_traffic
from moekit.shapes import PRESETS

QWEN3 = PRESETS["qwen3-30b-a3b"]
# The article's roofs (RTX 4060 Laptop): 248.7 GB/s and 25.3 BF16 TFLOP/s.
ARTICLE = Ceilings(copy_gbps=248.7, matmul_tflops=25.3)
EXPERT_BYTES_BF16 = 3 * 2048 * 768 * 2  # 9,437,184 bytes = 9.44 MB


def test_qwen3_one_expert_is_9_44_mb():
    assert QWEN3.expert_bytes(torch.bfloat16) == EXPERT_BYTES_BF16 == 9_437_184


def test_qwen3_one_token_reads_eight_experts():
    ids = torch.tensor([[0, 5, 17, 33, 64, 90, 101, 127]], dtype=torch.int32)
    t = traffic(QWEN3, 1, ids, torch.bfloat16)
    assert t.experts_hit == 8
    assert t.weight_bytes == 8 * 9_437_184 == 75_497_472
    assert t.io_bytes == 2 * 2048 * 2                       # input and output row, bf16
    assert t.routing_bytes == 8 * (4 + 4)                   # int32 ids + fp32 weights
    assert t.bytes == 75_497_472 + 8_192 + 64
    assert t.flops == 8 * 2 * 4_718_592 == 75_497_472       # 75.5 million FLOPs per token
    # memory: 75,505,728 B / 248.7 GB/s = 0.30360 ms; compute: 75.5 MFLOP / 25.3 TFLOP/s = 2.98 us
    expected = 75_505_728 / 248.7e9 * 1e3
    assert floor_ms(QWEN3, 1, ids, torch.bfloat16, ARTICLE) == pytest.approx(expected, rel=1e-12)
    assert floor_ms(QWEN3, 1, ids, torch.bfloat16, ARTICLE) == pytest.approx(0.30360, abs=1e-5)
    assert bound_of(t, ARTICLE) == "memory"


def test_qwen3_one_token_forward_and_backward():
    """--backward's floor: 3x the FLOPs; the 8 experts hit read twice, the weight gradients of all 128
    written once in bf16; x, out, grad_out, x again and dx; routing read twice, its gradient once."""
    ids = torch.tensor([[0, 5, 17, 33, 64, 90, 101, 127]], dtype=torch.int32)
    t = training_traffic(QWEN3, 1, ids, torch.bfloat16)
    assert t.flops == 3 * 75_497_472
    assert t.weight_bytes == 2 * 8 * EXPERT_BYTES_BF16
    assert t.grad_bytes == 128 * EXPERT_BYTES_BF16
    assert t.io_bytes == 5 * 2048 * 2
    assert t.routing_bytes == 2 * 8 * (4 + 4) + 8 * 4
    assert t.bytes == (16 + 128) * EXPERT_BYTES_BF16 + 5 * 2048 * 2 + 160
    assert traffic(QWEN3, 1, ids, torch.bfloat16).grad_bytes == 0      # a forward writes no gradient
    assert bound_of(t, ARTICLE) == "memory"


def test_distinct_experts_set_the_weight_bytes():
    # Four tokens sharing experts: {0..7} and {4..11} -> 12 distinct, 32 pairs.
    ids = torch.tensor([list(range(8)), list(range(4, 12))] * 2, dtype=torch.int64)
    t = traffic(QWEN3, 4, ids, torch.bfloat16)
    assert t.experts_hit == 12
    assert t.weight_bytes == 12 * EXPERT_BYTES_BF16
    assert t.routing_bytes == 32 * (8 + 4)                  # int64 ids this time
    assert t.flops == 32 * 2 * QWEN3.params_per_expert


def test_large_batch_is_compute_bound():
    tokens = 4096
    ids = (torch.arange(tokens * 8) % 128).view(tokens, 8).to(torch.int32)  # every expert hit
    t = traffic(QWEN3, tokens, ids, torch.bfloat16)
    assert t.experts_hit == 128
    compute_ms = tokens * 75_497_472 / 25.3e12 * 1e3       # 12.22 ms
    memory_ms = t.bytes / 248.7e9 * 1e3                     # 1.21 GB + I/O: ~5 ms
    assert compute_ms > memory_ms
    assert floor_ms(QWEN3, tokens, ids, torch.bfloat16, ARTICLE) == pytest.approx(compute_ms, rel=1e-12)
    assert bound_of(t, ARTICLE) == "compute"


def test_invalid_ids_move_nothing():
    ids = torch.tensor([[3, -1], [128, 3]], dtype=torch.int32)  # expert-parallel sentinels
    t = traffic(QWEN3, 2, ids, torch.bfloat16)
    assert t.experts_hit == 1
    assert t.flops == 2 * 2 * QWEN3.params_per_expert


def test_crossover_is_ridge_times_e_over_k():
    # The article: ridge 102 FLOP/byte x 128/8 -> "compute-bound near T = 1,600 tokens".
    ridge = 25.3e12 / 248.7e9
    assert ARTICLE.ridge_flops_per_byte == pytest.approx(ridge)
    assert crossover_tokens(QWEN3, torch.bfloat16, ARTICLE) == pytest.approx(ridge * 16)
    assert 1550 < crossover_tokens(QWEN3, torch.bfloat16, ARTICLE) < 1650
    # fp32 weights are twice the bytes per FLOP: the crossover doubles.
    assert crossover_tokens(QWEN3, torch.float32, ARTICLE) == pytest.approx(ridge * 32)


def test_traffic_checks_the_token_count():
    with pytest.raises(ValueError, match="topk_ids"):
        traffic(QWEN3, 3, torch.zeros(2, 8, dtype=torch.int32), torch.bfloat16)


@pytest.mark.parametrize("bad", [0, -1.0, math.nan])
def test_ceilings_must_be_positive(bad):
    with pytest.raises(ValueError, match="Ceilings"):
        Ceilings(copy_gbps=bad, matmul_tflops=1.0)


def test_measure_ceilings_on_cpu():
    c = measure_ceilings("cpu", torch.float32, copy_bytes=8 << 20, matmul_n=256, rep=3)
    # Measured rates are not asserted against any speed (a timing is never a unit test): only that
    # both are finite positive floats and the ridge point follows from them.
    for rate in (c.copy_gbps, c.matmul_tflops):
        assert isinstance(rate, float) and math.isfinite(rate) and rate > 0
    assert c.ridge_flops_per_byte == pytest.approx(c.matmul_tflops * 1e3 / c.copy_gbps)


@pytest.mark.gpu
def test_measure_ceilings_on_gpu():
    c = measure_ceilings("cuda", torch.bfloat16)
    for rate in (c.copy_gbps, c.matmul_tflops):
        assert isinstance(rate, float) and math.isfinite(rate) and rate > 0
