"""Grouped weight gradient for Hopper (sm_90) in Gluon: persistent, warp-specialized, TMA and wgmma.

Legend as in `moekit.grouped_gemm.backward_kernels`: E experts, L sorted rows (num_padded of them in
use), r a sorted row. Per expert e, its rows_e = [row_starts[e], row_starts[e + 1]) (a whole number
of the align block size, a multiple of BK):

    C[e] (N, C) = A[rows_e]^T @ B[rows_e]       A (L, N), B (L, C) sorted rows, 16-bit; fp32 acc

Both operands are read in sorted-row order, with zeros on every padding row of one of them and finite
values on the other's. By TMA, from operands already in that order (the launcher,
`moekit.grouped_gemm.backward.wgrad`, copies the one gathered by token there with
`moe_gather_rows_kernel`), so no index is read; or, GATHER_A, A straight from its token rows: the
producer reads each step's sorted ids and copies the rows by cp.async (`token_rows`, `gather_rows`),
padding rows zero-filled:

    d gate_up_e = dpre_w[rows_e]^T @ x_sorted[rows_e]        d down_e = dout[rows_e]^T @ h_w[rows_e]

The reduction runs over rows, so both wgmma operands are MN-major: a TMA tile of A is [BK rows, A_W]
(N contiguous) and wgmma reads its permuted view [A_W, BK]; a tile of B is [BK, BC] as it lies.

Schedule. One program an SM; work items t = (expert, N tile, C tile), expert slowest (the programs in
flight share an expert's rows in L2), program p taking items p, p + P, p + 2P, ... Three partitions:

    producer   1 warp (GATHER_WARPS with GATHER_A): walks the program's items and each item's BK-row
               steps, filling a ring of STAGES shared-memory stages (A tile(s) and B tile a stage).
               The ring runs across item boundaries: it never drains between experts (with a few row steps an
               item, a pipeline filled per item would cost as much as the item's GEMM).
    consumers  2 warpgroups issuing async wgmma (at most one in flight), releasing each stage once
               the wgmma that read it retired, then the epilogue: the fp32 accumulator rounded to the
               output dtype, stored to shared memory and written by a TMA store that overlaps the
               next item (a warpgroup waits for its previous store only before reusing its buffer).

    PINGPONG False ("cooperative"): both warpgroups work on every item, each on ACC_N = BLOCK_N / 2
        of its N rows (A arrives as two [BK, ACC_N] sub-tiles); each stage is released by both.
    PINGPONG True: the warpgroups take alternate items (the program's j-th item goes to warpgroup
        j % 2), each a whole BLOCK_N x BLOCK_C tile, so one's epilogue runs under the other's main
        loop. Both follow the one ring in order, each skipping the other's stage uses.

Barriers (mbarriers in shared memory; a wait on phase parity q returns once the barrier completed a
phase of that parity, and a fresh barrier counts as having completed the phase before phase 0):

    ready[s]  count 1: the producer's expect(bytes) arms it, the TMA loads complete it; with GATHER_A
              also one arrival from each producer thread once its cp.async copies land
              (cp.async.mbarrier.arrive.noinc), and the consumers fence the generic proxy's writes
              before wgmma reads them. The u-th use of stage s (u = use // STAGES) is waited on with
              parity u & 1.
    empty[s]  count 1 (pp) or 2 (coop, one arrive a warpgroup): the consumer(s) release stage s. The
              producer's u-th fill waits with parity (u & 1) ^ 1, so the first pass finds it free.
    order[w]  pp only, count 1: warpgroup 1 - w arrives when it finished its item's main loop (all its
              stage uses waited on); w waits on it before its next item. Without it one warpgroup could
              run a whole ring pass ahead and wait on a ready barrier of a later pass, whose parity is
              the same as the pass it means: the phase cannot tell them apart.

An expert with no rows has items with no steps: the consumers store the zero accumulator, so its
gradient is exactly 0. Results are deterministic: each output tile is one program's sum in row order.

Triton 3.6 names the TMA copies async_copy_global_to_shared / async_copy_shared_to_global, later
versions async_load / async_store: `tma_load` and `tma_store` are whichever exists (`cp_async`
likewise for the pointer copies); likewise
`thread_barrier` (the CTA barrier: gl.thread_barrier in 3.6, gl.barrier in 3.9). Without Gluon (an
older Triton, or a build without it) GLUON_AVAILABLE is False and the kernel names are None; moekit's
core imports everywhere.
"""

from __future__ import annotations

import types

import moekit.kernels  # noqa: F401  (first: the interpreter switch, before triton is imported)

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonTensorDescriptor

    tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared      # 3.6 names
    tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global
    thread_barrier = getattr(gl, "thread_barrier", None) or gl.barrier                   # 3.9: barrier
    cp_async = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared  # 3.6 name
    cp_async_arrive = async_copy.mbarrier_arrive
    GLUON_AVAILABLE = True
    GLUON_ERROR: str | None = None
except (ImportError, AttributeError) as exc:   # the kernels below are defined on stubs, then dropped
    GLUON_AVAILABLE = False
    GLUON_ERROR = f"{type(exc).__name__}: {exc}"
    gluon = types.SimpleNamespace(jit=lambda fn=None, **_: fn, constexpr_function=lambda fn: fn)
    gl = None
    fence_async_shared = mbarrier = tma = tma_load = tma_store = warpgroup_mma = warpgroup_mma_wait = None
    thread_barrier = cp_async = cp_async_arrive = None
    GluonTensorDescriptor = None

# setmaxnreg: the launch caps every thread at MAX_REGS (2 consumer warpgroups and the producer's padded
# warpgroup at 168 fill the 64K registers), then the producer gives registers up to the consumers.
MAX_REGS = 168
PRODUCER_REGS = 40
CONSUMER_REGS = 232
# The warps of a producer that gathers rows by cp.async (`gather_rows`): one warpgroup.
GATHER_WARPS = gl.constexpr(4) if GLUON_AVAILABLE else 4
# A producer that gathers rows (GATHER_WARPS issuing cp.async) needs more: the consumers give up 8 each.
GATHER_PRODUCER_REGS = 56
GATHER_CONSUMER_REGS = 224


@gluon.constexpr_function
def _acc_layout(ACC_N, BLOCK_C):
    # A warpgroup's wgmma accumulator: 4 warps stacked along N (16 rows each an instruction), the
    # widest instruction n = BLOCK_C (<= 256).
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_C, 16])


@gluon.jit
def _item(t, tiles_per_expert, c_tiles, row_starts_ptr, BLOCK_N: gl.constexpr, BLOCK_C: gl.constexpr):
    """Work item t -> (expert, first N row, first C column, the expert's first and end row)."""
    e = t // tiles_per_expert
    rem = t % tiles_per_expert
    off_n = (rem // c_tiles) * BLOCK_N
    off_c = (rem % c_tiles) * BLOCK_C
    start = gl.load(row_starts_ptr + e)
    end = gl.load(row_starts_ptr + e + 1)
    return e, off_n, off_c, start, end


@gluon.constexpr_function
def _gather_layout(W, VEC=8):
    # A gathered [BK, W] tile over the producer's GATHER_WARPS: 16 bytes (VEC elements) a copy, a
    # row's W / VEC copies in adjacent lanes, the warps stacked along the rows.
    return gl.BlockedLayout(size_per_thread=[1, VEC], threads_per_warp=[32 // (W // VEC), W // VEC],
                            warps_per_cta=[GATHER_WARPS, 1], order=[1, 0])


@gluon.jit
def token_rows(sorted_ids_ptr, num_pairs, r, end, BK: gl.constexpr, W: gl.constexpr, TOP_K: gl.constexpr,
               VEC: gl.constexpr = 8):
    """The token rows of sorted rows [r, r + BK), in `gather_rows`'s layout for a [BK, W] tile:
    (sorted_ids // TOP_K (0 on a padding row), whether the row holds a pair (id < num_pairs)); rows
    at or past `end` are not read and count as padding."""
    rows = r + gl.arange(0, BK, gl.SliceLayout(1, _gather_layout(W, VEC)))
    ids = gl.load(sorted_ids_ptr + rows, mask=rows < end, other=num_pairs)
    placed = ids < num_pairs
    return gl.where(placed, ids // TOP_K, 0), placed


@gluon.jit
def gather_rows(src_ptr, src_stride, tok, placed, col, dst):
    """cp.async of a [BK, W] tile into dst: row i from src (T, *) row tok[i], columns [col, col + W);
    zeros where placed[i] is False (`token_rows` gives both). The producer's GATHER_WARPS each issue
    their share; each thread then arrives on the stage's barrier once its own copies land."""
    W: gl.constexpr = dst.type.shape[1]
    VEC: gl.constexpr = 128 // dst.dtype.primitive_bitwidth          # 16 bytes a copy
    cols = col + gl.arange(0, W, gl.SliceLayout(0, _gather_layout(W, VEC)))
    cp_async(dst, src_ptr + tok.to(gl.int64)[:, None] * src_stride + cols[None, :], mask=placed[:, None])


@gluon.jit
def _wgrad_producer(a_desc, b_desc, a_bufs, b_bufs, ready_bars, empty_bars, row_starts_ptr, num_items,
                    tiles_per_expert, c_tiles, g_ptr, g_stride, sorted_ids_ptr, num_pairs,
                    BLOCK_N: gl.constexpr, GATHER_A: gl.constexpr, TOP_K: gl.constexpr):
    """For every item of this program and every BK-row step of its expert, the A tile(s) [BK, A_W]
    (A_PARTS of them side by side along N) and the B tile [BK, BC] into the next stage: by TMA (1
    warp), or with GATHER_A the A tiles copied from A's token rows by cp.async (GATHER_WARPS; B by
    TMA)."""
    STAGES: gl.constexpr = b_bufs.type.shape[0]
    BK: gl.constexpr = b_bufs.type.shape[1]
    BLOCK_C: gl.constexpr = b_bufs.type.shape[2]
    A_W: gl.constexpr = a_bufs.type.shape[2]
    A_PARTS: gl.constexpr = a_bufs.type.shape[0] // STAGES
    ITEM: gl.constexpr = b_bufs.dtype.primitive_bitwidth // 8
    TMA_BYTES: gl.constexpr = (0 if GATHER_A else A_PARTS * BK * A_W * ITEM) + BK * BLOCK_C * ITEM
    it = 0                          # stage uses so far, across this program's items
    for t in range(gl.program_id(0), num_items, gl.num_programs(0)):
        e, off_n, off_c, start, end = _item(t, tiles_per_expert, c_tiles, row_starts_ptr, BLOCK_N, BLOCK_C)
        for r in range(start, end, BK):
            if GATHER_A:
                tok, placed = token_rows(sorted_ids_ptr, num_pairs, r, end, BK, A_W, TOP_K)
            s = it % STAGES
            mbarrier.wait(empty_bars.index(s), ((it // STAGES) & 1) ^ 1)   # pass 0: free at once
            ready = ready_bars.index(s)
            mbarrier.expect(ready, TMA_BYTES)
            for i in gl.static_range(A_PARTS):
                if GATHER_A:
                    gather_rows(g_ptr, g_stride, tok, placed, off_n + i * A_W, a_bufs.index(s * A_PARTS + i))
                else:
                    tma_load(a_desc, [r, off_n + i * A_W], ready, a_bufs.index(s * A_PARTS + i))
            tma_load(b_desc, [r, off_c], ready, b_bufs.index(s))
            if GATHER_A:
                cp_async_arrive(ready, increment_count=False)    # once this thread's copies landed
            it += 1


@gluon.jit
def _wgrad_consumer(a_bufs, b_bufs, ready_bars, empty_bars, order_bars, c_desc, c_smem, row_starts_ptr,
                    num_items, tiles_per_expert, c_tiles, N, CONSUMER: gl.constexpr, PINGPONG: gl.constexpr,
                    A_PART: gl.constexpr, ROW_OFF: gl.constexpr, BLOCK_N: gl.constexpr,
                    GATHER_A: gl.constexpr):
    """One warpgroup. Cooperative (PINGPONG False): every item, its accumulator the N rows [ROW_OFF,
    ROW_OFF + ACC_N) of the tile, from A sub-tile A_PART. Ping-pong: the items j (counting this
    program's) with j % 2 == CONSUMER, the whole tile."""
    ACC_N: gl.constexpr = c_desc.block_type.shape[0]
    BLOCK_C: gl.constexpr = c_desc.block_type.shape[1]
    STAGES: gl.constexpr = b_bufs.type.shape[0]
    BK: gl.constexpr = b_bufs.type.shape[1]
    A_PARTS: gl.constexpr = a_bufs.type.shape[0] // STAGES
    SPLIT: gl.constexpr = 2 if PINGPONG else 1
    MINE: gl.constexpr = CONSUMER if PINGPONG else 0
    layout: gl.constexpr = _acc_layout(ACC_N, BLOCK_C)
    c_buf = c_smem.index(CONSUMER)

    it = 0                          # stage uses so far (both warpgroups' items)
    j = 0                           # items so far
    waits = 0                       # ping-pong: order-barrier waits so far
    for t in range(gl.program_id(0), num_items, gl.num_programs(0)):
        e, off_n, off_c, start, end = _item(t, tiles_per_expert, c_tiles, row_starts_ptr, BLOCK_N, BLOCK_C)
        steps = (end - start) // BK
        if j % SPLIT == MINE:
            if PINGPONG:
                # The other warpgroup finished the previous item's main loop: every stage use before
                # this item's has been waited on, so no ready wait below can match an earlier pass.
                mbarrier.wait(order_bars.index(CONSUMER), waits & 1, pred=j > 0)
                waits += (j > 0).to(gl.int32)
            acc = gl.zeros((ACC_N, BLOCK_C), gl.float32, layout)           # [ACC_N, BC]
            for ki in range(steps):
                k = it + ki
                s = k % STAGES
                mbarrier.wait(ready_bars.index(s), (k // STAGES) & 1)
                if GATHER_A:
                    fence_async_shared()    # cp.async wrote through the generic proxy; wgmma reads async
                a = a_bufs.index(s * A_PARTS + A_PART).permute((1, 0))    # [A_W, BK], MN-major
                acc = warpgroup_mma(a, b_bufs.index(s), acc, is_async=True)
                # <= 1 in flight: the previous step's wgmma retired, so its stage is free.
                acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
                mbarrier.arrive(empty_bars.index((k + STAGES - 1) % STAGES), pred=ki > 0)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            mbarrier.arrive(empty_bars.index((it + steps + STAGES - 1) % STAGES), pred=steps > 0)
            if PINGPONG:
                mbarrier.arrive(order_bars.index(1 - CONSUMER))              # the other may go on
            # Epilogue: this warpgroup's previous TMA store from c_buf had a whole item to finish; the
            # fence orders the shared stores before the async proxy reads them.
            c = acc.to(c_desc.dtype)
            tma.store_wait(pendings=0)
            c_buf.store(c)
            fence_async_shared()
            tma_store(c_desc, [e * N + off_n + ROW_OFF, off_c], c_buf)
        it += steps
        j += 1
    tma.store_wait(pendings=0)


@gluon.jit
def gluon_wgrad_kernel(a_desc, b_desc, c_desc, row_starts_ptr, num_items, tiles_per_expert, c_tiles, N,
                       g_ptr, g_stride, sorted_ids_ptr, num_pairs, A_LAYOUT: gl.constexpr,
                       B_LAYOUT: gl.constexpr, A_W: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr,
                       PINGPONG: gl.constexpr, PRODUCER_REGS: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                       GATHER_A: gl.constexpr, TOP_K: gl.constexpr):
    """C (E * N, C) viewed as E gradients, C[e] = A[rows_e]^T @ B[rows_e] (see the module docstring).

    a_desc: A (L, N) in boxes [BK, A_W] (A_W = ACC_N); b_desc: B (L, C) in boxes [BK, BLOCK_C];
    c_desc: C in boxes [ACC_N, BLOCK_C]; A_LAYOUT, B_LAYOUT their shared-memory layouts. row_starts
    (E + 1,) int32, each a multiple of BK. Items: num_items = E * tiles_per_expert, tiles_per_expert
    = (N / BLOCK_N) * c_tiles; BLOCK_N and BLOCK_C divide N and C (a tile never crosses experts in
    the (E * N, C) view). GATHER_A: A is read from its token rows instead, g_ptr (T, *) with row
    stride g_stride (its columns from the tile's N offset), sorted row r holding row
    sorted_ids[r] // TOP_K and zeros where sorted_ids[r] >= num_pairs; a_desc is not read.
    """
    dtype: gl.constexpr = c_desc.dtype
    ACC_N: gl.constexpr = c_desc.block_type.shape[0]
    BLOCK_C: gl.constexpr = c_desc.block_type.shape[1]
    # cooperative: two A sub-tiles of ACC_N (= A_W) rows, one a warpgroup; ping-pong: one, the item's.
    A_PARTS: gl.constexpr = 1 if PINGPONG else 2
    BLOCK_N: gl.constexpr = ACC_N if PINGPONG else 2 * ACC_N
    # The ready barrier's arrivals: the producer's expect, and with a gathered operand each of the
    # producer's 128 threads once its copies land (cp.async.mbarrier.arrive.noinc).
    READY_COUNT: gl.constexpr = 1 + GATHER_WARPS * 32 if GATHER_A else 1
    PRODUCER_WARPS: gl.constexpr = GATHER_WARPS if GATHER_A else 1

    a_bufs = gl.allocate_shared_memory(dtype, [STAGES * A_PARTS, BK, A_W], A_LAYOUT)
    b_bufs = gl.allocate_shared_memory(dtype, [STAGES, BK, BLOCK_C], B_LAYOUT)
    c_smem = gl.allocate_shared_memory(dtype, [2, ACC_N, BLOCK_C], c_desc.layout)   # one a warpgroup
    ready_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    order_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready_bars.index(i), count=READY_COUNT)
        mbarrier.init(empty_bars.index(i), count=1 if PINGPONG else 2)     # the stage's consumer(s)
    for i in gl.static_range(2):
        mbarrier.init(order_bars.index(i), count=1)
    fence_async_shared()
    C0: gl.constexpr = 0
    C1: gl.constexpr = 1
    R0: gl.constexpr = 0
    R1: gl.constexpr = 0 if PINGPONG else ACC_N
    P1: gl.constexpr = 0 if PINGPONG else 1
    # The default partition (4 warps) is consumer 0; the workers consumer 1 (4 warps) and the producer.
    gl.warp_specialize([
        (_wgrad_consumer, (a_bufs, b_bufs, ready_bars, empty_bars, order_bars, c_desc, c_smem,
                           row_starts_ptr, num_items, tiles_per_expert, c_tiles, N, C0, PINGPONG, C0, R0,
                           BLOCK_N, GATHER_A)),
        (_wgrad_consumer, (a_bufs, b_bufs, ready_bars, empty_bars, order_bars, c_desc, c_smem,
                           row_starts_ptr, num_items, tiles_per_expert, c_tiles, N, C1, PINGPONG, P1, R1,
                           BLOCK_N, GATHER_A)),
        (_wgrad_producer, (a_desc, b_desc, a_bufs, b_bufs, ready_bars, empty_bars, row_starts_ptr,
                           num_items, tiles_per_expert, c_tiles, g_ptr, g_stride, sorted_ids_ptr, num_pairs,
                           BLOCK_N, GATHER_A, TOP_K)),
    ], [4, PRODUCER_WARPS], [CONSUMER_REGS, PRODUCER_REGS])


if not GLUON_AVAILABLE:
    gluon_wgrad_kernel = None
