"""The weight-gradient kernel's tiles under study (`moekit sweep --set wgrad` times them,
`tools/aot_compile_check.py --wgrad` compiles them for sm_90): the candidates, the tiles the kernel
ran with before it had its own, and one T's inputs with the error rule.

The two launches of a training step (`moekit.grouped_gemm.backward`), unscaled: the SwiGLU backward
stores dpre_w and h_w with the routing weight applied, so neither launch multiplies by it (the
kernel's SCALE off; the scaled mode, used only when down_proj alone trains, is not swept):
    gate_up  d gate_up_proj (E, 2I, H) = sum over e's rows of dpre_w[r]^T x[t]
    down     d down_proj    (E, H, I)  = sum over e's rows of dout[t]^T h_w[r]
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from moekit.align import Alignment, align_block_size
from moekit.grouped_gemm import _placed_rows
from moekit.grouped_gemm.backward import sorted_rows, wgrad, wgrad_torch
from moekit.shapes import MoEShape
from moekit.tuning import ExpertsConfig, WgradConfig

LAUNCHES = ("gate_up", "down")

# bf16 on an H200 around the default (128 x 128 output, 32 rows a step, 8 warps, 7 stages): the
# output tile, the rows a step, warps and the pipeline's lead ((stages - 1) // 2, see WgradConfig)
# varied one or two at a time; 3 stages (lead 1: no overlap) as the control.
CANDIDATES = tuple(WgradConfig(*t) for t in (
    (128, 128, 32, 8, 7), (128, 128, 64, 8, 3), (128, 128, 64, 8, 5), (128, 128, 64, 8, 7),
    (128, 128, 64, 4, 5), (128, 128, 32, 8, 5), (128, 128, 32, 8, 9), (128, 128, 32, 4, 7),
    (128, 128, 128, 8, 3), (128, 128, 128, 8, 5),
    (128, 256, 64, 8, 5), (128, 256, 32, 8, 5), (128, 256, 32, 8, 7),
    (256, 128, 64, 8, 5), (256, 128, 32, 8, 5), (256, 128, 32, 8, 7),
    (64, 128, 64, 4, 5), (128, 64, 64, 4, 5), (64, 256, 64, 8, 5), (256, 64, 64, 8, 5),
    (64, 64, 64, 4, 5), (64, 64, 32, 4, 7),
    # The range kernel (the last field: experts a program walks in one loop).
    (128, 128, 64, 8, 3, 4), (128, 128, 64, 8, 3, 8), (128, 128, 64, 8, 4, 8), (128, 128, 64, 8, 5, 8),
    (128, 128, 32, 8, 5, 8), (128, 128, 32, 8, 7, 8), (128, 256, 64, 8, 3, 8), (128, 256, 32, 8, 5, 8),
    (128, 256, 32, 8, 5, 4), (128, 256, 32, 8, 5, 2), (256, 128, 64, 8, 3, 8), (128, 128, 64, 4, 4, 8),
    (128, 128, 64, 8, 3, 16), (128, 256, 64, 8, 4, 4),
))
# Interpreted on the CPU: small tiles, BN < BC and BN > BC, and the range kernel over 2 experts.
CPU_CANDIDATES = (WgradConfig(16, 32, 16, 4, 3), WgradConfig(32, 16, 32, 4, 5),
                  WgradConfig(16, 32, 16, 4, 3, 2))


def legacy_tiles(cfg: ExpertsConfig) -> dict[str, WgradConfig]:
    """Per launch, the tiles the kernel took from the forward's config until it had its own: GEMM1's
    (gate_up) or GEMM2's (down) block_n x block_k capped at 64, min(max(block_m, 16), 64) rows a
    step, 4 warps, Triton's default 3 stages."""
    rows = min(max(cfg.block_m, 16), 64)
    return {"gate_up": WgradConfig(min(cfg.block_n1, 64), min(cfg.block_k1, 64), rows, 4, 3),
            "down": WgradConfig(min(cfg.block_n2, 64), min(cfg.block_k2, 64), rows, 4, 3)}


@dataclass
class WgradCase:
    """One T's operands (random, the routing of a softmax top-k with the last expert never picked;
    dpre_w and h_w random too: already scaled, as the backward stores them, zeros on rows no pair
    owns, as it writes them) and, per launch, its
    FLOPs (placed pairs only), fp32 reference and plain same-dtype error."""

    tokens: int
    top_k: int
    align: Alignment
    operands: dict[str, tuple[torch.Tensor, torch.Tensor, bool, bool]]   # a, b, a_by_token, b_by_token
    shapes: dict[str, tuple[int, int, int]]
    flops: dict[str, float]
    refs: dict[str, torch.Tensor]
    base_err: dict[str, float]
    unused: torch.Tensor            # experts with no pairs: their gradients must be exactly 0
    _sorted: dict[str, torch.Tensor] = field(default_factory=dict)   # `sorted_operand`'s copies

    def run(self, launch: str, tiles: WgradConfig, padding_zero: bool = False,
            presorted: bool = False) -> torch.Tensor:
        """One launch; presorted: its gathered operand read from a copy in sorted-row order made
        beforehand (`sorted_operand`, not timed here), so the kernel reads no index."""
        a, b, a_by_token, b_by_token = self.operands[launch]
        if presorted:
            copy = self.sorted_operand(launch)
            a, b = (copy, b) if a_by_token else (a, copy)
            a_by_token = b_by_token = False
        return wgrad(a, b, None, self.align, self.top_k, self.shapes[launch], a.dtype,
                     a_by_token=a_by_token, b_by_token=b_by_token, tiles=tiles, padding_zero=padding_zero)

    def copy_operand(self, launch: str) -> torch.Tensor:
        """The launch's gathered operand copied into sorted-row order (`sorted_rows`)."""
        a, b, a_by_token, _ = self.operands[launch]
        return sorted_rows(a if a_by_token else b, self.align, self.top_k)

    def sorted_operand(self, launch: str) -> torch.Tensor:
        if launch not in self._sorted:
            self._sorted[launch] = self.copy_operand(launch)
        return self._sorted[launch]

    def problem(self, launch: str, got: torch.Tensor) -> tuple[float, str | None]:
        """(relative error against fp32, what breaks the rule or None): error at most 2x plain
        PyTorch's in the same dtype, exact zeros for experts with no pairs."""
        err = rel_err(got, self.refs[launch])
        if not err <= 2 * self.base_err[launch]:
            return err, f"error {err:.3e} > 2 x plain PyTorch's {self.base_err[launch]:.3e}"
        if bool(got[self.unused].any()):
            return err, "an expert with no pairs has a nonzero gradient"
        return err, None


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def make_case(shape: MoEShape, num_tokens: int, dtype: torch.dtype, block_m: int,
              device: torch.device, seed: int = 0) -> WgradCase:
    e, hidden, inter, top_k = shape.num_experts, shape.hidden_size, shape.intermediate_size, shape.top_k
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*size: int) -> torch.Tensor:
        return torch.randn(*size, device=device, generator=gen).to(dtype)

    logits = torch.randn(num_tokens, e, device=device, generator=gen)
    logits[:, -1] = float("-inf")
    _, ids = torch.softmax(logits, -1).topk(top_k, -1)
    align = align_block_size(ids, e, block_m, backend="torch")
    rows = align.sorted_ids.numel()
    x, dout = randn(num_tokens, hidden), randn(num_tokens, hidden)
    dpre_w, h_w = randn(rows, 2 * inter), randn(rows, inter)
    unowned = torch.ones(rows, dtype=torch.bool, device=device)   # zeros, as the SwiGLU backward
    unowned[_placed_rows(align)[0]] = False                        # writes its padding rows
    dpre_w[unowned] = 0
    h_w[unowned] = 0
    operands = {"gate_up": (dpre_w, x, False, True), "down": (dout, h_w, True, False)}
    shapes = {"gate_up": (e, 2 * inter, hidden), "down": (e, hidden, inter)}
    pairs = num_tokens * top_k
    flops = {k: 2.0 * pairs * n * c for k, (_, n, c) in shapes.items()}
    refs, base_err = {}, {}
    for k, (a, b, a_tok, b_tok) in operands.items():
        refs[k] = wgrad_torch(a, b, None, align, top_k, a_by_token=a_tok, b_by_token=b_tok)
        plain = wgrad_torch(a, b, None, align, top_k, a_by_token=a_tok, b_by_token=b_tok, compute_dtype=dtype)
        base_err[k] = rel_err(plain, refs[k])
    unused = align.tokens_per_expert == 0
    return WgradCase(num_tokens, top_k, align, operands, shapes, flops, refs, base_err, unused)
