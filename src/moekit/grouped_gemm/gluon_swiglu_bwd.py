"""Fused SwiGLU backward for Hopper (sm_90) in Gluon: persistent, warp-specialized, cp.async + TMA and
wgmma.

Legend as in `moekit.grouped_gemm.backward_kernels`: S pairs, L sorted rows (num_padded of them in
use), r a sorted row of expert e, t its token, w_p its pair's routing weight. Per row, in fp32:

    g = dout[t] @ down_e                 (down_proj (E, H, I): down_e is (H, I), g is (I,))
    a, b = pre[r] = [gate | up]          (L, 2I), the forward's pre-activations
    sig = sigmoid(a), silu = a sig, h = silu b
    dpre_w[r] = w_p [g b sig (1 + a (1 - sig)), g silu]      (L, 2I), the activations' dtype
    h_w[r]    = w_p h                                        (L, I)
    part[r, n_tile] = sum over the tile's BN columns of g h  (L, I / BN) fp32 -> d topk_weights
    padding rows (pair >= S): dpre_w and h_w rows 0, part 0.

dout stays by token: the producer reads each item's sorted ids once and copies the rows' [64, BK]
pieces by cp.async (`moekit.grouped_gemm.gluon_wgrad.token_rows`, `gather_rows`), padding rows
zero-filled, each producer thread arriving on the stage's ready barrier once its copies land; the
consumers fence the generic proxy's writes before wgmma reads them:

    A = dout's rows [t of each sorted row] in [64, BK] tiles (K-major, as wgmma's A wants it)
    B = down_proj viewed as (E * H, I) in [BK, BN] boxes at row e * H + k (N contiguous: an
        MN-major B, which wgmma reads for 16-bit types)

Schedule. One program an SM; work items (64-row sub-block, I tile), I tiles fastest (the programs in
flight share the sub-block's dout rows and the expert's down columns in L2), program p taking items
p, p + P, ...; a 64-row sub-block lies in one align block (block_m a multiple of 64), so in one
expert: expert_ids[row0 // ALIGN_M]. Items stop at num_padded, read on the device. Partitions:

    producer   GATHER_WARPS: per item, H / BK steps into a ring of STAGES shared-memory stages (ready /
               empty mbarriers, running across items), and at step PRE_STEP of the item the a and b
               tiles [64, BN] of pre into the item's consumer's epilogue slots (pre_ready /
               pre_empty, one pair a consumer): they land while the main loop runs.
    consumers  2 warpgroups, ping-pong: they take alternate items, each a whole [64, BN] tile (one
               wgmma accumulator), so one's epilogue runs under the other's main loop; an order
               barrier pair makes each start an item's main loop only after the other finished its
               previous one (without it one warpgroup could run a ring pass ahead and wait on a ready
               barrier of a later pass of the same parity). Epilogue: a, b from the slots into the
               accumulator's layout (padding rows' masked to 0: whatever pre holds there never
               reaches a result), fp32 math, part by a row sum (pointer store), d_gate, d_up and
               h_w written back into the slots (a, b, a third slot) and TMA-stored; the slots go back
               to the producer once the stores have read them.

STORE_DPRE, STORE_H, STORE_PART leave out the outputs nobody needs (their stores compiled out).
Deterministic: every output element is one program's, in a fixed order; no atomics. Without Gluon
(`moekit.grouped_gemm.gluon_wgrad.GLUON_AVAILABLE` False) the kernel name is None.
"""

from __future__ import annotations

from moekit.grouped_gemm.gluon_wgrad import (
    GATHER_WARPS,
    GLUON_AVAILABLE,
    cp_async_arrive,
    fence_async_shared,
    gather_rows,
    gl,
    gluon,
    mbarrier,
    thread_barrier,
    tma,
    tma_load,
    tma_store,
    token_rows,
    warpgroup_mma,
    warpgroup_mma_wait,
)

SUB_M = 64            # rows of a work item: one warpgroup's wgmma m64
BLOCK_K = 64          # H a ring step
PRE_STEP = 4          # the item's ring step at which the producer fetches its a, b tiles (H / BK > it)


@gluon.constexpr_function
def _acc_layout(BLOCK_N):
    # wgmma accumulator of one warpgroup: m64 x BLOCK_N (one instruction wide), 4 warps along M.
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16])


@gluon.jit
def _num_items(num_padded_ptr, n_tiles, BM: gl.constexpr):
    return (gl.load(num_padded_ptr) // BM) * n_tiles


@gluon.jit
def _swiglu_producer(b_desc, pre_desc, a_bufs, b_bufs, epi_bufs, ready_bars, empty_bars, pre_ready,
                     pre_empty, expert_ids_ptr, num_padded_ptr, H, inter, n_tiles, dout_ptr, dout_stride,
                     sorted_ids_ptr, S, ALIGN_M: gl.constexpr, PRE_STEP_: gl.constexpr, TOP_K: gl.constexpr):
    """GATHER_WARPS: for every item of this program, its H / BK steps (dout's rows [64, BK], gathered from
    its token rows by cp.async; down [BK, BN] by TMA) into the ring, and at step PRE_STEP_ the item's
    a, b tiles into its consumer's epilogue slots (TMA)."""
    STAGES: gl.constexpr = b_bufs.type.shape[0]
    BM: gl.constexpr = a_bufs.type.shape[1]
    BK: gl.constexpr = a_bufs.type.shape[2]
    BLOCK_N: gl.constexpr = b_bufs.type.shape[2]
    SLOTS: gl.constexpr = epi_bufs.type.shape[0] // 2
    NBYTES: gl.constexpr = b_desc.block_type.nbytes       # the TMA bytes a stage (dout's rows: cp.async)
    PRE_BYTES: gl.constexpr = 2 * pre_desc.block_type.nbytes
    num_items = _num_items(num_padded_ptr, n_tiles, BM)
    k_steps = H // BK
    it = 0                          # stage uses so far, across this program's items
    j = 0                           # items so far
    for t in range(gl.program_id(0), num_items, gl.num_programs(0)):
        row0 = (t // n_tiles) * BM
        n0 = (t % n_tiles) * BLOCK_N
        e = gl.load(expert_ids_ptr + row0 // ALIGN_M)
        b_row = e * H
        c = j % 2                   # the item's consumer
        u = j // 2                  # that consumer's items before this one
        tok, placed = token_rows(sorted_ids_ptr, S, row0, row0 + BM, BM, BK, TOP_K)     # the item's rows
        for ki in range(k_steps):
            s = it % STAGES
            # pass it // STAGES over the ring: the first finds the stages empty (parity 1 of a fresh
            # barrier returns at once), later ones wait for the release
            mbarrier.wait(empty_bars.index(s), ((it // STAGES) & 1) ^ 1)
            ready = ready_bars.index(s)
            mbarrier.expect(ready, NBYTES)
            gather_rows(dout_ptr, dout_stride, tok, placed, ki * BK, a_bufs.index(s))
            tma_load(b_desc, [b_row + ki * BK, n0], ready, b_bufs.index(s))
            cp_async_arrive(ready, increment_count=False)      # once this thread's copies landed
            it += 1
            if ki == PRE_STEP_:
                # the consumer released its slots (its previous item's epilogue is done)
                mbarrier.wait(pre_empty.index(c), (u & 1) ^ 1)
                pr = pre_ready.index(c)
                mbarrier.expect(pr, PRE_BYTES)
                tma_load(pre_desc, [row0, n0], pr, epi_bufs.index(c * SLOTS))
                tma_load(pre_desc, [row0, inter + n0], pr, epi_bufs.index(c * SLOTS + 1))
        j += 1


@gluon.jit
def _swiglu_epilogue(acc, a_s, b_s, h_s, dpre_desc, h_desc, part_ptr, w_ptr, sorted_ids_ptr, pre_empty_bar,
                     row0, n0, tile, S, inter, n_tiles, STORE_DPRE: gl.constexpr, STORE_H: gl.constexpr,
                     STORE_PART: gl.constexpr):
    BM: gl.constexpr = acc.type.shape[0]
    layout: gl.constexpr = acc.type.layout
    dtype: gl.constexpr = a_s.dtype
    a = a_s.load(layout).to(gl.float32)
    b = b_s.load(layout).to(gl.float32)
    rows = row0 + gl.arange(0, BM, layout=gl.SliceLayout(1, layout))
    pair = gl.load(sorted_ids_ptr + rows)
    valid = pair < S
    wt = gl.load(w_ptr + pair, mask=valid, other=0.0).to(gl.float32)[:, None]     # [BM, 1]; 0 on padding
    # padding rows: dout_sorted is 0 there (g = 0) and so is wt; a, b masked to 0 so that whatever
    # pre holds there (never written: NaN, inf) gives exact zeros
    a = gl.where(valid[:, None], a, 0.0)
    b = gl.where(valid[:, None], b, 0.0)
    sig = gl.fdiv(gl.full_like(a, 1.0), 1.0 + gl.exp(-a))
    silu = a * sig
    h = silu * b
    if STORE_PART:
        part = gl.sum(acc * h, axis=1)                                 # unscaled <g, h> over the tile
        gl.store(part_ptr + rows.to(gl.int64) * n_tiles + tile, part)
    # each thread overwrites the slot elements it read (same layout): a -> d_gate, b -> d_up, h_w
    if STORE_H:
        h_s.store((h * wt).to(dtype))
    if STORE_DPRE:
        gw = acc * wt
        b_s.store((gw * silu).to(dtype))
        a_s.store((gw * b * sig * (1.0 + a * (1.0 - sig))).to(dtype))
    fence_async_shared()
    if STORE_DPRE:
        tma_store(dpre_desc, [row0, n0], a_s)
        tma_store(dpre_desc, [row0, inter + n0], b_s)
    if STORE_H:
        tma_store(h_desc, [row0, n0], h_s)
    # the stores must have read the slots before the producer refills them (under the other
    # warpgroup's main loop)
    tma.store_wait(pendings=0)
    thread_barrier()
    mbarrier.arrive(pre_empty_bar)


@gluon.jit
def _swiglu_consumer(a_bufs, b_bufs, epi_bufs, ready_bars, empty_bars, order_bars, pre_ready, pre_empty,
                     dpre_desc, h_desc, part_ptr, w_ptr, sorted_ids_ptr, num_padded_ptr, S, H, inter, n_tiles,
                     CONSUMER: gl.constexpr, STORE_DPRE: gl.constexpr, STORE_H: gl.constexpr,
                     STORE_PART: gl.constexpr):
    """One warpgroup: the items j (this program's) with j % 2 == CONSUMER, a whole [64, BN] tile each."""
    BM: gl.constexpr = a_bufs.type.shape[1]
    BLOCK_N: gl.constexpr = b_bufs.type.shape[2]
    STAGES: gl.constexpr = b_bufs.type.shape[0]
    BK: gl.constexpr = a_bufs.type.shape[2]
    SLOTS: gl.constexpr = epi_bufs.type.shape[0] // 2
    layout: gl.constexpr = _acc_layout(BLOCK_N)
    a_s = epi_bufs.index(CONSUMER * SLOTS)
    b_s = epi_bufs.index(CONSUMER * SLOTS + 1)
    h_s = epi_bufs.index(CONSUMER * SLOTS + 2)
    num_items = _num_items(num_padded_ptr, n_tiles, BM)
    k_steps = H // BK
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
                fence_async_shared()    # cp.async wrote dout's rows through the generic proxy
                acc = warpgroup_mma(a_bufs.index(s), b_bufs.index(s), acc, is_async=True)
                # <= 1 in flight: the previous step's wgmma retired, release its stage
                acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
                mbarrier.arrive(empty_bars.index((k + STAGES - 1) % STAGES), pred=ki > 0)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            mbarrier.arrive(empty_bars.index((it + k_steps - 1) % STAGES))
            mbarrier.arrive(order_bars.index(1 - CONSUMER))          # the other may start its next item
            tile = t % n_tiles
            mbarrier.wait(pre_ready.index(CONSUMER), u & 1)
            _swiglu_epilogue(acc, a_s, b_s, h_s, dpre_desc, h_desc, part_ptr, w_ptr, sorted_ids_ptr,
                             pre_empty.index(CONSUMER), (t // n_tiles) * BM, tile * BLOCK_N, tile, S, inter,
                             n_tiles, STORE_DPRE, STORE_H, STORE_PART)
            u += 1
        it += k_steps
        j += 1
    tma.store_wait(pendings=0)


@gluon.jit
def gluon_swiglu_bwd_kernel(b_desc, pre_desc, dpre_desc, h_desc, part_ptr, w_ptr, sorted_ids_ptr,
                            expert_ids_ptr, num_padded_ptr, S, H, inter, n_tiles, dout_ptr, dout_stride,
                            A_LAYOUT: gl.constexpr, BK: gl.constexpr, ALIGN_M: gl.constexpr,
                            STAGES: gl.constexpr, PRE_STEP_: gl.constexpr, STORE_DPRE: gl.constexpr,
                            STORE_H: gl.constexpr, STORE_PART: gl.constexpr, PRODUCER_REGS: gl.constexpr,
                            CONSUMER_REGS: gl.constexpr, TOP_K: gl.constexpr):
    """dpre_w, h_w, part of the rows < num_padded (see the module docstring).

    dout (T, H) by token (row stride dout_stride), its rows read at sorted_ids // TOP_K (zeros on the
    padding rows) into [64, BK] tiles of layout A_LAYOUT; b_desc: down_proj as (E * H, I) in boxes
    [BK, BN]; pre_desc, dpre_desc: (L, 2I) and h_desc (L, I) in boxes [64, BN]; part (L, n_tiles)
    fp32 contiguous, n_tiles = I / BN; w (S,) the routing weights; the alignment's int32 sorted_ids,
    expert_ids and num_padded (0-d, on the device); ALIGN_M its block size, a multiple of 64.
    H / BK > PRE_STEP_; BN divides I."""
    dtype: gl.constexpr = b_desc.dtype
    BM: gl.constexpr = pre_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = b_desc.block_type.shape[1]
    a_bufs = gl.allocate_shared_memory(dtype, [STAGES, BM, BK], A_LAYOUT)
    b_bufs = gl.allocate_shared_memory(dtype, [STAGES, BK, BLOCK_N], b_desc.layout)
    # consumer c's slots [3 c, 3 c + 3): a, b (then d_gate, d_up), h_w
    epi_bufs = gl.allocate_shared_memory(dtype, [6, BM, BLOCK_N], pre_desc.layout)
    ready_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    order_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    pre_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    pre_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        # the producer's expect(), and each of its 128 threads once its copies land
        mbarrier.init(ready_bars.index(i), count=1 + GATHER_WARPS * 32)
        mbarrier.init(empty_bars.index(i), count=1)          # the stage's one consumer
    for i in gl.static_range(2):
        mbarrier.init(order_bars.index(i), count=1)
        mbarrier.init(pre_ready.index(i), count=1)
        mbarrier.init(pre_empty.index(i), count=1)
    fence_async_shared()
    C0: gl.constexpr = 0
    C1: gl.constexpr = 1
    # Default partition (4 warps): consumer 0; workers: consumer 1 (4 warps), the producer.
    gl.warp_specialize([
        (_swiglu_consumer, (a_bufs, b_bufs, epi_bufs, ready_bars, empty_bars, order_bars, pre_ready,
                            pre_empty, dpre_desc, h_desc, part_ptr, w_ptr, sorted_ids_ptr, num_padded_ptr, S,
                            H, inter, n_tiles, C0, STORE_DPRE, STORE_H, STORE_PART)),
        (_swiglu_consumer, (a_bufs, b_bufs, epi_bufs, ready_bars, empty_bars, order_bars, pre_ready,
                            pre_empty, dpre_desc, h_desc, part_ptr, w_ptr, sorted_ids_ptr, num_padded_ptr, S,
                            H, inter, n_tiles, C1, STORE_DPRE, STORE_H, STORE_PART)),
        (_swiglu_producer, (b_desc, pre_desc, a_bufs, b_bufs, epi_bufs, ready_bars, empty_bars,
                            pre_ready, pre_empty, expert_ids_ptr, num_padded_ptr, H, inter, n_tiles, dout_ptr,
                            dout_stride, sorted_ids_ptr, S, ALIGN_M, PRE_STEP_, TOP_K)),
    ], [4, GATHER_WARPS], [CONSUMER_REGS, PRODUCER_REGS])


if not GLUON_AVAILABLE:
    gluon_swiglu_bwd_kernel = None
