"""Grouped GEMM family: GEMM1 (gate_up + SwiGLU), GEMM2 (down + routing weight), the slot sum.

Each launcher (checks done by the caller, buffers allocated here, grid from fixed upper bounds) sits
beside its pure-PyTorch twin (`*_torch`), which computes the same rows in fp32 and is what the
kernel tests compare against (fp64 inputs stay fp64, for gradcheck). The @triton.jit code is in
`moekit.grouped_gemm.kernels`; the backward is `moekit.grouped_gemm.backward` (kernels in
`moekit.grouped_gemm.backward_kernels`), and quantized variants go beside these the same way.

Legend: T tokens, K top_k, S = T * K pairs, E experts, H hidden, I intermediate, L padded rows
(`Alignment.sorted_ids` length). Rows of h at or past `num_padded`, and rows of y of pairs that
were never placed (ids outside [0, E)), are not written: the twins leave them 0, and callers
never read them.

The extended expert math (`moekit.activation`: expert biases, the gpt_oss activation, interleaved
gate/up rows) is keyword arguments of GEMM1 and GEMM2 and of their twins; left at their defaults
the kernels compile exactly as without them (constexpr flags off).

`gemm1_swiglu_with_pre` is GEMM1 for a forward that the backward follows (plain SwiGLU): the same
launch also stores the [gate | up] pre-activations, (L, 2I) in x's dtype (constexpr STORE_PRE, off
in every other launch, which then compiles exactly as without it), that the SwiGLU backward reads
instead of recomputing them; their twin is `gemm1_swiglu_torch(..., swiglu=False)`.

`ExpertsConfig.tma_weights` (opt-in) passes the weights to GEMM1 and GEMM2 as host-side TMA tensor
descriptors (`triton.tools.tensor_descriptor.TensorDescriptor`, Triton >= 3.4) wherever
`tma_supported` holds, else the pointer path runs. Host descriptors, not `tl.make_tensor_descriptor`:
the device-side kind needs a global `triton.set_allocator`, which a library should not install.
It combines with the expert math: the biases and activations are epilogues on the accumulators,
and interleaved gate/up rows are read as one [2 BN, BK] box per step (`gate_up_block_n`), so
interleaved weights take TMA while 2 * block_n1 fits TMA's box (<= 256 rows), else the pointer path.

`ExpertsConfig.persistent` (opt-in) launches GEMM1 and GEMM2 as persistent kernels
(`persistent_programs`): as many programs as the device runs at once (SMs times the programs one SM
holds, from the compiled kernel's registers, shared memory and warps; cached), at most the tile
bound, each looping over tiles up to the live count read on the device. Off the GPU (the interpreter)
the device is taken to have `OFF_GPU_SMS` SMs. With paired tiles a persistent tile is two row
blocks (`moekit.grouped_gemm.kernels._for_each_tile`), so the bound is cdiv(max_blocks, 2) times
the column tiles.

The GEMMs' `tma` and every launcher's `pdl` keywords carry the triton path's decisions for the call
(`moekit.experts.plan`); left None, the launcher decides them itself (`resolve_tma`'s check,
`moekit.launch_hints`), as a direct call from the lab, a test or the backward wants.
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import replace

import torch
import triton.language as tl

from moekit import _workspace
from moekit._host import cdiv, next_power_of_2
from moekit._validation import interpreting
from moekit.activation import SWIGLU, GatedActivation, gated, split_gate_up
from moekit.align import Alignment
from moekit.grouped_gemm.kernels import moe_gemm1_swiglu_kernel, moe_gemm2_kernel, moe_sum_kernel
from moekit.launch_hints import capability_major as _cuda_capability_major
from moekit.launch_hints import pdl_kwargs
from moekit.tuning import ExpertsConfig

try:                                    # Triton >= 3.4; older Tritons keep the pointer path
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:
    TensorDescriptor = None

TMA_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float8_e4m3fn)
TMA_ALIGN = 16           # bytes: the base address and every stride but the last
TMA_MAX_BOX = 256        # elements: TMA's largest box along one dimension
TMA_MAX_COORD = 2**31    # TMA coordinates are int32: rows of the (E * N, K) view must stay below


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs are computed in full fp32 (not tf32): the fp32 path is a correctness path.
    return "ieee" if dtype == torch.float32 else "tf32"


def _device_has_tma(device: torch.device) -> bool:
    if interpreting():                  # the interpreter emulates descriptors (Triton >= 3.4)
        return True
    if device.type != "cuda":
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _cuda_capability_major(index) >= 9


def tma_supported(w: torch.Tensor, block_n: int = 64, block_k: int = 64) -> bool:
    """Whether the forward GEMMs can read the weights w (E, N, K) through a TMA descriptor over the
    view (E * N, K) with block [block_n, block_k]: a Triton with tensor descriptors, a device of
    CUDA capability >= 9 (or the interpreter), fp16 / bf16 / fp32 / e4m3, contiguous, 16-byte aligned base
    and rows (K * itemsize), row coordinates within int32, and a block within TMA's box."""
    if TensorDescriptor is None or not hasattr(tl, "make_tensor_descriptor"):
        return False
    if w.dim() != 3 or w.numel() == 0 or w.dtype not in TMA_DTYPES or not w.is_contiguous():
        return False
    num_experts, rows, k = w.shape
    item = w.element_size()
    return (w.data_ptr() % TMA_ALIGN == 0 and (k * item) % TMA_ALIGN == 0
            and num_experts * rows < TMA_MAX_COORD and block_n <= TMA_MAX_BOX and block_k <= TMA_MAX_BOX
            and (block_k * item) % TMA_ALIGN == 0 and _device_has_tma(w.device))


def gate_up_block_n(cfg: ExpertsConfig, interleaved: bool) -> int:
    """Rows of gate_up that GEMM1 reads per step for one BLOCK_N tile: block_n1 of gate and
    block_n1 of up, as two [block_n1] boxes (concatenated) or one [2 * block_n1] box (interleaved).
    The box size of gate_up's TMA descriptor."""
    return 2 * cfg.block_n1 if interleaved else cfg.block_n1


def resolve_tma(cfg: ExpertsConfig, gate_up_proj: torch.Tensor, down_proj: torch.Tensor, *,
                interleaved: bool = False) -> ExpertsConfig:
    """cfg with tma_weights as it will run: turned off unless both weights pass `tma_supported`
    with their GEMM's block (interleaved gate_up: 2 * block_n1 rows, `gate_up_block_n`). A call's
    plan (`moekit.experts.plan`) hands the result to the launchers (tma=); called without it, they
    check again."""
    if cfg.tma_weights and not (tma_supported(gate_up_proj, gate_up_block_n(cfg, interleaved), cfg.block_k1)
                                and tma_supported(down_proj, cfg.block_n2, cfg.block_k2)):
        return replace(cfg, tma_weights=False)
    return cfg


def _weights_operand(w: torch.Tensor, cfg: ExpertsConfig, block_n: int, block_k: int,
                     tma: bool | None = None):
    """(what the kernel's w gets, TMA_W): w itself, or its descriptor over (E * N, K) with block
    [block_n, block_k] when tma, or with tma None when the config asks for TMA and `tma_supported`
    holds (a direct call: nothing resolved it before)."""
    if tma is None:
        tma = cfg.tma_weights and tma_supported(w, block_n, block_k)
    if not tma:
        return w, False
    flat = w.view(-1, w.shape[-1])
    return TensorDescriptor(flat, list(flat.shape), list(flat.stride()), [block_n, block_k]), True


OFF_GPU_SMS = 4          # persistent kernels off CUDA (the interpreter): this many programs at most
# For variant comparisons: persistent kernels without paired tiles fuse their tile and K loops
# (`tl.range(..., flatten=True)`). Read at each launch.
PERSISTENT_FLATTEN = False


@functools.lru_cache(maxsize=16)
def _cuda_sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (cached); OFF_GPU_SMS elsewhere."""
    if device.type != "cuda" or interpreting():
        return OFF_GPU_SMS
    return _cuda_sm_count(device.index if device.index is not None else torch.cuda.current_device())


_RESIDENT: dict[tuple, int] = {}


def programs_per_sm(kernel, args: tuple, kwargs: dict, device: torch.device) -> int:
    """How many programs of this launch one SM holds at once: limited by the compiled kernel's
    registers, shared memory and warps (`kernel.warmup` compiles without running). Cached per
    specialization; 1 off CUDA, or when the compiled kernel does not say."""
    if device.type != "cuda" or interpreting():
        return 1
    key = (id(kernel), tuple(sorted(kwargs.items())), args[0].dtype, type(args[1]).__name__, device)
    if key not in _RESIDENT:
        try:
            compiled = kernel.warmup(*args, grid=(1,), **kwargs)
            if hasattr(compiled, "_init_handles"):
                compiled._init_handles()
            props = torch.cuda.get_device_properties(device)
            warps = kwargs.get("num_warps", 4)
            per_warp = -(-max(1, int(compiled.n_regs)) * 32 // 256) * 256       # allocated in 256s
            by_regs = getattr(props, "regs_per_multiprocessor", 65536) // (per_warp * warps)
            by_threads = getattr(props, "max_threads_per_multi_processor", 2048) // (32 * warps)
            smem = int(compiled.metadata.shared)
            by_smem = getattr(props, "shared_memory_per_multiprocessor", 228 * 1024) // (smem + 1024)
            _RESIDENT[key] = max(1, min(by_regs, by_threads, by_smem, 32))
        except Exception as exc:  # an API this Triton lacks: one program per SM is always safe
            warnings.warn(f"moekit: cannot tell how many programs of {getattr(kernel, '__name__', kernel)} "
                          f"an SM holds ({type(exc).__name__}: {exc}); the persistent launch starts one "
                          "per SM", stacklevel=4)
            _RESIDENT[key] = 1
    return _RESIDENT[key]


def _launch(kernel, max_blocks: int, n_tiles: int, cfg: ExpertsConfig, device: torch.device, args: tuple,
            kwargs: dict, pdl: bool | None = None) -> None:
    """kernel over max_blocks row blocks (an upper bound) times n_tiles column tiles: one program per
    tile, or with cfg.persistent as many as the device holds at once, at most the persistent tiles
    (with paired tiles two row blocks each: cdiv(max_blocks, 2) times n_tiles), with programmatic
    dependent launch when pdl (None: where `moekit.launch_hints` turns it on)."""
    kwargs["FLATTEN"] = cfg.persistent and cfg.pair_blocks == 1 and PERSISTENT_FLATTEN
    kwargs.update(pdl_kwargs(device, pdl))
    if cfg.persistent:
        units = cdiv(max_blocks, 2) if cfg.pair_blocks == 2 else max_blocks
        grid = min(units * n_tiles, num_sms(device) * programs_per_sm(kernel, args, kwargs, device))
    else:
        grid = max_blocks * n_tiles
    kernel[(grid,)](*args, **kwargs)


def twin_dtype(t: torch.Tensor) -> torch.dtype:
    """The twins compute in fp32, or in fp64 for fp64 inputs (so gradcheck can run on them)."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _bias_args(bias: torch.Tensor | None, like: torch.Tensor) -> tuple:
    """(pointer, stride_e, stride_n) of an optional (E, N) bias; `like` stands in when absent."""
    return (like, 0, 0) if bias is None else (bias, bias.stride(0), bias.stride(1))


def gemm1_swiglu(x: torch.Tensor, gate_up_proj: torch.Tensor, align: Alignment, top_k: int,
                 cfg: ExpertsConfig, *, swiglu: bool = True, bias: torch.Tensor | None = None,
                 activation: GatedActivation = SWIGLU, interleaved: bool = False, tma: bool | None = None,
                 pdl: bool | None = None) -> torch.Tensor:
    """h (L, I): act(x_tok @ gate_e^T [+ bias], x_tok @ up_e^T [+ bias]) at each sorted row; padding
    rows 0. swiglu=False: the epilogue left out, h (L, 2I) holds the [gate | up] pre-activations.
    bias: gate_up_bias (E, 2I) in gate_up_proj's row layout; interleaved: rows alternate gate, up.
    tma, pdl: the caller's decisions (a call's plan, `moekit.experts.plan`); None: decided here, as
    `_weights_operand` and `moekit.launch_hints.pdl_kwargs` do for a direct call."""
    return _gemm1(x, gate_up_proj, align, top_k, cfg, swiglu=swiglu, bias=bias, activation=activation,
                  interleaved=interleaved, store_pre=False, tma=tma, pdl=pdl)[0]


def gemm1_swiglu_with_pre(x: torch.Tensor, gate_up_proj: torch.Tensor, align: Alignment, top_k: int,
                          cfg: ExpertsConfig, pre_rows: int | None = None, *, tma: bool | None = None,
                          pdl: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """GEMM1 of a forward that a backward follows (plain SwiGLU): (h (L, I), pre (L, 2I)), pre the
    [gate | up] pre-activations x_tok @ gate_up_e^T rounded from fp32 to x's dtype at each sorted
    row (the layout swiglu=False gives h; padding rows 0), stored by the same launch (STORE_PRE).
    Both are fresh allocations (`moekit._workspace.empty`), so pre can be saved for the backward.
    pre_rows (>= L): pre gets that many rows, those past L never written (a size fixed before the
    config is known: `moekit.align.pre_rows_bound`). tma, pdl: as in `gemm1_swiglu`."""
    h, pre = _gemm1(x, gate_up_proj, align, top_k, cfg, swiglu=True, bias=None, activation=SWIGLU,
                    interleaved=False, store_pre=True, pre_rows=pre_rows, tma=tma, pdl=pdl)
    return h, pre


def _gemm1(x: torch.Tensor, gate_up_proj: torch.Tensor, align: Alignment, top_k: int, cfg: ExpertsConfig, *,
           swiglu: bool, bias: torch.Tensor | None, activation: GatedActivation, interleaved: bool,
           store_pre: bool, pre_rows: int | None = None, tma: bool | None = None,
           pdl: bool | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(h, pre or None): `moe_gemm1_swiglu_kernel`, with STORE_PRE when store_pre (plain SwiGLU);
    pre has max(L, pre_rows) rows."""
    if store_pre and (not swiglu or bias is not None or not activation.is_swiglu or interleaved):
        raise ValueError("GEMM1 stores the pre-activations for plain SwiGLU only (the fused SiLU epilogue, "
                         "no bias, not interleaved)")
    num_experts, two_i, hidden = gate_up_proj.shape
    inter = two_i // 2
    rows = align.sorted_ids.numel()
    h = _workspace.empty(rows, inter * (1 if swiglu else 2), dtype=x.dtype, device=x.device)
    if store_pre and pre_rows is not None and pre_rows < rows:
        raise ValueError(f"pre_rows {pre_rows} < the alignment's {rows} rows")
    pre_len = rows if pre_rows is None else pre_rows
    pre = _workspace.empty(pre_len, two_i, dtype=x.dtype, device=x.device) if store_pre else None
    n_tiles = cdiv(inter, cfg.block_n1)
    w, tma = _weights_operand(gate_up_proj, cfg, gate_up_block_n(cfg, interleaved), cfg.block_k1, tma)
    args = (x, w, h, align.sorted_ids, align.expert_ids, align.block_codes, align.num_padded,
            align.num_pairs, inter, hidden, n_tiles,
            x.stride(0), x.stride(1), *gate_up_proj.stride(), h.stride(0), h.stride(1),
            *_bias_args(bias, gate_up_proj), float(activation.alpha), float(activation.limit), pre)
    flags = dict(
        TOP_K=top_k, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n1, BLOCK_K=cfg.block_k1,
        GROUP_M=cfg.group_m, EVEN_K=hidden % cfg.block_k1 == 0, PAIRED=cfg.pair_blocks == 2,
        DOT_PRECISION=_dot_precision(x.dtype), SWIGLU=swiglu, HAS_BIAS=bias is not None,
        GPT_OSS=not activation.is_swiglu, INTERLEAVED=interleaved, TMA_W=tma, PERSISTENT=cfg.persistent,
        num_warps=cfg.warps1, num_stages=cfg.stages1,
        STORE_PRE=store_pre,
    )
    _launch(moe_gemm1_swiglu_kernel, align.max_blocks, n_tiles, cfg, x.device, args, flags, pdl)
    return h, pre


def gemm2_weighted(h: torch.Tensor, down_proj: torch.Tensor, topk_weights: torch.Tensor | None,
                   align: Alignment, cfg: ExpertsConfig, *, bias: torch.Tensor | None = None,
                   tma: bool | None = None, pdl: bool | None = None) -> torch.Tensor:
    """y (S, H): (h_row @ down_e^T [+ bias_e]) * routing weight, stored at each pair's own row
    (topk_weights None: the rows unweighted). bias: down_bias (E, H), added before the weight.
    tma, pdl: as in `gemm1_swiglu`."""
    num_experts, hidden, inter = down_proj.shape
    y = _workspace.empty(align.num_pairs, hidden, dtype=h.dtype, device=h.device)
    n_tiles = cdiv(hidden, cfg.block_n2)
    w, tma = _weights_operand(down_proj, cfg, cfg.block_n2, cfg.block_k2, tma)
    args = (h, w, y, h if topk_weights is None else topk_weights,   # h: a pointer never read
            align.sorted_ids, align.expert_ids, align.block_codes, align.num_padded, align.num_pairs,
            hidden, inter, n_tiles,
            h.stride(0), h.stride(1), *down_proj.stride(), y.stride(0), y.stride(1),
            *_bias_args(bias, down_proj))
    _launch(moe_gemm2_kernel, align.max_blocks, n_tiles, cfg, h.device, args, dict(
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n2, BLOCK_K=cfg.block_k2,
        GROUP_M=cfg.group_m, EVEN_K=inter % cfg.block_k2 == 0, PAIRED=cfg.pair_blocks == 2,
        DOT_PRECISION=_dot_precision(h.dtype), MUL_W=topk_weights is not None, HAS_BIAS=bias is not None,
        TMA_W=tma, PERSISTENT=cfg.persistent,
        num_warps=cfg.warps2, num_stages=cfg.stages2,
    ), pdl)
    return y


def moe_sum(y: torch.Tensor, topk_ids: torch.Tensor, num_experts: int, out: torch.Tensor, *,
            pdl: bool | None = None) -> torch.Tensor:
    """out[t] = fp32 sum of y[t*K + j] over the slots with an id in [0, E). pdl: as in `gemm1_swiglu`."""
    num_tokens, hidden = out.shape
    top_k = topk_ids.shape[1]
    block_h = min(1024, next_power_of_2(hidden))
    block_t = max(1, min(16, 4096 // block_h))
    grid = (cdiv(num_tokens, block_t), cdiv(hidden, block_h))
    moe_sum_kernel[grid](y, topk_ids, out, num_tokens, hidden, num_experts, out.stride(0), out.stride(1),
                         TOP_K=top_k, BLOCK_T=block_t, BLOCK_H=block_h, num_warps=4,
                         **pdl_kwargs(out.device, pdl))
    return out


def _placed_rows(align: Alignment) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sorted rows holding a pair, their pair ids, their experts), int64."""
    num_padded = int(align.num_padded)
    rows = torch.arange(num_padded, device=align.sorted_ids.device)
    pair = align.sorted_ids[:num_padded].long()
    expert = align.expert_ids.long().repeat_interleave(align.block_m)[:num_padded]
    keep = pair < align.num_pairs
    return rows[keep], pair[keep], expert[keep]


def gemm1_swiglu_torch(x: torch.Tensor, gate_up_proj: torch.Tensor, align: Alignment,
                       top_k: int, *, swiglu: bool = True, bias: torch.Tensor | None = None,
                       activation: GatedActivation = SWIGLU, interleaved: bool = False) -> torch.Tensor:
    """Twin of `gemm1_swiglu` in fp32: h (L, I), or (L, 2I) [gate | up] pre-activations; padding rows 0."""
    two_i = gate_up_proj.shape[1]
    acc = twin_dtype(x)
    h = torch.zeros(align.sorted_ids.numel(), two_i // 2 if swiglu else two_i, dtype=acc, device=x.device)
    rows, pair, expert = _placed_rows(align)
    for e in expert.unique().tolist():
        sel = expert == e
        pre = x[pair[sel] // top_k].to(acc) @ gate_up_proj[e].to(acc).T
        if bias is not None:
            pre = pre + bias[e].to(acc)
        h[rows[sel]] = gated(pre, activation, interleaved) if swiglu else torch.cat(
            split_gate_up(pre, interleaved), dim=-1)
    return h


def gemm2_weighted_torch(h: torch.Tensor, down_proj: torch.Tensor, topk_weights: torch.Tensor | None,
                         align: Alignment, *, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Twin of `gemm2_weighted` in fp32: y (S, H), rows of unplaced pairs 0."""
    acc = twin_dtype(h)
    y = torch.zeros(align.num_pairs, down_proj.shape[1], dtype=acc, device=h.device)
    rows, pair, expert = _placed_rows(align)
    w = None if topk_weights is None else topk_weights.reshape(-1).to(acc)
    for e in expert.unique().tolist():
        sel = expert == e
        rows_e = h[rows[sel]].to(acc) @ down_proj[e].to(acc).T
        if bias is not None:
            rows_e = rows_e + bias[e].to(acc)
        y[pair[sel]] = rows_e if w is None else rows_e * w[pair[sel], None]
    return y


def moe_sum_torch(y: torch.Tensor, topk_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Twin of `moe_sum` in fp32: out[t] = sum of y[t*K + j] over slots j with an id in [0, E)."""
    num_tokens, top_k = topk_ids.shape
    valid = (topk_ids >= 0) & (topk_ids < num_experts)
    per_slot = y.to(twin_dtype(y)).view(num_tokens, top_k, -1)
    return torch.where(valid[..., None], per_slot, 0.0).sum(1)   # rows of unplaced pairs never read
