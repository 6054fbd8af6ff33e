"""The expert-parallel MoE layer: each rank routes its own tokens, holds E_r of the E experts, and
exchanges token rows with the other ranks through `dispatch` and `combine`.

    route (local) -> dispatch (counts, then rows) -> moe_experts on local experts -> combine -> (T, H)

The output on every rank equals the single-device `MoELayer` on that rank's tokens (up to fp32
summation order: each token's partial sums from different ranks are added in rank order).
Forward only: the all-to-alls carry no autograd, so the layer refuses to run with gradients on.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.utils import skip_init

from moekit._validation import FLOAT_DTYPES, check_shape, check_tensor, needs_grad
from moekit.layer import MoELayer
from moekit.parallel.dispatch import combine, dispatch, run_local_experts
from moekit.placement import Placement, contiguous_placement, rank_weights
from moekit.routing import route
from moekit.shapes import MoEShape, get_shape


def _check_no_grad(*tensors: torch.Tensor) -> None:
    if needs_grad(*tensors):
        raise RuntimeError("moekit expert parallelism is forward-only (the all-to-alls carry no "
                           "gradient); run it under torch.no_grad() or torch.inference_mode()")


def ep_moe_experts(hidden_states: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
                   topk_weights: torch.Tensor, topk_ids: torch.Tensor, *, placement: Placement,
                   group: dist.ProcessGroup | None = None, backend: str = "auto",
                   ignore_invalid_ids: bool = False,
                   tables: tuple[torch.Tensor, torch.Tensor] | None = None,
                   **experts_opts) -> torch.Tensor:
    """`moekit.moe_experts` over an expert-parallel group (collective: every rank calls it).

    Args:
        hidden_states: (T, H) this rank's tokens; T may differ between ranks, and be 0.
        gate_up_proj: (E_r, 2I, H) this rank's experts, in `placement.slots[rank]` order.
        down_proj: (E_r, H, I).
        topk_weights: (T, K) routing weights.
        topk_ids: (T, K) global expert ids in [0, E).
        placement: which rank holds which of the E experts (`moekit.placement`).
        group: the process group (default: the world).
        backend: experts backend on each rank ("auto" or one of `moekit.BACKENDS`).
        ignore_invalid_ids: pairs with ids outside [0, E) contribute 0 instead of raising.
        tables: `placement.copy_table(device)`, to reuse across calls.
        experts_opts: passed on to `moe_experts` (e.g. config for triton).

    Returns:
        (T, H) in the dtype of hidden_states: sum_k w[t,k] * expert_{ids[t,k]}(x_t).
    """
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if placement.num_ranks != world:
        raise ValueError(f"placement is for {placement.num_ranks} ranks, the process group has {world}")
    num_local = len(placement.slots[rank])
    check_tensor("hidden_states", hidden_states, ndim=2, dtypes=FLOAT_DTYPES)
    like_x = dict(dtypes=(hidden_states.dtype,), device=hidden_states.device)
    check_tensor("gate_up_proj", gate_up_proj, ndim=3, **like_x)
    check_tensor("down_proj", down_proj, ndim=3, **like_x)
    if gate_up_proj.shape[0] != num_local or down_proj.shape[0] != num_local:
        raise ValueError(f"rank {rank} holds {num_local} experts in the placement, but gate_up_proj and "
                         f"down_proj have {gate_up_proj.shape[0]} and {down_proj.shape[0]}")
    # Checked here, not only in moe_experts: a rank that receives no rows never calls it, and a
    # rank that fails alone mid-exchange leaves the others waiting for the collective's timeout.
    hidden, two_i = hidden_states.shape[-1], gate_up_proj.shape[1]
    check_shape("gate_up_proj", gate_up_proj, (num_local, two_i - two_i % 2, hidden), "(E_r, 2I, H)")
    check_shape("down_proj", down_proj, (num_local, hidden, two_i // 2), "(E_r, H, I)")
    _check_no_grad(hidden_states, gate_up_proj, down_proj, topk_weights)
    tokens, handle = dispatch(hidden_states, topk_weights, topk_ids, placement, group=group,
                              ignore_invalid_ids=ignore_invalid_ids, tables=tables)
    partial = run_local_experts(tokens, gate_up_proj, down_proj, backend=backend, **experts_opts)
    return combine(partial, handle, group=group)


class ExpertParallelMoE(nn.Module):
    """An MoE layer whose experts are spread over a process group (expert parallelism).

    Args:
        shape: an `MoEShape` or a preset name.
        placement: which experts each rank holds (a `moekit.placement.Placement`, e.g. with
            replicas from `replicate_hot_experts`); default `contiguous_placement(E, N)`.
        group: the process group (default: the world); must be initialised.
        backend: experts backend on each rank; router_backend: "auto", "torch" or "triton".
        dtype, device: of the parameters.

    Parameters:
        router_weight (E, H), the same on every rank; gate_up_proj (E_r, 2I, H) and down_proj
        (E_r, H, I), this rank's experts in `placement.slots[rank]` order.
    """

    def __init__(self, shape: MoEShape | str, *, placement: Placement | None = None,
                 group: dist.ProcessGroup | None = None, backend: str = "auto",
                 router_backend: str = "auto", dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None):
        super().__init__()
        if not dist.is_initialized():
            raise RuntimeError("ExpertParallelMoE needs torch.distributed initialised "
                               "(init_process_group, e.g. under torchrun)")
        self.shape = get_shape(shape)
        self.group = group
        self.rank, world = dist.get_rank(group), dist.get_world_size(group)
        e, h, i = self.shape.num_experts, self.shape.hidden_size, self.shape.intermediate_size
        self.placement = placement if placement is not None else contiguous_placement(e, world)
        if self.placement.num_ranks != world or self.placement.num_experts != e:
            raise ValueError(f"placement is for {self.placement.num_experts} experts on "
                             f"{self.placement.num_ranks} ranks; the layer has {e} experts and the "
                             f"group {world} ranks")
        self.local_experts = self.placement.slots[self.rank]
        self._tables: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
        self.backend = backend
        self.router_backend = router_backend
        kw = dict(dtype=dtype, device=device)
        n = len(self.local_experts)
        self.router_weight = nn.Parameter(torch.empty(e, h, **kw))
        self.gate_up_proj = nn.Parameter(torch.empty(n, 2 * i, h, **kw))
        self.down_proj = nn.Parameter(torch.empty(n, h, i, **kw))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        """This rank's share of the weights `MoELayer.reset_parameters(generator)` draws: with the
        same seed on every rank, the group holds exactly the single-device layer's weights."""
        if self.router_weight.is_meta:
            return  # skip_init (from_layer): the weights are about to be copied in
        s = self.shape
        h, i = s.hidden_size, s.intermediate_size
        held = torch.tensor(self.local_experts, dtype=torch.int64)
        # The full tensors are drawn, in MoELayer's order, so that the numbers match it exactly.
        router = torch.randn(self.router_weight.shape, generator=generator) / math.sqrt(h)
        gate_up = torch.randn((s.num_experts, 2 * i, h), generator=generator) / math.sqrt(h)
        down = torch.randn((s.num_experts, h, i), generator=generator) / math.sqrt(i)
        self.router_weight.copy_(router)
        self.gate_up_proj.copy_(gate_up[held])
        self.down_proj.copy_(down[held])

    @classmethod
    @torch.no_grad()
    def from_layer(cls, layer: MoELayer, *, placement: Placement | None = None,
                   group: dist.ProcessGroup | None = None, backend: str | None = None) -> ExpertParallelMoE:
        """This rank's share of a full `MoELayer` (its router and its experts' weights, copied)."""
        p = layer.gate_up_proj
        ep = skip_init(cls, layer.shape, placement=placement, group=group, backend=backend or layer.backend,
                       router_backend=layer.router_backend, dtype=p.dtype, device=p.device)
        gate_up, down = rank_weights(layer.gate_up_proj, layer.down_proj, ep.placement, ep.rank)
        ep.router_weight.copy_(layer.router_weight)
        ep.gate_up_proj.copy_(gate_up)
        ep.down_proj.copy_(down)
        return ep

    def extra_repr(self) -> str:
        s = self.shape
        return (f"experts={s.num_experts}, local={list(self.local_experts)}, rank={self.rank}, "
                f"hidden={s.hidden_size}, intermediate={s.intermediate_size}, top_k={s.top_k}, "
                f"backend={self.backend!r}")

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return route(x, self.router_weight, self.shape.top_k, renormalize=self.shape.norm_topk_prob,
                     backend=self.router_backend)

    def experts(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                **experts_opts) -> torch.Tensor:
        """The expert path for given routing: (T, H) -> (T, H) (collective)."""
        dev = self.gate_up_proj.device
        if dev not in self._tables:
            self._tables[dev] = self.placement.copy_table(dev)
        return ep_moe_experts(x, self.gate_up_proj, self.down_proj, topk_weights, topk_ids,
                              placement=self.placement, group=self.group, backend=self.backend,
                              tables=self._tables[dev], **experts_opts)

    def forward(self, x: torch.Tensor, **experts_opts) -> torch.Tensor:
        """x (..., H) -> (..., H), routed on this rank (collective: every rank calls it)."""
        if x.shape[-1] != self.shape.hidden_size:
            raise ValueError(f"x must have shape (..., H={self.shape.hidden_size}), got {tuple(x.shape)}")
        flat = x.reshape(-1, self.shape.hidden_size)
        weights, ids = self.route(flat)
        return self.experts(flat, weights, ids, **experts_opts).view(x.shape)
