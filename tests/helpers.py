"""Test helpers shared by the suite (imported as `helpers`; pytest puts tests/ on sys.path).

The oracles here are written independently of the code under test (RELIABILITY.md case 27): plain
PyTorch and no moekit code.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def poisoned(shape, dtype, device) -> torch.Tensor:
    """A fresh buffer full of NaN (or -1 for integers): unwritten elements show up in checks."""
    if dtype.is_floating_point:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.full(shape, -1, dtype=dtype, device=device)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """‖out − ref‖ / ‖ref‖ in fp64; NaN or Inf in either gives NaN, which fails every comparison."""
    out, ref = out.double(), ref.double()
    if not (torch.isfinite(out).all() and torch.isfinite(ref).all()):
        return math.nan
    denom = ref.norm().item()
    return (out - ref).norm().item() / (denom if denom > 0 else 1.0)


def distinct_topk_ids(num_tokens, num_experts, top_k, *, generator=None, device="cpu",
                      dtype=torch.int32, avoid: int | None = None) -> torch.Tensor:
    """(T, K) ids with K distinct experts per row; expert `avoid` (default E-1 when K < E) gets none."""
    if avoid is None and top_k < num_experts:
        avoid = num_experts - 1
    pool = [e for e in range(num_experts) if e != avoid] if avoid is not None else list(range(num_experts))
    pool_t = torch.tensor(pool)
    scores = torch.rand(num_tokens, len(pool), generator=generator)
    idx = scores.argsort(dim=1)[:, :top_k]
    return pool_t[idx].to(dtype=dtype, device=device)


def experts_same_dtype(x: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
                       topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """Plain PyTorch in x's dtype: the "PyTorch in the same dtype" baseline of the tolerance rule.

    Every (token, slot) pair with an id in [0, E) is computed on its own row: gate and up
    projections, silu(gate) * up and the down projection, each rounded to the dtype; times the
    routing weight (one rounding to the dtype); the K slots are added in slot order in the dtype.
    Written without any moekit code, so a backend under test never sets its own bound.
    """
    num_tokens, hidden = x.shape
    num_experts, two_i, _ = gate_up_proj.shape
    inter = two_i // 2
    out = torch.zeros(num_tokens, hidden, dtype=x.dtype, device=x.device)
    for slot in range(topk_ids.shape[1]):
        ids = topk_ids[:, slot].long()
        contrib = torch.zeros_like(out)
        for e in range(num_experts):
            rows = torch.nonzero(ids == e)[:, 0]
            if rows.numel() == 0:
                continue
            xe = x[rows]
            gate = xe @ gate_up_proj[e, :inter].T
            up = xe @ gate_up_proj[e, inter:].T
            y = (F.silu(gate) * up) @ down_proj[e].T
            contrib[rows] = (y.float() * topk_weights[rows, slot].float()[:, None]).to(x.dtype)
        out = out + contrib
    return out


def same_dtype_bound(x: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
                     topk_weights: torch.Tensor, topk_ids: torch.Tensor, ref: torch.Tensor) -> float:
    """2x the relative error of `experts_same_dtype` against the fp32 reference `ref` (quack's rule).

    A baseline that is not finite sets no bound: the test fails here instead of comparing with inf.
    """
    base_err = rel_err(experts_same_dtype(x, gate_up_proj, down_proj, topk_weights, topk_ids), ref)
    assert math.isfinite(base_err), f"the same-dtype baseline or the reference is not finite ({base_err})"
    return 2 * base_err
