"""Gluon probe: a Hopper-native (sm_90) warp-specialized GEMM in Gluon, checked and timed on an H200.

De-risks writing moekit's grouped expert GEMM in Gluon (`triton.experimental.gluon`, Triton 3.6) by
measuring, for C[M, N] = A[M, K] @ B[N, K]^T in bf16 (fp32 accumulate, bf16 out, B shaped like a
weight), these variants:

    gluon_ws      persistent, warp-specialized: a 1-warp TMA producer partition fills a ring of
                  NVMMA-swizzled shared-memory stages (ready/empty mbarriers); consumer partitions of
                  one warpgroup each (two for 128x256 tiles, each owning 64 rows of the tile) issue
                  async wgmma, release stages, and store C through shared memory with a TMA store.
    gluon_ws_128  the same with 128x128x64 tiles, 4 stages, one consumer warpgroup.
    gluon_pipe    persistent, no warp specialization: TMA loads software-pipelined STAGES-1 steps
                  ahead of async wgmma in one partition (8 warps): separates the gain of WS from the
                  gain of TMA + wgmma.
    triton        plain Triton: `tl.dot` on host TensorDescriptor loads, 128x256x64, 3 stages, 8 warps.
    triton_128    plain Triton, 128x128x64, 4 stages, 8 warps.
    torch         torch.matmul(A, B.T) (cuBLAS).

on the Qwen3-30B-A3B expert shapes as dense products, (M, N, K) = (32768, 1536, 2048),
(32768, 2048, 768), (16384, 1536, 2048), (4096, 1536, 2048), plus (300, 384, 256) for correctness only
(M not a multiple of the tile: TMA zero-fills the loads and clips the stores).

Stage 2, `gluon_grouped` (and `gluon_grouped_128`): the gluon_ws (gluon_ws_128) kernel as a grouped
GEMM over E = 128 experts. A's rows are sorted by expert and each expert's group padded up to a multiple
of BLOCK_M; `expert_ids[block]` gives each row block's expert and `num_blocks` (read on the device)
how many blocks there are. Work items are (row block, N tile); B is (E, N, K), loaded by TMA from a 2-D
descriptor over B viewed as (E*N, K) at row e*N + n0 (so N must be a multiple of BLOCK_N). Compared
with per-expert torch matmuls, timed against `torch._grouped_mm` (when this torch has it) and the dense
gluon_ws / torch on the same padded rows (with one expert's weight: what padding alone would cost).

Correctness: each output is NaN-filled before its run and compared with the fp32 product
A.float() @ B.float().T; a variant passes when its max abs error is at most 2x torch's own bf16 error
against the same reference (both printed).

Timing: CUDA events around each launch, warm-up first, then ~50 rounds that run every variant once in
turn (round robin, so clock or thermal drift hits all alike); the median is reported in ms, TFLOP/s
(2*M*N*K / t; the grouped rows count only real rows) and % of torch.

Hangs: the Gluon kernels synchronise through mbarriers; a wrong phase or byte count hangs the GPU rather
than failing. Each variant therefore first runs once alone, with a line printed (flushed) before and a
torch.cuda.synchronize() after, so the log names the variant that hung; run the script under an outer
`timeout` (below), which kills a hung process. `--variants` leaves any variant out. A variant that fails
to compile or run is reported (first lines of the error) and the others go on; results are written as
JSON lines to `--out` as they come.

`--aot` needs no GPU: it compiles every variant for sm_90 (GPUTarget("cuda", 90, 32)) through the JIT's
own argument binder, as a launch would, and prints OK with shared memory, registers (cuobjdump
-res-usage), the number of HGMMA instructions and whether setmaxnreg was emitted, or FAIL with the
error; it exits 1 when any variant fails.

Seen on an H200 (torch 2.11, Triton 3.6; all variants within tolerance): gluon_ws 95-98% of cuBLAS on
the large dense shapes (gluon_ws_128 98-101%, gluon_pipe 86-96%, plain Triton 73-80%); at M=4096
gluon_ws 81% (1.45 waves of 128x256 tiles), gluon_ws_128 98%. Grouped, E=128, 32768 rows padded to
40448: gluon_grouped 1.21x (N=1536, K=2048) and 1.44x (N=2048, K=768) torch._grouped_mm's speed.

Usage:
    timeout 600 python scripts/gluon_probe.py --out results.jsonl      # on the H200 (~20 s)
    python scripts/gluon_probe.py --quick                              # smaller shapes, fewer rounds
    python scripts/gluon_probe.py --variants gluon_ws,torch --no-grouped
    python scripts/gluon_probe.py --aot [--dump DIR]                   # CPU only: compile check
"""

from __future__ import annotations

import os

if "--aot" in os.sys.argv:
    os.environ["TRITON_INTERPRET"] = "0"     # compile, never interpret (before triton is imported)

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
import types

import torch
import triton
import triton.language as tl

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonTensorDescriptor

    # Triton 3.6 names the TMA copies async_copy_global_to_shared / async_copy_shared_to_global; later
    # releases (3.9) renamed them async_load / async_store and made the old names raise.
    tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global
    GLUON_ERROR = None
except ImportError as exc:          # no Gluon: the kernels below are defined but never launched
    GLUON_ERROR = f"{type(exc).__name__}: {exc}"
    gluon = types.SimpleNamespace(jit=lambda fn=None, **_: fn, constexpr_function=lambda fn: fn)
    gl = types.SimpleNamespace(constexpr=None)
    fence_async_shared = mbarrier = tma = tma_load = tma_store = warpgroup_mma = warpgroup_mma_wait = None
    GluonTensorDescriptor = None

try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:
    TensorDescriptor = None

DENSE_SHAPES = [(32768, 1536, 2048), (32768, 2048, 768), (16384, 1536, 2048), (4096, 1536, 2048)]
ODD_SHAPE = (300, 384, 256)            # correctness only
QUICK_SHAPES = [(4096, 1536, 2048)]
GROUPED_SHAPES = [(1536, 2048), (2048, 768)]    # (N, K) per expert: gate_up and down of Qwen3-30B-A3B
H200_SMS = 132


# --------------------------------------------------------------------------------------------------
# Gluon: shared pieces
# --------------------------------------------------------------------------------------------------

@gluon.jit
def _tile_coords(t, num_pid_n, N, expert_ids_ptr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                 GROUPED: gl.constexpr):
    """Work item t -> (row of A and C, column of C, row of B's 2-D view). N tiles run fastest, so the
    programs in flight share A row blocks and all of B (a few MB) stays in L2."""
    pid_m = t // num_pid_n
    pid_n = t % num_pid_n
    off_m = pid_m * BLOCK_M
    off_n = pid_n * BLOCK_N
    if GROUPED:
        # B is (E, N, K) seen as (E*N, K): expert e's weight tile starts at row e*N + off_n.
        expert = gl.load(expert_ids_ptr + pid_m)
        b_row = expert * N + off_n
    else:
        b_row = off_n
    return off_m, off_n, b_row


@gluon.jit
def _num_tiles(M, N, num_blocks_ptr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, GROUPED: gl.constexpr):
    num_pid_n = gl.cdiv(N, BLOCK_N)
    if GROUPED:
        num_pid_m = gl.load(num_blocks_ptr)      # on the device, as an aligner would leave it
    else:
        num_pid_m = gl.cdiv(M, BLOCK_M)
    return num_pid_m * num_pid_n, num_pid_n


@gluon.constexpr_function
def _mma_layout(SUB_M, BLOCK_N, WARPS):
    # wgmma's accumulator layout: instruction m16 x n x k16 (bf16); each warp of a warpgroup owns 16 rows,
    # so WARPS warps stacked along M ([WARPS, 1]) cover SUB_M rows in SUB_M // (16 * WARPS) repeats.
    # n = BLOCK_N (<= 256) is the widest instruction: fewest wgmma issues per K step.
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1], instr_shape=[16, BLOCK_N, 16])


# --------------------------------------------------------------------------------------------------
# gluon_ws: persistent, warp-specialized
# --------------------------------------------------------------------------------------------------

@gluon.jit
def _ws_producer(a_desc, b_desc, a_bufs, b_bufs, ready_bars, empty_bars, M, N, K, expert_ids_ptr,
                 num_blocks_ptr, GROUPED: gl.constexpr):
    """1 warp: TMA loads of A [BM, BK] and B [BN, BK] tiles into the stage ring, as far ahead as the
    consumers let it."""
    BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = b_desc.block_type.shape[0]
    STAGES: gl.constexpr = a_bufs.type.shape[0]
    num_tiles, num_pid_n = _num_tiles(M, N, num_blocks_ptr, BLOCK_M, BLOCK_N, GROUPED)
    k_tiles = gl.cdiv(K, BLOCK_K)

    it = 0                          # K steps issued so far by this program, across its tiles
    for t in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        off_m, off_n, b_row = _tile_coords(t, num_pid_n, N, expert_ids_ptr, BLOCK_M, BLOCK_N, GROUPED)
        for ki in range(k_tiles):
            s = it % STAGES
            # Pass `it // STAGES` over the ring. An mbarrier starts in phase 0, and waiting on parity 1
            # (the phase "before" it) returns at once, so the first pass finds every stage empty; later
            # passes wait until the consumers released the stage (phase flips once per pass).
            phase = (it // STAGES) & 1
            mbarrier.wait(empty_bars.index(s), phase ^ 1)
            ready = ready_bars.index(s)
            # expect() is arrive + expect-tx: the ready barrier (count 1) completes once this many bytes
            # have landed. A box that reaches past the tensor (M % BLOCK_M, K % BLOCK_K) is zero-filled
            # and still counts its full size, so the byte count is the same for every tile.
            mbarrier.expect(ready, a_desc.block_type.nbytes + b_desc.block_type.nbytes)
            tma_load(a_desc, [off_m, ki * BLOCK_K], ready, a_bufs.index(s))
            tma_load(b_desc, [b_row, ki * BLOCK_K], ready, b_bufs.index(s))
            it += 1


@gluon.jit
def _ws_consumer(a_bufs, b_bufs, ready_bars, empty_bars, c_desc, c_smem, M, N, K, num_blocks_ptr,
                 CONSUMER: gl.constexpr, NUM_CONSUMERS: gl.constexpr, GROUPED: gl.constexpr):
    """One warpgroup: rows [CONSUMER * SUB_M, (CONSUMER + 1) * SUB_M) of every tile: wgmma over the
    stages, then the epilogue (bf16 into its own shared buffer, TMA store)."""
    SUB_M: gl.constexpr = c_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = c_desc.block_type.shape[1]
    BLOCK_M: gl.constexpr = a_bufs.type.shape[1]
    BLOCK_K: gl.constexpr = a_bufs.type.shape[2]
    STAGES: gl.constexpr = a_bufs.type.shape[0]
    layout: gl.constexpr = _mma_layout(SUB_M, BLOCK_N, 4)
    num_tiles, num_pid_n = _num_tiles(M, N, num_blocks_ptr, BLOCK_M, BLOCK_N, GROUPED)
    k_tiles = gl.cdiv(K, BLOCK_K)
    c_buf = c_smem.index(CONSUMER)

    acc = gl.zeros((SUB_M, BLOCK_N), gl.float32, layout)
    it = 0
    for t in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        off_m = (t // num_pid_n) * BLOCK_M
        off_n = (t % num_pid_n) * BLOCK_N
        for ki in range(k_tiles):
            s = it % STAGES
            mbarrier.wait(ready_bars.index(s), (it // STAGES) & 1)
            a = a_bufs.index(s)
            if NUM_CONSUMERS > 1:
                a = a.slice(CONSUMER * SUB_M, SUB_M)         # this warpgroup's rows of the A tile
            b = b_bufs.index(s).permute((1, 0))              # [BN, BK] K-major -> [BK, BN] view for wgmma
            # use_acc=False on a tile's first step zeroes the accumulator for free.
            acc = warpgroup_mma(a, b, acc, use_acc=ki > 0, is_async=True)
            # Keep one wgmma in flight: waiting until <= 1 is outstanding retires the previous step's,
            # so its stage can go back to the producer while this one runs. Each consumer arrives once
            # (the empty barriers count NUM_CONSUMERS arrivals), from one thread, after its warpgroup's
            # wait, as CUTLASS does; the stage of a tile's first step was already released below.
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
            mbarrier.arrive(empty_bars.index((it + STAGES - 1) % STAGES), pred=ki > 0)
            it += 1
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        mbarrier.arrive(empty_bars.index((it + STAGES - 1) % STAGES))

        # Epilogue. The previous tile's TMA store must have finished reading c_buf before we overwrite
        # it (it had a whole main loop to do so); the fence orders the generic-proxy shared stores
        # before the async-proxy (TMA) read of them.
        c = acc.to(c_desc.dtype)
        tma.store_wait(pendings=0)
        c_buf.store(c)
        fence_async_shared()
        tma_store(c_desc, [off_m + CONSUMER * SUB_M, off_n], c_buf)
    tma.store_wait(pendings=0)


@gluon.jit
def gluon_ws_kernel(a_desc, b_desc, c_desc, M, N, K, expert_ids_ptr, num_blocks_ptr,
                    STAGES: gl.constexpr, NUM_CONSUMERS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
                    CONSUMER_REGS: gl.constexpr, GROUPED: gl.constexpr):
    dtype: gl.constexpr = a_desc.dtype
    SUB_M: gl.constexpr = c_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = c_desc.block_type.shape[1]

    a_bufs = gl.allocate_shared_memory(dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
    b_bufs = gl.allocate_shared_memory(dtype, [STAGES] + b_desc.block_type.shape, b_desc.layout)
    c_smem = gl.allocate_shared_memory(dtype, [NUM_CONSUMERS, SUB_M, BLOCK_N], c_desc.layout)
    ready_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready_bars.index(i), count=1)               # the producer's expect() arrival
        mbarrier.init(empty_bars.index(i), count=NUM_CONSUMERS)   # one arrival per consumer warpgroup
    # Make the initialised barriers visible to the async proxy (TMA complete-tx) before any use.
    fence_async_shared()
    C0: gl.constexpr = 0
    C1: gl.constexpr = 1
    # The default partition runs in the kernel's num_warps (4) warps: consumer 0. Workers: consumer 1
    # (4 warps, when two) and the producer (1 warp, few registers: setmaxnreg gives the rest to the
    # consumers; the kernel's maxnreg caps the pool, see _ws_maxnreg).
    # (Argument tuples are written out in each call: a constexpr kept in a tuple variable reaches a
    # worker partition as a run-time value.)
    if NUM_CONSUMERS == 2:
        gl.warp_specialize([
            (_ws_consumer, (a_bufs, b_bufs, ready_bars, empty_bars, c_desc, c_smem, M, N, K, num_blocks_ptr,
                            C0, NUM_CONSUMERS, GROUPED)),
            (_ws_consumer, (a_bufs, b_bufs, ready_bars, empty_bars, c_desc, c_smem, M, N, K, num_blocks_ptr,
                            C1, NUM_CONSUMERS, GROUPED)),
            (_ws_producer, (a_desc, b_desc, a_bufs, b_bufs, ready_bars, empty_bars, M, N, K, expert_ids_ptr,
                            num_blocks_ptr, GROUPED)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
    else:
        gl.warp_specialize([
            (_ws_consumer, (a_bufs, b_bufs, ready_bars, empty_bars, c_desc, c_smem, M, N, K, num_blocks_ptr,
                            C0, NUM_CONSUMERS, GROUPED)),
            (_ws_producer, (a_desc, b_desc, a_bufs, b_bufs, ready_bars, empty_bars, M, N, K, expert_ids_ptr,
                            num_blocks_ptr, GROUPED)),
        ], [1], [PRODUCER_REGS])


def _ws_maxnreg(num_consumers: int) -> int:
    """Registers per thread the kernel starts with. The warps are counted in whole warpgroups (the
    1-warp producer takes one), and all of them at this cap must fit the SM's 64K registers:
    (consumers + 1) * 128 threads."""
    threads = (num_consumers + 1) * 128
    return min(256, (65536 // threads) // 8 * 8)


# --------------------------------------------------------------------------------------------------
# gluon_pipe: persistent, software-pipelined, one partition
# --------------------------------------------------------------------------------------------------

@gluon.jit
def _pipe_load(a_desc, b_desc, a_bufs, b_bufs, ready_bars, prod, off_m, off_n, k):
    STAGES: gl.constexpr = a_bufs.type.shape[0]
    s = prod % STAGES
    ready = ready_bars.index(s)
    mbarrier.expect(ready, a_desc.block_type.nbytes + b_desc.block_type.nbytes)
    tma_load(a_desc, [off_m, k], ready, a_bufs.index(s))
    tma_load(b_desc, [off_n, k], ready, b_bufs.index(s))
    return prod + 1


@gluon.jit
def gluon_pipe_kernel(a_desc, b_desc, c_desc, M, N, K, STAGES: gl.constexpr, num_warps: gl.constexpr):
    dtype: gl.constexpr = a_desc.dtype
    BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = b_desc.block_type.shape[0]
    layout: gl.constexpr = _mma_layout(BLOCK_M, BLOCK_N, num_warps)

    a_bufs = gl.allocate_shared_memory(dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
    b_bufs = gl.allocate_shared_memory(dtype, [STAGES] + b_desc.block_type.shape, b_desc.layout)
    c_buf = gl.allocate_shared_memory(dtype, c_desc.block_type.shape, c_desc.layout)
    ready_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready_bars.index(i), count=1)
    fence_async_shared()

    num_pid_n = gl.cdiv(N, BLOCK_N)
    num_tiles = gl.cdiv(M, BLOCK_M) * num_pid_n
    k_tiles = gl.cdiv(K, BLOCK_K)      # the launcher checks k_tiles >= STAGES - 1

    acc = gl.zeros((BLOCK_M, BLOCK_N), gl.float32, layout)
    prod = 0                           # loads issued, and consumed, across this program's tiles
    cons = 0
    for t in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        off_m = (t // num_pid_n) * BLOCK_M
        off_n = (t % num_pid_n) * BLOCK_N
        # Prologue: STAGES - 1 loads ahead. Their stages are free: every wgmma of the last tile retired.
        for i in gl.static_range(STAGES - 1):
            prod = _pipe_load(a_desc, b_desc, a_bufs, b_bufs, ready_bars, prod, off_m, off_n, i * BLOCK_K)
        for ki in range(k_tiles):
            s = cons % STAGES
            mbarrier.wait(ready_bars.index(s), (cons // STAGES) & 1)
            acc = warpgroup_mma(a_bufs.index(s), b_bufs.index(s).permute((1, 0)), acc, use_acc=ki > 0,
                                is_async=True)
            # <= 1 outstanding: step ki - 1's wgmma retired, so its stage (the one the next load goes
            # to: prod trails cons by STAGES - 1 ... now STAGES - 2) can be refilled. With 8 warps the
            # compiler's shared-memory barrier before the TMA write covers the other warpgroup's wgmma.
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
            cons += 1
            if ki + STAGES - 1 < k_tiles:
                prod = _pipe_load(a_desc, b_desc, a_bufs, b_bufs, ready_bars, prod, off_m, off_n,
                                  (ki + STAGES - 1) * BLOCK_K)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))

        c = acc.to(dtype)
        tma.store_wait(pendings=0)
        c_buf.store(c)
        fence_async_shared()
        tma_store(c_desc, [off_m, off_n], c_buf)
    tma.store_wait(pendings=0)


# --------------------------------------------------------------------------------------------------
# Plain Triton baseline
# --------------------------------------------------------------------------------------------------

@triton.jit
def triton_matmul_kernel(a_desc, b_desc, c_desc, M, N, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    off_m = (pid // num_pid_n) * BLOCK_M
    off_n = (pid % num_pid_n) * BLOCK_N
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        a = a_desc.load([off_m, k * BLOCK_K])
        b = b_desc.load([off_n, k * BLOCK_K])
        acc = tl.dot(a, b.T, acc)
    c_desc.store([off_m, off_n], acc.to(c_desc.dtype))


# --------------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------------

def _num_sms(num_sms):
    if num_sms:
        return num_sms
    return torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count


def _gl_desc(t, block):
    layout = gl.NVMMASharedLayout.get_default_for(block, gl.bfloat16)
    return GluonTensorDescriptor.from_tensor(t, block, layout)


def gluon_ws_matmul(a, b, c, block_m=128, block_n=256, block_k=64, stages=3, consumers=2, num_sms=None,
                    expert_ids=None, num_blocks=None):
    """C = A @ B^T, or with expert_ids/num_blocks (int32 device tensors) the grouped product: b is then
    (E, N, K) and row block i of A uses expert expert_ids[i]; a has a multiple of block_m rows."""
    assert block_m % (64 * consumers) == 0 and block_n <= 256
    grouped = expert_ids is not None
    n, k = b.shape[-2:]
    b2 = b.reshape(-1, k)                     # (E*N, K) for the grouped product
    if grouped:
        assert n % block_n == 0, "grouped: N must be a multiple of BLOCK_N (tiles would cross experts)"
        assert a.shape[0] % block_m == 0
        tiles = (a.shape[0] // block_m) * (n // block_n)      # an upper bound: num_blocks is on the device
    else:
        expert_ids = num_blocks = a                           # unused pointers
        tiles = triton.cdiv(a.shape[0], block_m) * triton.cdiv(n, block_n)
    sub_m = block_m // consumers
    a_desc = _gl_desc(a, [block_m, block_k])
    b_desc = _gl_desc(b2, [block_n, block_k])
    c_desc = _gl_desc(c, [sub_m, block_n])
    grid = (min(_num_sms(num_sms), tiles),)
    maxnreg = _ws_maxnreg(consumers)
    gluon_ws_kernel[grid](a_desc, b_desc, c_desc, a.shape[0], n, k, expert_ids, num_blocks,
                          STAGES=stages, NUM_CONSUMERS=consumers, PRODUCER_REGS=40,
                          CONSUMER_REGS=232 if consumers == 2 else 0, GROUPED=grouped,
                          num_warps=4, maxnreg=maxnreg)
    return c


def gluon_pipe_matmul(a, b, c, block_m=128, block_n=256, block_k=64, stages=3, num_warps=8, num_sms=None):
    n, k = b.shape
    assert triton.cdiv(k, block_k) >= stages - 1, "the prologue assumes at least STAGES - 1 K steps"
    a_desc = _gl_desc(a, [block_m, block_k])
    b_desc = _gl_desc(b, [block_n, block_k])
    c_desc = _gl_desc(c, [block_m, block_n])
    tiles = triton.cdiv(a.shape[0], block_m) * triton.cdiv(n, block_n)
    grid = (min(_num_sms(num_sms), tiles),)
    gluon_pipe_kernel[grid](a_desc, b_desc, c_desc, a.shape[0], n, k, STAGES=stages, num_warps=num_warps)
    return c


def triton_matmul(a, b, c, block_m=128, block_n=256, block_k=64, stages=3, num_warps=8):
    n, k = b.shape
    a_desc = TensorDescriptor.from_tensor(a, [block_m, block_k])
    b_desc = TensorDescriptor.from_tensor(b, [block_n, block_k])
    c_desc = TensorDescriptor.from_tensor(c, [block_m, block_n])
    grid = (triton.cdiv(a.shape[0], block_m) * triton.cdiv(n, block_n),)
    triton_matmul_kernel[grid](a_desc, b_desc, c_desc, a.shape[0], n, k, BLOCK_M=block_m, BLOCK_N=block_n,
                               BLOCK_K=block_k, num_warps=num_warps, num_stages=stages)
    return c


def torch_matmul(a, b, c):
    return torch.matmul(a, b.T, out=c)


# name -> (launcher(a, b, c), needs Gluon)
DENSE_VARIANTS = {
    "gluon_ws": (lambda a, b, c: gluon_ws_matmul(a, b, c), True),
    "gluon_ws_128": (lambda a, b, c: gluon_ws_matmul(a, b, c, block_n=128, stages=4, consumers=1), True),
    "gluon_pipe": (lambda a, b, c: gluon_pipe_matmul(a, b, c), True),
    "triton": (lambda a, b, c: triton_matmul(a, b, c), False),
    "triton_128": (lambda a, b, c: triton_matmul(a, b, c, block_n=128, stages=4), False),
    "torch": (torch_matmul, False),
}
# grouped launch options per Gluon variant (the tiles of gluon_ws and gluon_ws_128)
GROUPED_TILES = {"gluon_grouped": {}, "gluon_grouped_128": dict(block_n=128, stages=4, consumers=1)}
GROUPED_VARIANTS = (*GROUPED_TILES, "torch_grouped_mm", "gluon_ws_dense", "torch_dense")


def print_device(gluon_error: str | None) -> None:
    """A GPU run's first line: the device and its SMs, torch, Triton, and whether Gluon imports (why
    not, where it does not)."""
    props = torch.cuda.get_device_properties(0)
    print(f"device {props.name} ({props.multi_processor_count} SMs), torch {torch.__version__}, "
          f"triton {triton.__version__}, gluon {'yes' if not gluon_error else 'NO: ' + gluon_error}",
          flush=True)


# --------------------------------------------------------------------------------------------------
# --aot: compile every variant for sm_90 on the CPU
# --------------------------------------------------------------------------------------------------

def _cuobjdump(cubin: bytes, flag: str) -> str:
    from triton import knobs

    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([knobs.nvidia.cuobjdump.path, flag, f.name], capture_output=True, text=True,
                              check=True).stdout


def compiled_facts(compiled) -> types.SimpleNamespace:
    """What the --aot reports print of a compiled kernel: shared memory (B), registers a thread (a
    string, '?' when cuobjdump names none), local memory (B: spills), HGMMA count, SASS and PTX."""
    res = _cuobjdump(compiled.asm["cubin"], "-res-usage")
    regs = re.search(r"REG:(\d+)", res)
    sass = _cuobjdump(compiled.asm["cubin"], "-sass")
    return types.SimpleNamespace(
        shared=compiled.metadata.shared, regs=regs.group(1) if regs else "?",
        local=sum(int(x) for x in re.findall(r"(?:LOCAL|STACK):(\d+)", res)),
        hgmma=len(re.findall(r"\bHGMMA\.", sass)), sass=sass, ptx=compiled.asm["ptx"])


def dump_compiled(compiled, facts, folder: str, stem: str) -> None:
    """The kernel's TTGIR, PTX and SASS as folder/stem.{ttgir,ptx,sass} (--dump)."""
    os.makedirs(folder, exist_ok=True)
    for ext, text in (("ttgir", compiled.asm["ttgir"]), ("ptx", facts.ptx), ("sass", facts.sass)):
        with open(os.path.join(folder, f"{stem}.{ext}"), "w") as f:
            f.write(text)


def aot_aligned_variants(args, variants: dict, make_launch, kernel, extra_facts) -> int:
    """--aot of the grouped-GEMM probes (gluon_gemm1_probe, gluon_gemm2_probe): each of `variants`
    (those named in args.variants, or all) over a 64-row paired and a 128-row alignment, compiled for
    sm_90 from the one launch of `kernel` that `make_launch(align_m, paired, opts)()` makes. A line
    each: shared memory, registers, spills, HGMMAs, then `extra_facts(facts, compiled, kwargs)`; FAIL
    past the H200's shared memory or where the compile raises. args.dump: each one's TTGIR, PTX and
    SASS. Returns 1 if any failed."""
    from aot_compile_check import capture_launches, compile_launch  # --aot only: it turns interpreting off
    from triton.backends.compiler import GPUTarget

    from moekit.tuning import SHARED_MEMORY_LIMIT  # Hopper's 227 KB a block

    target = GPUTarget("cuda", 90, 32)
    failed = 0
    for name, opts in variants.items():
        if args.variants and name not in args.variants:
            continue
        for align_m, paired in ((64, True), (128, False)):
            label = f"{name} block_m={align_m}{' paired' if paired else ''}"
            started = time.perf_counter()
            try:
                (kern, kargs, kwargs), = capture_launches(make_launch(align_m, paired, opts), (kernel,))
                compiled = compile_launch(kern, kargs, kwargs, target)
                facts = compiled_facts(compiled)
                status = (f"OK   shared {facts.shared} B, {facts.regs} regs, "
                          f"local {facts.local} B{' (SPILLS)' if facts.local else ''}, {facts.hgmma} HGMMA, "
                          + extra_facts(facts, compiled, kwargs))
                if compiled.metadata.shared > SHARED_MEMORY_LIMIT:
                    status = "FAIL " + status[5:] + " (over the H200's 227 KB a block)"
                    failed += 1
                if args.dump:
                    dump_compiled(compiled, facts, args.dump, label.replace(" ", "_").replace("=", ""))
            except Exception as exc:
                failed += 1
                status = "FAIL " + _error_head(exc, 12)
            print(f"{label:<32} {status}  ({time.perf_counter() - started:.1f} s)", flush=True)
    return 1 if failed else 0


def run_aot(args) -> int:
    from aot_compile_check import capture_launches, compile_launch  # --aot only: it turns interpreting off
    from triton.backends.compiler import GPUTarget

    if GLUON_ERROR:
        print(f"Gluon unavailable ({GLUON_ERROR}): only the plain Triton variants are checked")
    target = GPUTarget("cuda", 90, 32)
    m, n, k = 4096, 1536, 2048
    a = torch.empty(m, k, dtype=torch.bfloat16)
    b = torch.empty(n, k, dtype=torch.bfloat16)
    c = torch.empty(m, n, dtype=torch.bfloat16)
    e = 8
    w = torch.empty(e, n, k, dtype=torch.bfloat16)
    ids = torch.zeros(m // 128, dtype=torch.int32)
    nb = torch.zeros(1, dtype=torch.int32)
    checks = {name: (lambda fn=fn: fn(a, b, c), needs) for name, (fn, needs) in DENSE_VARIANTS.items()
              if name != "torch"}
    for name, tiles in GROUPED_TILES.items():
        checks[name] = (lambda tiles=tiles: gluon_ws_matmul(a, w, c, expert_ids=ids, num_blocks=nb,
                                                            num_sms=H200_SMS, **tiles), True)
    kernels = (gluon_ws_kernel, gluon_pipe_kernel, triton_matmul_kernel)
    failed = 0
    for name, (call, needs_gluon) in checks.items():
        if args.variants and name not in args.variants:
            continue
        if needs_gluon and GLUON_ERROR:
            print(f"{name:<18} SKIP (no Gluon)")
            continue
        started = time.perf_counter()
        try:
            with _patched_sms():
                launches = capture_launches(call, kernels)
            (kernel, kargs, kwargs), = launches
            compiled = compile_launch(kernel, kargs, kwargs, target)
            signature = compiled.src.signature
            facts = compiled_facts(compiled)
            setmaxnreg = "setmaxnreg" in facts.ptx
            descs = [v for v in signature.values() if str(v).startswith("tensordesc")]
            status = (f"OK   shared {facts.shared} B, {facts.regs} regs"
                      f"{f', local {facts.local} B (spills)' if facts.local else ''}, {facts.hgmma} HGMMA, "
                      f"setmaxnreg {'yes' if setmaxnreg else 'no'}, warps {compiled.metadata.num_warps}"
                      f"{', maxnreg ' + str(kwargs['maxnreg']) if kwargs.get('maxnreg') else ''}")
            if args.verbose:
                status += f"\n     descriptors: {descs}"
            if args.dump:
                dump_compiled(compiled, facts, args.dump, name)
        except Exception as exc:
            failed += 1
            status = "FAIL " + _error_head(exc, 12)
        print(f"{name:<18} {status}  ({time.perf_counter() - started:.1f} s)", flush=True)
    return 1 if failed else 0


class _patched_sms:
    """Under --aot there is no device to ask for its multiprocessor count."""

    def __enter__(self):
        global _num_sms
        self._saved = _num_sms
        _num_sms = lambda num_sms: num_sms or H200_SMS     # noqa: E731
        return self

    def __exit__(self, *exc):
        global _num_sms
        _num_sms = self._saved


def _error_head(exc: BaseException, lines: int = 6) -> str:
    """The error's first lines. A CompilationError shows the source line, and its cause comes last:
    the innermost one, whose message says what went wrong."""
    text = f"{type(exc).__name__}: {exc}".strip().splitlines()
    if type(exc).__name__ == "CompilationError":
        inner = exc
        while inner.__cause__ is not None or (inner.__context__ is not None
                                              and not inner.__suppress_context__):
            inner = inner.__cause__ or inner.__context__
        cause = f"{type(inner).__name__}: {inner}".strip().splitlines()
        text = text[-3:] + ["cause: " + "; ".join(cause[-3:])]
    return "\n     ".join(line[:300] for line in text[:lines])


# --------------------------------------------------------------------------------------------------
# GPU run: correctness and timing
# --------------------------------------------------------------------------------------------------

class Recorder:
    """Prints and keeps result rows; appends each as a JSON line to --out."""

    def __init__(self, path):
        self.path = path
        self.rows = []
        if path:
            open(path, "w").close()

    def add(self, **row):
        self.rows.append(row)
        if self.path:
            with open(self.path, "a") as f:
                f.write(json.dumps(row) + "\n")


def max_err(out, ref) -> float:
    return (out.float() - ref).abs().max().item()       # NaN when any element is NaN (never written)


def first_run(name, fn, out) -> str | None:
    """Run once alone (NaN-filled output), synchronised: None, or the error's first lines. A hang stops
    here, after the flushed line that names the variant."""
    print(f"  [{name}] first run ...", end="", flush=True)
    try:
        out.fill_(float("nan"))
        fn()
        torch.cuda.synchronize()
    except Exception as exc:
        print(" FAILED", flush=True)
        return _error_head(exc)
    print(" done", flush=True)
    return None


def bench_round_robin(fns: dict, rounds: int, warmup: int) -> dict:
    """Median ms per variant; every round runs each variant once, in turn."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    torch.cuda.synchronize()
    events = {name: [] for name in fns}
    sleep = getattr(torch.cuda, "_sleep", None)
    for _ in range(rounds):
        # A ~1 ms spin first lets the host queue the round's launches ahead of the GPU: the events then
        # time the kernels back to back, not the host's launch overhead (descriptors, binder) on the
        # small shapes, whose kernels take tens of microseconds.
        if sleep is not None:
            sleep(2_000_000)
        for name, fn in fns.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            events[name].append((start, end))
    torch.cuda.synchronize()
    return {name: statistics.median(s.elapsed_time(e) for s, e in pairs) for name, pairs in events.items()}


def run_dense(args, rec: Recorder) -> bool:
    shapes = (QUICK_SHAPES if args.quick else DENSE_SHAPES) + [ODD_SHAPE]
    torch_ran = False
    names = [v for v in DENSE_VARIANTS if not args.variants or v in args.variants or v == "torch"]
    broken = {}                                  # variant -> error: skipped from then on
    for m, n, k in shapes:
        timed = (m, n, k) != ODD_SHAPE
        print(f"\n== dense M={m} N={n} K={k}" + ("" if timed else " (correctness only)"), flush=True)
        gen = torch.Generator(device="cuda").manual_seed(0)
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
        b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) / k ** 0.5
        ref = a.float() @ b.float().T
        outs, fns, errs = {}, {}, {}
        for name in names:
            if name in broken:
                continue
            fn, needs_gluon = DENSE_VARIANTS[name]
            if needs_gluon and GLUON_ERROR:
                broken[name] = f"no Gluon: {GLUON_ERROR}"
                print(f"  [{name}] skipped: {broken[name]}")
                continue
            out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
            call = lambda fn=fn, a=a, b=b, out=out: fn(a, b, out)       # noqa: E731
            err = first_run(name, call, out)
            if err is not None:
                print(f"    {err}")
                broken[name] = err
                rec.add(kind="dense", variant=name, M=m, N=n, K=k, error=err)
                continue
            errs[name] = max_err(out, ref)
            outs[name], fns[name] = out, call
        if "torch" in errs:
            torch_ran = True
        tol = 2 * errs.get("torch", float("nan"))
        ok = {name: e <= tol for name, e in errs.items()}     # False on NaN
        ms = bench_round_robin(fns, args.rounds, args.warmup) if timed and fns else {}
        flops = 2.0 * m * n * k
        t_torch = ms.get("torch")
        print(f"  {'variant':<14}{'max err':>11}{'ok':>5}{'ms':>10}{'TFLOP/s':>10}{'% torch':>9}")
        for name in fns:
            t = ms.get(name)
            tflops = flops / t / 1e9 if t else None
            pct = 100.0 * t_torch / t if t and t_torch else None
            if t:
                timing = f"{t:>10.4f}{tflops:>10.1f}{pct if pct else float('nan'):>8.1f}%"
            else:
                timing = f"{'-':>10}{'-':>10}{'-':>9}"
            print(f"  {name:<14}{errs[name]:>11.3e}{'yes' if ok[name] else 'NO':>5}{timing}")
            rec.add(kind="dense", variant=name, M=m, N=n, K=k, max_err=errs[name],
                    torch_err=errs.get("torch"), ok=ok[name], ms=t, tflops=tflops, pct_torch=pct)
        if "torch" in errs:
            print(f"  (tolerance: 2 x torch's error = {tol:.3e})")
        del a, b, ref, outs, fns
        torch.cuda.empty_cache()
    return torch_ran


def make_grouped(num_experts, total_rows, n, k, block_m, gen):
    """Rows per expert (random, summing to total_rows), A padded per expert to block_m rows, expert id
    per row block, and the offsets of the real rows (for torch._grouped_mm and the reference)."""
    weights = torch.rand(num_experts, generator=gen, device="cuda") + 0.25
    counts = (weights / weights.sum() * total_rows).floor().long()
    counts[: total_rows - int(counts.sum())] += 1
    counts = counts.cpu()
    padded = (counts + block_m - 1) // block_m * block_m
    m_pad = int(padded.sum())
    a = torch.randn(total_rows, k, device="cuda", dtype=torch.bfloat16, generator=gen)
    w = torch.randn(num_experts, n, k, device="cuda", dtype=torch.bfloat16, generator=gen) / k ** 0.5
    a_pad = torch.zeros(m_pad, k, device="cuda", dtype=torch.bfloat16)
    rows_real, rows_pad, ids = [], [], []
    r = p = 0
    for e in range(num_experts):
        c, pc = int(counts[e]), int(padded[e])
        rows_real.append((r, r + c))
        rows_pad.append((p, p + c))
        ids += [e] * (pc // block_m)
        r += c
        p += pc
    # one gather, not E copies
    index = torch.cat([torch.arange(s, s + (re - rs), device="cuda")
                       for (rs, re), (s, _) in zip(rows_real, rows_pad)])
    a_pad[index] = a
    expert_ids = torch.tensor(ids, dtype=torch.int32, device="cuda")
    num_blocks = torch.tensor([len(ids)], dtype=torch.int32, device="cuda")
    offs = torch.cumsum(counts, 0).to(torch.int32).cuda()
    return types.SimpleNamespace(a=a, w=w, a_pad=a_pad, index=index, expert_ids=expert_ids,
                                 num_blocks=num_blocks, offs=offs, rows_real=rows_real, m_pad=m_pad)


def run_grouped(args, rec: Recorder):
    block_m = 128
    num_experts = 32 if args.quick else args.experts
    total = 8192 if args.quick else args.grouped_rows
    wanted = [v for v in GROUPED_VARIANTS if not args.variants or v in args.variants]
    for n, k in GROUPED_SHAPES[:1] if args.quick else GROUPED_SHAPES:
        gen = torch.Generator(device="cuda").manual_seed(1)
        g = make_grouped(num_experts, total, n, k, block_m, gen)
        print(f"\n== grouped E={num_experts} rows={total} "
              f"(padded to {g.m_pad}, {g.expert_ids.numel()} blocks) "
              f"N={n} K={k}", flush=True)
        ref = torch.empty(total, n, device="cuda", dtype=torch.float32)
        torch_out = torch.empty(total, n, device="cuda", dtype=torch.bfloat16)
        for e, (r0, r1) in enumerate(g.rows_real):
            ref[r0:r1] = g.a[r0:r1].float() @ g.w[e].float().T
            torch_out[r0:r1] = g.a[r0:r1] @ g.w[e].T
        torch_err = max_err(torch_out, ref)
        tol = 2 * torch_err
        print(f"  per-expert torch bf16 error {torch_err:.3e} (tolerance {tol:.3e})")
        calls, outs, errs, real = {}, {}, {}, {}
        dense_b = g.w[0]
        for name in wanted:
            if GLUON_ERROR and name.startswith("gluon"):
                print(f"  [{name}] skipped: no Gluon")
                continue
            if name in GROUPED_TILES:
                out = torch.empty(g.m_pad, n, device="cuda", dtype=torch.bfloat16)
                call = lambda g=g, out=out, t=GROUPED_TILES[name]: gluon_ws_matmul(  # noqa: E731
                    g.a_pad, g.w, out, expert_ids=g.expert_ids, num_blocks=g.num_blocks, **t)
                pick = lambda out, g=g: out[g.index]                                              # noqa
            elif name == "torch_grouped_mm":
                if not hasattr(torch, "_grouped_mm"):
                    print(f"  [{name}] skipped: this torch has no torch._grouped_mm")
                    continue
                out = torch.empty(total, n, device="cuda", dtype=torch.bfloat16)
                wt = g.w.transpose(1, 2)                                # (E, K, N) view
                call = lambda g=g, out=out, wt=wt: out.copy_(torch._grouped_mm(g.a, wt, offs=g.offs))  # noqa
                # the copy is timed too: it is ~1% of the product; `out=` is not part of _grouped_mm's API
                pick = lambda out: out                                                            # noqa
            elif name == "gluon_ws_dense":
                out = torch.empty(g.m_pad, n, device="cuda", dtype=torch.bfloat16)
                call = lambda g=g, out=out: gluon_ws_matmul(g.a_pad, dense_b, out)                 # noqa
                pick = None
            else:   # torch_dense
                out = torch.empty(g.m_pad, n, device="cuda", dtype=torch.bfloat16)
                call = lambda g=g, out=out: torch.matmul(g.a_pad, dense_b.T, out=out)             # noqa
                pick = None
            err = first_run(name, call, out)
            if err is not None:
                print(f"    {err}")
                rec.add(kind="grouped", variant=name, N=n, K=k, E=num_experts, rows=total, error=err)
                continue
            calls[name], outs[name] = call, out
            real[name] = pick is not None
            if pick is not None:
                errs[name] = max_err(pick(out), ref)
        ms = bench_round_robin(calls, args.rounds, args.warmup) if calls else {}
        ref_t = ms.get("torch_grouped_mm") or ms.get("torch_dense")
        ref_name = "torch_grouped_mm" if "torch_grouped_mm" in ms else "torch_dense"
        print(f"  {'variant':<18}{'rows':>7}{'max err':>11}{'ok':>5}{'ms':>10}{'TFLOP/s':>10}"
              f"{'% ' + ref_name:>22}")
        for name, t in ms.items():
            rows = total if real[name] else g.m_pad
            tflops = 2.0 * rows * n * k / t / 1e9
            pct = 100.0 * ref_t / t if ref_t else None
            e = errs.get(name)
            ok = None if e is None else e <= tol
            print(f"  {name:<18}{rows:>7}{f'{e:.3e}' if e is not None else '-':>11}"
                  f"{'-' if ok is None else ('yes' if ok else 'NO'):>5}{t:>10.4f}{tflops:>10.1f}"
                  f"{pct if pct else float('nan'):>21.1f}%")
            rec.add(kind="grouped", variant=name, N=n, K=k, E=num_experts, rows=rows, m_pad=g.m_pad,
                    max_err=e, torch_err=torch_err, ok=ok, ms=t, tflops=tflops, pct_ref=pct, ref=ref_name)
        print("  (TFLOP/s of the grouped variants count real rows only; the dense ones all padded rows "
              "with expert 0's weight)")
        del g, ref, torch_out, calls, outs
        torch.cuda.empty_cache()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="See the module docstring for what is measured and how.")
    parser.add_argument("--out", help="append results as JSON lines to this file (truncated first)")
    parser.add_argument("--quick", action="store_true",
                        help="one dense shape, a small grouped case, fewer rounds")
    parser.add_argument("--aot", action="store_true",
                        help="no GPU: compile every variant for sm_90 and report")
    parser.add_argument("--dump", help="with --aot: write each variant's TTGIR, PTX and SASS here")
    parser.add_argument("--verbose", action="store_true", help="with --aot: print the descriptor signatures")
    parser.add_argument("--variants", type=lambda s: [v for v in s.split(",") if v],
                        help="comma-separated subset (torch always runs in the dense part, for the "
                             "tolerance); "
                             "names: "
                             + ", ".join(list(DENSE_VARIANTS) + list(GROUPED_VARIANTS)))
    parser.add_argument("--no-grouped", action="store_true", help="skip stage 2 (gluon_grouped)")
    parser.add_argument("--no-dense", action="store_true", help="skip the dense shapes")
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds (default 50, --quick 10)")
    parser.add_argument("--warmup", type=int, default=None, help="warm-up rounds (default 5, --quick 2)")
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--grouped-rows", type=int, default=32768)
    args = parser.parse_args(argv)
    if args.rounds is None:
        args.rounds = 10 if args.quick else 50
    if args.warmup is None:
        args.warmup = 2 if args.quick else 5

    if args.aot:
        return run_aot(args)
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to run (use --aot for the compile check)")
        return 1
    print_device(GLUON_ERROR)
    torch.backends.cuda.matmul.allow_tf32 = False          # the fp32 reference must be fp32
    rec = Recorder(args.out)
    started = time.perf_counter()
    torch_ran = True
    if not args.no_dense:
        torch_ran = run_dense(args, rec)
    if not args.no_grouped:
        try:
            run_grouped(args, rec)
        except Exception as exc:
            print(f"grouped stage failed: {_error_head(exc)}")
    print(f"\ntotal {time.perf_counter() - started:.0f} s" + (f"; results in {args.out}" if args.out else ""))
    return 0 if torch_ran else 1


if __name__ == "__main__":
    sys.exit(main())
