"""Gluon SwiGLU-backward probe: a persistent, warp-specialized Gluon (sm_90) fused SwiGLU backward
against moekit's Triton `moe_swiglu_bwd_kernel` (reading the saved pre-activations), checked and timed
on an H200. A go/no-go measurement.

Per sorted row r of expert e (t = sorted_ids[r] // K its token, w_p its routing weight), in fp32:

    g = dout[t] @ down_e          (down_proj (E, H, I): down_e is (H, I), g is (I,))
    a, b = pre[r] (L, 2I) = [gate | up] pre-activations; sig = sigmoid(a), silu = a sig, h = silu b
    dpre_w[r] = w_p [g b sig (1 + a (1 - sig)), g silu]   (L, 2I) bf16
    h_w[r]    = w_p h                                     (L, I) bf16
    part[r, tile] = sum over the tile's I columns of g h  (fp32) -> d topk_weights[p] = sum over tiles
    padding rows (pair >= S): dpre_w, h_w rows 0, part 0.

moekit gathers the dout rows by token through sorted_ids inside its GEMM loop. Here dout is first
pre-gathered into sorted-row order (dout_sorted[r] = dout[t(r)], zeros on padding rows: the gather kernel
of scripts/gluon_wgrad_probe.py, timed on its own: in training the same dout_sorted also feeds the
d down weight gradient, so its cost is shared), so the GEMM's A operand is plain rows loaded by TMA:

    A = dout_sorted [64 rows, BK] boxes (K-major: as wgmma's A wants it)
    B = down_proj viewed as (E * H, I), [BK rows of H, BN columns of I] boxes at row e * H + k: B lies
        as it does for A @ B, N contiguous ("MN-major" B, which wgmma reads for 16-bit types)

The kernel (`gluon_swiglu_bwd_kernel`): persistent (one program an SM), work items (64-row sub-block, I
tile), I tiles fastest (the programs in flight share the sub-block's dout rows and the expert's down
columns in L2), dealt round robin; a 64-row sub-block lies in one align block (block_m 64 or 128), so
in one expert: expert_ids[row0 // block_m]; items up to num_padded (read on the device). Partitions:

    producer   1 warp: per item, H / BK steps into a ring of STAGES shared-memory stages (ready/empty
               mbarriers, running across items), and at step PRE_STEP of the item the a and b tiles
               [64, BN] of pre into the item's consumer's epilogue slots (pre_ready/pre_empty, one
               pair a consumer): they land while the main loop runs.
    consumers  2 warpgroups, "ping-pong": they take alternate items, each a whole [64, BN] tile (one
               wgmma accumulator), so one's epilogue runs under the other's main loop; an order
               barrier pair makes each start an item's main loop only after the other finished the
               previous one (as gluon_wgrad_probe's pp schedule). Epilogue: a, b from the slots into
               the accumulator's layout, fp32 math, part by a row sum (pointer store), then either
               (TMA_EPI) d_gate, d_up, h_w written back into the slots (a, b, a third slot) and TMA-
               stored, the slots released after the stores read them, or direct pointer stores from
               the accumulator layout (slots released once a, b are in registers).
d topk_weights: part (L, I / BN) fp32 reduced by moekit's `moe_tile_sum_kernel` (its tile order).

Variants (`VARIANTS`): pp_64x128 (BN 128, TMA epilogue, 4 stages), pp_64x128_s5 (5), pp_64x128_direct
(pointer-store epilogue, 6 stages), pp_64x64 (BN 64, TMA epilogue, 8 stages).

Compared per T in (1024, 4096, 16384) on Qwen3-30B-A3B (E=128, H=2048, I=768, K=8, bf16), routing
softmax(randn(T, E)).topk(K) renormalised, the last expert never picked, align_block_size(backend=
"triton") at the tuned config's block_m; pre random bf16 (L, 2I), dout random bf16, down random / sqrt(I):
    moekit   swiglu_backward(x, gate_up, down, dout, w, align, K, cfg, pre=pre) (its tile sum included)
    gather   dout -> dout_sorted
    pp_*     the Gluon kernel + the tile sum; also reported with the gather added
Correctness first: outputs NaN-filled (moekit's workspace poisoned), relative Frobenius error of
dpre_w, h_w (rows < num_padded) and d topk_weights against the fp32 twin `swiglu_backward_torch(...,
pre=pre)` at most 2x the same twin's in bf16 (compute_dtype=torch.bfloat16), per output; padding rows
(< num_padded) of dpre_w and h_w exactly 0. Timing: CUDA events, a 256 MB write (L2 flush) before each
call, round robin, medians; TFLOP/s = 2 S H I / t.

Hangs: each variant first runs alone with a flushed line before and a synchronize after; run under an
outer `timeout`. A failing variant is reported, the others go on. `--aot` needs no GPU: compiles each
variant (and the gather) for sm_90 and prints OK with shared memory, registers, local memory (0; WARN
when the register allocator spilled: the variant still runs), or FAIL (exit 1).

Usage:
    PYTHONPATH=src timeout 300 python scripts/gluon_swiglu_bwd_probe.py --out swiglu_gluon.jsonl  # H200
    PYTHONPATH=src python scripts/gluon_swiglu_bwd_probe.py --tokens 4096 --variants pp_64x128
    PYTHONPATH=src /tmp/t36/bin/python scripts/gluon_swiglu_bwd_probe.py --aot [--dump DIR]   # CPU only
"""

from __future__ import annotations

import os
import sys

if "--aot" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "0"     # compile, never interpret (before triton is imported)

import argparse
import re
import statistics
import time
import types

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gluon_probe import Recorder, _cuobjdump, _error_head  # noqa: E402

from moekit.grouped_gemm_backward import GATHER_BLOCK_C, GATHER_BLOCK_R  # noqa: E402
from moekit.kernels.gluon_wgrad import (  # noqa: E402
    # noqa: E402,
    GLUON_ERROR,
    GluonTensorDescriptor,
    fence_async_shared,
    gl,
    gluon,
    mbarrier,
    tma,
    tma_load,
    tma_store,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from moekit.kernels.grouped_gemm_backward import moe_gather_rows_kernel as gather_rows_kernel  # noqa: E402


def gather_rows(src, sorted_ids, num_padded, top_k, out):
    """out (L, H): src's token rows in sorted-row order, zeros on padding rows (moekit's gather kernel,
    the one `moekit.grouped_gemm_backward.sorted_rows` launches, into a given buffer)."""
    rows, cols = out.shape
    gather_rows_kernel[(triton.cdiv(rows, GATHER_BLOCK_R), triton.cdiv(cols, GATHER_BLOCK_C))](
        src, out, sorted_ids, num_padded, src.shape[0] * top_k, cols, src.stride(0), src.stride(1),
        out.stride(0), out.stride(1), TOP_K=top_k, BLOCK_R=GATHER_BLOCK_R, BLOCK_C=GATHER_BLOCK_C,
        num_warps=4)
    return out
H200_SMS = 132
SMEM_LIMIT = 232448          # sm_90's largest dynamic shared memory a block (227 KB)
PRESET = "qwen3-30b-a3b"
TOKENS = (1024, 4096, 16384)
FLUSH_BYTES = 256 << 20
DEVICE = "cuda"
SUB_M = 64                   # rows of an item: one warpgroup's wgmma m64
BK = 64                      # H a step


# --------------------------------------------------------------------------------------------------
# Gluon kernel
# --------------------------------------------------------------------------------------------------

@gluon.constexpr_function
def _acc_layout(BLOCK_N):
    # wgmma accumulator of one warpgroup: m64 x BLOCK_N (one instruction wide), 4 warps along M.
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16])


@gluon.jit
def _num_items(num_padded_ptr, n_tiles, BM: gl.constexpr):
    return (gl.load(num_padded_ptr) // BM) * n_tiles


@gluon.jit
def _producer(a_desc, b_desc, pre_desc, a_bufs, b_bufs, epi_bufs, ready_bars, empty_bars, pre_ready,
              pre_empty, expert_ids_ptr, num_padded_ptr, H, inter, n_tiles, ALIGN_M: gl.constexpr,
              PRE_STEP: gl.constexpr):
    """1 warp: for every item of this program, its H / BK steps (dout_sorted [64, BK], down [BK, BN])
    into the ring, and at step PRE_STEP the item's a, b tiles into its consumer's epilogue slots."""
    BM: gl.constexpr = a_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = b_desc.block_type.shape[1]
    STAGES: gl.constexpr = b_bufs.type.shape[0]
    SLOTS: gl.constexpr = epi_bufs.type.shape[0] // 2
    NBYTES: gl.constexpr = a_desc.block_type.nbytes + b_desc.block_type.nbytes
    PRE_BYTES: gl.constexpr = 2 * pre_desc.block_type.nbytes
    num_items = _num_items(num_padded_ptr, n_tiles, BM)
    k_steps = H // BLOCK_K
    it = 0                          # stage uses so far, across this program's items
    j = 0                           # items so far
    for t in range(gl.program_id(0), num_items, gl.num_programs(0)):
        row0 = (t // n_tiles) * BM
        n0 = (t % n_tiles) * BLOCK_N
        e = gl.load(expert_ids_ptr + row0 // ALIGN_M)
        b_row = e * H
        c = j % 2                   # the item's consumer
        u = j // 2                  # that consumer's items before this one
        for ki in range(k_steps):
            s = it % STAGES
            # pass it // STAGES over the ring: the first finds the stages empty (parity 1 of a fresh
            # barrier returns at once), later ones wait for the release
            mbarrier.wait(empty_bars.index(s), ((it // STAGES) & 1) ^ 1)
            ready = ready_bars.index(s)
            mbarrier.expect(ready, NBYTES)
            tma_load(a_desc, [row0, ki * BLOCK_K], ready, a_bufs.index(s))
            tma_load(b_desc, [b_row + ki * BLOCK_K, n0], ready, b_bufs.index(s))
            it += 1
            if ki == PRE_STEP:
                # the consumer released its slots (its previous item's epilogue done, long ago)
                mbarrier.wait(pre_empty.index(c), (u & 1) ^ 1)
                pr = pre_ready.index(c)
                mbarrier.expect(pr, PRE_BYTES)
                tma_load(pre_desc, [row0, n0], pr, epi_bufs.index(c * SLOTS))
                tma_load(pre_desc, [row0, inter + n0], pr, epi_bufs.index(c * SLOTS + 1))
        j += 1


@gluon.jit
def _epilogue(acc, a_s, b_s, h_s, dpre_desc, h_desc, dpre_ptr, h_ptr, part_ptr, w_ptr, sorted_ids_ptr,
              pre_empty_bar, row0, n0, tile, S, inter, n_tiles, TMA_EPI: gl.constexpr,
              MASK_PRE: gl.constexpr):
    BM: gl.constexpr = acc.type.shape[0]
    BLOCK_N: gl.constexpr = acc.type.shape[1]
    layout: gl.constexpr = acc.type.layout
    dtype: gl.constexpr = a_s.dtype
    a = a_s.load(layout).to(gl.float32)
    b = b_s.load(layout).to(gl.float32)
    if not TMA_EPI:             # a, b in registers: the slots go back to the producer
        gl.thread_barrier()
        mbarrier.arrive(pre_empty_bar)
    rows = row0 + gl.arange(0, BM, layout=gl.SliceLayout(1, layout))
    pair = gl.load(sorted_ids_ptr + rows)
    valid = pair < S
    wt = gl.load(w_ptr + pair, mask=valid, other=0.0)[:, None]      # [BM, 1]; 0 on padding rows
    # padding rows: dout_sorted is 0 there (g = 0) and so is wt: every output is 0 for finite a, b;
    # MASK_PRE: any a, b (NaN or inf on padding rows never reach a result)
    if MASK_PRE:
        a = gl.where(valid[:, None], a, 0.0)
        b = gl.where(valid[:, None], b, 0.0)
    sig = gl.fdiv(gl.full_like(a, 1.0), 1.0 + gl.exp(-a))
    silu = a * sig
    h = silu * b
    part = gl.sum(acc * h, axis=1)                                    # unscaled <g, h> over the tile
    gl.store(part_ptr + rows.to(gl.int64) * n_tiles + tile, part)
    h_w = (h * wt).to(dtype)
    gw = acc * wt
    d_up = (gw * silu).to(dtype)
    d_gate = (gw * b * sig * (1.0 + a * (1.0 - sig))).to(dtype)
    if TMA_EPI:
        # each thread overwrites the slot elements it read (same layout): a -> d_gate, b -> d_up
        h_s.store(h_w)
        b_s.store(d_up)
        a_s.store(d_gate)
        fence_async_shared()
        tma_store(dpre_desc, [row0, n0], a_s)
        tma_store(dpre_desc, [row0, inter + n0], b_s)
        tma_store(h_desc, [row0, n0], h_s)
        # the stores must have read the slots before the producer refills them (under the other
        # warpgroup's main loop)
        tma.store_wait(pendings=0)
        gl.thread_barrier()
        mbarrier.arrive(pre_empty_bar)
    else:
        cols = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, layout))
        rows64 = rows.to(gl.int64)[:, None]
        p_ptrs = dpre_ptr + rows64 * (2 * inter) + cols[None, :]
        gl.store(h_ptr + rows64 * inter + cols[None, :], h_w)
        gl.store(p_ptrs + inter, d_up)
        gl.store(p_ptrs, d_gate)


@gluon.jit
def _consumer(a_bufs, b_bufs, epi_bufs, ready_bars, empty_bars, order_bars, pre_ready, pre_empty,
              dpre_desc, h_desc, dpre_ptr, h_ptr, part_ptr, w_ptr, sorted_ids_ptr, num_padded_ptr,
              S, H, inter, n_tiles, CONSUMER: gl.constexpr, TMA_EPI: gl.constexpr, MASK_PRE: gl.constexpr):
    """One warpgroup: the items j (this program's) with j % 2 == CONSUMER, a whole [64, BN] tile each."""
    BM: gl.constexpr = a_bufs.type.shape[1]
    BLOCK_K: gl.constexpr = a_bufs.type.shape[2]
    BLOCK_N: gl.constexpr = b_bufs.type.shape[2]
    STAGES: gl.constexpr = b_bufs.type.shape[0]
    SLOTS: gl.constexpr = epi_bufs.type.shape[0] // 2
    layout: gl.constexpr = _acc_layout(BLOCK_N)
    a_s = epi_bufs.index(CONSUMER * SLOTS)
    b_s = epi_bufs.index(CONSUMER * SLOTS + 1)
    h_s = epi_bufs.index(CONSUMER * SLOTS + SLOTS - 1)       # (TMA_EPI: the third slot)
    num_items = _num_items(num_padded_ptr, n_tiles, BM)
    k_steps = H // BLOCK_K
    it = 0                          # stage uses so far (both warpgroups' items)
    j = 0                           # items so far
    waits = 0                       # order-barrier waits so far
    u = 0                           # this warpgroup's items so far
    for t in range(gl.program_id(0), num_items, gl.num_programs(0)):
        if j % 2 == CONSUMER:
            # the other warpgroup finished the previous item's main loop: every stage use before this
            # item's has landed, so no ready wait below can match an earlier pass's phase
            mbarrier.wait(order_bars.index(CONSUMER), waits & 1, pred=j > 0)
            waits += (j > 0).to(gl.int32)
            acc = gl.zeros((BM, BLOCK_N), gl.float32, layout)
            for ki in range(k_steps):
                k = it + ki
                s = k % STAGES
                mbarrier.wait(ready_bars.index(s), (k // STAGES) & 1)
                acc = warpgroup_mma(a_bufs.index(s), b_bufs.index(s), acc, is_async=True)
                # <= 1 in flight: the previous step's wgmma retired, release its stage
                acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
                mbarrier.arrive(empty_bars.index((k + STAGES - 1) % STAGES), pred=ki > 0)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            mbarrier.arrive(empty_bars.index((it + k_steps - 1) % STAGES))
            mbarrier.arrive(order_bars.index(1 - CONSUMER))          # the other may start its next item
            row0 = (t // n_tiles) * BM
            tile = t % n_tiles
            mbarrier.wait(pre_ready.index(CONSUMER), u & 1)
            _epilogue(acc, a_s, b_s, h_s, dpre_desc, h_desc, dpre_ptr, h_ptr, part_ptr, w_ptr,
                      sorted_ids_ptr, pre_empty.index(CONSUMER), row0, tile * BLOCK_N, tile, S, inter,
                      n_tiles, TMA_EPI, MASK_PRE)
            u += 1
        it += k_steps
        j += 1
    tma.store_wait(pendings=0)


@gluon.jit
def gluon_swiglu_bwd_kernel(a_desc, b_desc, pre_desc, dpre_desc, h_desc, dpre_ptr, h_ptr, part_ptr, w_ptr,
                            sorted_ids_ptr, expert_ids_ptr, num_padded_ptr, S, H, inter, n_tiles,
                            ALIGN_M: gl.constexpr, STAGES: gl.constexpr, PRE_STEP: gl.constexpr,
                            TMA_EPI: gl.constexpr, MASK_PRE: gl.constexpr, PRODUCER_REGS: gl.constexpr,
                            CONSUMER_REGS: gl.constexpr):
    dtype: gl.constexpr = a_desc.dtype
    BM: gl.constexpr = a_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = b_desc.block_type.shape[1]
    SLOTS: gl.constexpr = 3 if TMA_EPI else 2
    a_bufs = gl.allocate_shared_memory(dtype, [STAGES, BM, BLOCK_K], a_desc.layout)
    b_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_K, BLOCK_N], b_desc.layout)
    # consumer c's slots [c * SLOTS, (c + 1) * SLOTS): a, b (then d_gate, d_up), h_w
    epi_bufs = gl.allocate_shared_memory(dtype, [2 * SLOTS, BM, BLOCK_N], pre_desc.layout)
    ready_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    order_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    pre_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    pre_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready_bars.index(i), count=1)          # the producer's expect()
        mbarrier.init(empty_bars.index(i), count=1)          # the stage's one consumer
    for i in gl.static_range(2):
        mbarrier.init(order_bars.index(i), count=1)
        mbarrier.init(pre_ready.index(i), count=1)
        mbarrier.init(pre_empty.index(i), count=1)
    fence_async_shared()
    C0: gl.constexpr = 0
    C1: gl.constexpr = 1
    # Default partition (4 warps): consumer 0; workers: consumer 1 (4 warps), producer (1 warp).
    gl.warp_specialize([
        (_consumer, (a_bufs, b_bufs, epi_bufs, ready_bars, empty_bars, order_bars, pre_ready, pre_empty,
                     dpre_desc, h_desc, dpre_ptr, h_ptr, part_ptr, w_ptr, sorted_ids_ptr, num_padded_ptr,
                     S, H, inter, n_tiles, C0, TMA_EPI, MASK_PRE)),
        (_consumer, (a_bufs, b_bufs, epi_bufs, ready_bars, empty_bars, order_bars, pre_ready, pre_empty,
                     dpre_desc, h_desc, dpre_ptr, h_ptr, part_ptr, w_ptr, sorted_ids_ptr, num_padded_ptr,
                     S, H, inter, n_tiles, C1, TMA_EPI, MASK_PRE)),
        (_producer, (a_desc, b_desc, pre_desc, a_bufs, b_bufs, epi_bufs, ready_bars, empty_bars, pre_ready,
                     pre_empty, expert_ids_ptr, num_padded_ptr, H, inter, n_tiles, ALIGN_M, PRE_STEP)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


# --------------------------------------------------------------------------------------------------
# Launcher
# --------------------------------------------------------------------------------------------------

# name -> (BN, stages, TMA epilogue, (producer, consumer) registers after setmaxnreg)
VARIANTS = {
    "pp_64x128": (128, 4, True, (24, 240)),
    "pp_64x128_s5": (128, 5, True, (24, 240)),
    "pp_64x128_direct": (128, 6, False, (24, 240)),
    "pp_64x64": (64, 8, True, (40, 232)),
}
PRE_STEP = 4                 # the ring step of an item at which the producer fetches its a, b tiles


def smem_bytes(variant, itemsize=2) -> int:
    """The ring (A [64, BK] + B [BK, BN] a stage) and both consumers' epilogue slots, barriers aside."""
    block_n, stages, tma_epi, _ = VARIANTS[variant]
    slots = 3 if tma_epi else 2
    return (stages * (SUB_M * BK + BK * block_n) + 2 * slots * SUB_M * block_n) * itemsize


def _gl_desc(t, block):
    layout = gl.NVMMASharedLayout.get_default_for(block, gl.bfloat16)
    return GluonTensorDescriptor.from_tensor(t, block, layout)


def gluon_swiglu_bwd(dout_sorted, down_proj, pre, topk_weights, sorted_ids, expert_ids, num_padded, num_pairs,
                     align_m, dpre, h, part, variant, *, num_sms=None, mask_pre=False):
    """dpre (L, 2I), h (L, I), part (L, I / BN) fp32 of the rows < num_padded (see the module docstring);
    dout_sorted (L, H) in sorted-row order (zeros on padding rows), pre (L, 2I), topk_weights (S,) fp32,
    the alignment's int32 tensors (num_padded 0-d, on the device), align_m its block size. mask_pre:
    padding rows' a, b masked to 0 (needed only where pre may hold non-finite values there)."""
    block_n, stages, tma_epi, (producer_regs, consumer_regs) = VARIANTS[variant]
    rows, hidden = dout_sorted.shape
    num_experts, _, inter = down_proj.shape
    assert inter % block_n == 0 and hidden % BK == 0 and hidden // BK > PRE_STEP
    assert align_m % SUB_M == 0, "a 64-row item must lie in one align block"
    assert pre.shape == (rows, 2 * inter) and dpre.shape == (rows, 2 * inter) and h.shape == (rows, inter)
    assert smem_bytes(variant) <= SMEM_LIMIT
    n_tiles = inter // block_n
    assert part.shape == (rows, n_tiles) and part.is_contiguous()
    a_desc = _gl_desc(dout_sorted, [SUB_M, BK])
    b_desc = _gl_desc(down_proj.view(num_experts * hidden, inter), [BK, block_n])
    pre_desc = _gl_desc(pre, [SUB_M, block_n])
    dpre_desc = _gl_desc(dpre, [SUB_M, block_n])
    h_desc = _gl_desc(h, [SUB_M, block_n])
    items = triton.cdiv(rows, SUB_M) * n_tiles          # a bound: num_padded is on the device
    sms = num_sms or torch.cuda.get_device_properties(dout_sorted.device).multi_processor_count
    # 2 consumer warpgroups + the producer's (padded) warpgroup at 168 registers fill the 64K; setmaxnreg
    # then moves registers from the producer to the consumers (24 + 2 x 240 <= 512: the epilogue holds
    # g, a, b and what follows from them in fp32).
    gluon_swiglu_bwd_kernel[(max(1, min(sms, items)),)](
        a_desc, b_desc, pre_desc, dpre_desc, h_desc, dpre, h, part, topk_weights, sorted_ids, expert_ids,
        num_padded, num_pairs, hidden, inter, n_tiles, ALIGN_M=align_m, STAGES=stages, PRE_STEP=PRE_STEP,
        TMA_EPI=tma_epi, MASK_PRE=mask_pre, PRODUCER_REGS=producer_regs, CONSUMER_REGS=consumer_regs,
        num_warps=4, maxnreg=168)
    return dpre, h, part


def tile_sum(part, align, out):
    """d topk_weights (S,) fp32 from part (L, n_tiles): moekit's tile-sum kernel (pairs never placed: 0)."""
    from moekit._host import next_power_of_2
    from moekit.kernels.grouped_gemm_backward import moe_tile_sum_kernel

    n_tiles = part.shape[1]
    out.zero_()
    moe_tile_sum_kernel[(align.max_blocks,)](
        part, out, align.sorted_ids, align.num_padded, align.num_pairs, n_tiles, part.stride(0),
        BLOCK_M=align.block_m, BLOCK_T=min(64, max(16, next_power_of_2(n_tiles))), num_warps=4)
    return out


# --------------------------------------------------------------------------------------------------
# --aot
# --------------------------------------------------------------------------------------------------

def run_aot(args) -> int:
    from aot_compile_check import capture_launches, compile_launch  # --aot only: it turns interpreting off
    from triton.backends.compiler import GPUTarget

    if GLUON_ERROR:
        print(f"no Gluon ({GLUON_ERROR})")
        return 1
    target = GPUTarget("cuda", 90, 32)
    e, hidden, inter, rows, k = 8, 2048, 768, 8 * 256, 8
    bf = torch.bfloat16
    dout_sorted = torch.empty(rows, hidden, dtype=bf)
    down = torch.empty(e, hidden, inter, dtype=bf)
    pre = torch.empty(rows, 2 * inter, dtype=bf)
    dpre = torch.empty(rows, 2 * inter, dtype=bf)
    h = torch.empty(rows, inter, dtype=bf)
    w = torch.empty(rows, dtype=torch.float32)
    sid = torch.zeros(rows, dtype=torch.int32)
    eid = torch.zeros(rows // 64, dtype=torch.int32)
    npad = torch.zeros((), dtype=torch.int32)
    checks = {}
    for name, (block_n, *_) in VARIANTS.items():
        part = torch.empty(rows, inter // block_n, dtype=torch.float32)
        checks[name] = (lambda name=name, part=part: gluon_swiglu_bwd(
            dout_sorted, down, pre, w, sid, eid, npad, rows, 64, dpre, h, part, name, num_sms=H200_SMS),
            gluon_swiglu_bwd_kernel)
    checks["gather"] = (lambda: gather_rows(torch.empty(256, hidden, dtype=bf), sid, npad, k, dout_sorted),
                        gather_rows_kernel)
    failed = 0
    for name, (call, kernel) in checks.items():
        if args.variants and name not in args.variants:
            continue
        started = time.perf_counter()
        try:
            (kern, kargs, kwargs), = capture_launches(call, (kernel,))
            compiled = compile_launch(kern, kargs, kwargs, target)
            res = _cuobjdump(compiled.asm["cubin"], "-res-usage")
            regs = re.search(r"REG:(\d+)", res)
            local = sum(int(x) for x in re.findall(r"(?:LOCAL|STACK):(\d+)", res))
            sass = _cuobjdump(compiled.asm["cubin"], "-sass")
            hgmma = len(re.findall(r"\bHGMMA\.", sass))
            ptx = compiled.asm["ptx"]
            tma_ops = len(re.findall(r"cp\.async\.bulk\.tensor", ptx))
            shared = compiled.metadata.shared
            bad = [f"shared {shared} B > {SMEM_LIMIT}"] if shared > SMEM_LIMIT else []
            # spills: WARN (runs; a few loop-invariant scalars spilled cost a few L1 loads an item)
            head = "FAIL " + "; ".join(bad) + " | " if bad else (
                f"WARN local memory {local} B (spills) | " if local else "OK   ")
            status = head + (
                f"shared {shared} B, {regs.group(1) if regs else '?'} regs, local {local} B, {hgmma} HGMMA, "
                f"{tma_ops} TMA ops (PTX), setmaxnreg {'yes' if 'setmaxnreg' in ptx else 'no'}, "
                f"warps {compiled.metadata.num_warps}"
                f"{', maxnreg ' + str(kwargs['maxnreg']) if kwargs.get('maxnreg') else ''}")
            failed += bool(bad)
            if args.dump:
                os.makedirs(args.dump, exist_ok=True)
                for ext in ("ttgir", "ptx"):
                    with open(os.path.join(args.dump, f"{name}.{ext}"), "w") as f:
                        f.write(compiled.asm[ext])
                with open(os.path.join(args.dump, f"{name}.sass"), "w") as f:
                    f.write(sass)
        except Exception as exc:
            failed += 1
            status = "FAIL " + _error_head(exc, 12)
        print(f"{name:<18} {status}  ({time.perf_counter() - started:.1f} s)", flush=True)
    return 1 if failed else 0


# --------------------------------------------------------------------------------------------------
# GPU run
# --------------------------------------------------------------------------------------------------

def rel_err(got, want) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()   # NaN if any NaN


def make_case(tokens, gen):
    from moekit.align import align_block_size
    from moekit.grouped_gemm_backward import swiglu_backward_torch
    from moekit.shapes import PRESETS
    from moekit.tuning import get_config

    shape = PRESETS[PRESET]
    e, hidden, inter, k = shape.num_experts, shape.hidden_size, shape.intermediate_size, shape.top_k
    cfg = get_config(shape, tokens, torch.bfloat16, "cuda")
    dev = DEVICE
    logits = torch.randn(tokens, e, device=dev, generator=gen)
    logits[:, -1] = float("-inf")
    w, ids = torch.softmax(logits, -1).topk(k, -1)
    w = (w / w.sum(-1, keepdim=True)).float().contiguous()
    align = align_block_size(ids, e, cfg.block_m, backend="triton")
    rows = align.sorted_ids.numel()
    bf = torch.bfloat16
    pre = torch.randn(rows, 2 * inter, device=dev, generator=gen).to(bf)
    dout = torch.randn(tokens, hidden, device=dev, generator=gen).to(bf)
    down = (torch.randn(e, hidden, inter, device=dev, generator=gen) / inter ** 0.5).to(bf)
    x = torch.zeros(1, device=dev, dtype=bf).expand(tokens, hidden)              # shapes only
    gate_up = torch.zeros(1, device=dev, dtype=bf).expand(e, 2 * inter, hidden)
    npad = int(align.num_padded)
    ref = swiglu_backward_torch(x, gate_up, down, dout, w, align, k, pre=pre)
    plain = swiglu_backward_torch(x, gate_up, down, dout, w, align, k, pre=pre, compute_dtype=bf)
    refs = {"dpre_w": ref.dpre_w[:npad], "h_w": ref.h_w[:npad], "d_topk_w": ref.topk_weights}
    base_err = {"dpre_w": rel_err(plain.dpre_w[:npad], refs["dpre_w"]),
                "h_w": rel_err(plain.h_w[:npad], refs["h_w"]),
                "d_topk_w": rel_err(plain.topk_weights, refs["d_topk_w"])}
    del plain
    pad = align.sorted_ids[:npad] >= tokens * k
    s = tokens * k
    return types.SimpleNamespace(tokens=tokens, top_k=k, cfg=cfg, align=align, rows=rows, npad=npad, pad=pad,
                                 x=x, gate_up=gate_up, down=down, dout=dout, pre=pre, w=w, refs=refs,
                                 base_err=base_err, pairs=s, flops=2.0 * s * hidden * inter)


def first_run(name, fn) -> str | None:
    print(f"  [{name}] first run ...", end="", flush=True)
    try:
        fn()
        torch.cuda.synchronize()
    except Exception as exc:
        print(" FAILED", flush=True)
        return _error_head(exc)
    print(" done", flush=True)
    return None


def check(case, dpre, h, dw) -> tuple[dict, str | None]:
    n = case.npad
    errs = {"dpre_w": rel_err(dpre[:n], case.refs["dpre_w"]), "h_w": rel_err(h[:n], case.refs["h_w"]),
            "d_topk_w": rel_err(dw, case.refs["d_topk_w"])}
    problems = [f"{key} error {err:.3e} > 2 x plain bf16's {case.base_err[key]:.3e}"
                for key, err in errs.items() if not err <= 2 * case.base_err[key]]
    for name, t in (("dpre_w", dpre), ("h_w", h)):
        if bool((t[:n][case.pad] != 0).any()):                 # NaN (never written) counts too
            problems.append(f"{name}: a padding row is not 0")
    return errs, "; ".join(problems) or None


def bench(fns: dict, rounds: int, warmup: int, flush_buf) -> dict:
    """Median ms per call; every round runs each call once in turn, each after an L2 flush."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    torch.cuda.synchronize()
    events = {name: [] for name in fns}
    sleep = getattr(torch.cuda, "_sleep", None)
    for _ in range(rounds):
        # a spin first lets the host queue the round's launches ahead of the GPU
        if sleep is not None:
            sleep(10_000_000)
        for name, fn in fns.items():
            flush_buf.zero_()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            events[name].append((start, end))
        torch.cuda.synchronize()
    return {name: statistics.median(s.elapsed_time(e) for s, e in pairs) for name, pairs in events.items()}


def run_tokens(tokens, args, rec, flush_buf, broken):
    from moekit._workspace import poisoning
    from moekit.grouped_gemm_backward import swiglu_backward

    gen = torch.Generator(device=DEVICE).manual_seed(tokens)
    case = make_case(tokens, gen)
    al, k = case.align, case.top_k
    inter = case.down.shape[2]
    print(f"\n== T={tokens}: {case.pairs} pairs, block_m {al.block_m}, {case.npad} rows used of {case.rows}; "
          f"plain bf16 errors dpre_w {case.base_err['dpre_w']:.3e}, h_w {case.base_err['h_w']:.3e}, "
          f"d topk_w {case.base_err['d_topk_w']:.3e}", flush=True)
    fns, rows = {}, {}

    if "moekit" not in broken:
        def moekit_call():
            return swiglu_backward(case.x, case.gate_up, case.down, case.dout, case.w, al, k, case.cfg,
                                   pre=case.pre)
        got = {}
        with poisoning():
            err = first_run("moekit", lambda: got.__setitem__("r", moekit_call()))
        if err is None:
            r = got.pop("r")
            rows["moekit"] = check(case, r.dpre_w, r.h_w, r.topk_weights)
            fns["moekit"] = moekit_call
            del r
        else:
            print(f"    {err}")
            rec.add(tokens=tokens, variant="moekit", error=err)

    dout_sorted = torch.empty(case.rows, case.dout.shape[1], device=DEVICE, dtype=torch.bfloat16)
    gathered = False
    if GLUON_ERROR:
        print(f"  Gluon variants skipped: {GLUON_ERROR}")
    else:
        dout_sorted.fill_(float("nan"))

        def gather_call():
            return gather_rows(case.dout, al.sorted_ids, al.num_padded, k, dout_sorted)
        err = first_run("gather", gather_call)
        if err is None:
            pair = al.sorted_ids[:case.npad].long()
            valid = pair < case.pairs
            want = case.dout[torch.where(valid, pair // k, 0)] * valid[:, None]
            gathered = torch.equal(dout_sorted[:case.npad], want)
            print(f"    gather exact: {'yes' if gathered else 'NO'}")
            if gathered:
                fns["gather"] = gather_call
            else:
                rec.add(tokens=tokens, variant="gather", error="gathered rows differ from torch indexing")
            del pair, valid, want
        else:
            print(f"    {err}")
            rec.add(tokens=tokens, variant="gather", error=err)

    for name in VARIANTS:
        if not gathered or (args.variants and name not in args.variants):
            continue
        if name in broken:
            print(f"  [{name}] skipped (failed earlier: {broken[name].splitlines()[0][:120]})")
            continue
        block_n = VARIANTS[name][0]
        dpre = torch.full((case.rows, 2 * inter), float("nan"), device=DEVICE, dtype=torch.bfloat16)
        h = torch.full((case.rows, inter), float("nan"), device=DEVICE, dtype=torch.bfloat16)
        part = torch.full((case.rows, inter // block_n), float("nan"), device=DEVICE, dtype=torch.float32)
        dw = torch.full((case.pairs,), float("nan"), device=DEVICE, dtype=torch.float32)

        def call(name=name, dpre=dpre, h=h, part=part, dw=dw):
            gluon_swiglu_bwd(dout_sorted, case.down, case.pre, case.w.view(-1), al.sorted_ids, al.expert_ids,
                             al.num_padded, case.pairs, al.block_m, dpre, h, part, name)
            tile_sum(part, al, dw)
        err = first_run(name, call)
        if err is not None:
            print(f"    {err}")
            broken[name] = err
            rec.add(tokens=tokens, variant=name, error=err)
            continue
        rows[name] = check(case, dpre, h, dw)
        fns[name] = call

    timed = {name: fn for name, fn in fns.items() if name == "gather" or rows[name][1] is None}
    ms = bench(timed, args.rounds, args.warmup, flush_buf) if timed else {}
    g_ms = ms.get("gather")
    base = ms.get("moekit")
    print(f"  {'variant':<18}{'dpre_w err':>11}{'h_w err':>10}{'dtw err':>10}{'ok':>4}{'ms':>9}{'TFLOP/s':>9}"
          f"{'speed-up':>10}{'+gather':>9}{'speed-up':>10}")
    if g_ms is not None:
        print(f"  {'gather':<18}{'':>35}{g_ms:>9.4f}")
        rec.add(tokens=tokens, variant="gather", ms=g_ms)
    for name, (errs, problem) in rows.items():
        t = ms.get(name)
        tflops = case.flops / t / 1e9 if t else None
        speed = base / t if t and base else None
        with_g = t + g_ms if t and g_ms is not None and name != "moekit" else None
        speed_g = base / with_g if with_g and base else None
        line = (f"  {name:<18}{errs['dpre_w']:>11.2e}{errs['h_w']:>10.2e}{errs['d_topk_w']:>10.2e}"
                f"{'yes' if problem is None else 'NO':>4}")
        if t:
            line += f"{t:>9.4f}{tflops:>9.1f}{speed or float('nan'):>9.2f}x"
            if with_g:
                line += f"{with_g:>9.4f}{speed_g or float('nan'):>9.2f}x"
        if problem:
            line += f"   {problem}"
        print(line)
        rec.add(tokens=tokens, variant=name, block_m=al.block_m, errors=errs, base_errors=case.base_err,
                ok=problem is None, problem=problem, ms=t, tflops=tflops, speedup=speed,
                ms_with_gather=with_g, speedup_with_gather=speed_g)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="See the module docstring for what is measured and how.")
    parser.add_argument("--out", help="write results as JSON lines to this file (truncated first)")
    parser.add_argument("--aot", action="store_true",
                        help="no GPU: compile every variant for sm_90 and report")
    parser.add_argument("--dump", help="with --aot: write each variant's TTGIR, PTX and SASS here")
    parser.add_argument("--tokens", type=lambda s: [int(v) for v in s.split(",") if v], default=list(TOKENS),
                        help="comma-separated T values (default 1024,4096,16384)")
    parser.add_argument("--variants", type=lambda s: [v for v in s.split(",") if v],
                        help="comma-separated subset of the Gluon variants (" + ", ".join(VARIANTS)
                             + "; with --aot also 'gather'); moekit and the gather always run")
    parser.add_argument("--rounds", type=int, default=25, help="timed rounds (default 25)")
    parser.add_argument("--warmup", type=int, default=3, help="warm-up rounds (default 3)")
    args = parser.parse_args(argv)

    if args.aot:
        return run_aot(args)
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to run (use --aot for the compile check)")
        return 1
    props = torch.cuda.get_device_properties(0)
    print(f"device {props.name} ({props.multi_processor_count} SMs), torch {torch.__version__}, "
          f"triton {triton.__version__}, gluon {'yes' if not GLUON_ERROR else 'NO: ' + GLUON_ERROR}",
          flush=True)
    torch.backends.cuda.matmul.allow_tf32 = False          # the fp32 reference must be fp32
    rec = Recorder(args.out)
    flush_buf = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device=DEVICE)
    broken = {}
    started = time.perf_counter()
    for tokens in args.tokens:
        try:
            run_tokens(tokens, args, rec, flush_buf, broken)
        except Exception as exc:
            print(f"T={tokens} failed: {_error_head(exc)}", flush=True)
            rec.add(tokens=tokens, error=_error_head(exc))
        torch.cuda.empty_cache()
    print(f"\ntotal {time.perf_counter() - started:.0f} s" + (f"; results in {args.out}" if args.out else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
