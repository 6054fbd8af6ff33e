"""The expert path: one entry (`moe_experts`), a registry of backends, one custom op.

    loop        experts/loop.py        Transformers' eager loop (reference behaviour, slow)
    padded      experts/padded.py      (E, cap, H) buffers + torch.bmm; optional capacity factor
    grouped_mm  experts/grouped_mm.py  sort + gather + torch grouped_mm
    triton      experts/triton.py      moekit's fused grouped GEMMs (gather on load, SwiGLU and
                                       routing weight fused, scatter on store)
    masked      experts/masked.py      DeepGEMM's masked layout: (E, C, H) with per-expert counts on
                                       the device (`moekit.masked`); optional capacity factor

`moe_experts` checks its arguments once (shapes, dtypes, devices, options against the backend's
capabilities, `out=`, and the ids where that costs no host sync), then runs the backend's entry in
`registry`. Inside torch.compile it calls the `moekit::experts` custom op instead, whose body is
the same dispatch: one opaque node whose fake implementation derives the output size from the
inputs alone, so one graph serves every token count. A call that needs gradients (known at trace
time) on backend="triton" calls `moekit::experts_train` instead: the same forward, which also returns
what the eager autograd saves (the (L, 2I) SwiGLU pre-activations GEMM1 stores beside h, and the
alignment packed in one int32 buffer; sizes from (T, K, E, block_m) with a config, else bounds
over every block_m up to `moekit.align.BLOCK_M_BOUND`, so they follow T alone, symbolic or not);
its autograd saves them with the inputs and calls
`moekit::experts_backward`, another opaque op, which runs the triton backward kernels on them (no
align, the SwiGLU backward reads a and b: one GEMM, not three). Inference calls `moekit::experts`
(no store, no extra memory). `moekit::experts` itself stays differentiable for direct callers (its
backward recomputes the alignment and the pre-activations). A call that needs gradients on another
backend, or gives `stats`, is traced by torch.compile as in eager mode: grouped_mm's GEMMs through
the `moekit::grouped_mm` op, padded with a capacity factor; loop and padded without one read counts
back to the host, and under fullgraph=True torch.compile names that reason. An inference call with
`capacity_factor` (padded, masked) runs in `moekit::experts`.

Expert math beyond SwiGLU (`moekit.activation`): per-expert biases on both projections, the gpt_oss
activation and interleaved gate/up rows, on every backend but masked (fused in the triton kernels'
epilogues, plain PyTorch in loop, padded and grouped_mm). The triton backward has none of them: a
call with them that needs gradients runs on grouped_mm or loop ("auto", warned once) or raises
(backend="triton"); a bias gradient is never dropped.
"""

from __future__ import annotations

import warnings

import torch

from moekit._validation import (
    check_bool,
    check_capacity_factor,
    check_expert_biases,
    check_expert_ids_in_range,
    check_experts_args,
    check_out,
    needs_grad,
)
from moekit.activation import SWIGLU, GatedActivation, as_activation
from moekit.align import pack_alignment, packed_bound, packed_size, padded_length, pre_rows_bound
from moekit.experts.fp8 import experts_loop_fp8, experts_triton_fp8, moe_experts_fp8
from moekit.experts.grouped_mm import check_grouped_mm_layout, experts_grouped_mm
from moekit.experts.loop import experts_loop
from moekit.experts.masked import experts_masked, experts_masked_fp8
from moekit.experts.padded import PaddedWorkspaceTooLarge, experts_padded
from moekit.experts.plan import auto_config
from moekit.experts.registry import (
    CONFIG_FIELDS,
    MATH_OPTIONS,
    Backend,
    ExpertsOptions,
    backend_names,
    check_backend_name,
    config_of_ints,
    get_backend,
    register_backend,
)
from moekit.experts.triton import (
    check_first_order_backward,
    experts_triton,
    experts_triton_grads,
    experts_triton_train,
)
from moekit.quant import Fp8Weight
from moekit.tuning import ExpertsConfig

__all__ = ["BACKENDS", "Backend", "ExpertsOptions", "PaddedWorkspaceTooLarge", "check_backend_name",
           "get_backend", "has_backward", "moe_experts", "register_backend", "resolve_backend"]


def _into(out: torch.Tensor | None, result: torch.Tensor) -> torch.Tensor:
    return result if out is None else out.copy_(result)


class _NothingRouted(torch.autograd.Function):
    """The output of a call in which no pair reaches an expert (no tokens, or no experts and every id
    ignored): zeros, whose gradient for every input is zeros, so a training step with an empty batch
    or an expert-parallel rank holding no experts still gives every parameter a gradient."""

    @staticmethod
    def forward(ctx, hidden_states: torch.Tensor, *inputs: torch.Tensor) -> torch.Tensor:
        ctx.like = [(t.shape, t.dtype, t.device) for t in (hidden_states, *inputs)]
        return torch.zeros_like(hidden_states)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(torch.zeros(shape, dtype=dtype, device=device) for shape, dtype, device in ctx.like)


def _nothing_routed(hidden_states: torch.Tensor, inputs: list[torch.Tensor], grad: bool,
                    stats: dict | None, out: torch.Tensor | None) -> torch.Tensor:
    if stats is not None:
        dev = hidden_states.device
        stats.update(capacity=0, dropped=torch.zeros((), dtype=torch.int64, device=dev),
                     counts=torch.zeros(inputs[0].shape[0], dtype=torch.int32, device=dev))
    if grad:
        return _NothingRouted.apply(hidden_states, *inputs)
    if out is not None:
        return out.zero_()
    return torch.zeros_like(hidden_states)


register_backend(Backend(
    "loop",
    lambda x, gu, d, w, ids, opts, out: _into(out, experts_loop(x, gu, d, w, ids, **opts.math_kwargs())),
    "a Python loop over the experts hit, as Transformers' eager code (one sync per expert)",
    options=MATH_OPTIONS,
    run_fp8=lambda x, gu, d, w, ids, opts, out, ue8m0: experts_loop_fp8(x, gu, d, w, ids, out=out,
                                                                        ue8m0=ue8m0)))
register_backend(Backend(
    "padded",
    lambda x, gu, d, w, ids, opts, out: _into(out, experts_padded(
        x, gu, d, w, ids, capacity_factor=opts.capacity_factor, stats=opts.stats, **opts.math_kwargs())),
    "every expert padded to the busiest count (or a capacity), two torch.bmm",
    options=frozenset({"capacity_factor", "stats"}) | MATH_OPTIONS))
register_backend(Backend(
    "grouped_mm",
    lambda x, gu, d, w, ids, opts, out: _into(out, experts_grouped_mm(
        x, gu, d, w, ids, **opts.math_kwargs())),
    "sort, gather, torch grouped_mm x2, weighted sum",
    check_layout=check_grouped_mm_layout, options=MATH_OPTIONS))
register_backend(Backend(
    "triton",
    lambda x, gu, d, w, ids, opts, out: experts_triton(x, gu, d, w, ids, config=opts.config, out=out,
                                                       **opts.math_kwargs()),
    "moekit's fused grouped GEMMs: gather on load, SwiGLU and routing weight fused, scatter on store",
    capturable=True, backward_devices=frozenset({"cpu", "cuda"}),
    options=frozenset({"config"}) | MATH_OPTIONS, backward_options=frozenset({"config"}),
    default_config=auto_config,
    run_fp8=lambda x, gu, d, w, ids, opts, out, ue8m0: experts_triton_fp8(
        x, gu, d, w, ids, config=opts.config, out=out, ue8m0=ue8m0)))
register_backend(Backend(
    "masked",
    lambda x, gu, d, w, ids, opts, out: experts_masked(
        x, gu, d, w, ids, capacity_factor=opts.capacity_factor, stats=opts.stats, config=opts.config,
        out=out, capacity=opts.capacity),
    "DeepGEMM's masked layout: pairs scattered into (E, C, H), counts on the device, grouped GEMMs "
    "whose programs past a count exit, weighted gather",
    capturable=True, backward_devices=frozenset(), options=frozenset({"config", "capacity_factor", "stats"}),
    run_fp8=lambda x, gu, d, w, ids, opts, out, ue8m0: experts_masked_fp8(
        x, gu, d, w, ids, config=opts.config, out=out, ue8m0=ue8m0)))

BACKENDS = backend_names()


def has_backward(backend: str, device: torch.device, options: ExpertsOptions | None = None) -> bool:
    """Whether autograd can differentiate the backend on this device (with these options: the
    triton backward has no expert biases, gpt_oss activation or interleaved rows)."""
    return get_backend(backend).has_backward(device, options)


_warned_grad_fallback: set[tuple[str, str]] = set()


def _no_backward_why(impl: Backend, device: torch.device, options: ExpertsOptions | None) -> str:
    missing = impl.no_backward_for(options)
    if device.type in impl.backward_devices and missing:
        return f"has no backward for calls given {', '.join(missing)}"
    return f"has no backward on {device.type}"


def resolve_backend(backend: str, device: torch.device, hidden: int = 16, inter: int = 16,
                    itemsize: int = 2, *, grad: bool = False, options: ExpertsOptions | None = None) -> str:
    """"auto" -> triton on CUDA; on CPU grouped_mm when its alignment holds, else loop.

    grad=True (the call needs gradients): "auto" picks a backend with a backward for these options
    (grouped_mm on CUDA when aligned, else loop) and warns once; an explicit backend without one
    raises.
    """
    aligned = (hidden * itemsize) % 16 == 0 and (inter * itemsize) % 16 == 0
    if backend != "auto":
        impl = get_backend(backend)                                    # ValueError if unknown
        if grad and not impl.has_backward(device, options):
            raise RuntimeError(
                f"backend={backend!r} {_no_backward_why(impl, device, options)}, but this call needs "
                "gradients (an input requires grad and grad mode is on); run it under torch.no_grad() or "
                "torch.inference_mode(), or use backend='auto' (picks a differentiable backend)")
        return backend
    choice = "triton" if device.type == "cuda" else ("grouped_mm" if aligned else "loop")
    if grad and not has_backward(choice, device, options):
        why = _no_backward_why(get_backend(choice), device, options)
        fallback = "grouped_mm" if aligned and has_backward("grouped_mm", device, options) else "loop"
        if (choice, why) not in _warned_grad_fallback:
            _warned_grad_fallback.add((choice, why))
            warnings.warn(f"moekit: backend {choice!r} {why}; this call needs gradients, so it runs on "
                          f"{fallback!r} (warned once)", stacklevel=3)
        choice = fallback
    return choice


def moe_experts(
    hidden_states: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    backend: str = "auto",
    config: ExpertsConfig | None = None,
    capacity_factor: float | None = None,
    stats: dict | None = None,
    ignore_invalid_ids: bool = False,
    validate: bool | None = None,
    out: torch.Tensor | None = None,
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
    activation: str | GatedActivation | None = None,
    interleaved: bool = False,
    ue8m0_scales: bool = False,
) -> torch.Tensor:
    """Run the experts: out[t] = sum_k w[t,k] * down_e(silu(gate_e x_t) * up_e x_t), e = ids[t,k].

    With the optional expert math (`moekit.activation`): out[t] = sum_k w[t,k] *
    (down_e(act(gate_up_e x_t + gate_up_bias_e)) + down_bias_e), as gpt-oss computes it.

    Args:
        hidden_states: (T, H) float32, float16 or bfloat16.
        gate_up_proj: (E, 2I, H), gate rows first (Transformers layout), same dtype and device; or a
            `moekit.quant.Fp8Weight` (block-scaled float8 e4m3, `moekit.quant.quantize_experts`):
            FP8 experts, inference only, on backends triton, masked and loop (`Backend.run_fp8`),
            with no capacity_factor, stats, biases or other activation.
        down_proj: (E, H, I), dense or `Fp8Weight` as gate_up_proj.
        topk_weights: (T, K) routing weights, float32, float16 or bfloat16 (applied in fp32 by triton).
        topk_ids: (T, K) int32 or int64 expert ids.
        backend: "auto" or one of `BACKENDS`. A call that needs gradients runs only on a backend
            with a backward (`has_backward`); "auto" picks one (warning once), an explicit
            backend without one raises RuntimeError. Never a silently detached output.
        config, capacity_factor, stats: the backend's options (`ExpertsOptions`); an option the
            backend does not take raises ValueError.
        ignore_invalid_ids: pairs with ids outside [0, E) contribute exactly 0 (expert
            parallelism marks non-local experts so), and K may exceed E. When False, such ids
            raise ValueError where that costs no host sync: on CPU, or when validate=True.
        validate: check id ranges, and FP8 weights' scales finite and positive (a host sync on
            CUDA). Default: True on CPU, False on CUDA and under torch.compile; FP8 weights made by
            `moekit.quant` (quantized, or loaded from a checkpoint) had their scales checked then.
        out: optional (T, H) output buffer of the input dtype, any strides; must not overlap
            itself or any input (a disjoint slice of an input's storage is fine, and so is a
            strided view such as the first H columns of a wider buffer).
        gate_up_bias: optional (E, 2I) bias of the gate/up projection, in gate_up_proj's row
            layout, of the weights' dtype.
        down_bias: optional (E, H) bias of the down projection, added before the routing weight.
        activation: "swiglu" (default), "gpt_oss" (alpha 1.702, limit 7.0) or a
            `moekit.GatedActivation` with other alpha and limit.
        interleaved: gate_up_proj's rows alternate gate, up (gpt-oss) instead of [gate; up].
            Backends: all but masked. The triton backward has none of these: with them, a call
            that needs gradients runs on grouped_mm / loop under "auto" and raises for "triton".
        ue8m0_scales: FP8 weights: the activations' per-128-channel scales are powers of two (the
            triton backend's decode path, w8a16, quantizes no activations).

    Returns:
        (T, H) in the dtype of hidden_states. Kernels never read an expert for an invalid id.
    """
    if isinstance(gate_up_proj, Fp8Weight) or isinstance(down_proj, Fp8Weight):
        swiglu = activation is None or as_activation(activation).is_swiglu     # what the FP8 path computes
        given = {"capacity_factor": capacity_factor, "stats": stats, "gate_up_bias": gate_up_bias,
                 "down_bias": down_bias, "activation": None if swiglu else activation,
                 "interleaved": interleaved or None}
        extra = [name for name, value in given.items() if value is not None]
        if extra:
            raise ValueError(f"{', '.join(extra)}: not available with FP8 weights")
        return moe_experts_fp8(hidden_states, gate_up_proj, down_proj, topk_weights, topk_ids,
                               backend=backend, config=config, ignore_invalid_ids=ignore_invalid_ids,
                               validate=validate, out=out, ue8m0=ue8m0_scales)
    num_experts = check_experts_args(hidden_states, gate_up_proj, down_proj, topk_weights, topk_ids,
                                     top_k_at_most_experts=not ignore_invalid_ids)
    if (config is None and capacity_factor is None and stats is None and gate_up_bias is None
            and down_bias is None and activation is None and interleaved is False):
        act, options = SWIGLU, _NO_OPTIONS          # the common call: nothing more to check or build
    else:
        check_expert_biases(gate_up_bias, down_bias, gate_up_proj)
        act = as_activation(activation)
        math = ExpertsOptions.math(gate_up_bias, down_bias, act, check_bool("interleaved", interleaved))
        options = ExpertsOptions(config, check_capacity_factor(capacity_factor), stats, **math)
    dev = hidden_states.device
    biases = [b for b in (gate_up_bias, down_bias) if b is not None]
    grad = needs_grad(hidden_states, gate_up_proj, down_proj, topk_weights, *biases)
    name = resolve_backend(backend, dev, hidden_states.shape[1], down_proj.shape[2],
                           hidden_states.element_size(), grad=grad, options=options)
    impl = get_backend(name)
    impl.check_options(options)
    compiling = torch.compiler.is_compiling()
    if validate is None:
        validate = dev.type == "cpu" and not compiling
    if validate and not ignore_invalid_ids:
        check_expert_ids_in_range(topk_ids, num_experts)
    if out is not None:
        if grad:
            raise RuntimeError("out= cannot be used when the call needs gradients (autograd does not "
                               "record writes into out); drop out= or run under torch.no_grad()")
        inputs = {"hidden_states": hidden_states, "gate_up_proj": gate_up_proj, "down_proj": down_proj,
                  "topk_weights": topk_weights, "topk_ids": topk_ids, "gate_up_bias": gate_up_bias,
                  "down_bias": down_bias}
        check_out(out, hidden_states, {k: t for k, t in inputs.items() if t is not None})
    if impl.check_layout is not None:
        impl.check_layout(hidden_states, gate_up_proj, down_proj)
    if hidden_states.shape[0] == 0 or num_experts == 0:
        return _nothing_routed(hidden_states, [gate_up_proj, down_proj, topk_weights, *biases], grad,
                               options.stats, out)
    if (compiling and (not grad or (name in OP_BACKWARD_BACKENDS and impl.has_backward(dev, options)))
            and options.stats is None):
        cfg = None if config is None else [int(getattr(config, f)) for f in CONFIG_FIELDS]
        # The math only when given: Python floats make Dynamo restart its analysis once.
        math_args = () if not (biases or options.activation or interleaved) else (
            gate_up_bias, down_bias, act.name, act.alpha, act.limit, interleaved)
        if grad:    # known at trace time: the op that also returns what its backward reads
            store_pre = any(t.requires_grad for t in (hidden_states, gate_up_proj, topk_weights))
            return torch.ops.moekit.experts_train(hidden_states, gate_up_proj, down_proj, topk_weights,
                                                  topk_ids, name, cfg, store_pre)[0]
        cf = {} if options.capacity_factor is None else {"capacity_factor": options.capacity_factor}
        result = torch.ops.moekit.experts(hidden_states, gate_up_proj, down_proj, topk_weights, topk_ids,
                                          name, cfg, *math_args, **cf)
        return _into(out, result)
    return impl.run(hidden_states, gate_up_proj, down_proj, topk_weights, topk_ids, options, out)


_NO_OPTIONS = ExpertsOptions()
# Backends the custom op differentiates. A custom op's body runs below autograd, so another backend
# cannot be recomputed under autograd there: under torch.compile those are traced instead.
OP_BACKWARD_BACKENDS = frozenset({"triton"})
_config_of = config_of_ints


def _op_options(gate_up_proj: torch.Tensor, config: list[int] | None, gate_up_bias: torch.Tensor | None,
                down_bias: torch.Tensor | None, activation: str, alpha: float, limit: float,
                interleaved: bool, capacity_factor: float | None = None) -> ExpertsOptions:
    """The op's arguments back to checked `ExpertsOptions`."""
    check_expert_biases(gate_up_bias, down_bias, gate_up_proj)
    math = ExpertsOptions.math(gate_up_bias, down_bias, GatedActivation(activation, alpha, limit),
                               interleaved)
    return ExpertsOptions(config_of_ints(config), check_capacity_factor(capacity_factor), **math)


@torch.library.custom_op(
    "moekit::experts", mutates_args=(),
    schema="(Tensor hidden_states, Tensor gate_up_proj, Tensor down_proj, Tensor topk_weights, "
           "Tensor topk_ids, str backend, int[]? config, Tensor? gate_up_bias=None, Tensor? down_bias=None, "
           "str activation=\"swiglu\", float alpha=1.702, float limit=7.0, bool interleaved=False, "
           "float? capacity_factor=None) -> Tensor",
)
def _experts_op(hidden_states: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
                topk_weights: torch.Tensor, topk_ids: torch.Tensor, backend: str,
                config: list[int] | None, gate_up_bias: torch.Tensor | None = None,
                down_bias: torch.Tensor | None = None, activation: str = "swiglu", alpha: float = 1.702,
                limit: float = 7.0, interleaved: bool = False,
                capacity_factor: float | None = None) -> torch.Tensor:
    """The registry's dispatch as one opaque node. Ids outside [0, E) contribute 0 and are never
    read back (no host sync); K may exceed E. The expert math and capacity_factor as in `moe_experts`."""
    check_experts_args(hidden_states, gate_up_proj, down_proj, topk_weights, topk_ids,
                       top_k_at_most_experts=False)
    options = _op_options(gate_up_proj, config, gate_up_bias, down_bias, activation, alpha, limit,
                          interleaved, capacity_factor)
    impl = get_backend(backend)
    impl.check_options(options)
    if impl.check_layout is not None:       # the same layout check as moe_experts, for direct calls
        impl.check_layout(hidden_states, gate_up_proj, down_proj)
    x = hidden_states.contiguous()   # a contiguous output from every backend, as the fake one is
    if x.shape[0] == 0 or gate_up_proj.shape[0] == 0:      # no pair reaches an expert, as in moe_experts
        return torch.zeros_like(x)
    with torch.no_grad():   # the op's own autograd (below) records this call, not the backend
        result = impl.run(x, gate_up_proj, down_proj, topk_weights, topk_ids, options, None)
    return result.contiguous()


@_experts_op.register_fake
def _experts_fake(hidden_states, gate_up_proj, down_proj, topk_weights, topk_ids, backend, config,
                  gate_up_bias=None, down_bias=None, activation="swiglu", alpha=1.702, limit=7.0,
                  interleaved=False, capacity_factor=None):
    check_experts_args(hidden_states, gate_up_proj, down_proj, topk_weights, topk_ids,
                       top_k_at_most_experts=False)
    _op_options(gate_up_proj, None, gate_up_bias, down_bias, activation, alpha, limit, interleaved,
                capacity_factor)
    return hidden_states.new_empty(hidden_states.shape)


@torch.library.custom_op(
    "moekit::experts_train", mutates_args=(),
    schema="(Tensor hidden_states, Tensor gate_up_proj, Tensor down_proj, Tensor topk_weights, "
           "Tensor topk_ids, str backend, int[]? config, bool store_pre) -> (Tensor, Tensor, Tensor)",
)
def _experts_train_op(hidden_states: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
                      topk_weights: torch.Tensor, topk_ids: torch.Tensor, backend: str,
                      config: list[int] | None, store_pre: bool,
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`moekit::experts` (plain SwiGLU) for a call that needs gradients: (out, pre, alignment), what
    the eager autograd saves. pre: the (L, 2I) SwiGLU pre-activations GEMM1 stored beside h when
    store_pre (else (0, 2I)); alignment: the forward's `Alignment`, packed into one int32 buffer
    (`moekit.align.pack_alignment`). Both are non-differentiable; the backward reads them."""
    _check_op_backward(backend, "moekit::experts_train")
    check_experts_args(hidden_states, gate_up_proj, down_proj, topk_weights, topk_ids,
                       top_k_at_most_experts=False)
    num_pairs, num_experts = topk_ids.numel(), gate_up_proj.shape[0]
    bounded = config is None     # sizes from bounds: the fake cannot know the tuned block_m
    pre_rows = pre_rows_bound(num_pairs, num_experts) if bounded and store_pre else None
    out, pre, align = experts_triton_train(hidden_states.contiguous(), gate_up_proj, down_proj, topk_weights,
                                           topk_ids, config=config_of_ints(config), store_pre=store_pre,
                                           pre_rows=pre_rows)
    if pre is None:
        pre = hidden_states.new_empty(0, gate_up_proj.shape[1])
    capacity = packed_bound(num_pairs, num_experts) if bounded else None
    return out, pre, pack_alignment(align, num_experts, capacity)


@_experts_train_op.register_fake
def _experts_train_fake(hidden_states, gate_up_proj, down_proj, topk_weights, topk_ids, backend, config,
                        store_pre):
    _check_op_backward(backend, "moekit::experts_train")
    check_experts_args(hidden_states, gate_up_proj, down_proj, topk_weights, topk_ids,
                       top_k_at_most_experts=False)
    rows, packed = _saved_sizes(hidden_states, gate_up_proj, topk_ids, config, store_pre)
    pre = hidden_states.new_empty(rows, gate_up_proj.shape[1])
    return (hidden_states.new_empty(hidden_states.shape), pre,
            hidden_states.new_empty(packed, dtype=torch.int32))


def _saved_sizes(hidden_states, gate_up_proj, topk_ids, config, store_pre):
    """(pre's rows, or 0 without store_pre; the packed alignment's length) as `moekit::experts_train`
    allocates them, from (T, K, E) and the config, no device data read. Given a config: L and the
    packed length of its block_m. Without one the tuned block_m is picked when the op runs (it
    follows T, which torch.compile may keep symbolic), so both are bounds over every block_m up to
    `moekit.align.BLOCK_M_BOUND` (`pre_rows_bound`, `packed_bound`): expressions of T, never unbacked
    sizes (an op with unbacked output sizes broke CUDA-graph trees under mode="reduce-overhead")."""
    num_tokens, top_k = topk_ids.shape
    num_pairs, num_experts = num_tokens * top_k, gate_up_proj.shape[0]
    cfg = config_of_ints(config)
    if cfg is None:
        rows = pre_rows_bound(num_pairs, num_experts) if store_pre else 0
        return rows, packed_bound(num_pairs, num_experts)
    sizes = (num_pairs, num_experts, cfg.block_m)
    return padded_length(*sizes) if store_pre else 0, packed_size(*sizes)


def _check_op_backward(backend: str, op: str) -> None:
    if backend not in OP_BACKWARD_BACKENDS:      # the forward would otherwise return a dead end
        raise RuntimeError(f"{op} differentiates backend {sorted(OP_BACKWARD_BACKENDS)} only, "
                           f"got backend={backend!r} with inputs that need gradients; call "
                           "moekit.moe_experts, which picks a differentiable path")


@torch.library.custom_op(
    "moekit::experts_backward", mutates_args=(),
    schema="(Tensor grad_out, Tensor hidden_states, Tensor gate_up_proj, Tensor down_proj, "
           "Tensor topk_weights, Tensor topk_ids, str backend, int[]? config, bool[] needs, "
           "Tensor? pre=None, Tensor? alignment=None) -> Tensor[]",
)
def _experts_backward_op(grad_out: torch.Tensor, hidden_states: torch.Tensor, gate_up_proj: torch.Tensor,
                         down_proj: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                         backend: str, config: list[int] | None, needs: list[bool],
                         pre: torch.Tensor | None = None, alignment: torch.Tensor | None = None,
                         ) -> list[torch.Tensor]:
    """Gradients of `moekit::experts` / `moekit::experts_train` for the inputs `needs` marks, an
    empty tensor for the others. pre, alignment: what `moekit::experts_train` saved (the SwiGLU
    backward then reads a, b and skips the align); None (the autograd of `moekit::experts`):
    recomputed."""
    inputs = [hidden_states, gate_up_proj, down_proj, topk_weights]
    if backend not in OP_BACKWARD_BACKENDS:
        raise RuntimeError(f"moekit::experts has no backward for backend={backend!r}")
    if hidden_states.shape[0] == 0:
        grads = [torch.zeros_like(t) if need else None for t, need in zip(inputs, needs)]
    else:
        grads = list(experts_triton_grads(grad_out, *inputs, topk_ids, tuple(needs),
                                          config=config_of_ints(config), alignment=alignment, pre=pre))
    return [g.contiguous() if g is not None else t.new_empty(0) for g, t in zip(grads, inputs)]


@_experts_backward_op.register_fake
def _experts_backward_fake(grad_out, hidden_states, gate_up_proj, down_proj, topk_weights, topk_ids, backend,
                           config, needs, pre=None, alignment=None):
    inputs = [hidden_states, gate_up_proj, down_proj, topk_weights]
    return [t.new_empty(t.shape) if need else t.new_empty(0) for t, need in zip(inputs, needs)]


def _experts_setup_context(ctx, inputs, output):
    hidden_states, gate_up_proj, down_proj, topk_weights, topk_ids, backend, config, *math = inputs
    gate_up_bias, down_bias, activation, _, _, interleaved = (math + [None, None, "swiglu", 0, 0, False])[:6]
    _check_op_backward(backend, "moekit::experts")
    if gate_up_bias is not None or down_bias is not None or activation != "swiglu" or interleaved:
        raise RuntimeError("moekit::experts differentiates SwiGLU experts without biases only (the triton "
                           "backward), got expert biases, another activation or interleaved rows with inputs "
                           "that need gradients; call moekit.moe_experts, which picks a differentiable path")
    ctx.save_for_backward(hidden_states, gate_up_proj, down_proj, topk_weights, topk_ids)
    ctx.backend, ctx.config = backend, config
    ctx.num_inputs = len(inputs)


def _experts_backward(ctx, grad_out):
    return _call_backward(ctx, grad_out, *ctx.saved_tensors)


def _call_backward(ctx, grad_out, *saved):
    """The op's grads of the four differentiable inputs, None for the rest of its inputs."""
    check_first_order_backward()        # experts_backward has no autograd of its own
    needs = list(ctx.needs_input_grad[:4])
    grads = torch.ops.moekit.experts_backward(grad_out, *saved[:5], ctx.backend, ctx.config, needs,
                                              *saved[5:])
    return (*(g if need else None for g, need in zip(grads, needs)), *[None] * (ctx.num_inputs - 4))


def _experts_train_setup_context(ctx, inputs, output):
    hidden_states, gate_up_proj, down_proj, topk_weights, topk_ids, backend, config, store_pre = inputs
    _, pre, alignment = output
    ctx.mark_non_differentiable(pre, alignment)
    ctx.save_for_backward(hidden_states, gate_up_proj, down_proj, topk_weights, topk_ids, pre, alignment)
    ctx.backend, ctx.config, ctx.store_pre = backend, config, store_pre
    ctx.num_inputs = len(inputs)


def _experts_train_backward(ctx, grad_out, _grad_pre, _grad_alignment):
    *inputs, pre, alignment = ctx.saved_tensors
    return _call_backward(ctx, grad_out, *inputs, pre if ctx.store_pre else None, alignment)


torch.library.register_autograd("moekit::experts", _experts_backward, setup_context=_experts_setup_context)
torch.library.register_autograd("moekit::experts_train", _experts_train_backward,
                                setup_context=_experts_train_setup_context)
