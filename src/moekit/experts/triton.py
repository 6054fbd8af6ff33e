"""`triton` backend launcher: align -> GEMM1 (gather + SwiGLU) -> GEMM2 (weight + scatter) -> sum,
and its backward (`moekit.grouped_gemm.backward`) as a torch.autograd.Function.

Four launches after the router up to `moekit.align.ONE_LAUNCH_MAX_PAIRS` pairs (4,096 by default;
the align in one kernel: one program up to `FUSED_MAX_PAIRS`, a program a chunk above), six above
(the align in three).
No host synchronisation: every buffer's size follows from (T, K, E, config) and the grids are
sized from the fixed upper bound `Alignment.max_blocks`; programs past num_padded return.
Workspace: h (L, I) and y (S, H) in the input dtype (L = padded rows, S = T * K).

Backward (when grad mode is on and an input requires grad). Saved: the inputs themselves (references,
no copies); the forward's `Alignment`: sorted_ids int32 (L,), expert_ids int32 (L / block_m,),
num_padded, tokens_per_expert int32 (E,), block_codes, about 4 bytes per pair plus padding; and, when
x, gate_up_proj or topk_weights needs a gradient, the (L, 2I) gate/up pre-activations that GEMM1
stores beside h in the same launch (`gemm1_swiglu_with_pre`: 4I bytes per pair in bf16, 3 KiB at
Qwen3-30B-A3B's I = 768, plus the padding rows), in place of recomputing them. The buffer is a fresh
allocation per forward (`moekit._workspace.empty` allocates every call; nothing pools or reuses it),
so a later forward never overwrites what an earlier one saved. The backward frees it once the
SwiGLU backward has read it, before the weight gradients are allocated (a lower peak); a second
backward through a retained graph has GEMM1 store it again, bit for bit. Not saved: h (recomputed
from the saved a, b in the SwiGLU backward's epilogue, silu(a) * b) and y. When only down_proj needs a
gradient nothing extra is saved and the backward recomputes h by the forward's GEMM1 (one GEMM).
Launches, each skipped when no input needs it:
    swiglu_backward     dpre_w (L, 2I), h_w (L, I), d topk_weights   if x, gate_up or weights need grad
                        (g = dout @ down_e, one GEMM; a, b read from the saved pre-activations)
    (gemm1_swiglu)      h alone, unscaled                            if only down_proj needs grad
    hidden_states_grad  dx: GEMM2 on (dpre_w, gate_up^T) + slot sum  if x needs grad
    gate_up_proj_grad   (E, 2I, H)                                   if gate_up_proj needs grad
    down_proj_grad      (E, H, I)                                    if down_proj needs grad
dpre_w and h_w carry the routing weight (`moekit.grouped_gemm.backward`), so dx and the weight
gradients need none; d down from the recomputed h applies it in the weight-gradient kernel.
Backward workspace: dpre_w (L, 2I), h_w (L, I), (L, cdiv(I, block_n)) fp32 partial sums, (S, H)
per-pair dx (4I + 2I + 2H bytes per pair in bf16, plus the partial sums). On Hopper (the Gluon
kernels, `moekit.grouped_gemm.backward`) the SwiGLU backward reads dout's token rows itself; inside
`wgrad`, d gate_up reads x copied into sorted rows (L, H), and d down reads dout's token rows itself
up to `GATHER_A_ROWS` rows an expert, else a copy made a column chunk at a time (`GLUON_A_CHUNKS`),
freed on return. Deterministic (no
atomics), no host sync. Not twice differentiable: a backward with create_graph=True raises
(`check_first_order_backward`). Under torch.compile a training call runs the
`moekit::experts_train` custom op (`experts_triton_train`): it saves the same things as the eager
autograd (the alignment, packed into one buffer, and the pre-activations under the same rule), and
its backward (`experts_triton_grads` with them) runs the launches above. Only a direct call of the
`moekit::experts` op with inputs that need gradients has the inputs alone: its backward re-aligns
and recomputes a and b inside the SwiGLU backward (the same loop over H as g: two more GEMMs, no
extra launch).

Expert biases, the gpt_oss activation and interleaved gate/up rows (`moekit.activation`) run in the
forward kernels' epilogues; the backward kernels compute SwiGLU without biases only, so a call with
any of them that needs gradients raises here (`moekit.moe_experts` routes such calls to a backend
with a torch backward first: no bias gradient is ever dropped).

Direct decode (on by default, `moekit.decode`; MOEKIT_DECODE_DIRECT=0 switches it off): an inference
call with plain SwiGLU (no biases, not interleaved), no `config` given and T * K <=
`moekit.decode.DECODE_MAX_PAIRS` runs two kernels instead of the four (no align); every other call
runs the path above (a `config` names the normal path's tiles, so a caller who gives one, the tuner
or ablate, gets that path).

Each entry point decides what it runs once, in `moekit.experts.plan.plan_triton_call` (the path, the
tiles with TMA resolved, the launch hints), and hands the launchers those decisions.
"""

from __future__ import annotations

import torch

from moekit import _workspace
from moekit._validation import check_triton_device, needs_grad
from moekit.activation import SWIGLU, GatedActivation
from moekit.align import BLOCK_M_BOUND, Alignment, align_block_size, padded_length, unpack_alignment
from moekit.decode import experts_decode
from moekit.experts.plan import DECODE, TritonPlan, align_backend, plan_triton_call
from moekit.experts.plan import auto_config as auto_config  # re-exported: the backend's callers name it here
from moekit.grouped_gemm import gemm1_swiglu, gemm1_swiglu_with_pre, gemm2_weighted, moe_sum
from moekit.grouped_gemm.backward import (
    down_proj_grad,
    gate_up_proj_grad,
    hidden_states_grad,
    swiglu_backward,
)
from moekit.tuning import ExpertsConfig


def align_pairs(topk_ids: torch.Tensor, num_experts: int, config: ExpertsConfig, *,
                backend: str | None = None, pdl: bool | None = None) -> Alignment:
    """The triton backend's align step at config.block_m: backend (None: `align_backend`, the Triton
    kernels up to their expert limit, else torch) and pdl as a call's plan has them."""
    return align_block_size(topk_ids, num_experts, config.block_m,
                            backend=align_backend(num_experts) if backend is None else backend, pdl=pdl)


def _forward(x: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor, topk_weights: torch.Tensor,
             topk_ids: torch.Tensor, plan: TritonPlan, out: torch.Tensor, *,
             gate_up_bias: torch.Tensor | None = None, down_bias: torch.Tensor | None = None,
             activation: GatedActivation = SWIGLU, interleaved: bool = False,
             pre_rows: int | None = None) -> tuple[Alignment, torch.Tensor | None]:
    """The grouped path's launches as plan has them: (alignment, pre), pre the (L, 2I) pre-activations
    GEMM1 stored when plan.store_pre (plain SwiGLU only), else None."""
    config, tma, pdl = plan.config, plan.config.tma_weights, plan.pdl
    align = align_pairs(topk_ids, gate_up_proj.shape[0], config, backend=plan.align, pdl=pdl)
    top_k = topk_ids.shape[1]
    pre = None
    if plan.store_pre:
        h, pre = gemm1_swiglu_with_pre(x, gate_up_proj, align, top_k, config, pre_rows=pre_rows, tma=tma,
                                       pdl=pdl)
    else:
        h = gemm1_swiglu(x, gate_up_proj, align, top_k, config, bias=gate_up_bias, activation=activation,
                         interleaved=interleaved, tma=tma, pdl=pdl)
    y = gemm2_weighted(h, down_proj, topk_weights, align, config, bias=down_bias, tma=tma, pdl=pdl)
    moe_sum(y, topk_ids, gate_up_proj.shape[0], out, pdl=pdl)
    return align, pre


def experts_triton_backward(
    dout: torch.Tensor, x: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
    topk_weights: torch.Tensor, topk_ids: torch.Tensor, align: Alignment, config: ExpertsConfig,
    needs: tuple[bool, bool, bool, bool], *, pre: torch.Tensor | None = None, release_pre: bool = False,
) -> tuple[torch.Tensor | None, ...]:
    """(dx, d gate_up_proj, d down_proj, d topk_weights), None where `needs` is False.

    topk_weights and topk_ids must be the contiguous tensors the forward used with `align`; pre the
    (L, 2I) pre-activations that forward's GEMM1 stored (`gemm1_swiglu_with_pre`), or None to
    recompute them. release_pre: free pre's memory once the SwiGLU backward has read it (its storage
    resized to 0, whoever else holds the tensor; only when pre owns its whole storage), so it is not
    alive beside the weight gradients.
    """
    need_x, need_gu, need_down, need_w = needs
    top_k = topk_ids.shape[1]
    dx = d_gu = d_down = d_w = None
    if need_x or need_gu or need_w:
        # d down, the last weight gradient, comes after d gate_up has freed its copy of x: the step's
        # peak then holds h_w and at most a column chunk of a copy of dout beside the gradients.
        grads = swiglu_backward(x, gate_up_proj, down_proj, dout, topk_weights, align, top_k, config, pre=pre,
                                want_dpre=need_x or need_gu, want_h=need_down, want_topk_weights=need_w)
        if release_pre and pre is not None and _owns_storage(pre):
            # Stream-ordered: the allocator hands the block on only to work queued after the read.
            pre.untyped_storage().resize_(0)
        if need_w:
            d_w = grads.topk_weights.view(topk_weights.shape).to(topk_weights.dtype)
        if need_x:
            dx = hidden_states_grad(grads.dpre_w, gate_up_proj, topk_ids, align, config)
        # dpre_w and h_w: zeros on padding rows, as swiglu_backward writes them; one row_starts
        starts = align.row_starts() if need_gu or need_down else None
        if need_gu:
            d_gu = gate_up_proj_grad(grads.dpre_w, x, None, align, top_k, gate_up_proj.dtype,
                                     padding_zero=True, row_starts=starts)
        grads = grads._replace(dpre_w=None)     # freed before d down's buffers: a lower peak
        if need_down:
            d_down = down_proj_grad(dout, grads.h_w, None, align, top_k, down_proj.dtype, padding_zero=True,
                                    row_starts=starts)
    elif need_down:          # frozen everything else: h alone, unscaled, by the forward's GEMM1
        h = gemm1_swiglu(x, gate_up_proj, align, top_k, config)
        d_down = down_proj_grad(dout, h, topk_weights, align, top_k, down_proj.dtype)
    return dx, d_gu, d_down, d_w


def _owns_storage(t: torch.Tensor) -> bool:
    """Whether t is the whole of its storage (freeing the storage frees t and nothing else)."""
    return t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.numel() * t.element_size()


def check_first_order_backward() -> None:
    """Raise when a backward of the triton backend runs with create_graph=True (grad mode is on in a
    backward exactly then): its kernels record no graph, so a second-order gradient would be wrong."""
    if torch.is_grad_enabled():
        raise RuntimeError(
            "backend='triton' is not twice differentiable: its backward kernels record no graph, but this "
            "backward runs with create_graph=True; use backend='grouped_mm' or 'loop' for a double backward "
            "(a gradient penalty, a Hessian-vector product)")


class _TritonExperts(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, gate_up_proj, down_proj, topk_weights, topk_ids, plan):
        out = _workspace.empty_like(x)
        # plan.store_pre: the SwiGLU backward runs (x, gate_up or weights need grad) and reads a, b.
        align, pre = _forward(x, gate_up_proj, down_proj, topk_weights, topk_ids, plan, out)
        ctx.save_for_backward(x, gate_up_proj, down_proj, topk_weights, topk_ids, align.sorted_ids,
                              align.expert_ids, align.num_padded, align.tokens_per_expert, align.block_codes,
                              pre)
        ctx.config, ctx.block_m, ctx.num_pairs = plan.config, align.block_m, align.num_pairs
        ctx.mark_non_differentiable(topk_ids)
        return out

    @staticmethod
    def backward(ctx, dout):
        check_first_order_backward()
        x, gate_up_proj, down_proj, topk_weights, topk_ids, *meta, block_codes, pre = ctx.saved_tensors
        align = Alignment(*meta, ctx.block_m, ctx.num_pairs, block_codes)
        if pre is not None and pre.numel() and not pre.untyped_storage().nbytes():
            # A second backward through a retained graph: the first one freed pre. The forward's
            # GEMM1 (same inputs, alignment and config; deterministic) stores it again, bit for bit.
            _, pre = gemm1_swiglu_with_pre(x, gate_up_proj, align, topk_ids.shape[1], ctx.config)
        grads = experts_triton_backward(dout, x, gate_up_proj, down_proj, topk_weights, topk_ids, align,
                                        ctx.config, tuple(ctx.needs_input_grad[:4]), pre=pre,
                                        release_pre=True)
        return (*grads, None, None)


def _contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.is_contiguous() else t.contiguous()


def experts_triton(
    hidden_states: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    config: ExpertsConfig | None = None,
    out: torch.Tensor | None = None,
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
    activation: GatedActivation = SWIGLU,
    interleaved: bool = False,
) -> torch.Tensor:
    biases = [b for b in (gate_up_bias, down_bias) if b is not None]
    grad = needs_grad(hidden_states, gate_up_proj, down_proj, topk_weights, *biases)
    # The SwiGLU backward runs, and reads GEMM1's pre-activations, when one of these needs a gradient.
    store_pre = grad and any(t.requires_grad for t in (hidden_states, gate_up_proj, topk_weights))
    check_triton_device("hidden_states", hidden_states)
    plan = plan_triton_call(hidden_states, gate_up_proj, down_proj, topk_ids, grad=grad, store_pre=store_pre,
                            config=config, biases=bool(biases), activation=activation,
                            interleaved=interleaved)
    weights, ids = _contiguous(topk_weights), _contiguous(topk_ids)
    if grad:
        if out is not None:
            raise RuntimeError("out= cannot be used when the call needs gradients")
        return _TritonExperts.apply(hidden_states, gate_up_proj, down_proj, weights, ids, plan)
    if out is None:
        out = _workspace.empty_like(hidden_states)
    if plan.path == DECODE:
        return experts_decode(hidden_states, gate_up_proj, down_proj, weights, ids, out, plan.decode,
                              pdl=plan.pdl, evict=plan.weight_evict)
    _forward(hidden_states, gate_up_proj, down_proj, weights, ids, plan, out, gate_up_bias=gate_up_bias,
             down_bias=down_bias, activation=activation, interleaved=interleaved)
    return out


def experts_triton_train(hidden_states: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
                         topk_weights: torch.Tensor, topk_ids: torch.Tensor, *,
                         config: ExpertsConfig | None = None, store_pre: bool = True,
                         pre_rows: int | None = None,
                         ) -> tuple[torch.Tensor, torch.Tensor | None, Alignment]:
    """The forward of `_TritonExperts` below autograd, for the `moekit::experts_train` custom op:
    (out, pre or None, alignment), pre the (L, 2I) pre-activations GEMM1 stored when store_pre,
    with pre_rows rows when given (>= L: a size fixed before the config was known). Plain SwiGLU;
    no decode-direct path (a call that needs gradients never takes it)."""
    check_triton_device("hidden_states", hidden_states)
    plan = plan_triton_call(hidden_states, gate_up_proj, down_proj, topk_ids, grad=True, store_pre=store_pre,
                            config=config)
    config, weights, ids = plan.config, _contiguous(topk_weights), _contiguous(topk_ids)
    out = _workspace.empty_like(hidden_states)
    if pre_rows is not None and padded_length(ids.numel(), gate_up_proj.shape[0], config.block_m) > pre_rows:
        raise RuntimeError(f"moekit::experts_train: the config's block_m {config.block_m} pads to more rows "
                           f"than the {pre_rows} its sizes allow (block_m up to {BLOCK_M_BOUND} without a "
                           "config); pass config=")
    if hidden_states.shape[0] == 0:
        pre = hidden_states.new_empty(pre_rows or 0, gate_up_proj.shape[1]) if store_pre else None
        return out, pre, align_pairs(ids, gate_up_proj.shape[0], config, backend=plan.align, pdl=plan.pdl)
    align, pre = _forward(hidden_states, gate_up_proj, down_proj, weights, ids, plan, out, pre_rows=pre_rows)
    return out, pre, align


def experts_triton_grads(
    grad_out: torch.Tensor,
    hidden_states: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    needs: tuple[bool, bool, bool, bool],
    *,
    config: ExpertsConfig | None = None,
    alignment: torch.Tensor | None = None,
    pre: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, ...]:
    """The backward of the custom ops (`moekit::experts_backward`). `moekit::experts_train` saved
    its forward's alignment (packed, `moekit.align.pack_alignment`) and pre-activations: the SwiGLU
    backward reads them (one GEMM). Without them (the autograd of `moekit::experts`, which saves only
    the inputs) the alignment is recomputed (one small launch), and pre None recomputes a and b in the
    SwiGLU backward. config None: the tuned config of the forward, picked again. T must be > 0."""
    check_triton_device("hidden_states", hidden_states)
    plan = plan_triton_call(hidden_states, gate_up_proj, down_proj, topk_ids, grad=True, config=config)
    config, weights, ids = plan.config, _contiguous(topk_weights), _contiguous(topk_ids)
    num_experts = gate_up_proj.shape[0]
    if alignment is None:
        align = align_pairs(ids, num_experts, config, backend=plan.align, pdl=plan.pdl)
    else:
        align = unpack_alignment(alignment, ids.numel(), num_experts, config.block_m)
    return experts_triton_backward(grad_out, hidden_states, gate_up_proj, down_proj, weights, ids, align,
                                   config, needs, pre=pre)
