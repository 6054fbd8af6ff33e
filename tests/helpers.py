"""Test helpers shared by the suite (imported as `helpers`; pytest puts tests/ on sys.path)."""

from __future__ import annotations

import torch


def poisoned(shape, dtype, device) -> torch.Tensor:
    """A fresh buffer full of NaN (or -1 for integers): unwritten elements show up in checks."""
    if dtype.is_floating_point:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.full(shape, -1, dtype=dtype, device=device)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """‖out − ref‖ / ‖ref‖ in fp64; NaN anywhere gives inf."""
    out, ref = out.double(), ref.double()
    if not torch.isfinite(out).all():
        return float("inf")
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
