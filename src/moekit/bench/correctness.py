"""The correctness gate every backend passes before it is timed (STYLE.md items 6 and 11).

Rule (quack's): against the fp32 reference, a backend's largest error may be at most twice the
largest error of plain PyTorch computing the same thing in the same dtype. "Plain PyTorch" is the
arithmetic of Transformers' eager experts loop: every op in the dtype, the K contributions added
into a dtype buffer with index_add_.

In fp32 that baseline *is* the reference's arithmetic, so its error is 0 and the rule would demand
bit-identical results. The baseline error is therefore floored at the rounding of fp32 sums of the
layer's reduction length, eps_fp32 * sqrt(H + I) * max|ref|, the least error any fp32-accumulating
backend can promise. In bf16 and fp16 the floor is about 1000 times below the baseline error and
changes nothing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from moekit.reference import moe_experts_ref

TOLERANCE_FACTOR = 2.0


@dataclass(frozen=True)
class Check:
    """Outcome of comparing one backend's output with the reference.

    Attributes:
        ok: passed the gate.
        max_err: largest |out - ref| (inf for NaN/Inf or a wrong shape).
        tol: the largest error allowed.
        reason: why it failed ("" when ok).
    """

    ok: bool
    max_err: float
    tol: float
    reason: str = ""


@dataclass(frozen=True)
class Expected:
    """The reference output of one workload and the error budget derived from it."""

    ref: torch.Tensor          # float32 (T, H)
    baseline_err: float        # max error of PyTorch in the workload's dtype
    tol: float

    def check(self, out: object) -> Check:
        if not isinstance(out, torch.Tensor):
            return Check(False, math.inf, self.tol, f"returned {type(out).__name__}, not a tensor")
        if tuple(out.shape) != tuple(self.ref.shape):
            return Check(False, math.inf, self.tol,
                         f"output shape {tuple(out.shape)}, expected {tuple(self.ref.shape)}")
        diff = (out.detach().float() - self.ref).abs()
        if not torch.isfinite(diff).all():
            return Check(False, math.inf, self.tol, "output has NaN or Inf")
        err = float(diff.max()) if diff.numel() else 0.0
        if err > self.tol:
            return Check(False, err, self.tol,
                         f"max error {err:.3g} > {self.tol:.3g} (2x PyTorch's {self.baseline_err:.3g})")
        return Check(True, err, self.tol)


def experts_same_dtype(x: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
                       topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """Plain PyTorch in the inputs' dtype, one pass per expert: the error baseline (see module doc)."""
    inter = down_proj.shape[2]
    out = torch.zeros(x.shape[0], down_proj.shape[1], dtype=x.dtype, device=x.device)
    ids = topk_ids.long()
    for e in range(gate_up_proj.shape[0]):
        tok, slot = torch.nonzero(ids == e, as_tuple=True)
        if tok.numel() == 0:
            continue
        h = F.linear(x[tok], gate_up_proj[e])
        y = F.linear(F.silu(h[:, :inter]) * h[:, inter:], down_proj[e])
        out.index_add_(0, tok, y * topk_weights[tok, slot, None].to(y.dtype))
    return out


def expected_output(x: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
                    topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> Expected:
    """fp32 reference and the tolerance for every backend run on these inputs."""
    ref = moe_experts_ref(x, gate_up_proj, down_proj, topk_weights, topk_ids)
    base = experts_same_dtype(x, gate_up_proj, down_proj, topk_weights, topk_ids)
    baseline_err = float((base.float() - ref).abs().max()) if ref.numel() else 0.0
    scale = float(ref.abs().max()) if ref.numel() else 0.0
    reduction = x.shape[1] + down_proj.shape[2]
    fp32_floor = torch.finfo(torch.float32).eps * math.sqrt(reduction) * scale
    return Expected(ref=ref, baseline_err=baseline_err,
                    tol=TOLERANCE_FACTOR * max(baseline_err, fp32_floor))
