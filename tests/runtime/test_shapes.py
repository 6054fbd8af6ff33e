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


@pytest.mark.parametrize("kwargs,exc,msg", [
    (dict(num_experts=True), ValueError, r"MoEShape.num_experts must be a positive int, got True"),
    (dict(top_k=False), ValueError, r"MoEShape.top_k must be a positive int, got False"),
    (dict(hidden_size=16.0), ValueError, r"MoEShape.hidden_size must be a positive int, got 16.0"),
    (dict(norm_topk_prob="false"), ValueError, r"MoEShape.norm_topk_prob must be a bool, got 'false'"),
    (dict(norm_topk_prob=0), ValueError, r"MoEShape.norm_topk_prob must be a bool, got 0"),
], ids=["bool-experts", "bool-top-k", "float-hidden", "str-norm", "int-norm"])
def test_wrongly_typed_fields_raise_naming_them(kwargs, exc, msg):
    """A bool is no count, and a string is no bool ("false" would read as true): both raise."""
    with pytest.raises(exc, match=msg):
        MoEShape(**(dict(num_experts=8, hidden_size=16, intermediate_size=8, top_k=2) | kwargs))


def test_get_shape_of_another_type_names_what_it_takes():
    with pytest.raises(TypeError, match=r"shape must be a MoEShape or a preset name, got list"):
        get_shape(["tiny"])
