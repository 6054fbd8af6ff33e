"""Direct decode path of the triton backend (on by default): two kernels for a few pairs, no align.

    decode_gemm1_swiglu   h (S, I): silu(x_t @ gate_e^T) * (x_t @ up_e^T) per pair, unsorted
    decode_gemm2_sum      out (T, H): sum over slots k ascending of w[t,k] * (h[t*K+k] @ down_e^T)

(kernels: `moekit.decode.kernels`), each beside its pure-PyTorch twin (`*_torch`, fp32). At decode
sizes (T * K pairs of the order of E) each expert gets about one pair: sorting pairs by expert buys
no weight reuse, and the normal path's four dependent launches (align, GEMM1, GEMM2, moe_sum) each
pay launch and ramp latency. Pairs whose id is outside [0, E) read no weights and contribute 0, as
in the normal path (which never places them). Inference only: the triton backend uses it for calls
that need no gradients, plain SwiGLU without biases or interleaved rows, no explicit `config` (the
normal path's tiles), T * K <= `DECODE_MAX_PAIRS` (`DECODE_MAX_PAIRS_FP8` on block-scaled FP8
weights) and at most `DECODE_MAX_REREAD` pairs per expert
hit (expected under uniform routing: every pair reads its expert's weights, so an expert with two
pairs is read twice), unless switched off: `MOEKIT_DECODE_DIRECT=0`
(read at each call). The call's plan (`moekit.experts.plan`) makes that decision and picks the tiles
(`decode_config`) and launch hints the two launchers take.

Why 64 pairs: past that, sorting pairs by expert pays for itself (the normal path's tuned tiles
read each expert's weights once for several pairs); below it, the direct path saves launches and
host time (3 launches and 6 torch ops a layer call instead of 5 and 10). Why 16 on FP8 weights:
the decode kernels wait on each step's loads in registers, so one-byte weights halve their bytes
but not their time, while the normal path's shared-memory pipeline reads them in about half the
time and overtakes the decode kernels from about 32 pairs (measured: the CHANGELOG).

Rounding: h is stored in the activation dtype (as the normal path's h); GEMV2 keeps each pair's row
and the slot sum in fp32 and rounds once, at the store (the normal path rounds y per pair first).
No host sync; grids depend on shapes only (CUDA-graph safe); deterministic (no atomics).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moekit import _workspace, env
from moekit._host import cdiv
from moekit.decode.kernels import decode_gemm1_swiglu_kernel, decode_gemm2_sum_kernel
from moekit.launch_hints import pdl_kwargs, weight_evict
from moekit.tuning import FP8_SCALE_BLOCK, check_tile, tile_bound

DECODE_MAX_PAIRS = 64        # T * K at most this many pairs take the direct path (unless switched off)
DECODE_MAX_PAIRS_FP8 = 16    # ... on block-scaled FP8 weights
# ... and at most this many pairs per expert hit, expected under uniform routing (`expected_rereads`).
# The direct path reads an expert's weights once per pair, so few experts (Mixtral 8x7B: E = 8,
# K = 2) would re-read them several times a call; Qwen3-30B-A3B's largest direct call, T = 8, has 1.24.
DECODE_MAX_REREAD = 1.25
ENV_VAR = "MOEKIT_DECODE_DIRECT"


@dataclass(frozen=True)
class GemvTiles:
    """One decode kernel's tiles: block_n output columns and block_k reduction columns per step of
    a program (its [block_n, block_k] fp32 accumulator), warps, pipeline stages and the reduction
    loop's unroll factor. step_sum: each step's products are summed over its block_k columns at
    once into a [block_n] accumulator (the kernels' STEP_SUM)."""

    block_n: int = 16
    block_k: int = 256
    warps: int = 4
    stages: int = 3
    unroll: int = 1
    step_sum: bool = False

    def __post_init__(self) -> None:
        for name, v in vars(self).items():
            if name != "step_sum":
                check_tile("GemvTiles", name, v, name.startswith(("block_", "warps")), tile_bound(name))
        if not isinstance(self.step_sum, bool):
            raise ValueError(f"GemvTiles.step_sum must be a bool, got {self.step_sum!r}")

    def label(self) -> str:
        return f"n{self.block_n}k{self.block_k}w{self.warps}s{self.stages}u{self.unroll}" + \
            ("r" if self.step_sum else "")


@dataclass(frozen=True)
class DecodeConfig:
    """Tiles of the two decode kernels: gemv1 (gate/up + SwiGLU), gemv2 (down + the slot sum);
    slots2: GEMV2 computes that many of a token's slots together (a power of two; 1: one slot
    after the other)."""

    gemv1: GemvTiles = GemvTiles()
    gemv2: GemvTiles = GemvTiles()
    slots2: int = 1

    def __post_init__(self) -> None:
        for name in ("gemv1", "gemv2"):
            if not isinstance(getattr(self, name), GemvTiles):
                raise ValueError(f"DecodeConfig.{name} must be a GemvTiles, got {getattr(self, name)!r}")
        check_tile("DecodeConfig", "slots2", self.slots2, True)

    @classmethod
    def both(cls, block_n: int, block_k: int, warps: int, stages: int, unroll: int = 1) -> DecodeConfig:
        """The same tiles for both kernels."""
        tiles = GemvTiles(block_n, block_k, warps, stages, unroll)
        return cls(tiles, tiles)

    def label(self) -> str:
        return f"{self.gemv1.label()}/{self.gemv2.label()}" + (f"x{self.slots2}" if self.slots2 > 1 else "")


DEFAULT_DECODE = DecodeConfig()
# Up to SMALL_DECODE_PAIRS pairs GEMV2 computes a token's 8 slots together over narrower column
# tiles: more loads in flight when only one or two tokens' outputs are being produced.
SMALL_DECODE = DecodeConfig(gemv2=GemvTiles(block_n=8, block_k=128), slots2=8)
SMALL_DECODE_PAIRS = 16
# On one-byte FP8 weights GEMV1 sums each step at once and GEMV2 runs 8 warps: fewer registers a
# program for the accumulators, more loads in flight (the CHANGELOG has the comparison).
SMALL_DECODE_FP8 = DecodeConfig(GemvTiles(block_n=16, block_k=256, step_sum=True),
                                GemvTiles(block_n=8, block_k=128, warps=8), slots2=8)
# Candidates for the GPU comparison (`moekit sweep --set decode`) and the sm_90 compile check
# (tools/aot_compile_check.py --decode): narrower / wider column tiles, more warps and a longer
# reduction step, the loops unrolled twice, GEMV2 over 8 slots at once, step sums (fewer registers
# for the accumulators: longer steps).
DECODE_TILES = (
    DecodeConfig.both(block_n=8, block_k=256, warps=4, stages=3),
    DecodeConfig.both(block_n=32, block_k=128, warps=4, stages=3),
    DecodeConfig(GemvTiles(block_n=16, block_k=512, warps=8, stages=2),
                 GemvTiles(block_n=16, block_k=256, warps=8, stages=2)),
    DecodeConfig.both(block_n=16, block_k=256, warps=4, stages=3, unroll=2),
    SMALL_DECODE,
    DecodeConfig(gemv2=GemvTiles(block_n=16, block_k=128, warps=8), slots2=8),
    DecodeConfig(GemvTiles(block_n=16, block_k=512, warps=8, step_sum=True),
                 GemvTiles(block_n=4, block_k=256, step_sum=True), slots2=8),
    SMALL_DECODE_FP8,
)


def decode_direct_enabled() -> bool:
    """Whether the direct decode path is on: unless $MOEKIT_DECODE_DIRECT is 0 (read at each call)."""
    return env.flag(ENV_VAR)


def decode_config(num_pairs: int, fp8: bool = False) -> DecodeConfig:
    """The tiles the backend runs for num_pairs = T * K pairs; fp8: on block-scaled FP8 weights, which
    take the decode path up to `DECODE_MAX_PAIRS_FP8` pairs on `SMALL_DECODE_FP8`'s tiles."""
    if fp8 and num_pairs <= SMALL_DECODE_PAIRS:
        return SMALL_DECODE_FP8
    return SMALL_DECODE if num_pairs <= SMALL_DECODE_PAIRS else DEFAULT_DECODE


def expected_rereads(num_tokens: int, top_k: int, num_experts: int) -> float:
    """Pairs per expert hit for T tokens of K distinct experts each out of E, routed uniformly: the
    T * K pairs over the E * (1 - (1 - K/E)^T) experts they are expected to hit (1.0 for one token;
    T * K / E once K >= E)."""
    if num_tokens < 1 or top_k < 1 or num_experts < 1:
        raise ValueError(f"expected_rereads needs num_tokens, top_k and num_experts >= 1, got "
                         f"num_tokens={num_tokens}, top_k={top_k}, num_experts={num_experts}")
    hit = num_experts * (1.0 - max(0.0, 1.0 - top_k / num_experts) ** num_tokens)
    return num_tokens * top_k / hit


def use_decode_direct(num_tokens: int, top_k: int, num_experts: int, *, fp8: bool = False) -> bool:
    """The triton backend's decision for a plain-SwiGLU inference call of T tokens, K slots, E experts:
    at most `DECODE_MAX_PAIRS` pairs (fp8: block-scaled FP8 weights, `DECODE_MAX_PAIRS_FP8`) and
    `DECODE_MAX_REREAD` pairs per expert hit, and switched on."""
    num_pairs = num_tokens * top_k
    max_pairs = DECODE_MAX_PAIRS_FP8 if fp8 else DECODE_MAX_PAIRS
    if not 0 < num_pairs <= max_pairs or num_experts < 1 or not decode_direct_enabled():
        return False
    return expected_rereads(num_tokens, top_k, num_experts) <= DECODE_MAX_REREAD


def _scale_args(w_scale: torch.Tensor | None, block_n: int) -> dict:
    """The decode kernels' arguments for block-scaled FP8 weights (scales (E, N / 128, K / 128)):
    a tile of block_n rows must lie in one 128-row scale block."""
    if w_scale is None:
        return {}
    if FP8_SCALE_BLOCK % block_n:
        raise ValueError(f"block_n {block_n} must divide {FP8_SCALE_BLOCK} for block-scaled FP8 weights")
    return dict(ws_ptr=w_scale, stride_wse=w_scale.stride(0), stride_wsn=w_scale.stride(1),
                stride_wsk=w_scale.stride(2), W_SCALED=True)


def decode_gemm1_swiglu(x: torch.Tensor, gate_up_proj: torch.Tensor, topk_ids: torch.Tensor,
                        cfg: DecodeConfig = DEFAULT_DECODE, w_scale: torch.Tensor | None = None, *,
                        pdl: bool | None = None, evict: str | None = None) -> torch.Tensor:
    """h (S, I) in x's dtype, row p = pair p (token p // K): silu(gate) * up; zeros for ids outside
    [0, E). topk_ids (T, K) contiguous, int32 or int64. w_scale: gate_up_proj is block-scaled FP8
    data and these its (E, 2I / 128, H / 128) scales (w8a16: dequantized in registers). pdl, evict:
    the launch hints as the caller decided them (a call's plan, `moekit.experts.plan`); None:
    decided here (`moekit.launch_hints`)."""
    num_experts, two_i, hidden = gate_up_proj.shape
    inter = two_i // 2
    h = _workspace.empty(topk_ids.numel(), inter, dtype=x.dtype, device=x.device)
    if h.numel():
        tiles = cfg.gemv1
        grid = (topk_ids.numel(), cdiv(inter, tiles.block_n))
        decode_gemm1_swiglu_kernel[grid](
            x, gate_up_proj, topk_ids, h, num_experts, inter, hidden,
            x.stride(0), x.stride(1), *gate_up_proj.stride(), h.stride(0), h.stride(1),
            TOP_K=topk_ids.shape[1], BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
            EVEN_K=hidden % tiles.block_k == 0, UNROLL=tiles.unroll,
            W_EVICT=weight_evict(x.device, topk_ids.numel()) if evict is None else evict,
            STEP_SUM=tiles.step_sum, num_warps=tiles.warps, num_stages=tiles.stages,
            **pdl_kwargs(x.device, pdl),
            **_scale_args(w_scale, tiles.block_n))
    return h


def decode_gemm2_sum(h: torch.Tensor, down_proj: torch.Tensor, topk_weights: torch.Tensor,
                     topk_ids: torch.Tensor, out: torch.Tensor, cfg: DecodeConfig = DEFAULT_DECODE,
                     w_scale: torch.Tensor | None = None, *, pdl: bool | None = None,
                     evict: str | None = None) -> torch.Tensor:
    """out (T, H) = fp32 sum over slots k ascending (ids in [0, E)) of w[t,k] * h[t*K+k] @ down_e^T,
    stored once in out's dtype. topk_weights and topk_ids (T, K) contiguous. w_scale: down_proj is
    block-scaled FP8 data and these its (E, H / 128, I / 128) scales. pdl, evict: as in
    `decode_gemm1_swiglu`."""
    num_experts, hidden, inter = down_proj.shape
    num_tokens, top_k = topk_ids.shape
    if out.numel():
        tiles = cfg.gemv2
        grid = (num_tokens, cdiv(hidden, tiles.block_n))
        decode_gemm2_sum_kernel[grid](
            h, down_proj, topk_weights, topk_ids, out, num_experts, hidden, inter,
            h.stride(0), h.stride(1), *down_proj.stride(), out.stride(0), out.stride(1),
            TOP_K=top_k, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
            EVEN_K=inter % tiles.block_k == 0, UNROLL=tiles.unroll, SLOTS=cfg.slots2,
            W_EVICT=weight_evict(h.device, topk_ids.numel()) if evict is None else evict,
            STEP_SUM=tiles.step_sum, num_warps=tiles.warps, num_stages=tiles.stages,
            **pdl_kwargs(h.device, pdl),
            **_scale_args(w_scale, tiles.block_n))
    return out


def experts_decode(x: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
                   topk_weights: torch.Tensor, topk_ids: torch.Tensor, out: torch.Tensor,
                   cfg: DecodeConfig | None = None, scales: tuple[torch.Tensor, torch.Tensor] | None = None,
                   *, pdl: bool | None = None, evict: str | None = None) -> torch.Tensor:
    """The whole direct path into out (T, H): the two launches (cfg None: `decode_config`'s tiles for
    the pairs and the weights' format; pdl, evict: as in `decode_gemm1_swiglu`). scales: the weights
    are block-scaled FP8 data and these their (gate_up, down) block scales."""
    cfg = decode_config(topk_ids.numel(), scales is not None) if cfg is None else cfg
    gs, ds = (None, None) if scales is None else scales
    h = decode_gemm1_swiglu(x, gate_up_proj, topk_ids, cfg, w_scale=gs, pdl=pdl, evict=evict)
    return decode_gemm2_sum(h, down_proj, topk_weights, topk_ids, out, cfg, w_scale=ds, pdl=pdl, evict=evict)


def _valid(topk_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    return (topk_ids >= 0) & (topk_ids < num_experts)


def decode_gemm1_swiglu_torch(x: torch.Tensor, gate_up_proj: torch.Tensor,
                              topk_ids: torch.Tensor) -> torch.Tensor:
    """Twin of `decode_gemm1_swiglu` in fp32: h (S, I), zeros for ids outside [0, E)."""
    num_experts, two_i, _ = gate_up_proj.shape
    ids = topk_ids.reshape(-1).long()
    valid = _valid(ids, num_experts)
    h = torch.zeros(ids.numel(), two_i // 2, dtype=torch.float32, device=x.device)
    tok = torch.arange(ids.numel(), device=x.device) // topk_ids.shape[1]
    for p in torch.nonzero(valid)[:, 0].tolist():
        gate, up = (gate_up_proj[ids[p]].float() @ x[tok[p]].float()).chunk(2)
        h[p] = torch.nn.functional.silu(gate) * up
    return h


def decode_gemm2_sum_torch(h: torch.Tensor, down_proj: torch.Tensor, topk_weights: torch.Tensor,
                           topk_ids: torch.Tensor) -> torch.Tensor:
    """Twin of `decode_gemm2_sum` in fp32: out (T, H), slots with ids outside [0, E) left out."""
    num_tokens, top_k = topk_ids.shape
    out = torch.zeros(num_tokens, down_proj.shape[1], dtype=torch.float32, device=h.device)
    ids = topk_ids.long()
    for t in range(num_tokens):
        for k in range(top_k):
            e = int(ids[t, k])
            if 0 <= e < down_proj.shape[0]:
                out[t] += float(topk_weights[t, k]) * (down_proj[e].float() @ h[t * top_k + k].float())
    return out
