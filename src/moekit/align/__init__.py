"""Align: sort the T*K token-expert pairs by expert, padded per expert to a multiple of block_m.

Every output has a size fixed by (T, K, E, block_m) alone, so nothing is read back to the host
and the step can be captured in a CUDA graph. Pair p is token p // K, slot p % K. Backends:
    torch   sort + histogram + cumsum (mirrors vLLM's moe_align_block_size in PyTorch ops)
    triton  one launch of one program up to FUSED_MAX_PAIRS pairs, one launch of a program a
            chunk up to ONE_LAUNCH_MAX_PAIRS pairs, else three (`moekit.align.kernels`)
Both give identical outputs: within an expert, pairs keep ascending pair order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moekit import _workspace
from moekit._host import cdiv, next_power_of_2
from moekit._validation import ID_DTYPES, MAX_PAIRS, MAX_TRITON_EXPERTS, check_tensor, check_triton_device
from moekit.align.kernels import (
    align_hist_kernel,
    align_one_launch_kernel,
    align_scan_kernel,
    align_scatter_kernel,
    row_starts_kernel,
)
from moekit.launch_hints import pdl_kwargs

ALIGN_BACKENDS = ("torch", "triton")
FUSED_MAX_PAIRS = 1024
# Above FUSED_MAX_PAIRS and up to this many pairs, one launch of one program a chunk
# (`align_one_launch_kernel`: each program histograms every id itself) instead of hist + scan +
# scatter. Read at each call; 0 (or anything up to FUSED_MAX_PAIRS): the three launches. Not higher:
# past 4,096 pairs every program's own histogram of all S ids costs more than the two launches it saves.
ONE_LAUNCH_MAX_PAIRS = 4096
# The limit the tests and tools/aot_compile_check.py set to run the one-launch path whatever the
# default is.
ONE_LAUNCH_CANDIDATE = 4096
# For variant comparisons: the align kernels' num_warps instead of the default by chunk size (None).
# Read at each call.
ALIGN_WARPS: int | None = None
# The fused kernel writes the blocks' expert ids expert by expert (True, the default: one program
# searching the experts for every block is its slowest step) or by the multi-program kernels'
# search over experts a block (False). For variant comparisons; the outputs are the same. Read at
# each call.
FUSED_IDS_BY_EXPERT = True
SCAN_ELEMENTS = 16384


@dataclass(frozen=True)
class Alignment:
    """Pairs sorted by expert, each expert's group padded to a multiple of `block_m` rows.

    Attributes:
        sorted_ids: int32 (L,), L = S + min(E, S) * (block_m - 1), the most padding possible
            (S = T * K pairs; only experts that can hold a pair add padding). Entry r is the pair
            id at sorted row r; padding rows hold the sentinel S.
        expert_ids: int32 (cdiv(L, block_m),): the expert of each block of block_m rows; -1 for
            blocks at or past num_padded.
        num_padded: int32 0-d device tensor, rows in use (a multiple of block_m).
        tokens_per_expert: int32 (E,), pairs routed to each expert (ids outside [0, E) excluded).
        block_m: rows per block.
        num_pairs: S.
        block_codes: int32 (cdiv(L, block_m),): how a grouped GEMM that takes up to two blocks
            of one expert per tile ("paired" tiles, `ExpertsConfig.pair_blocks == 2`) covers
            block b: 2 = b starts a tile of 2 * block_m rows (b + 1 is the same expert's), 1 = b
            is a tile of block_m rows alone (its expert's last, unpaired block), 0 = b is the
            second half of the tile before it, or past num_padded. Within an expert, tiles
            start at its even blocks, so only an expert's last tile can be a short one.
    """

    sorted_ids: torch.Tensor
    expert_ids: torch.Tensor
    num_padded: torch.Tensor
    tokens_per_expert: torch.Tensor
    block_m: int
    num_pairs: int
    block_codes: torch.Tensor

    @property
    def max_blocks(self) -> int:
        return self.expert_ids.numel()

    def row_starts(self) -> torch.Tensor:
        """int32 (E + 1,): the first sorted row of each expert's padded group, then num_padded.

        Device work only (no host sync); expert e's rows are [row_starts[e], row_starts[e + 1]). On
        CUDA one launch (`row_starts_kernel`), up to MAX_TRITON_EXPERTS experts; else, and for the
        CPU, its twin `row_starts_torch` (seven torch ops)."""
        counts = self.tokens_per_expert
        num_experts = counts.numel()
        if not counts.is_cuda or num_experts > MAX_TRITON_EXPERTS:
            return self.row_starts_torch()
        out = _workspace.empty(num_experts + 1, dtype=torch.int32, device=counts.device)
        row_starts_kernel[(1,)](counts, out, num_experts, BLOCK_M=self.block_m,
                                E_POW2=max(16, next_power_of_2(num_experts)), num_warps=4,
                                **pdl_kwargs(counts.device))
        return out

    def row_starts_torch(self) -> torch.Tensor:
        """Twin of `row_starts` (torch ops, int64 sums)."""
        padded = (self.tokens_per_expert.long() + self.block_m - 1) // self.block_m * self.block_m
        return torch.nn.functional.pad(torch.cumsum(padded, 0), (1, 0)).to(torch.int32)


def padded_length(num_pairs: int, num_experts: int, block_m: int) -> int:
    """L; symbolic sizes stay symbolic (torch.sym_min: no guard under torch.compile)."""
    return num_pairs + torch.sym_min(num_experts, num_pairs) * (block_m - 1)


def part_sizes(num_pairs: int, num_experts: int, block_m: int) -> tuple:
    """The lengths of sorted_ids, expert_ids, block_codes, tokens_per_expert and num_padded, in the
    order the triton aligner carves them from one allocation (`moekit._workspace.empty_parts`)."""
    length = padded_length(num_pairs, num_experts, block_m)
    max_blocks = cdiv(length, block_m)
    return length, max_blocks, max_blocks, num_experts, 1


def packed_size(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Elements of `pack_alignment`'s buffer; from the sizes alone (symbolic ones too)."""
    return _workspace.parts_size(part_sizes(num_pairs, num_experts, block_m), torch.int32)


BLOCK_M_BOUND = 128   # the largest block_m `packed_bound` and `pre_rows_bound` allow (the tuner's largest)


def pre_rows_bound(num_pairs: int, num_experts: int) -> int:
    """L at block_m = BLOCK_M_BOUND: no block_m up to it pads to more rows (symbolic sizes too)."""
    return padded_length(num_pairs, num_experts, BLOCK_M_BOUND)


def packed_bound(num_pairs: int, num_experts: int) -> int:
    """At least `packed_size` for every block_m in [1, BLOCK_M_BOUND], from the sizes alone
    (symbolic ones too): the longest sorted_ids (`pre_rows_bound`) and the most blocks, S + min(E, S)
    (cdiv(S + m (b - 1), b) <= S + m for every b >= 1), each part rounded up as `packed_size` does."""
    blocks = num_pairs + torch.sym_min(num_experts, num_pairs)
    sizes = (pre_rows_bound(num_pairs, num_experts), blocks, blocks, num_experts, 1)
    return _workspace.parts_size(sizes, torch.int32)


def _parts(align: Alignment) -> tuple[torch.Tensor, ...]:
    return (align.sorted_ids, align.expert_ids, align.block_codes, align.tokens_per_expert,
            align.num_padded.view(1))


def pack_alignment(align: Alignment, num_experts: int, capacity: int | None = None) -> torch.Tensor:
    """The alignment's int32 tensors as one flat buffer (`unpack_alignment` inverts it), `packed_size`
    long, or `capacity` long (>= it; the parts at its start, the rest unwritten): the triton
    aligner's own allocation when it has that length and the parts are its views (no copy), else a
    copy of them. For the `moekit::experts_train` op, which must return tensors that alias nothing
    else it returns, of sizes its fake function knows (`packed_bound` when no config is given)."""
    sizes = part_sizes(align.num_pairs, num_experts, align.block_m)
    total = _workspace.parts_size(sizes, torch.int32)
    capacity = total if capacity is None else capacity
    if capacity < total:
        raise ValueError(f"capacity {capacity} < the {total} elements of the alignment's parts")
    base = align.sorted_ids._base
    if (base is not None and base.dim() == 1 and base.numel() == total == capacity
            and [p.data_ptr() for p in _parts(align)]
            == [v.data_ptr() for v in _workspace.split_parts(base, sizes)]):
        return base
    buffer = _workspace.empty(capacity, dtype=torch.int32, device=align.sorted_ids.device)
    for view, part in zip(_workspace.split_parts(buffer[:total], sizes), _parts(align)):
        view.copy_(part)
    return buffer


def unpack_alignment(buffer: torch.Tensor, num_pairs: int, num_experts: int, block_m: int) -> Alignment:
    """The `Alignment` that `pack_alignment` packed into buffer (views of its start, no copy)."""
    sizes = part_sizes(num_pairs, num_experts, block_m)
    total = _workspace.parts_size(sizes, torch.int32)
    if buffer.numel() < total:
        raise ValueError(f"alignment buffer of {buffer.numel()} elements, expected at least {total} for "
                         f"{num_pairs} pairs, {num_experts} experts and block_m {block_m}")
    sorted_ids, expert_ids, block_codes, tokens_per_expert, num_padded = _workspace.split_parts(
        buffer[:total], sizes)
    return Alignment(sorted_ids, expert_ids, num_padded.view(()), tokens_per_expert, block_m, num_pairs,
                     block_codes)


def _check(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> None:
    check_tensor("topk_ids", topk_ids, dtypes=ID_DTYPES)
    if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"num_experts must be a positive int, got {num_experts!r}")
    if isinstance(block_m, bool) or not isinstance(block_m, int) or block_m < 1:
        raise ValueError(f"block_m must be a positive int, got {block_m!r}")
    if topk_ids.numel() > MAX_PAIRS:
        raise ValueError(f"topk_ids has {topk_ids.numel()} pairs; at most 2**31 - 2 are supported")


@dataclass(frozen=True)
class PairSort:
    """The T*K pairs stably sorted by expert (torch ops; shared by align and the torch backends).

    Attributes:
        valid: bool (S,), the pair's id lies in [0, E).
        key: int64 (S,), the expert id, or E for invalid pairs (they sort last).
        e_sorted: int64 (S,), keys in sorted order.
        order: int64 (S,), pair ids in sorted order (a stable sort: pair order within an expert).
        counts: int64 (E + 1,), pairs per expert; counts[E] counts the invalid pairs.
    """

    valid: torch.Tensor
    key: torch.Tensor
    e_sorted: torch.Tensor
    order: torch.Tensor
    counts: torch.Tensor

    def sorted_ranks(self) -> torch.Tensor:
        """int64 (S,): at sorted position i, how many earlier pairs went to the same expert."""
        start = torch.cumsum(self.counts, 0) - self.counts
        return torch.arange(self.order.numel(), device=self.order.device) - start[self.e_sorted]

    def ranks(self) -> torch.Tensor:
        """int64 (S,): pair p's position among its expert's pairs, which keep pair order."""
        ranks = self.sorted_ranks()
        return torch.empty_like(ranks).scatter_(0, self.order, ranks)


def sort_pairs(topk_ids: torch.Tensor, num_experts: int) -> PairSort:
    flat = topk_ids.reshape(-1).long()
    valid = (flat >= 0) & (flat < num_experts)
    key = torch.where(valid, flat, num_experts)
    e_sorted, order = torch.sort(key, stable=True)
    counts = torch.zeros(num_experts + 1, device=flat.device, dtype=torch.int64)
    counts.scatter_add_(0, key, torch.ones_like(key))
    return PairSort(valid, key, e_sorted, order, counts)


def align_block_size_torch(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> Alignment:
    """PyTorch align: the reference the Triton kernels must match exactly."""
    pairs = sort_pairs(topk_ids, num_experts)
    num_pairs = pairs.key.numel()
    dev = pairs.key.device
    e_sorted, order = pairs.e_sorted, pairs.order
    counts = pairs.counts[:num_experts]
    padded = (counts + block_m - 1) // block_m * block_m
    pad_end = torch.cumsum(padded, 0)
    pad_start = pad_end - padded
    length = padded_length(num_pairs, num_experts, block_m)
    e_clamped = e_sorted.clamp(max=num_experts - 1)
    dest = pad_start[e_clamped] + pairs.sorted_ranks()
    dest = torch.where(e_sorted < num_experts, dest, length)      # one spare slot takes the unplaced
    buf = torch.full((length + 1,), num_pairs, device=dev, dtype=torch.int32)
    buf.scatter_(0, dest, order.to(torch.int32))
    num_padded = pad_end[-1]
    rows = torch.arange(cdiv(length, block_m), device=dev) * block_m
    owner = torch.searchsorted(pad_end, rows, right=True)
    live = rows < num_padded
    expert_ids = torch.where(live, owner, -1).to(torch.int32)
    owner = owner.clamp(max=num_experts - 1)
    rank = (rows - pad_start[owner]) // block_m                    # the block's index in its expert
    codes = torch.where(rows + block_m < pad_end[owner], 2, 1)
    codes = torch.where(live & (rank % 2 == 0), codes, 0).to(torch.int32)
    return Alignment(buf[:length], expert_ids, num_padded.to(torch.int32), counts.to(torch.int32),
                     block_m, num_pairs, codes)


def align_block_size_triton(topk_ids: torch.Tensor, num_experts: int, block_m: int, *,
                            pdl: bool | None = None) -> Alignment:
    check_triton_device("topk_ids", topk_ids)
    if num_experts > MAX_TRITON_EXPERTS:
        raise ValueError(
            f"backend='triton' supports num_experts <= {MAX_TRITON_EXPERTS}, got {num_experts}; "
            "use backend='torch'"
        )
    # The kernels index the pairs flat: a contiguous (T, K) tensor is already that.
    ids = topk_ids if topk_ids.is_contiguous() else topk_ids.reshape(-1).contiguous()
    num_pairs = ids.numel()
    dev = ids.device
    sizes = part_sizes(num_pairs, num_experts, block_m)
    length, max_blocks = sizes[:2]
    sorted_ids, expert_ids, block_codes, tokens_per_expert, num_padded = _workspace.empty_parts(
        sizes, device=dev, dtype=torch.int32)
    num_padded = num_padded.view(())
    out = Alignment(sorted_ids, expert_ids, num_padded, tokens_per_expert, block_m, num_pairs, block_codes)
    if num_pairs == 0:
        num_padded.zero_()
        tokens_per_expert.zero_()
        return out

    e_pad = next_power_of_2(num_experts)
    chunk = _chunk_size(num_pairs)
    num_chunks = cdiv(num_pairs, chunk)
    block_b = max(1, min(64, 4096 // e_pad))
    num_warps = ALIGN_WARPS or (4 if chunk * max(1, e_pad // 128) <= 1024 else 8)
    pdl = pdl_kwargs(dev, pdl)
    scatter = dict(BLOCK_M=block_m, CHUNK=chunk, E_PAD=e_pad, BLOCK_B=block_b, num_warps=num_warps, **pdl)
    if num_chunks == 1:
        align_scatter_kernel[(1,)](
            ids, sorted_ids, sorted_ids, num_padded, tokens_per_expert, sorted_ids, expert_ids, block_codes,
            num_pairs, num_experts, length, max_blocks, max_blocks, FUSED=True,
            IDS_BY_EXPERT=FUSED_IDS_BY_EXPERT, **scatter,
        )
        return out
    if num_pairs <= ONE_LAUNCH_MAX_PAIRS:
        # Every id in one histogram step up to 8192 pairs (steps of 2048 ids were slower at 8192
        # pairs than the three launches, see ONE_LAUNCH_MAX_PAIRS), and 8 warps.
        hist = max(chunk, min(8192, next_power_of_2(num_pairs)))
        blocks_per_program = cdiv(max_blocks, num_chunks)
        # BLOCK_J from E alone (not the blocks a program has), so that every T of one shape compiles
        # the same kernel (tests/fuzz_plan.py's bands)
        align_one_launch_kernel[(num_chunks,)](
            ids, num_padded, tokens_per_expert, sorted_ids, expert_ids, block_codes, num_pairs, num_experts,
            length, max_blocks, blocks_per_program, cdiv(num_pairs, hist), BLOCK_M=block_m, CHUNK=chunk,
            E_PAD=e_pad, HIST=hist, BLOCK_J=max(1, min(256, 4096 // e_pad)),
            FILL_COLS=min(next_power_of_2(block_m), max(1, 4096 // e_pad)), num_warps=ALIGN_WARPS or 8, **pdl,
        )
        return out
    counts = _workspace.empty(num_chunks, e_pad, device=dev, dtype=torch.int32)
    base = _workspace.empty_like(counts)
    pad_end = _workspace.empty(e_pad, device=dev, dtype=torch.int32)
    align_hist_kernel[(num_chunks,)](
        ids, counts, sorted_ids, num_pairs, num_experts, length, cdiv(length, num_chunks),
        CHUNK=chunk, E_PAD=e_pad, num_warps=num_warps, **pdl,
    )
    # The scan walks the (chunks, E_PAD) counts in slabs of at most SCAN_ELEMENTS, so its
    # registers and shared memory stay bounded at any T (long-context prefill).
    c_block = max(1, min(next_power_of_2(num_chunks), SCAN_ELEMENTS // e_pad))
    align_scan_kernel[(1,)](
        counts, base, pad_end, num_padded, tokens_per_expert, num_chunks, num_experts,
        BLOCK_M=block_m, C_BLOCK=c_block, E_PAD=e_pad, num_warps=8 if c_block * e_pad > 8192 else 4, **pdl,
    )
    align_scatter_kernel[(num_chunks,)](
        ids, base, pad_end, num_padded, tokens_per_expert, sorted_ids, expert_ids, block_codes,
        num_pairs, num_experts, length, max_blocks, cdiv(max_blocks, num_chunks),
        FUSED=False, **scatter,
    )
    return out


def _chunk_size(num_pairs: int) -> int:
    """Pairs per program: one program up to FUSED_MAX_PAIRS, else at most ~128 chunks."""
    if num_pairs <= FUSED_MAX_PAIRS:
        return max(16, next_power_of_2(num_pairs))
    return min(4096, max(256, next_power_of_2(cdiv(num_pairs, 128))))


def align_block_size(
    topk_ids: torch.Tensor, num_experts: int, block_m: int, *, backend: str = "auto", pdl: bool | None = None
) -> Alignment:
    """Sort token-expert pairs by expert, padding each expert's group to a multiple of block_m.

    Args:
        topk_ids: (T, K) int32 or int64 expert ids. Ids outside [0, E) are left out (their pairs
            are never placed), which is how expert-parallel maps and graph padding mark pairs.
        num_experts: E.
        block_m: rows per block of the grouped GEMM.
        backend: "auto" (triton on CUDA, torch elsewhere), "torch" or "triton".
        pdl: the triton kernels' programmatic dependent launch as the caller decided it (a call's
            plan, `moekit.experts.plan`); None: `moekit.launch_hints` decides at the launch.

    Returns:
        An `Alignment` whose tensor sizes depend on (T, K, E, block_m) only.
    """
    _check(topk_ids, num_experts, block_m)
    if backend == "auto":
        backend = "triton" if topk_ids.is_cuda and num_experts <= MAX_TRITON_EXPERTS else "torch"
    if backend == "torch":
        return align_block_size_torch(topk_ids, num_experts, block_m)
    if backend == "triton":
        return align_block_size_triton(topk_ids, num_experts, block_m, pdl=pdl)
    raise ValueError(f"backend must be 'auto' or one of {ALIGN_BACKENDS}, got {backend!r}")
