"""The expert path on block-scaled FP8 weights (`moekit.quant.Fp8Weight`), inference only.

    triton, T * K above the decode bound     x quantized per token per 128 channels (one launch)
                                             -> align -> GEMM1 fp8 (SwiGLU, h quantized in its
                                             epilogue) -> GEMM2 fp8 (routing weight) -> slot sum
    triton, few pairs (`moekit.decode`:      the two decode kernels on the e4m3 weights, scaled in
    `DECODE_MAX_PAIRS_FP8`)                  registers (w8a16: at decode sizes the weight bytes are
                                             the cost, and bf16 activations lose nothing)
    loop                                     the fp32 twin (`experts_fp8_torch`), any device

`moe_experts` routes a call whose weights are `Fp8Weight`s here through the backend registry (a
backend's `run_fp8`); under torch.compile it is the `moekit::experts_fp8` custom op. No host sync,
CUDA-graph safe; fresh buffers for every intermediate.
"""

from __future__ import annotations

import torch

from moekit import _workspace, env
from moekit._validation import (
    FLOAT_DTYPES,
    check_expert_ids_in_range,
    check_out,
    check_routing_args,
    check_tensor,
    check_triton_device,
)
from moekit.align import align_block_size
from moekit.decode import experts_decode
from moekit.experts.plan import DECODE, plan_triton_call
from moekit.experts.registry import (
    CONFIG_FIELDS,
    ExpertsOptions,
    config_of_ints,
    fp8_backend_names,
    get_backend,
)
from moekit.grouped_gemm import moe_sum
from moekit.grouped_gemm.fp8 import (
    experts_fp8_torch,
    gemm1_swiglu_fp8,
    gemm2_weighted_fp8,
    gluon_gemm1_fp8_problem,
    gluon_gemm1_swiglu_fp8,
    gluon_gemm2_fp8_problem,
    gluon_gemm2_weighted_fp8,
)
from moekit.quant import (
    Fp8Weight,
    check_fp8_scales,
    check_fp8_weight,
    check_inference,
    fp8_inputs,
    quantize_rows,
)
from moekit.tuning import ExpertsConfig

GLUON_FP8_ENV = "MOEKIT_GLUON_FP8"     # "1": the GEMMs on the Hopper Gluon kernels where they run (each call)


def check_fp8_experts_args(x: torch.Tensor, gate_up: object, down: object, topk_weights: torch.Tensor,
                           topk_ids: torch.Tensor, *, top_k_at_most_experts: bool = True,
                           allow_standin: bool = False) -> int:
    """The bf16 contract's checks with both weights `Fp8Weight`s on x's device, gate_up (E, 2I, H) and
    down (E, H, I), H and I divisible by 128; returns E. Reads no tensor data."""
    check_tensor("hidden_states", x, ndim=2, dtypes=FLOAT_DTYPES)
    num_tokens, hidden = x.shape
    gate_up = check_fp8_weight("gate_up_proj", gate_up, device=x.device, allow_standin=allow_standin)
    num_experts, two_i, h_in = gate_up.shape
    if h_in != hidden or two_i % 2:
        raise ValueError(f"gate_up_proj must have shape (E, 2*I, H={hidden}) (Transformers layout, gate rows "
                         f"first), got {tuple(gate_up.shape)}")
    check_fp8_weight("down_proj", down, shape=(num_experts, hidden, two_i // 2), device=x.device,
                     allow_standin=allow_standin)
    check_routing_args(topk_weights, topk_ids, num_tokens, num_experts, x.device,
                       top_k_at_most_experts=top_k_at_most_experts)
    return num_experts


def fp8_backend(backend: str, device: torch.device) -> str:
    """The backend an FP8 call runs on: "auto" is triton on CUDA and loop (the fp32 twin) elsewhere;
    any other name must take FP8 weights (ValueError naming those that do)."""
    name = ("triton" if device.type == "cuda" else "loop") if backend == "auto" else backend
    if get_backend(name).run_fp8 is None:
        raise ValueError(f"backend={name!r} takes no FP8 weights; backends that do: "
                         f"{list(fp8_backend_names())}")
    return name


def experts_triton_fp8(x: torch.Tensor, gate_up: Fp8Weight, down: Fp8Weight, topk_weights: torch.Tensor,
                       topk_ids: torch.Tensor, *, config: ExpertsConfig | None = None,
                       out: torch.Tensor | None = None, ue8m0: bool = False) -> torch.Tensor:
    """(T, H) in x's dtype: the FP8 expert path on the Triton kernels (module docstring), run as the
    call's plan says (`moekit.experts.plan`: path, tiles, align, launch hints). config: the grouped
    path's tiles (`moekit.tuning.check_fp8_config`); given, the decode path is not taken. ue8m0: the
    activations' and h's scales are powers of two."""
    check_triton_device("hidden_states", x)
    check_inference(hidden_states=x, topk_weights=topk_weights, gate_up_proj=gate_up, down_proj=down)
    if out is None:
        out = _workspace.empty_like(x)
    num_tokens, top_k = topk_ids.shape
    num_experts = gate_up.shape[0]
    if num_tokens == 0:
        return out
    ids = topk_ids.contiguous()
    weights = topk_weights.contiguous()
    plan = plan_triton_call(x, gate_up, down, ids, config=config)
    if plan.path == DECODE:
        return experts_decode(x, gate_up.data, down.data, weights, ids, out, plan.decode,
                              (gate_up.scale, down.scale), pdl=plan.pdl, evict=plan.weight_evict)
    cfg = plan.config
    gate_up, down = gate_up.for_kernels(), down.for_kernels()
    xq, xs = quantize_rows(x, ue8m0=ue8m0, dtype=gate_up.data.dtype)
    align = align_block_size(ids, num_experts, cfg.block_m, backend=plan.align, pdl=plan.pdl)
    if env.flag(GLUON_FP8_ENV) and not gluon_gemm1_fp8_problem(xq, gate_up, align):
        hq, hs = gluon_gemm1_swiglu_fp8(xq, xs, gate_up, align, top_k, ue8m0=ue8m0)
    else:
        hq, hs = gemm1_swiglu_fp8(xq, xs, gate_up, align, top_k, cfg, ue8m0=ue8m0, pdl=plan.pdl)
    if env.flag(GLUON_FP8_ENV) and not gluon_gemm2_fp8_problem(hq, down, align):
        y = gluon_gemm2_weighted_fp8(hq, hs, down, weights, align, x.dtype)
    else:
        y = gemm2_weighted_fp8(hq, hs, down, weights, align, cfg, x.dtype, pdl=plan.pdl)
    return moe_sum(y, ids, num_experts, out, pdl=plan.pdl)


def experts_loop_fp8(x: torch.Tensor, gate_up: Fp8Weight, down: Fp8Weight, topk_weights: torch.Tensor,
                     topk_ids: torch.Tensor, *, out: torch.Tensor | None = None,
                     ue8m0: bool = False) -> torch.Tensor:
    """The fp32 twin, rounded to x's dtype: the FP8 path on any device (a loop over the experts hit)."""
    check_inference(hidden_states=x, topk_weights=topk_weights, gate_up_proj=gate_up, down_proj=down)
    result = experts_fp8_torch(x, gate_up, down, topk_weights, topk_ids, ue8m0=ue8m0).to(x.dtype)
    return result if out is None else out.copy_(result)


def moe_experts_fp8(x: torch.Tensor, gate_up: Fp8Weight, down: Fp8Weight, topk_weights: torch.Tensor,
                    topk_ids: torch.Tensor, *, backend: str = "auto", config: ExpertsConfig | None = None,
                    ignore_invalid_ids: bool = False, validate: bool | None = None,
                    out: torch.Tensor | None = None, ue8m0: bool = False) -> torch.Tensor:
    """`moekit.moe_experts` for `Fp8Weight` weights: checks, then the backend's `run_fp8` ("auto":
    triton on CUDA, loop elsewhere); under torch.compile the `moekit::experts_fp8` op."""
    num_experts = check_fp8_experts_args(x, gate_up, down, topk_weights, topk_ids,
                                         top_k_at_most_experts=not ignore_invalid_ids)
    name = fp8_backend(backend, x.device)
    impl = get_backend(name)
    if config is not None and "config" not in impl.options:
        raise ValueError(f"config applies to backend='triton', not backend={name!r}")
    check_inference(hidden_states=x, topk_weights=topk_weights, gate_up_proj=gate_up, down_proj=down)
    compiling = torch.compiler.is_compiling()
    if validate is None:
        validate = x.device.type == "cpu" and not compiling
    if validate:        # reads the ids and scales: a host sync on CUDA, so on the CPU by default
        check_fp8_scales("gate_up_proj", gate_up)
        check_fp8_scales("down_proj", down)
        if not ignore_invalid_ids:
            check_expert_ids_in_range(topk_ids, num_experts)
    if out is not None:
        check_out(out, x, fp8_inputs(hidden_states=x, topk_weights=topk_weights, topk_ids=topk_ids,
                                     gate_up_proj=gate_up, down_proj=down))
    if x.shape[0] == 0 or num_experts == 0:     # no pair reaches an expert: zeros, as the dense path
        return out.zero_() if out is not None else torch.zeros_like(x)
    if compiling:
        cfg = None if config is None else [int(getattr(config, f)) for f in CONFIG_FIELDS]
        result = torch.ops.moekit.experts_fp8(x, gate_up.data, gate_up.scale, down.data, down.scale,
                                              topk_weights, topk_ids, name, cfg, ue8m0)
        return result if out is None else out.copy_(result)
    return impl.run_fp8(x, gate_up, down, topk_weights, topk_ids, ExpertsOptions(config=config), out, ue8m0)


@torch.library.custom_op(
    "moekit::experts_fp8", mutates_args=(),
    schema="(Tensor hidden_states, Tensor gate_up, Tensor gate_up_scale, Tensor down, Tensor down_scale, "
           "Tensor topk_weights, Tensor topk_ids, str backend, int[]? config, bool ue8m0=False) -> Tensor",
)
def _experts_fp8_op(hidden_states: torch.Tensor, gate_up: torch.Tensor, gate_up_scale: torch.Tensor,
                    down: torch.Tensor, down_scale: torch.Tensor, topk_weights: torch.Tensor,
                    topk_ids: torch.Tensor, backend: str, config: list[int] | None,
                    ue8m0: bool = False) -> torch.Tensor:
    """The FP8 dispatch as one opaque node (inference only). Ids outside [0, E) contribute 0."""
    gu, dn = Fp8Weight(gate_up, gate_up_scale), Fp8Weight(down, down_scale)
    check_fp8_experts_args(hidden_states, gu, dn, topk_weights, topk_ids, top_k_at_most_experts=False)
    x = hidden_states.contiguous()
    if x.shape[0] == 0 or gate_up.shape[0] == 0:      # no pair reaches an expert, as in moe_experts_fp8
        return torch.zeros_like(x)
    options = ExpertsOptions(config=config_of_ints(config))
    return get_backend(backend).run_fp8(x, gu, dn, topk_weights, topk_ids, options, None, ue8m0).contiguous()


@_experts_fp8_op.register_fake
def _experts_fp8_fake(hidden_states, gate_up, gate_up_scale, down, down_scale, topk_weights, topk_ids,
                      backend, config, ue8m0=False):
    check_fp8_experts_args(hidden_states, Fp8Weight(gate_up, gate_up_scale), Fp8Weight(down, down_scale),
                           topk_weights, topk_ids, top_k_at_most_experts=False)
    return hidden_states.new_empty(hidden_states.shape)
