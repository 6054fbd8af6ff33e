"""The gated activation between an expert's two projections, and the layout of its gate/up rows.

    "swiglu"   h = silu(gate) * up                                    (default: Qwen, Mixtral, OLMoE, ...)
    "gpt_oss"  gate = min(gate, limit), up = clamp(up, -limit, limit)
               h = (up + 1) * gate * sigmoid(alpha * gate)            (gpt-oss: alpha 1.702, limit 7.0)

"gpt_oss" is Transformers' `GptOssExperts._apply_gate`, clamp included. With expert biases the
expert is  y = (act(x @ gate_up_e^T + gate_up_bias_e) @ down_e^T + down_bias_e) * w : the routing
weight multiplies the biased down projection, as in gpt-oss.

Layout of gate_up_proj's 2I rows: concatenated [gate; up] (Transformers' default) or interleaved
[g0, u0, g1, u1, ...] (gpt-oss: gate = pre[..., ::2], up = pre[..., 1::2]). The triton kernels read
the interleaved layout as it is: GEMM1 loads one [BK, 2 BN] tile of consecutive rows, the same bytes
and as contiguous as the concatenated layout's two [BK, BN] tiles, runs one dot of width 2 BN in
place of two of width BN, and splits gate from up in the epilogue, in registers (tl.reshape +
tl.split): no extra memory traffic and no copy. De-interleaving once at conversion would instead copy
every layer's gate_up weights (1.1 GB a layer for gpt-oss-20b in bf16, held twice while the
Parameters live), and the copy would go stale at every optimizer step; reading the layout is the
cheaper of the two.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

ACTIVATIONS = ("swiglu", "gpt_oss")
GPT_OSS_ALPHA, GPT_OSS_LIMIT = 1.702, 7.0


@dataclass(frozen=True)
class GatedActivation:
    """A gated activation of the expert path (see the module docstring).

    Attributes:
        name: "swiglu" or "gpt_oss".
        alpha, limit: gpt_oss's sigmoid scale and clamp (ignored by swiglu); limit may be inf.
    """

    name: str = "swiglu"
    alpha: float = GPT_OSS_ALPHA
    limit: float = GPT_OSS_LIMIT

    def __post_init__(self) -> None:
        if self.name not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {ACTIVATIONS}, got {self.name!r}")
        for field, value in (("alpha", self.alpha), ("limit", self.limit)):
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"activation {field} must be a number, got {type(value).__name__}")
        if not -math.inf < self.alpha < math.inf:        # comparisons, not math.isfinite: Dynamo traces them
            raise ValueError(f"activation alpha must be finite, got {self.alpha}")
        if not self.limit > 0:
            raise ValueError(f"activation limit must be > 0 (inf: no clamp), got {self.limit}")

    @property
    def is_swiglu(self) -> bool:
        return self.name == "swiglu"

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """h from gate and up, in their dtype (plain PyTorch: the torch backends and twins)."""
        if self.is_swiglu:
            return F.silu(gate) * up
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))


SWIGLU = GatedActivation()


def as_activation(activation: str | GatedActivation | None) -> GatedActivation:
    """`activation=` of the expert path: None or "swiglu", "gpt_oss" (its default alpha and limit),
    or a `GatedActivation`."""
    if activation is None:
        return SWIGLU
    if isinstance(activation, GatedActivation):
        return activation
    if isinstance(activation, str):
        return GatedActivation(activation)
    raise TypeError(f"activation must be a str, a GatedActivation or None, got {type(activation).__name__}")


def split_gate_up(pre: torch.Tensor, interleaved: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate, up) halves of the (..., 2I) pre-activations, concatenated or interleaved."""
    if interleaved:
        return pre[..., ::2], pre[..., 1::2]
    gate, up = pre.chunk(2, dim=-1)
    return gate, up


def gated(pre: torch.Tensor, activation: GatedActivation, interleaved: bool) -> torch.Tensor:
    """(..., 2I) pre-activations -> (..., I)."""
    return activation(*split_gate_up(pre, interleaved))
