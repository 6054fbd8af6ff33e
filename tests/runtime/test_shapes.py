import pytest
import torch

from moekit import PRESETS, MoEShape, get_shape


def test_qwen3_preset_matches_the_model_card_numbers():
    s = PRESETS["qwen3-30b-a3b"]
    assert (s.num_experts, s.hidden_size, s.intermediate_size, s.top_k) == (128, 2048, 768, 8)
    assert s.params_per_expert == 4_718_592
    assert s.expert_bytes(torch.bfloat16) == 9_437_184            # 9.44 MB
    assert s.flops_per_token == 8 * 2 * 4_718_592                  # 75.5 MFLOP
    assert round(s.expected_distinct_experts(4)) == 29
    assert round(s.expected_distinct_experts(64)) == 126


def test_presets_and_lookup():
    for name in ("qwen3-30b-a3b", "olmoe-1b-7b", "mixtral-8x7b", "deepseek-v2-lite", "tiny"):
        assert get_shape(name) is PRESETS[name]
    assert PRESETS["deepseek-v2-lite"].norm_topk_prob is False
    assert PRESETS["olmoe-1b-7b"].norm_topk_prob is False       # OLMoE's config: norm_topk_prob false
    with pytest.raises(ValueError, match="unknown preset"):
        get_shape("nope")


@pytest.mark.parametrize("kwargs", [dict(num_experts=0), dict(top_k=9), dict(hidden_size=-1)])
def test_bad_shapes_raise(kwargs):
    base = dict(num_experts=8, hidden_size=16, intermediate_size=8, top_k=2) | kwargs
    with pytest.raises(ValueError):
        MoEShape(**base)
