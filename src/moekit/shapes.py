"""MoE layer shapes and the presets moekit studies.

Dimension legend used across moekit:
    T  tokens            E  experts           K  top_k (experts per token)
    H  hidden size       I  intermediate size (per expert; gate_up has 2I rows)
    S  token-expert pairs = T * K
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MoEShape:
    """Shape of one MoE layer with SwiGLU experts.

    Args:
        num_experts: E, experts in the layer.
        hidden_size: H, width of the tokens.
        intermediate_size: I, width of one expert's hidden layer.
        top_k: K, experts each token is sent to.
        norm_topk_prob: renormalise the top-k router probabilities to sum to 1.
    """

    num_experts: int
    hidden_size: int
    intermediate_size: int
    top_k: int
    norm_topk_prob: bool = True

    def __post_init__(self) -> None:
        for name in ("num_experts", "hidden_size", "intermediate_size", "top_k"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:     # a bool is no count
                raise ValueError(f"MoEShape.{name} must be a positive int, got {value!r}")
        if not isinstance(self.norm_topk_prob, bool):       # "false" would read as true
            raise ValueError(f"MoEShape.norm_topk_prob must be a bool, got {self.norm_topk_prob!r}")
        if self.top_k > self.num_experts:
            raise ValueError(
                f"MoEShape.top_k must be <= num_experts ({self.num_experts}), got {self.top_k}"
            )

    @property
    def params_per_expert(self) -> int:
        """Weights of one expert: gate, up (I x H each) and down (H x I)."""
        return 3 * self.hidden_size * self.intermediate_size

    def expert_bytes(self, dtype: torch.dtype = torch.bfloat16) -> int:
        return self.params_per_expert * dtype.itemsize

    def layer_bytes(self, dtype: torch.dtype = torch.bfloat16) -> int:
        """Bytes of all experts' weights (the router is not counted)."""
        return self.num_experts * self.expert_bytes(dtype)

    @property
    def flops_per_token(self) -> int:
        """Expert FLOPs for one token: 2 per weight for each of its K experts."""
        return 2 * self.top_k * self.params_per_expert

    def expected_distinct_experts(self, num_tokens: int) -> float:
        """Experts hit by T tokens under uniform random routing: E * (1 - ((E-K)/E)^T)."""
        e, k = self.num_experts, self.top_k
        return e * (1.0 - ((e - k) / e) ** num_tokens)


PRESETS: dict[str, MoEShape] = {
    # Qwen3-30B-A3B config.json: 128 experts, 8 per token, hidden 2048, moe_intermediate 768.
    "qwen3-30b-a3b": MoEShape(128, 2048, 768, 8),
    # OLMoE-1B-7B config.json: norm_topk_prob false (the top-8 softmax weights are not renormalised).
    "olmoe-1b-7b": MoEShape(64, 2048, 1024, 8, norm_topk_prob=False),
    "mixtral-8x7b": MoEShape(8, 4096, 14336, 2),
    "deepseek-v2-lite": MoEShape(64, 2048, 1408, 6, norm_topk_prob=False),
    # gpt-oss-20b config.json: 32 local experts, 4 per token, hidden 2880, intermediate 2880. Its router
    # (GptOssTopKRouter) takes a softmax over the top-4 logits: the renormalised top-4 softmax. The
    # layer's SwiGLU experts stand in for gpt-oss's (expert biases, clamped activation, interleaved
    # rows: `moe_experts(..., activation="gpt_oss")`), which read the same weight bytes.
    "gpt-oss-20b": MoEShape(32, 2880, 2880, 4),
    # Small enough for the CPU and the Triton interpreter, with odd sizes on purpose.
    "tiny": MoEShape(8, 64, 48, 2),
}


def get_shape(shape: MoEShape | str) -> MoEShape:
    """Return `shape` itself, or the preset of that name."""
    if isinstance(shape, MoEShape):
        return shape
    if not isinstance(shape, str):
        raise TypeError(f"shape must be a MoEShape or a preset name, got {type(shape).__name__} {shape!r}")
    try:
        return PRESETS[shape]
    except KeyError:
        raise ValueError(f"unknown preset {shape!r}; expected one of {sorted(PRESETS)}") from None
