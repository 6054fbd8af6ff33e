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
at 36-46% of the FP8 matmul ceiling). Here two consumer warpgroups share the tensor cores, so that
one's wgmma runs while the other scales.

Schedule. One program an SM; work items (64-row sub-block, 128-column tile of h), tiles fastest (the
programs in flight share the sub-block's x rows and the expert's weights in L2); a 64-row sub-block
lies in one align block (block_m a multiple of 64), so in one expert. Items stop at num_padded, read
on the device. Partitions:

    producer   GATHER_WARPS: per item, 2 H / 128 steps (the tile's two 64-column halves) into a ring
               of STAGES stages: the item's x rows [64, 128] gathered from their tokens by cp.async
               (padding rows zero-filled; each thread arrives on the stage's ready barrier when its
               copies land), the half's gate and up rows [64, 128] each by TMA.
    consumers  2 warpgroups, each a whole item at a time. A step: the products into a scratch
               accumulator, waited, scaled by the rows' x scales and the block's weight scale into the
               gate and up accumulators, the stage released. Epilogue: silu(gate) * up, quantized per
               row, hq by TMA store, hs by pointer.

Two schedules of the consumers (DUAL, `MOEKIT_GLUON_FP8_DUAL`):

    ping-pong  alternate items, an order barrier pair as in the SwiGLU backward: one warpgroup's
               main loop runs under the other's epilogue, the main loops one after the other. A step
               is two m64 n64 wgmmas, gate and up.
    dual       the items in pairs, both main loops at once (the section "the dual schedule" below):
               one's scaling under the other's wgmma. A step is one m64 n128 wgmma over the gate and
               up rows stacked in one stage, split into its halves in registers.

Registers: a consumer holds a tile as two 64-column halves one after the other: gate and up [64, 64]
each and the scratch (ping-pong: two [64, 64]; dual: one [64, 128]), and the first half's h,
160 fp32 a thread (a whole [64, 128] tile at once, gate and up and their scratch, spills at 232).
Without Gluon the kernel name is None.
"""

from __future__ import annotations

import triton.language as tl

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
CONSUMER2_REGS = 232
DUAL_ENV = "MOEKIT_GLUON_FP8_DUAL"     # 1 (default): the dual schedule, 0: ping-pong (each call)

FP8_MAX = gl.constexpr(448.0) if GLUON_AVAILABLE else 448.0
SCALE_FLOOR = gl.constexpr(1e-10 / 448.0) if GLUON_AVAILABLE else 1e-10 / 448.0


@gluon.constexpr_function
def _acc_layout(BN):
    # A warpgroup's wgmma accumulator, m64 x BN, 4 warps along M; e4m3 operands: k32 instructions.
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 32])


@gluon.jit
def _max_nan(a, b):
    return gl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@gluon.jit
def _clamp_fp8(v):
    return gl.minimum(_max_nan(v, -FP8_MAX), FP8_MAX, propagate_nan=tl.PropagateNan.ALL)


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
def _quantize_store(h_lo, h_hi, h_desc, c_lo, c_hi, hs_ptr, hs_stride, row0, n0, UE8M0: gl.constexpr):
    """A tile's h (two [BM, HALF] fp32 halves, rows row0.., columns n0..) quantized per row over its
    128 columns (one group), as `moekit.quant.kernels.quantize_groups` does (IEEE divisions, times
    the reciprocal): hq by TMA store through this warpgroup's c_lo, c_hi, hs by pointer."""
    BM: gl.constexpr = h_lo.type.shape[0]
    HALF: gl.constexpr = h_lo.type.shape[1]
    # NaN-propagating max and clamp: a NaN or infinity in h reaches the row's output (as in the twin)
    amax = _max_nan(gl.reduce(gl.abs(h_lo), 1, _max_nan), gl.reduce(gl.abs(h_hi), 1, _max_nan))
    scale = _max_nan(gl.div_rn(amax, gl.full_like(amax, FP8_MAX)), gl.full_like(amax, SCALE_FLOOR))
    if UE8M0:
        scale = gl.where(scale == scale, _ue8m0_ceil(scale), scale)
    inv = gl.div_rn(gl.full_like(scale, 1.0), scale)[:, None]
    tma.store_wait(pendings=0)                  # this warpgroup's previous stores read c_lo, c_hi
    c_lo.store(_clamp_fp8(h_lo * inv).to(c_lo.dtype))
    c_hi.store(_clamp_fp8(h_hi * inv).to(c_hi.dtype))
    fence_async_shared()
    tma_store(h_desc, [row0, n0], c_lo)
    tma_store(h_desc, [row0, n0 + HALF], c_hi)
    rows = row0 + gl.arange(0, BM, gl.SliceLayout(1, h_lo.type.layout))
    gl.store(hs_ptr + rows.to(gl.int64) * hs_stride + n0 // (2 * HALF), scale)


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
            _quantize_store(h_lo, h_hi, h_desc, c_lo, c_hi, hs_ptr, hs_stride, row0, n0, UE8M0)
        it += 2 * k_steps
        j += 1
    tma.store_wait(pendings=0)


# ---- the dual schedule: both consumers' main loops at once --------------------------------------
#
# The ping-pong consumers above take turns on the tensor cores (the order barrier), so a warpgroup's
# scaling of each step's products leaves them idle. In the dual schedule the program's items go in
# pairs, item 2q to consumer 0 and 2q + 1 to consumer 1, and the producer fills their steps
# alternately: stage use 2 (q * steps + i) + c is step i of consumer c's item of pair q. With an even
# number of stages each stage serves one consumer, so each consumer's stages form a ring of their
# own, waited on as a single consumer's ring is, and no order barrier is needed: while one consumer
# scales, the other's wgmma runs. GEMM1's step is one m64 n128 wgmma over the gate half's and the up
# half's 64 rows stacked in one [128, BK] stage, not two n64 ones (half the x reads from shared
# memory); each step's products are split into the gate and up halves in registers.


@gluon.jit
def _my_items(num_items):
    """How many of num_items this program takes (items pid, pid + P, pid + 2P, ...)."""
    return (num_items - gl.program_id(0) + gl.num_programs(0) - 1) // gl.num_programs(0)


@gluon.jit
def _pair(q, mine):
    """Pair q of this program's items: (t0, t1, whether t1 is one of them; a lone last item has
    t1 = t0, and consumer 1 idles)."""
    t0 = gl.program_id(0) + 2 * q * gl.num_programs(0)
    has1 = 2 * q + 1 < mine
    return t0, gl.where(has1, t0 + gl.num_programs(0), t0), has1


@gluon.jit
def _split_halves(acc):
    """[BM, 2 HALF] -> its column halves [BM, HALF] each (a register renaming: the wgmma layout keeps
    columns c and c + HALF in one thread)."""
    BM: gl.constexpr = acc.type.shape[0]
    HALF: gl.constexpr = acc.type.shape[1] // 2
    return gl.split(gl.permute(gl.reshape(acc, [BM, 2, HALF]), (0, 2, 1)))


@gluon.jit
def _dual_fill(w_desc, a_bufs, w_bufs, ready_bars, empty_bars, u, w_row, inter, x_ptr, x_stride, tok, placed,
               k0):
    """Stage use u: the x rows (cp.async from their tokens) and the gate and up halves' rows w_row and
    inter + w_row (TMA, stacked in one stage), columns [k0, k0 + BK)."""
    STAGES_: gl.constexpr = a_bufs.type.shape[0]
    HALF: gl.constexpr = w_desc.block_type.shape[0]
    s = u % STAGES_
    mbarrier.wait(empty_bars.index(s), ((u // STAGES_) & 1) ^ 1)   # the first pass finds it free
    ready = ready_bars.index(s)
    mbarrier.expect(ready, 2 * w_desc.block_type.nbytes)
    gather_rows(x_ptr, x_stride, tok, placed, k0, a_bufs.index(s))
    w = w_bufs.index(s)
    tma_load(w_desc, [w_row, k0], ready, w.slice(0, HALF))
    tma_load(w_desc, [w_row + inter, k0], ready, w.slice(HALF, HALF))
    cp_async_arrive(ready, increment_count=False)      # once this thread's copies landed


@gluon.jit
def _dual_producer(w_desc, a_bufs, w_bufs, ready_bars, empty_bars, x_ptr, x_stride, sorted_ids_ptr,
                   expert_ids_ptr, num_padded_ptr, S, H, inter, n_tiles, ALIGN_M: gl.constexpr,
                   TOP_K: gl.constexpr):
    """GATHER_WARPS: the program's items in pairs, the two items' steps alternately into the ring (an
    item: its two halves, H / BK steps each)."""
    BM: gl.constexpr = a_bufs.type.shape[1]
    BK: gl.constexpr = a_bufs.type.shape[2]
    HALF: gl.constexpr = w_desc.block_type.shape[0]
    mine = _my_items(_num_items(num_padded_ptr, n_tiles, BM))
    k_steps = H // BK
    steps = 2 * k_steps
    for q in range((mine + 1) // 2):
        t0, t1, has1 = _pair(q, mine)
        row0 = (t0 // n_tiles) * BM
        row1 = (t1 // n_tiles) * BM
        w0 = gl.load(expert_ids_ptr + row0 // ALIGN_M) * (2 * inter) + (t0 % n_tiles) * (2 * HALF)
        w1 = gl.load(expert_ids_ptr + row1 // ALIGN_M) * (2 * inter) + (t1 % n_tiles) * (2 * HALF)
        tok0, placed0 = token_rows(sorted_ids_ptr, S, row0, row0 + BM, BM, BK, TOP_K, 16)
        tok1, placed1 = token_rows(sorted_ids_ptr, S, row1, row1 + BM, BM, BK, TOP_K, 16)
        for i in range(steps):
            half = i // k_steps
            k0 = (i % k_steps) * BK
            u = 2 * (q * steps + i)
            _dual_fill(w_desc, a_bufs, w_bufs, ready_bars, empty_bars, u, w0 + half * HALF, inter, x_ptr,
                       x_stride, tok0, placed0, k0)
            if has1:
                _dual_fill(w_desc, a_bufs, w_bufs, ready_bars, empty_bars, u + 1, w1 + half * HALF, inter,
                           x_ptr, x_stride, tok1, placed1, k0)


@gluon.jit
def _dual_half(a_bufs, w_bufs, ready_bars, empty_bars, xs_rows, placed, xs_stride_k, gs_ptr, us_ptr,
               ws_stride_k, u0, k_steps, layout: gl.constexpr):
    """One half's H / BK steps, stage uses u0, u0 + 2, ...: h = silu(gate) * up [BM, HALF] in fp32.
    Each step's m64 n128 wgmma (gate | up) into a scratch accumulator, waited, split into its halves
    and scaled by the rows' x scales times each half's weight scale into the gate and up
    accumulators."""
    STAGES_: gl.constexpr = a_bufs.type.shape[0]
    BM: gl.constexpr = a_bufs.type.shape[1]
    GU: gl.constexpr = w_bufs.type.shape[1]             # a stage's gate and up rows
    scratch = gl.zeros((BM, GU), gl.float32, layout)
    gate, up = _split_halves(scratch)
    rows_layout: gl.constexpr = gl.SliceLayout(1, gate.type.layout)
    for ki in range(k_steps):
        u = u0 + 2 * ki
        s = u % STAGES_
        # the step's scales, loaded before the wait so their latency passes under it
        a_s = gl.convert_layout(gl.load(xs_rows + ki * xs_stride_k, mask=placed, other=0.0), rows_layout)
        g_s = gl.load(gs_ptr + ki * ws_stride_k)
        u_s = gl.load(us_ptr + ki * ws_stride_k)
        mbarrier.wait(ready_bars.index(s), (u // STAGES_) & 1)
        fence_async_shared()    # cp.async wrote the x rows through the generic proxy
        scratch = warpgroup_mma(a_bufs.index(s), w_bufs.index(s).permute((1, 0)), scratch, use_acc=False,
                                is_async=True)
        scratch = warpgroup_mma_wait(num_outstanding=0, deps=(scratch,))
        mbarrier.arrive(empty_bars.index(s))
        sg, su = _split_halves(scratch)
        gate += sg * (a_s * g_s)[:, None]
        up += su * (a_s * u_s)[:, None]
    return gate * gl.fdiv(gl.full_like(gate, 1.0), 1.0 + gl.exp(-gate)) * up


@gluon.jit
def _dual_consumer(a_bufs, w_bufs, ready_bars, empty_bars, h_desc, c_smem, hs_ptr, hs_stride, xs_ptr,
                   xs_stride_t, xs_stride_k, ws_ptr, ws_stride_e, ws_stride_n, ws_stride_k, sorted_ids_ptr,
                   expert_ids_ptr, num_padded_ptr, S, H, inter, n_tiles, ALIGN_M: gl.constexpr,
                   TOP_K: gl.constexpr, UE8M0: gl.constexpr, CONSUMER: gl.constexpr):
    """One warpgroup: item CONSUMER of each of the program's pairs, a [64, 128] tile of h as two
    64-column halves one after the other, then the epilogue as `_consumer`'s."""
    BM: gl.constexpr = a_bufs.type.shape[1]
    HALF: gl.constexpr = w_bufs.type.shape[1] // 2
    layout: gl.constexpr = _acc_layout(2 * HALF)
    c_lo = c_smem.index(2 * CONSUMER)
    c_hi = c_smem.index(2 * CONSUMER + 1)
    mine = _my_items(_num_items(num_padded_ptr, n_tiles, BM))
    k_steps = H // a_bufs.type.shape[2]
    for q in range((mine + 1) // 2):
        if 2 * q + CONSUMER < mine:
            t = gl.program_id(0) + (2 * q + CONSUMER) * gl.num_programs(0)
            row0 = (t // n_tiles) * BM
            n0 = (t % n_tiles) * (2 * HALF)
            e = gl.load(expert_ids_ptr + row0 // ALIGN_M)
            rows = row0 + gl.arange(0, BM, gl.SliceLayout(1, layout))
            ids = gl.load(sorted_ids_ptr + rows)
            placed = ids < S
            xs_rows = xs_ptr + gl.where(placed, ids // TOP_K, 0).to(gl.int64) * xs_stride_t
            gs_ptr = ws_ptr + e * ws_stride_e + (n0 // (2 * HALF)) * ws_stride_n      # the tile is one block
            us_ptr = gs_ptr + (inter // (2 * HALF)) * ws_stride_n
            u0 = 2 * q * (2 * k_steps) + CONSUMER
            h_lo = _dual_half(a_bufs, w_bufs, ready_bars, empty_bars, xs_rows, placed, xs_stride_k, gs_ptr,
                              us_ptr, ws_stride_k, u0, k_steps, layout)
            h_hi = _dual_half(a_bufs, w_bufs, ready_bars, empty_bars, xs_rows, placed, xs_stride_k, gs_ptr,
                              us_ptr, ws_stride_k, u0 + 2 * k_steps, k_steps, layout)
            _quantize_store(h_lo, h_hi, h_desc, c_lo, c_hi, hs_ptr, hs_stride, row0, n0, UE8M0)
    tma.store_wait(pendings=0)


@gluon.jit
def gluon_gemm1_fp8_kernel(w_desc, h_desc, x_ptr, x_stride, xs_ptr, xs_stride_t, xs_stride_k, ws_ptr,
                           ws_stride_e, ws_stride_n, ws_stride_k, hs_ptr, hs_stride, sorted_ids_ptr,
                           expert_ids_ptr, num_padded_ptr, S, H, inter, n_tiles, A_LAYOUT: gl.constexpr,
                           ALIGN_M: gl.constexpr, STAGES_: gl.constexpr, UE8M0: gl.constexpr,
                           TOP_K: gl.constexpr, PRODUCER_REGS_: gl.constexpr, CONSUMER_REGS_: gl.constexpr,
                           DUAL: gl.constexpr = False):
    """hq, hs of the rows < num_padded (see the module docstring).

    w_desc: gate_up's e4m3 data viewed as (E * 2I, H) in boxes [64, 128] (a tile's half); h_desc:
    hq (L, I) e4m3 in boxes [64, 64] (a tile's two halves); x (T, H) e4m3 by token (row stride
    x_stride), its rows read at sorted_ids // TOP_K into [64, 128] tiles of layout A_LAYOUT; xs
    (T, H / 128), ws (E, 2I / 128, H / 128) and hs (L, I / 128) fp32 scales; the alignment's int32
    sorted_ids, expert_ids and num_padded (0-d, on the device); ALIGN_M its block size, a multiple
    of 64; n_tiles = I / 128. DUAL: the dual schedule (STAGES_ even), else ping-pong."""
    dtype: gl.constexpr = w_desc.dtype
    HALF: gl.constexpr = w_desc.block_type.shape[0]
    BK: gl.constexpr = w_desc.block_type.shape[1]
    BM: gl.constexpr = h_desc.block_type.shape[0]
    a_bufs = gl.allocate_shared_memory(dtype, [STAGES_, BM, BK], A_LAYOUT)
    c_smem = gl.allocate_shared_memory(h_desc.dtype, [4, BM, HALF], h_desc.layout)  # two halves a warpgroup
    # ready: the producer's expect(), and each of its 128 threads once its copies land
    ready_bars, empty_bars, order_bars = _ping_pong_barriers(STAGES_, 1 + GATHER_WARPS * 32)
    C0: gl.constexpr = 0
    C1: gl.constexpr = 1
    if DUAL:
        gl.static_assert(STAGES_ % 2 == 0, "the dual schedule needs an even number of stages")
        w_bufs = gl.allocate_shared_memory(dtype, [STAGES_, 2 * HALF, BK], w_desc.layout)  # gate | up rows
        gl.warp_specialize([
            (_dual_consumer, (a_bufs, w_bufs, ready_bars, empty_bars, h_desc, c_smem, hs_ptr, hs_stride,
                              xs_ptr, xs_stride_t, xs_stride_k, ws_ptr, ws_stride_e, ws_stride_n, ws_stride_k,
                              sorted_ids_ptr, expert_ids_ptr, num_padded_ptr, S, H, inter, n_tiles, ALIGN_M,
                              TOP_K, UE8M0, C0)),
            (_dual_consumer, (a_bufs, w_bufs, ready_bars, empty_bars, h_desc, c_smem, hs_ptr, hs_stride,
                              xs_ptr, xs_stride_t, xs_stride_k, ws_ptr, ws_stride_e, ws_stride_n, ws_stride_k,
                              sorted_ids_ptr, expert_ids_ptr, num_padded_ptr, S, H, inter, n_tiles, ALIGN_M,
                              TOP_K, UE8M0, C1)),
            (_dual_producer, (w_desc, a_bufs, w_bufs, ready_bars, empty_bars, x_ptr, x_stride, sorted_ids_ptr,
                              expert_ids_ptr, num_padded_ptr, S, H, inter, n_tiles, ALIGN_M, TOP_K)),
        ], [4, GATHER_WARPS], [CONSUMER_REGS_, PRODUCER_REGS_])
    else:
        g_bufs = gl.allocate_shared_memory(dtype, [STAGES_, HALF, BK], w_desc.layout)
        u_bufs = gl.allocate_shared_memory(dtype, [STAGES_, HALF, BK], w_desc.layout)
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
            (_producer, (w_desc, a_bufs, g_bufs, u_bufs, ready_bars, empty_bars, x_ptr, x_stride,
                         sorted_ids_ptr, expert_ids_ptr, num_padded_ptr, S, H, inter, n_tiles, ALIGN_M,
                         TOP_K)),
        ], [4, GATHER_WARPS], [CONSUMER_REGS_, PRODUCER_REGS_])


# ---- GEMM2: y[pair] = w_p * sum over k blocks of (hq[r, k] . down_e[n, k]) * hs[r, k] * ds[e, n, k]

@gluon.jit
def _gemm2_fill(a_desc, b_desc, a_bufs, b_bufs, ready_bars, empty_bars, u, row0, b_row, k0):
    """Stage use u: hq's rows row0.. and down's rows b_row.., columns [k0, k0 + BK), by TMA."""
    STAGES_: gl.constexpr = a_bufs.type.shape[0]
    s = u % STAGES_
    mbarrier.wait(empty_bars.index(s), ((u // STAGES_) & 1) ^ 1)   # the first pass finds it free
    ready = ready_bars.index(s)
    mbarrier.expect(ready, a_desc.block_type.nbytes + b_desc.block_type.nbytes)
    tma_load(a_desc, [row0, k0], ready, a_bufs.index(s))
    tma_load(b_desc, [b_row, k0], ready, b_bufs.index(s))


@gluon.jit
def _gemm2_producer(a_desc, b_desc, a_bufs, b_bufs, ready_bars, empty_bars, expert_ids_ptr, num_padded_ptr, H,
                    n_tiles, k_steps, ALIGN_M: gl.constexpr):
    """1 warp: every item's I / BK steps into the ring, hq's sorted rows [64, BK] and down's rows
    [BN, BK], both by TMA (GEMM1 wrote hq in sorted-row order, zeros on the padding rows)."""
    BM: gl.constexpr = a_bufs.type.shape[1]
    BK: gl.constexpr = a_bufs.type.shape[2]
    BN: gl.constexpr = b_bufs.type.shape[1]
    num_items = _num_items(num_padded_ptr, n_tiles, BM)
    it = 0
    for t in range(gl.program_id(0), num_items, gl.num_programs(0)):
        row0 = (t // n_tiles) * BM
        n0 = (t % n_tiles) * BN
        e = gl.load(expert_ids_ptr + row0 // ALIGN_M)
        for ki in range(k_steps):
            _gemm2_fill(a_desc, b_desc, a_bufs, b_bufs, ready_bars, empty_bars, it, row0, e * H + n0, ki * BK)
            it += 1


@gluon.jit
def _store_pairs(acc, y_ptr, y_stride, w_ptr, sorted_ids_ptr, S, row0, n0):
    """GEMM2's epilogue: a [BM, BN] tile of sorted rows row0.., columns n0.., times each row's routing
    weight, stored to its pair's row of y (padding rows: nothing)."""
    BM: gl.constexpr = acc.type.shape[0]
    BN: gl.constexpr = acc.type.shape[1]
    # the store's layout: 8 consecutive columns (16 bytes of bf16) a thread, a row's 128 in 16 lanes
    out_layout: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])
    out = gl.convert_layout(acc, out_layout)
    out_rows = row0 + gl.arange(0, BM, gl.SliceLayout(1, out_layout))
    pair = gl.load(sorted_ids_ptr + out_rows)
    valid = pair < S
    wt = gl.load(w_ptr + pair, mask=valid, other=0.0).to(gl.float32)
    cols = n0 + gl.arange(0, BN, gl.SliceLayout(0, out_layout))
    ptrs = y_ptr + pair.to(gl.int64)[:, None] * y_stride + cols[None, :]
    gl.store(ptrs, (out * wt[:, None]).to(y_ptr.dtype.element_ty), mask=valid[:, None])


@gluon.jit
def _gemm2_item(a_bufs, b_bufs, ready_bars, empty_bars, hs_ptr, hs_stride_r, hs_stride_k, ds_ptr, ds_stride_e,
                ds_stride_n, ds_stride_k, expert_ids_ptr, t, n_tiles, k_steps, u0, u_step,
                ALIGN_M: gl.constexpr):
    """Item t's main loop, its steps at stage uses u0, u0 + u_step, ...: each step's wgmma into a
    scratch accumulator, waited, the stage released, the products scaled by the rows' hq scales
    times the tile's down scale into the tile's accumulator. (acc [BM, BN] fp32, row0, n0)."""
    STAGES_: gl.constexpr = a_bufs.type.shape[0]
    BM: gl.constexpr = a_bufs.type.shape[1]
    BN: gl.constexpr = b_bufs.type.shape[1]
    layout: gl.constexpr = _acc_layout(BN)
    row0 = (t // n_tiles) * BM
    n0 = (t % n_tiles) * BN
    e = gl.load(expert_ids_ptr + row0 // ALIGN_M)
    rows = row0 + gl.arange(0, BM, gl.SliceLayout(1, layout))
    hs_rows = hs_ptr + rows.to(gl.int64) * hs_stride_r
    ds_tile = ds_ptr + e * ds_stride_e + (n0 // BN) * ds_stride_n          # BN = the scale block
    acc = gl.zeros((BM, BN), gl.float32, layout)
    scratch = gl.zeros((BM, BN), gl.float32, layout)
    for ki in range(k_steps):
        u = u0 + u_step * ki
        s = u % STAGES_
        a_s = gl.load(hs_rows + ki * hs_stride_k)              # padding rows: hq is 0 there
        b_s = gl.load(ds_tile + ki * ds_stride_k)
        mbarrier.wait(ready_bars.index(s), (u // STAGES_) & 1)
        scratch = warpgroup_mma(a_bufs.index(s), b_bufs.index(s).permute((1, 0)), scratch, use_acc=False,
                                is_async=True)
        scratch = warpgroup_mma_wait(num_outstanding=0, deps=(scratch,))
        mbarrier.arrive(empty_bars.index(s))
        acc += scratch * (a_s * b_s)[:, None]
    return acc, row0, n0


@gluon.jit
def _gemm2_consumer(a_bufs, b_bufs, ready_bars, empty_bars, order_bars, y_ptr, y_stride, w_ptr, hs_ptr,
                    hs_stride_r, hs_stride_k, ds_ptr, ds_stride_e, ds_stride_n, ds_stride_k, sorted_ids_ptr,
                    expert_ids_ptr, num_padded_ptr, S, n_tiles, k_steps, ALIGN_M: gl.constexpr,
                    CONSUMER: gl.constexpr):
    """One warpgroup, ping-pong: the items j with j % 2 == CONSUMER, a [64, 128] tile of y each, the
    main loop (`_gemm2_item`) after the other warpgroup's, the epilogue (`_store_pairs`) under its
    next one."""
    BM: gl.constexpr = a_bufs.type.shape[1]
    num_items = _num_items(num_padded_ptr, n_tiles, BM)
    it = 0
    j = 0
    waits = 0
    for t in range(gl.program_id(0), num_items, gl.num_programs(0)):
        if j % 2 == CONSUMER:
            mbarrier.wait(order_bars.index(CONSUMER), waits & 1, pred=j > 0)
            waits += (j > 0).to(gl.int32)
            acc, row0, n0 = _gemm2_item(a_bufs, b_bufs, ready_bars, empty_bars, hs_ptr, hs_stride_r,
                                        hs_stride_k, ds_ptr, ds_stride_e, ds_stride_n, ds_stride_k,
                                        expert_ids_ptr, t, n_tiles, k_steps, it, 1, ALIGN_M)
            mbarrier.arrive(order_bars.index(1 - CONSUMER))
            _store_pairs(acc, y_ptr, y_stride, w_ptr, sorted_ids_ptr, S, row0, n0)
        it += k_steps
        j += 1


@gluon.jit
def _gemm2_dual_producer(a_desc, b_desc, a_bufs, b_bufs, ready_bars, empty_bars, expert_ids_ptr,
                         num_padded_ptr, H, n_tiles, k_steps, ALIGN_M: gl.constexpr):
    """1 warp, the dual schedule: the program's items in pairs, the two items' I / BK steps
    alternately into the ring (stage use 2 (q * k_steps + ki) + c: step ki of consumer c's item)."""
    BM: gl.constexpr = a_bufs.type.shape[1]
    BK: gl.constexpr = a_bufs.type.shape[2]
    BN: gl.constexpr = b_bufs.type.shape[1]
    mine = _my_items(_num_items(num_padded_ptr, n_tiles, BM))
    for q in range((mine + 1) // 2):
        t0, t1, has1 = _pair(q, mine)
        row0 = (t0 // n_tiles) * BM
        row1 = (t1 // n_tiles) * BM
        b0 = gl.load(expert_ids_ptr + row0 // ALIGN_M) * H + (t0 % n_tiles) * BN
        b1 = gl.load(expert_ids_ptr + row1 // ALIGN_M) * H + (t1 % n_tiles) * BN
        for ki in range(k_steps):
            u = 2 * (q * k_steps + ki)
            _gemm2_fill(a_desc, b_desc, a_bufs, b_bufs, ready_bars, empty_bars, u, row0, b0, ki * BK)
            if has1:
                _gemm2_fill(a_desc, b_desc, a_bufs, b_bufs, ready_bars, empty_bars, u + 1, row1, b1, ki * BK)


@gluon.jit
def _gemm2_dual_consumer(a_bufs, b_bufs, ready_bars, empty_bars, y_ptr, y_stride, w_ptr, hs_ptr, hs_stride_r,
                         hs_stride_k, ds_ptr, ds_stride_e, ds_stride_n, ds_stride_k, sorted_ids_ptr,
                         expert_ids_ptr, num_padded_ptr, S, n_tiles, k_steps, ALIGN_M: gl.constexpr,
                         CONSUMER: gl.constexpr):
    """One warpgroup, the dual schedule: item CONSUMER of each of the program's pairs, stage uses
    2 (q * k_steps + ki) + CONSUMER; a step and the epilogue as `_gemm2_consumer`'s."""
    BM: gl.constexpr = a_bufs.type.shape[1]
    mine = _my_items(_num_items(num_padded_ptr, n_tiles, BM))
    for q in range((mine + 1) // 2):
        if 2 * q + CONSUMER < mine:
            t = gl.program_id(0) + (2 * q + CONSUMER) * gl.num_programs(0)
            acc, row0, n0 = _gemm2_item(a_bufs, b_bufs, ready_bars, empty_bars, hs_ptr, hs_stride_r,
                                        hs_stride_k, ds_ptr, ds_stride_e, ds_stride_n, ds_stride_k,
                                        expert_ids_ptr, t, n_tiles, k_steps, 2 * q * k_steps + CONSUMER, 2,
                                        ALIGN_M)
            _store_pairs(acc, y_ptr, y_stride, w_ptr, sorted_ids_ptr, S, row0, n0)


@gluon.jit
def gluon_gemm2_fp8_kernel(a_desc, b_desc, y_ptr, y_stride, w_ptr, hs_ptr, hs_stride_r, hs_stride_k, ds_ptr,
                           ds_stride_e, ds_stride_n, ds_stride_k, sorted_ids_ptr, expert_ids_ptr,
                           num_padded_ptr, S, H, n_tiles, k_steps, ALIGN_M: gl.constexpr,
                           STAGES_: gl.constexpr, PRODUCER_REGS_: gl.constexpr,
                           CONSUMER_REGS_: gl.constexpr, DUAL: gl.constexpr = False):
    """y (S, H) at the pairs' rows of the sorted rows < num_padded: a_desc hq (L, I) e4m3 in boxes
    [64, 128]; b_desc down's e4m3 data viewed as (E * H, I) in boxes [128, 128]; hs (L, I / 128) and
    ds (E, H / 128, I / 128) fp32 scales; w (S,) the routing weights; n_tiles = H / 128, k_steps =
    I / 128; the alignment as in GEMM1. DUAL: the dual schedule (STAGES_ even), else ping-pong."""
    dtype: gl.constexpr = a_desc.dtype
    BM: gl.constexpr = a_desc.block_type.shape[0]
    BK: gl.constexpr = a_desc.block_type.shape[1]
    BN: gl.constexpr = b_desc.block_type.shape[0]
    a_bufs = gl.allocate_shared_memory(dtype, [STAGES_, BM, BK], a_desc.layout)
    b_bufs = gl.allocate_shared_memory(dtype, [STAGES_, BN, BK], b_desc.layout)
    ready_bars, empty_bars, order_bars = _ping_pong_barriers(STAGES_, 1)     # ready: the expect() alone
    C0: gl.constexpr = 0
    C1: gl.constexpr = 1
    if DUAL:
        gl.static_assert(STAGES_ % 2 == 0, "the dual schedule needs an even number of stages")
        gl.warp_specialize([
            (_gemm2_dual_consumer, (a_bufs, b_bufs, ready_bars, empty_bars, y_ptr, y_stride, w_ptr, hs_ptr,
                                    hs_stride_r, hs_stride_k, ds_ptr, ds_stride_e, ds_stride_n, ds_stride_k,
                                    sorted_ids_ptr, expert_ids_ptr, num_padded_ptr, S, n_tiles, k_steps,
                                    ALIGN_M, C0)),
            (_gemm2_dual_consumer, (a_bufs, b_bufs, ready_bars, empty_bars, y_ptr, y_stride, w_ptr, hs_ptr,
                                    hs_stride_r, hs_stride_k, ds_ptr, ds_stride_e, ds_stride_n, ds_stride_k,
                                    sorted_ids_ptr, expert_ids_ptr, num_padded_ptr, S, n_tiles, k_steps,
                                    ALIGN_M, C1)),
            (_gemm2_dual_producer, (a_desc, b_desc, a_bufs, b_bufs, ready_bars, empty_bars, expert_ids_ptr,
                                    num_padded_ptr, H, n_tiles, k_steps, ALIGN_M)),
        ], [4, 1], [CONSUMER_REGS_, PRODUCER_REGS_])
    else:
        # Default partition (4 warps): consumer 0; workers: consumer 1 (4 warps), the producer (1 warp).
        gl.warp_specialize([
            (_gemm2_consumer, (a_bufs, b_bufs, ready_bars, empty_bars, order_bars, y_ptr, y_stride, w_ptr,
                               hs_ptr, hs_stride_r, hs_stride_k, ds_ptr, ds_stride_e, ds_stride_n,
                               ds_stride_k, sorted_ids_ptr, expert_ids_ptr, num_padded_ptr, S, n_tiles,
                               k_steps, ALIGN_M, C0)),
            (_gemm2_consumer, (a_bufs, b_bufs, ready_bars, empty_bars, order_bars, y_ptr, y_stride, w_ptr,
                               hs_ptr, hs_stride_r, hs_stride_k, ds_ptr, ds_stride_e, ds_stride_n,
                               ds_stride_k, sorted_ids_ptr, expert_ids_ptr, num_padded_ptr, S, n_tiles,
                               k_steps, ALIGN_M, C1)),
            (_gemm2_producer, (a_desc, b_desc, a_bufs, b_bufs, ready_bars, empty_bars, expert_ids_ptr,
                               num_padded_ptr, H, n_tiles, k_steps, ALIGN_M)),
        ], [4, 1], [CONSUMER_REGS_, PRODUCER_REGS_])


if not GLUON_AVAILABLE:
    gluon_gemm1_fp8_kernel = gluon_gemm2_fp8_kernel = None
