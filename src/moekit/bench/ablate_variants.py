"""The variants `moekit ablate` times (named and described in `ablate_report.VARIANTS`), each as a
call with the check that gates it.

For one workload (T tokens, `moekit.bench.runner.Workload`) a `Setup` holds what the variants share,
computed once outside every timed call, as the router's outputs are:

    config        the tuned tiles for T (`moekit.tuning.get_config`)
    align         the triton backend's alignment of the routing at config.block_m
    perm          pairs in expert order for the separate-pass variants (`Permutation`)
    counts        pairs per expert, on the host (padding counts)

`build(name, setup)` returns a `Case`: the call to time and the `Expected` its output must meet
(`moekit.bench.correctness`: the fp32 reference, 2x plain PyTorch's error in the dtype), or raises
`NotApplicable` when the layer cannot run it (FP8 weights need H and I divisible by 128). A variant
that computes a piece of the path (the GEMMs on permuted rows, an alignment, dense matmuls) is
checked through a `finish` that turns its output into the layer's (T, H) in fp32 outside the
timed call, so a piece that is wrong is refused like a whole path that is. The fp8 variant runs on
the layer's weights quantized (`moekit.bench.fp8`), checked against the FP8 oracle of its path and
carrying the FP8 traffic (its floor: FP8 bytes, the FP8 roof).

The unfused epilogues are the kernels' own constexpr switches (`gemm1_swiglu(swiglu=False)`,
`gemm2_weighted(topk_weights=None)`), followed by the PyTorch pass they leave out; the separate
passes (`permute`, `swiglu_pass`, `weight_pass`, the unpermutes) are module functions, so a test can
plant a bug in one (the dense pair's are `moekit.bench.dense`'s, shared with `moekit bench`; the
padding counts are `moekit.bench.kernel_work`'s). Legend: T tokens, K top_k, S = T * K pairs,
E experts, H hidden, I intermediate, L padded rows.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import cached_property

import torch

from moekit import _workspace
from moekit.align import Alignment, align_block_size, sort_pairs
from moekit.bench.ablate_report import TILE_HEIGHTS, VARIANTS
from moekit.bench.correctness import Expected, Finished
from moekit.bench.dense import dense_expected, dense_pair, swiglu_pass
from moekit.bench.fp8 import Fp8Workloads, quantize_layer, shape_problem
from moekit.bench.kernel_work import TILED, padded_rows
from moekit.bench.roofline import Traffic
from moekit.bench.runner import Workload
from moekit.experts import moe_experts
from moekit.experts.triton import align_pairs
from moekit.grouped_gemm import (
    gemm1_swiglu,
    gemm1_swiglu_torch,
    gemm2_weighted,
    gemm2_weighted_torch,
    moe_sum,
    moe_sum_torch,
)
from moekit.tuning import ExpertsConfig, fit_shared_memory, get_config, shared_memory_budget


@dataclass(frozen=True)
class Case:
    """One variant on one workload: the call to time and what gates it.

    Attributes:
        call: the work of one call, its inputs bound.
        expected: the check its output must pass before it is timed.
        config: the contiguous layout's tiles it runs (None: dense matmuls, the masked layout).
        padded_rows: rows its tiles compute (each expert's pairs rounded up to config.block_m).
        traffic: the bytes and FLOPs its floor counts (None: the workload's; the fp8 variant's own).
    """

    call: Callable[[], object]
    expected: Expected
    config: ExpertsConfig | None = None
    padded_rows: int | None = None
    traffic: Traffic | None = None


class NotApplicable(ValueError):
    """The layer cannot run this variant (the reason is the message): its rows are skipped."""


@dataclass(frozen=True)
class Permutation:
    """Pairs in expert order, for the separate-pass variants.

    Attributes:
        order: int64 (S,), the pair at each sorted position (`moekit.align.sort_pairs`).
        token: int64 (S,), the token of each sorted pair (order // K): the permute gathers x by it.
        weight: (S,) routing weight of each sorted pair, in the activations' dtype.
        position: int64 (S,), the sorted position of each pair (order's inverse).
        rows: the alignment with each sorted row pointing at its permuted row (position of its pair)
            instead of its pair: the grouped GEMMs run on the permuted rows as on any input, with
            top_k = 1, reading and writing contiguous rows.
    """

    order: torch.Tensor
    token: torch.Tensor
    weight: torch.Tensor
    position: torch.Tensor
    rows: Alignment


def permutation(topk_ids: torch.Tensor, topk_weights: torch.Tensor, align: Alignment,
                dtype: torch.dtype) -> Permutation:
    num_pairs, top_k = align.num_pairs, topk_ids.shape[1]
    order = sort_pairs(topk_ids, align.tokens_per_expert.numel()).order
    position = torch.empty_like(order).scatter_(0, order, torch.arange(num_pairs, device=order.device))
    pair = align.sorted_ids.long()
    rows = torch.where(pair < num_pairs, position[pair.clamp(max=num_pairs - 1)], num_pairs)
    return Permutation(order, order // top_k, topk_weights.reshape(-1)[order].to(dtype), position,
                       replace(align, sorted_ids=rows.to(torch.int32)))


def permute(x: torch.Tensor, perm: Permutation) -> torch.Tensor:
    """x_sorted (S, H): each pair's token row, in expert order (a gather)."""
    return x.index_select(0, perm.token)


def weight_pass(y: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """y (S, H) *= the routing weight of each pair row, in place (rounded to y's dtype)."""
    return y.mul_(weights.reshape(-1, 1))


def unpermute_index_add(y_sorted: torch.Tensor, perm: Permutation, num_tokens: int) -> torch.Tensor:
    """out (T, H): each sorted row times its weight, index_add_ into its token's row."""
    out = torch.zeros(num_tokens, y_sorted.shape[1], dtype=y_sorted.dtype, device=y_sorted.device)
    return out.index_add_(0, perm.token, y_sorted * perm.weight[:, None])


def unpermute_gather_sum(y_sorted: torch.Tensor, perm: Permutation, num_tokens: int) -> torch.Tensor:
    """out (T, H): rows times their weights, gathered back to (token, slot) order, summed over K."""
    rows = (y_sorted * perm.weight[:, None]).index_select(0, perm.position)
    return rows.view(num_tokens, -1, y_sorted.shape[1]).sum(1)


def grouped_gemms(x: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor, align: Alignment,
                  top_k: int, cfg: ExpertsConfig, topk_weights: torch.Tensor | None, *,
                  fuse_swiglu: bool = True, fuse_weight: bool = True) -> torch.Tensor:
    """y (S, H): GEMM1 (+ SwiGLU) -> GEMM2 (+ routing weight unless topk_weights is None); an epilogue
    not fused runs as its separate pass."""
    h = gemm1_swiglu(x, gate_up_proj, align, top_k, cfg, swiglu=fuse_swiglu)
    if not fuse_swiglu:
        h = swiglu_pass(h, down_proj.shape[2])
    y = gemm2_weighted(h, down_proj, topk_weights if fuse_weight else None, align, cfg)
    return y if fuse_weight or topk_weights is None else weight_pass(y, topk_weights)


def experts_path(x: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
                 topk_weights: torch.Tensor, topk_ids: torch.Tensor, cfg: ExpertsConfig,
                 align: Alignment | None = None, **epilogues: bool) -> torch.Tensor:
    """(T, H): [align ->] grouped GEMMs -> slot sum; with both epilogues fused and align None, the
    triton backend's forward (`moekit.experts.triton`)."""
    num_experts = gate_up_proj.shape[0]
    align = align if align is not None else align_pairs(topk_ids, num_experts, cfg)
    y = grouped_gemms(x, gate_up_proj, down_proj, align, topk_ids.shape[1], cfg, topk_weights, **epilogues)
    return moe_sum(y, topk_ids, num_experts, _workspace.empty_like(x))


def tile_config(base: ExpertsConfig, block_m: int, pair_blocks: int, itemsize: int,
                device: torch.device) -> ExpertsConfig:
    """base with these tile rows, its pipelined tiles shrunk to fit the device's shared memory, and
    8 warps for tiles of 128 rows or more (as `moekit.tuning.default_config` gives 128-row tiles)."""
    cfg = replace(base, block_m=block_m, pair_blocks=pair_blocks)
    if block_m * pair_blocks >= 128:
        cfg = replace(cfg, warps1=max(cfg.warps1, 8), warps2=max(cfg.warps2, 8))
    return fit_shared_memory(cfg, itemsize, shared_memory_budget(device))


class Setup:
    """What the variants of one workload share (see the module doc); built lazily, once."""

    def __init__(self, work: Workload):
        self.work = work
        self.config = get_config(work.shape, work.tokens, work.dtype, work.device)

    @cached_property
    def align(self) -> Alignment:
        return align_pairs(self.work.topk_ids, self.work.shape.num_experts, self.config)

    @cached_property
    def perm(self) -> Permutation:
        w = self.work
        return permutation(w.topk_ids, w.topk_weights, self.align, w.dtype)

    @cached_property
    def fp8(self) -> Fp8Workloads:
        """The workload on the layer's weights quantized to block-scaled FP8 (quantized here, once)."""
        return Fp8Workloads(self.work, quantize_layer(self.work.weights))

    @cached_property
    def counts(self) -> list[int]:
        ids = self.work.topk_ids.reshape(-1).long()
        return torch.bincount(ids, minlength=self.work.shape.num_experts).tolist()

    @property
    def args(self) -> tuple[torch.Tensor, ...]:
        """(x, gate_up_proj, down_proj, topk_weights, topk_ids)."""
        w = self.work
        return w.x, w.weights.gate_up_proj, w.weights.down_proj, w.topk_weights, w.topk_ids

    def case(self, call: Callable[[], object], finish: Callable[[object], torch.Tensor] | None = None,
             config: ExpertsConfig | None = None, expected: Expected | None = None) -> Case:
        e = expected or self.work.expected
        checked = Finished(e.ref, e.baseline_err, e.tol, finish) if finish is not None else e
        return Case(call, checked, config, padded_rows(self.counts, config.block_m) if config else None)

    def twins(self, align: Alignment) -> torch.Tensor:
        """The layer in fp32 through the grouped GEMMs' twins on `align` (checks an alignment)."""
        x, gate_up, down, w, ids = self.args
        h = gemm1_swiglu_torch(x, gate_up, align, ids.shape[1])
        return moe_sum_torch(gemm2_weighted_torch(h, down, w, align), ids, gate_up.shape[0])

    def unpermuted(self, y_sorted: torch.Tensor) -> torch.Tensor:
        """(T, H) fp32 from unweighted rows in expert order (checks the GEMMs on permuted rows)."""
        p, w = self.perm, self.work.topk_weights.reshape(-1)
        out = torch.zeros(self.work.tokens, y_sorted.shape[1], device=y_sorted.device)
        return out.index_add_(0, p.token, y_sorted.float() * w[p.order, None])


Builder = Callable[[Setup], Case]


def _gemms(s: Setup) -> Case:
    x, gate_up, down, _, _ = s.args
    x_sorted = permute(x, s.perm)
    return s.case(lambda: grouped_gemms(x_sorted, gate_up, down, s.perm.rows, 1, s.config, None),
                  s.unpermuted, s.config)


def _separate_passes(unpermute: Callable[[torch.Tensor, Permutation, int], torch.Tensor]) -> Builder:
    def build(s: Setup) -> Case:
        x, gate_up, down, _, _ = s.args
        p, t = s.perm, s.work.tokens

        def call() -> torch.Tensor:
            return unpermute(grouped_gemms(permute(x, p), gate_up, down, p.rows, 1, s.config, None), p, t)

        return s.case(call, config=s.config)

    return build


def _fused(s: Setup) -> Case:
    return s.case(lambda: experts_path(*s.args, s.config, s.align), config=s.config)


def _layer(**epilogues: bool) -> Builder:
    return lambda s: s.case(lambda: experts_path(*s.args, s.config, **epilogues), config=s.config)


def _tile(block_m: int, pair_blocks: int) -> Builder:
    def build(s: Setup) -> Case:
        cfg = tile_config(s.config, block_m, pair_blocks, s.work.dtype.itemsize, s.work.device)
        return s.case(lambda: experts_path(*s.args, cfg), config=cfg)

    return build


def _grouped(s: Setup) -> Case:
    x, gate_up, down, w, ids = s.args
    num_experts = gate_up.shape[0]
    return s.case(lambda: grouped_gemms(x, gate_up, down, s.align, ids.shape[1], s.config, w),
                  lambda y: moe_sum_torch(y, ids, num_experts), s.config)


def _dense(s: Setup) -> Case:
    """Every pair through expert 0 (`moekit.bench.dense`, as `moekit bench`'s dense rows): checked as
    the layer whose router sends every pair there."""
    x, gate_up, down, w, ids = s.args
    expected = dense_expected(x, gate_up, down, w, ids)
    return s.case(dense_pair(x, gate_up, down, ids.shape[1]), expected=expected)


def _align(backend: str) -> Builder:
    def build(s: Setup) -> Case:
        ids, num_experts = s.work.topk_ids, s.work.shape.num_experts
        return s.case(lambda: align_block_size(ids, num_experts, s.config.block_m, backend=backend), s.twins)

    return build


def _masked(s: Setup) -> Case:
    return s.case(lambda: moe_experts(*s.args, backend="masked"))


def _fp8(s: Setup) -> Case:
    """The triton path on FP8 weights, as `moekit bench --weights fp8` times it."""
    problem = shape_problem(s.work.preset, s.work.shape)
    if problem:
        raise NotApplicable(problem)
    twin = s.fp8.for_backend(TILED)
    return Case(s.fp8.factory(TILED)(twin), twin.expected, traffic=twin.traffic)


BUILDERS: dict[str, Builder] = {
    "gemms": _gemms,
    "index_add": _separate_passes(lambda y, p, t: unpermute_index_add(y, p, t)),
    "gather_sum": _separate_passes(lambda y, p, t: unpermute_gather_sum(y, p, t)),
    "fused": _fused,
    "layer": _layer(),
    "swiglu_separate": _layer(fuse_swiglu=False),
    "weight_separate": _layer(fuse_weight=False),
    **{f"tile_{bm}{'x2' if pair == 2 else ''}": _tile(bm, pair) for bm in TILE_HEIGHTS for pair in (1, 2)},
    "grouped_gemms": _grouped,
    "dense": _dense,
    "align_torch": _align("torch"),
    "align_triton": _align("triton"),
    "masked": _masked,
    "fp8": _fp8,
}
MEASURED = tuple(v for v in VARIANTS if v in BUILDERS)   # every variant but dram_bytes, in report order


def build(name: str, setup: Setup) -> Case:
    """The case of variant `name` on the setup's workload."""
    return BUILDERS[name](setup)
