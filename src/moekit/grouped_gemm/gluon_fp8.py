"""Block-scaled FP8 grouped GEMMs for Hopper (sm_90) in Gluon: persistent, warp-specialized, cp.async +
TMA and wgmma, the promotion of one warpgroup under the other's tensor-core work.

Legend as in `moekit.grouped_gemm.fp8_kernels`: T tokens, K top_k, S pairs, E experts, H hidden, I
intermediate, L sorted rows (num_padded of them in use), B = 128 (the scale block). Per sorted row r
of expert e, t its token, for each 128-column tile n of h:

    gate = sum over k blocks of (xq[t, k] . gate_e[n, k]) * xs[t, k] * gs[e, n, k]      (fp32)
    up   = the same on the up half (rows I + n of gate_up_e)
    h    = silu(gate) * up -> hs[r, n] = max(amax / 448, floor) (UE8M0: a power of two), hq[r, n] =
           h / hs rounded to e4m3                                           padding rows: 0 (floor)

exactly what `moekit.grouped_gemm.fp8_kernels.moe_gemm1_fp8_kernel` computes, as its Triton version;
GEMM2 (`gluon_gemm2_fp8_kernel`, what `moe_gemm2_fp8_kernel` computes) reads hq's sorted rows and
down's by TMA (one producer warp), scales each step's products the same way and stores each row,
times its routing weight, to its pair's row of y.

Why a second kernel: in Triton each 128-deep step's dot is waited on before it is scaled into the
fp32 accumulator, so the tensor cores idle while the accumulators are scaled (the FP8 prefill runs
at 36-46% of the FP8 matmul ceiling). Here two consumer warpgroups take alternate work items
(ping-pong, as `moekit.grouped_gemm.gluon_swiglu_bwd`): while one scales its step's products into its
accumulators, the other's wgmma runs.

Schedule. One program an SM; work items (64-row sub-block, 128-column tile of h), tiles fastest (the
programs in flight share the sub-block's x rows and the expert's weights in L2); a 64-row sub-block
lies in one align block (block_m a multiple of 64), so in one expert. Items stop at num_padded, read
on the device. Partitions:

    producer   GATHER_WARPS: per item, H / 128 steps into a ring of STAGES stages: the item's x rows
               [64, 128] gathered from their tokens by cp.async (padding rows zero-filled; each thread
               arrives on the stage's ready barrier when its copies land), the gate and up tiles
               [128, 128] by TMA.
    consumers  2 warpgroups, alternate items, an order barrier pair as in the SwiGLU backward. A step:
               the gate tile's wgmma into a scratch accumulator, waited, scaled by the rows' x scales
               and the tile's weight scale into the gate accumulator; the same for up; the stage
               released. Epilogue: silu(gate) * up, quantized per row, hq by TMA store, hs by pointer.

Registers: a consumer holds a tile as two 64-column halves, gate and up each: four [64, 64] fp32
accumulators and a scratch one, 160 a thread (two [64, 128] ones and their scratch spill at 232).
Without Gluon the kernel name is None.
"""

from __future__ import annotations

from moekit.grouped_gemm.gluon_swiglu_bwd import _num_items
from moekit.grouped_gemm.gluon_wgrad import (
    GATHER_WARPS,
    GLUON_AVAILABLE,
    cp_async_arrive,
    fence_async_shared,
    gather_rows,
    gl,
    gluon,
    mbarrier,
    tma,
    tma_load,
    tma_store,
    token_rows,
    warpgroup_mma,
    warpgroup_mma_wait,
)

SUB_M = 64            # rows of a work item: one warpgroup's wgmma m64
BLOCK_N = 128         # h columns of a work item: one scale group
BLOCK_K = 128         # H a ring step: one scale block
STAGES = 8            # GEMM1's ring: 24 KiB a stage (x rows, a half of gate and of up)
STAGES2 = 8           # GEMM2's ring: 24 KiB a stage (hq rows, down rows), run across items
PRODUCER2_REGS = 24   # GEMM2's producer: one warp issuing TMA
PRODUCER_REGS = 40
CONSUMER_REGS = 232

FP8_MAX = gl.constexpr(448.0) if GLUON_AVAILABLE else 448.0
SCALE_FLOOR = gl.constexpr(1e-10 / 448.0) if GLUON_AVAILABLE else 1e-10 / 448.0


@gluon.constexpr_function
def _acc_layout(BN):
    # A warpgroup's wgmma accumulator, m64 x BN, 4 warps along M; e4m3 operands: k32 instructions.
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 32])


@gluon.jit
def _ue8m0_ceil(s):
    """The power of two at or above s (positive, normal fp32), as `moekit.quant.kernels.ue8m0_ceil`."""
    bits = s.to(gl.int32, bitcast=True)
    up = ((bits & 0x7FFFFF) != 0).to(gl.int32)
    return ((bits & 0x7F800000) + (up << 23)).to(gl.float32, bitcast=True)


@gluon.jit
def _ping_pong_barriers(STAGES_: gl.constexpr, READY_COUNT: gl.constexpr):
    """The ring's ready and empty barriers (ready: READY_COUNT arrivals; empty: the stage's one
    consumer) and the ping-pong consumers' order pair, initialised and fenced."""
    ready_bars = gl.allocate_shared_memory(gl.int64, [STAGES_, 1], mbarrier.MBarrierLayout())
    empty_bars = gl.allocate_shared_memory(gl.int64, [STAGES_, 1], mbarrier.MBarrierLayout())
    order_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES_):
        mbarrier.init(ready_bars.index(i), count=READY_COUNT)
        mbarrier.init(empty_bars.index(i), count=1)
    for i in gl.static_range(2):
        mbarrier.init(order_bars.index(i), count=1)
    fence_async_shared()
    return ready_bars, empty_bars, order_bars


@gluon.jit
def _producer(w_desc, a_bufs, g_bufs, u_bufs, ready_bars, empty_bars, x_ptr, x_stride, sorted_ids_ptr,
              expert_ids_ptr, num_padded_ptr, S, H, inter, n_tiles, ALIGN_M: gl.constexpr,
              TOP_K: gl.constexpr):
    """GATHER_WARPS: every item's two halves, H / BK steps each, into the ring (x rows by cp.async, the
    half's gate and up rows by TMA)."""
    STAGES_: gl.constexpr = a_bufs.type.shape[0]
    BM: gl.constexpr = a_bufs.type.shape[1]
    BK: gl.constexpr = a_bufs.type.shape[2]
    HALF: gl.constexpr = g_bufs.type.shape[1]
    NBYTES: gl.constexpr = 2 * w_desc.block_type.nbytes          # TMA bytes a stage: gate and up
    num_items = _num_items(num_padded_ptr, n_tiles, BM)
    k_steps = H // BK
    it = 0                          # stage uses so far, across this program's items
    for t in range(gl.program_id(0), num_items, gl.num_programs(0)):
        row0 = (t // n_tiles) * BM
        n0 = (t % n_tiles) * (2 * HALF)
        e = gl.load(expert_ids_ptr + row0 // ALIGN_M)
        tok, placed = token_rows(sorted_ids_ptr, S, row0, row0 + BM, BM, BK, TOP_K, 16)     # the item's rows
        for half in gl.static_range(2):
            w_row = e * (2 * inter) + n0 + half * HALF
            for ki in range(k_steps):
                s = it % STAGES_
                mbarrier.wait(empty_bars.index(s), ((it // STAGES_) & 1) ^ 1)   # pass 0: free at once
                ready = ready_bars.index(s)
                mbarrier.expect(ready, NBYTES)
                gather_rows(x_ptr, x_stride, tok, placed, ki * BK, a_bufs.index(s))
                tma_load(w_desc, [w_row, ki * BK], ready, g_bufs.index(s))
                tma_load(w_desc, [w_row + inter, ki * BK], ready, u_bufs.index(s))
                cp_async_arrive(ready, increment_count=False)      # once this thread's copies landed
                it += 1


@gluon.jit
def _half_main_loop(a_bufs, g_bufs, u_bufs, ready_bars, empty_bars, xs_rows, placed, xs_stride_k, gs_ptr,
                    us_ptr, ws_stride_k, it, k_steps, layout: gl.constexpr):
    """One half's H / BK ring steps from stage use `it`: (gate, up) [64, HALF] fp32, each step's two
    dots into a scratch accumulator, waited, then scaled by the rows' x scales and the block's weight
    scale into the half's accumulators (the promotion: the other warpgroup's wgmma runs meanwhile)."""
    STAGES_: gl.constexpr = a_bufs.type.shape[0]
    BM: gl.constexpr = a_bufs.type.shape[1]
    HALF: gl.constexpr = g_bufs.type.shape[1]
    gate = gl.zeros((BM, HALF), gl.float32, layout)
    up = gl.zeros((BM, HALF), gl.float32, layout)
    scratch = gl.zeros((BM, HALF), gl.float32, layout)
    for ki in range(k_steps):
        k = it + ki
        s = k % STAGES_
        # the step's scales, loaded before the wait so their latency passes under it
        a_s = gl.load(xs_rows + ki * xs_stride_k, mask=placed, other=0.0)       # [64]
        g_s = gl.load(gs_ptr + ki * ws_stride_k)
        u_s = gl.load(us_ptr + ki * ws_stride_k)
        mbarrier.wait(ready_bars.index(s), (k // STAGES_) & 1)
        fence_async_shared()    # cp.async wrote the x rows through the generic proxy
        a = a_bufs.index(s)
        scratch = warpgroup_mma(a, g_bufs.index(s).permute((1, 0)), scratch, use_acc=False, is_async=True)
        scratch = warpgroup_mma_wait(num_outstanding=0, deps=(scratch,))
        gate += scratch * (a_s * g_s)[:, None]
        scratch = warpgroup_mma(a, u_bufs.index(s).permute((1, 0)), scratch, use_acc=False, is_async=True)
        scratch = warpgroup_mma_wait(num_outstanding=0, deps=(scratch,))
        mbarrier.arrive(empty_bars.index(s))                  # both dots have read the stage
        up += scratch * (a_s * u_s)[:, None]
    return gate, up


@gluon.jit
def _consumer(a_bufs, g_bufs, u_bufs, ready_bars, empty_bars, order_bars, h_desc, c_smem, hs_ptr, hs_stride,
              xs_ptr, xs_stride_t, xs_stride_k, ws_ptr, ws_stride_e, ws_stride_n, ws_stride_k, sorted_ids_ptr,
              expert_ids_ptr, num_padded_ptr, S, H, inter, n_tiles, ALIGN_M: gl.constexpr,
              TOP_K: gl.constexpr, UE8M0: gl.constexpr, CONSUMER: gl.constexpr):
    """One warpgroup: the items j (this program's) with j % 2 == CONSUMER, a whole [64, 128] tile
    each, as two 64-column halves one after the other: the first half's h (fp32) waits in registers
    while the second half's gate and up accumulate (128 accumulator registers a thread; a whole tile
    at once would take 192 and spill)."""
    BM: gl.constexpr = a_bufs.type.shape[1]
    HALF: gl.constexpr = g_bufs.type.shape[1]
    layout: gl.constexpr = _acc_layout(HALF)
    rows_layout: gl.constexpr = gl.SliceLayout(1, layout)
    c_lo = c_smem.index(2 * CONSUMER)
    c_hi = c_smem.index(2 * CONSUMER + 1)
    num_items = _num_items(num_padded_ptr, n_tiles, BM)
    k_steps = H // a_bufs.type.shape[2]
    it = 0                          # stage uses so far (both warpgroups' items)
    j = 0                           # items so far
    waits = 0                       # order-barrier waits so far
    for t in range(gl.program_id(0), num_items, gl.num_programs(0)):
        if j % 2 == CONSUMER:
            # the other warpgroup finished the previous item's main loop: every stage use before this
            # item's has landed, so no ready wait below can match an earlier pass's phase
            mbarrier.wait(order_bars.index(CONSUMER), waits & 1, pred=j > 0)
            waits += (j > 0).to(gl.int32)
            row0 = (t // n_tiles) * BM
            n0 = (t % n_tiles) * (2 * HALF)
            e = gl.load(expert_ids_ptr + row0 // ALIGN_M)
            rows = row0 + gl.arange(0, BM, rows_layout)
            ids = gl.load(sorted_ids_ptr + rows)
            placed = ids < S
            xs_rows = xs_ptr + gl.where(placed, ids // TOP_K, 0).to(gl.int64) * xs_stride_t
            gs_ptr = ws_ptr + e * ws_stride_e + (n0 // (2 * HALF)) * ws_stride_n      # the tile is one block
            us_ptr = gs_ptr + (inter // (2 * HALF)) * ws_stride_n
            gate, up = _half_main_loop(a_bufs, g_bufs, u_bufs, ready_bars, empty_bars, xs_rows, placed,
                                       xs_stride_k, gs_ptr, us_ptr, ws_stride_k, it, k_steps, layout)
            h_lo = gate * gl.fdiv(gl.full_like(gate, 1.0), 1.0 + gl.exp(-gate)) * up
            gate, up = _half_main_loop(a_bufs, g_bufs, u_bufs, ready_bars, empty_bars, xs_rows, placed,
                                       xs_stride_k, gs_ptr, us_ptr, ws_stride_k, it + k_steps, k_steps,
                                       layout)
            mbarrier.arrive(order_bars.index(1 - CONSUMER))          # the other may start its next item
            h_hi = gate * gl.fdiv(gl.full_like(gate, 1.0), 1.0 + gl.exp(-gate)) * up
            # silu(gate) * up quantized per row over the tile's 128 columns (one group), as
            # `moekit.quant.kernels.quantize_groups` does: IEEE divisions, times the reciprocal.
            amax = gl.maximum(gl.max(gl.abs(h_lo), axis=1), gl.max(gl.abs(h_hi), axis=1))
            scale = gl.maximum(gl.div_rn(amax, gl.full_like(amax, FP8_MAX)), SCALE_FLOOR)
            if UE8M0:
                scale = _ue8m0_ceil(scale)
            inv = gl.div_rn(gl.full_like(scale, 1.0), scale)[:, None]
            tma.store_wait(pendings=0)                  # this warpgroup's previous stores read c_lo, c_hi
            c_lo.store(gl.minimum(gl.maximum(h_lo * inv, -FP8_MAX), FP8_MAX).to(c_lo.dtype))
            c_hi.store(gl.minimum(gl.maximum(h_hi * inv, -FP8_MAX), FP8_MAX).to(c_hi.dtype))
            fence_async_shared()
            tma_store(h_desc, [row0, n0], c_lo)
            tma_store(h_desc, [row0, n0 + HALF], c_hi)
            gl.store(hs_ptr + rows.to(gl.int64) * hs_stride + n0 // (2 * HALF), scale)
        it += 2 * k_steps
        j += 1
    tma.store_wait(pendings=0)


@gluon.jit
def gluon_gemm1_fp8_kernel(w_desc, h_desc, x_ptr, x_stride, xs_ptr, xs_stride_t, xs_stride_k, ws_ptr,
                           ws_stride_e, ws_stride_n, ws_stride_k, hs_ptr, hs_stride, sorted_ids_ptr,
                           expert_ids_ptr, num_padded_ptr, S, H, inter, n_tiles, A_LAYOUT: gl.constexpr,
                           ALIGN_M: gl.constexpr, STAGES_: gl.constexpr, UE8M0: gl.constexpr,
                           TOP_K: gl.constexpr, PRODUCER_REGS_: gl.constexpr, CONSUMER_REGS_: gl.constexpr):
    """hq, hs of the rows < num_padded (see the module docstring).

    w_desc: gate_up's e4m3 data viewed as (E * 2I, H) in boxes [64, 128] (a tile's half); h_desc:
    hq (L, I) e4m3 in boxes [64, 64] (a tile's two halves); x (T, H) e4m3 by token (row stride
    x_stride), its rows read at sorted_ids // TOP_K into [64, 128] tiles of layout A_LAYOUT; xs
    (T, H / 128), ws (E, 2I / 128, H / 128) and hs (L, I / 128) fp32 scales; the alignment's int32
    sorted_ids, expert_ids and num_padded (0-d, on the device); ALIGN_M its block size, a multiple
    of 64; n_tiles = I / 128."""
    dtype: gl.constexpr = w_desc.dtype
    HALF: gl.constexpr = w_desc.block_type.shape[0]
    BK: gl.constexpr = w_desc.block_type.shape[1]
    BM: gl.constexpr = h_desc.block_type.shape[0]
    a_bufs = gl.allocate_shared_memory(dtype, [STAGES_, BM, BK], A_LAYOUT)
    g_bufs = gl.allocate_shared_memory(dtype, [STAGES_, HALF, BK], w_desc.layout)
    u_bufs = gl.allocate_shared_memory(dtype, [STAGES_, HALF, BK], w_desc.layout)
    c_smem = gl.allocate_shared_memory(h_desc.dtype, [4, BM, HALF], h_desc.layout)  # two halves a warpgroup
    # ready: the producer's expect(), and each of its 128 threads once its copies land
    ready_bars, empty_bars, order_bars = _ping_pong_barriers(STAGES_, 1 + GATHER_WARPS * 32)
    C0: gl.constexpr = 0
    C1: gl.constexpr = 1
    # Default partition (4 warps): consumer 0; workers: consumer 1 (4 warps), the producer.
    gl.warp_specialize([
        (_consumer, (a_bufs, g_bufs, u_bufs, ready_bars, empty_bars, order_bars, h_desc, c_smem, hs_ptr,
                     hs_stride, xs_ptr, xs_stride_t, xs_stride_k, ws_ptr, ws_stride_e, ws_stride_n,
                     ws_stride_k, sorted_ids_ptr, expert_ids_ptr, num_padded_ptr, S, H, inter, n_tiles,
                     ALIGN_M, TOP_K, UE8M0, C0)),
        (_consumer, (a_bufs, g_bufs, u_bufs, ready_bars, empty_bars, order_bars, h_desc, c_smem, hs_ptr,
                     hs_stride, xs_ptr, xs_stride_t, xs_stride_k, ws_ptr, ws_stride_e, ws_stride_n,
                     ws_stride_k, sorted_ids_ptr, expert_ids_ptr, num_padded_ptr, S, H, inter, n_tiles,
                     ALIGN_M, TOP_K, UE8M0, C1)),
        (_producer, (w_desc, a_bufs, g_bufs, u_bufs, ready_bars, empty_bars, x_ptr, x_stride, sorted_ids_ptr,
                     expert_ids_ptr, num_padded_ptr, S, H, inter, n_tiles, ALIGN_M, TOP_K)),
    ], [4, GATHER_WARPS], [CONSUMER_REGS_, PRODUCER_REGS_])


# ---- GEMM2: y[pair] = w_p * sum over k blocks of (hq[r, k] . down_e[n, k]) * hs[r, k] * ds[e, n, k]

@gluon.jit
def _gemm2_producer(a_desc, b_desc, a_bufs, b_bufs, ready_bars, empty_bars, expert_ids_ptr, num_padded_ptr, H,
                    n_tiles, k_steps, ALIGN_M: gl.constexpr):
    """1 warp: every item's I / BK steps into the ring, hq's sorted rows [64, BK] and down's rows
    [BN, BK], both by TMA (GEMM1 wrote hq in sorted-row order, zeros on the padding rows)."""
    STAGES_: gl.constexpr = a_bufs.type.shape[0]
    BM: gl.constexpr = a_bufs.type.shape[1]
    BK: gl.constexpr = a_bufs.type.shape[2]
    BN: gl.constexpr = b_bufs.type.shape[1]
    NBYTES: gl.constexpr = a_desc.block_type.nbytes + b_desc.block_type.nbytes
    num_items = _num_items(num_padded_ptr, n_tiles, BM)
    it = 0
    for t in range(gl.program_id(0), num_items, gl.num_programs(0)):
        row0 = (t // n_tiles) * BM
        n0 = (t % n_tiles) * BN
        e = gl.load(expert_ids_ptr + row0 // ALIGN_M)
        for ki in range(k_steps):
            s = it % STAGES_
            mbarrier.wait(empty_bars.index(s), ((it // STAGES_) & 1) ^ 1)   # pass 0: free at once
            ready = ready_bars.index(s)
            mbarrier.expect(ready, NBYTES)
            tma_load(a_desc, [row0, ki * BK], ready, a_bufs.index(s))
            tma_load(b_desc, [e * H + n0, ki * BK], ready, b_bufs.index(s))
            it += 1


@gluon.jit
def _gemm2_consumer(a_bufs, b_bufs, ready_bars, empty_bars, order_bars, y_ptr, y_stride, w_ptr, hs_ptr,
                    hs_stride_r, hs_stride_k, ds_ptr, ds_stride_e, ds_stride_n, ds_stride_k, sorted_ids_ptr,
                    expert_ids_ptr, num_padded_ptr, S, n_tiles, k_steps, ALIGN_M: gl.constexpr,
                    CONSUMER: gl.constexpr):
    """One warpgroup: the items j with j % 2 == CONSUMER, a [64, 128] tile of y each: each step's
    products into a scratch accumulator, waited, scaled into the tile's accumulator (under the other
    warpgroup's wgmma); then times the routing weight, stored to the pairs' rows."""
    STAGES_: gl.constexpr = a_bufs.type.shape[0]
    BM: gl.constexpr = a_bufs.type.shape[1]
    BN: gl.constexpr = b_bufs.type.shape[1]
    layout: gl.constexpr = _acc_layout(BN)
    rows_layout: gl.constexpr = gl.SliceLayout(1, layout)
    # the store's layout: 8 consecutive columns (16 bytes of bf16) a thread, a row's 128 in 16 lanes
    out_layout: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])
    num_items = _num_items(num_padded_ptr, n_tiles, BM)
    it = 0
    j = 0
    waits = 0
    for t in range(gl.program_id(0), num_items, gl.num_programs(0)):
        if j % 2 == CONSUMER:
            mbarrier.wait(order_bars.index(CONSUMER), waits & 1, pred=j > 0)
            waits += (j > 0).to(gl.int32)
            row0 = (t // n_tiles) * BM
            n0 = (t % n_tiles) * BN
            e = gl.load(expert_ids_ptr + row0 // ALIGN_M)
            rows = row0 + gl.arange(0, BM, rows_layout)
            hs_rows = hs_ptr + rows.to(gl.int64) * hs_stride_r
            ds_tile = ds_ptr + e * ds_stride_e + (n0 // BN) * ds_stride_n          # BN = the scale block
            acc = gl.zeros((BM, BN), gl.float32, layout)
            scratch = gl.zeros((BM, BN), gl.float32, layout)
            for ki in range(k_steps):
                k = it + ki
                s = k % STAGES_
                a_s = gl.load(hs_rows + ki * hs_stride_k)              # padding rows: hq is 0 there
                b_s = gl.load(ds_tile + ki * ds_stride_k)
                mbarrier.wait(ready_bars.index(s), (k // STAGES_) & 1)
                scratch = warpgroup_mma(a_bufs.index(s), b_bufs.index(s).permute((1, 0)), scratch,
                                        use_acc=False, is_async=True)
                scratch = warpgroup_mma_wait(num_outstanding=0, deps=(scratch,))
                mbarrier.arrive(empty_bars.index(s))
                acc += scratch * (a_s * b_s)[:, None]
            mbarrier.arrive(order_bars.index(1 - CONSUMER))
            # Epilogue: the routing weight, then the tile's rows to their pairs' rows of y.
            out = gl.convert_layout(acc, out_layout)
            out_rows = row0 + gl.arange(0, BM, gl.SliceLayout(1, out_layout))
            pair = gl.load(sorted_ids_ptr + out_rows)
            valid = pair < S
            wt = gl.load(w_ptr + pair, mask=valid, other=0.0).to(gl.float32)
            cols = n0 + gl.arange(0, BN, gl.SliceLayout(0, out_layout))
            ptrs = y_ptr + pair.to(gl.int64)[:, None] * y_stride + cols[None, :]
            gl.store(ptrs, (out * wt[:, None]).to(y_ptr.dtype.element_ty), mask=valid[:, None])
        it += k_steps
        j += 1


@gluon.jit
def gluon_gemm2_fp8_kernel(a_desc, b_desc, y_ptr, y_stride, w_ptr, hs_ptr, hs_stride_r, hs_stride_k, ds_ptr,
                           ds_stride_e, ds_stride_n, ds_stride_k, sorted_ids_ptr, expert_ids_ptr,
                           num_padded_ptr, S, H, n_tiles, k_steps, ALIGN_M: gl.constexpr,
                           STAGES_: gl.constexpr, PRODUCER_REGS_: gl.constexpr,
                           CONSUMER_REGS_: gl.constexpr):
    """y (S, H) at the pairs' rows of the sorted rows < num_padded: a_desc hq (L, I) e4m3 in boxes
    [64, 128]; b_desc down's e4m3 data viewed as (E * H, I) in boxes [128, 128]; hs (L, I / 128) and
    ds (E, H / 128, I / 128) fp32 scales; w (S,) the routing weights; n_tiles = H / 128, k_steps =
    I / 128; the alignment as in GEMM1."""
    dtype: gl.constexpr = a_desc.dtype
    BM: gl.constexpr = a_desc.block_type.shape[0]
    BK: gl.constexpr = a_desc.block_type.shape[1]
    BN: gl.constexpr = b_desc.block_type.shape[0]
    a_bufs = gl.allocate_shared_memory(dtype, [STAGES_, BM, BK], a_desc.layout)
    b_bufs = gl.allocate_shared_memory(dtype, [STAGES_, BN, BK], b_desc.layout)
    ready_bars, empty_bars, order_bars = _ping_pong_barriers(STAGES_, 1)     # ready: the expect() alone
    C0: gl.constexpr = 0
    C1: gl.constexpr = 1
    # Default partition (4 warps): consumer 0; workers: consumer 1 (4 warps), the producer (1 warp).
    gl.warp_specialize([
        (_gemm2_consumer, (a_bufs, b_bufs, ready_bars, empty_bars, order_bars, y_ptr, y_stride, w_ptr, hs_ptr,
                           hs_stride_r, hs_stride_k, ds_ptr, ds_stride_e, ds_stride_n, ds_stride_k,
                           sorted_ids_ptr, expert_ids_ptr, num_padded_ptr, S, n_tiles, k_steps, ALIGN_M, C0)),
        (_gemm2_consumer, (a_bufs, b_bufs, ready_bars, empty_bars, order_bars, y_ptr, y_stride, w_ptr, hs_ptr,
                           hs_stride_r, hs_stride_k, ds_ptr, ds_stride_e, ds_stride_n, ds_stride_k,
                           sorted_ids_ptr, expert_ids_ptr, num_padded_ptr, S, n_tiles, k_steps, ALIGN_M, C1)),
        (_gemm2_producer, (a_desc, b_desc, a_bufs, b_bufs, ready_bars, empty_bars, expert_ids_ptr,
                           num_padded_ptr, H, n_tiles, k_steps, ALIGN_M)),
    ], [4, 1], [CONSUMER_REGS_, PRODUCER_REGS_])


if not GLUON_AVAILABLE:
    gluon_gemm1_fp8_kernel = gluon_gemm2_fp8_kernel = None
