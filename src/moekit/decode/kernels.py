"""Direct decode path: the expert computation in two kernels for a few (token, slot) pairs, no align.

Legend: T tokens, K top_k, S = T * K pairs, E experts, H hidden, I intermediate, BN/BK tile sizes.

    GEMV1  program (p, n-tile): e = ids[p], t = p // K;
           h[p, n-tile] = silu(x[t] @ gate_e^T) * (x[t] @ up_e^T), fp32 accumulators, h (S, I)
           in the activation dtype. A pair with e outside [0, E) reads no weights and stores zeros.
    GEMV2  program (t, n-tile): out[t, n-tile] = sum over k = 0..K-1 (ascending, fixed) of
           w[t, k] * (h[t*K + k] @ down_e^T)[n-tile] in fp32, slots with e outside [0, E) skipped;
           stored once in out's dtype. No atomics: deterministic, graph and eager bitwise equal.

At decode sizes every expert gets about one pair, so sorting pairs by expert buys no weight reuse;
one row per program is a matrix-vector product: each step loads a [BN, BK] weight tile and the
matching [BK] chunk of the row, multiplies in fp32 into a [BN, BK] accumulator, and the K dimension
is reduced once after the loop (tl.sum), which compiles to plain FMAs and one final shuffle tree.
GEMV2's SLOTS computes that many of a token's slots together ([SLOTS, BN, BK] steps, the slots
still added in ascending order). STEP_SUM sums each step's products over its BK columns at once
into a [BN] accumulator instead: the accumulator's registers go to more programs resident and
wider steps, at a shuffle tree a step. UNROLL unrolls the reduction loop (`tl.range(loop_unroll_factor=...)`).
Both put more weight bytes in flight per program: the loads are not software-pipelined through
shared memory (only registers carry them), and at T = 1 GEMV2 has only H / BN programs.
Ids are compared in their own integer type (int64 ids are never truncated before the range check).
W_EVICT is the weight loads' L2 eviction policy and USE_PDL a launch with programmatic dependent
launch (`moekit.launch_hints` decides both; neither changes a value).
"""

import moekit.kernels  # noqa: F401  (first: the interpreter switch, before triton is imported)

# isort: split
import triton
import triton.language as tl

from moekit.kernels.pdl import pdl_enter

SCALE_BLOCK = tl.constexpr(128)


@triton.jit
def _gemv_acc(acc, w_ptrs, v_ptrs, n_in, k0, K, stride_wk, stride_vk,
              BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, W_EVICT: tl.constexpr, s_ptr=None,
              stride_sk=0, W_SCALED: tl.constexpr = False, STEP_SUM: tl.constexpr = False):
    """acc [BN, BK] fp32 += W[:, k0:k0+BK] * v[k0:k0+BK] (broadcast over rows); past K reads 0.
    W_EVICT: the weight loads' eviction policy (`moekit.launch_hints.weight_evict`). W_SCALED: W is
    block-scaled FP8 and s_ptr its scales' row for these rows (one 128-row block): v is multiplied by
    the scale of each column's 128-column block first. STEP_SUM: acc is [BN], the step's products
    summed over its BK columns at once."""
    rk = k0 + tl.arange(0, BLOCK_K)
    if EVEN_K:
        v = tl.load(v_ptrs + rk * stride_vk)
        if W_SCALED:
            v = v.to(tl.float32) * tl.load(s_ptr + (rk // SCALE_BLOCK) * stride_sk)
        w = tl.load(w_ptrs + rk[None, :] * stride_wk, mask=n_in[:, None], other=0.0, eviction_policy=W_EVICT)
    else:
        k_in = rk < K
        v = tl.load(v_ptrs + rk * stride_vk, mask=k_in, other=0.0)
        if W_SCALED:
            v = v.to(tl.float32) * tl.load(s_ptr + (rk // SCALE_BLOCK) * stride_sk, mask=k_in, other=0.0)
        w = tl.load(w_ptrs + rk[None, :] * stride_wk, mask=n_in[:, None] & k_in[None, :], other=0.0,
                    eviction_policy=W_EVICT)
    return _step_add(acc, w.to(tl.float32) * v.to(tl.float32)[None, :], STEP_SUM)


@triton.jit
def _step_zeros(BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STEP_SUM: tl.constexpr):
    """One row's accumulator: [BN] with STEP_SUM, else [BN, BK]."""
    if STEP_SUM:
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    return acc


@triton.jit
def _step_add(acc, prod, STEP_SUM: tl.constexpr):
    """acc + a step's products (last axis BK): summed over that axis first with STEP_SUM."""
    if STEP_SUM:
        acc = acc + tl.sum(prod, axis=-1)
    else:
        acc = acc + prod
    return acc


@triton.jit
def _step_total(acc, STEP_SUM: tl.constexpr):
    """The accumulator reduced over its BK axis (with STEP_SUM already reduced, as it is)."""
    if not STEP_SUM:
        acc = tl.sum(acc, axis=-1)
    return acc


@triton.jit
def decode_gemm1_swiglu_kernel(
    x_ptr, w_ptr, ids_ptr, h_ptr, E, N, K,
    stride_xt, stride_xk, stride_we, stride_wn, stride_wk, stride_hm, stride_hn,
    TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    UNROLL: tl.constexpr = 1, W_EVICT: tl.constexpr = "", USE_PDL: tl.constexpr = False,
    ws_ptr=None, stride_wse=0, stride_wsn=0, stride_wsk=0, W_SCALED: tl.constexpr = False,
    STEP_SUM: tl.constexpr = False,
):
    # N = I, K = H; w: gate_up (E, 2N, K), gate rows first. grid (S, cdiv(N, BLOCK_N)).
    # USE_PDL: launched with programmatic dependent launch (`moekit.kernels.pdl`).
    pdl_enter(USE_PDL)
    pair = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(ids_ptr + pair)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_in = rn < N
    h = tl.zeros((BLOCK_N,), dtype=tl.float32)
    if (e >= 0) & (e < E):
        tok = (pair // TOP_K).to(tl.int64)
        x_row = x_ptr + tok * stride_xt
        g_ptrs = w_ptr + e.to(tl.int64) * stride_we + rn.to(tl.int64)[:, None] * stride_wn   # [BN, 1]
        u_ptrs = g_ptrs + N * stride_wn
        if W_SCALED:    # BLOCK_N divides 128: the tile's rows share one row of block scales
            gs_row = ws_ptr + e.to(tl.int64) * stride_wse + (pid_n * BLOCK_N // SCALE_BLOCK) * stride_wsn
            us_row = gs_row + (N // SCALE_BLOCK) * stride_wsn
        else:
            gs_row = ws_ptr
            us_row = ws_ptr
        acc_g = _step_zeros(BLOCK_N, BLOCK_K, STEP_SUM)
        acc_u = _step_zeros(BLOCK_N, BLOCK_K, STEP_SUM)
        for k0 in tl.range(0, K, BLOCK_K, loop_unroll_factor=UNROLL):
            acc_g = _gemv_acc(acc_g, g_ptrs, x_row, n_in, k0, K, stride_wk, stride_xk, BLOCK_K, EVEN_K,
                              W_EVICT, gs_row, stride_wsk, W_SCALED, STEP_SUM)
            acc_u = _gemv_acc(acc_u, u_ptrs, x_row, n_in, k0, K, stride_wk, stride_xk, BLOCK_K, EVEN_K,
                              W_EVICT, us_row, stride_wsk, W_SCALED, STEP_SUM)
        gate = _step_total(acc_g, STEP_SUM)
        up = _step_total(acc_u, STEP_SUM)
        h = gate * tl.sigmoid(gate) * up                                    # silu(gate) * up, fp32
    h_ptrs = h_ptr + pair.to(tl.int64) * stride_hm + rn * stride_hn
    tl.store(h_ptrs, h.to(h_ptr.dtype.element_ty), mask=n_in)


@triton.jit
def _slot_group(out, tok, s0, h_ptr, w_ptr, topk_weights_ptr, ids_ptr, E, N, K, rn, n_in,
                stride_hm, stride_hk, stride_we, stride_wn, stride_wk,
                TOP_K: tl.constexpr, SLOTS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                EVEN_K: tl.constexpr, UNROLL: tl.constexpr, W_EVICT: tl.constexpr, scales,
                W_SCALED: tl.constexpr, STEP_SUM: tl.constexpr):
    """out [BN] += the weighted rows of slots s0 .. s0 + SLOTS - 1, computed together (one
    [SLOTS, BN, BK] step loads every slot's weight tile: more bytes in flight), added in ascending
    slot order. Slots past TOP_K or with ids outside [0, E) read nothing and add 0. W_SCALED: the
    weights are block-scaled FP8, scales = (their scales at these rows' block of expert 0, the
    expert and column-block strides); each slot's row of h is multiplied by its expert's scales."""
    rs = tl.arange(0, SLOTS)
    slot = s0 + rs
    pair = tok * TOP_K + slot
    e = tl.load(ids_ptr + pair, mask=slot < TOP_K, other=-1)
    valid = (slot < TOP_K) & (e >= 0) & (e < E)
    wt = tl.load(topk_weights_ptr + pair, mask=valid, other=0.0).to(tl.float32)
    e = tl.where(valid, e, 0).to(tl.int64)
    h_rows = h_ptr + pair[:, None] * stride_hm                                             # [S, 1]
    d_rows = w_ptr + e[:, None, None] * stride_we + rn.to(tl.int64)[None, :, None] * stride_wn  # [S, BN, 1]
    row_in = valid[:, None, None] & n_in[None, :, None]
    if STEP_SUM:
        acc = tl.zeros((SLOTS, BLOCK_N), dtype=tl.float32)
    else:
        acc = tl.zeros((SLOTS, BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, loop_unroll_factor=UNROLL):
        rk = k0 + tl.arange(0, BLOCK_K)
        if EVEN_K:
            v = tl.load(h_rows + rk[None, :] * stride_hk, mask=valid[:, None], other=0.0)
            w = tl.load(d_rows + rk[None, None, :] * stride_wk, mask=row_in, other=0.0,
                        eviction_policy=W_EVICT)
        else:
            k_in = rk < K
            v = tl.load(h_rows + rk[None, :] * stride_hk, mask=valid[:, None] & k_in[None, :], other=0.0)
            w = tl.load(d_rows + rk[None, None, :] * stride_wk, mask=row_in & k_in[None, None, :], other=0.0,
                        eviction_policy=W_EVICT)
        v = v.to(tl.float32)
        if W_SCALED:
            ws_row, stride_wse, stride_wsk = scales
            s_ptrs = ws_row + e[:, None] * stride_wse
            v = v * tl.load(s_ptrs + (rk // SCALE_BLOCK)[None, :] * stride_wsk, mask=valid[:, None],
                            other=0.0)
        acc = _step_add(acc, w.to(tl.float32) * v[:, None, :], STEP_SUM)
    part = _step_total(acc, STEP_SUM) * wt[:, None]                                        # [S, BN]
    for j in tl.static_range(SLOTS):     # ascending: each row extracted exactly (a sum with zeros)
        out += tl.sum(tl.where(rs[:, None] == j, part, 0.0), axis=0)
    return out


@triton.jit
def decode_gemm2_sum_kernel(
    h_ptr, w_ptr, topk_weights_ptr, ids_ptr, out_ptr, E, N, K,
    stride_hm, stride_hk, stride_we, stride_wn, stride_wk, stride_ot, stride_on,
    TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    UNROLL: tl.constexpr = 1, SLOTS: tl.constexpr = 1, W_EVICT: tl.constexpr = "",
    USE_PDL: tl.constexpr = False, ws_ptr=None, stride_wse=0, stride_wsn=0, stride_wsk=0,
    W_SCALED: tl.constexpr = False, STEP_SUM: tl.constexpr = False,
):
    # N = H, K = I; w: down (E, N, K). grid (T, cdiv(N, BLOCK_N)). h (S, I) from GEMV1.
    # SLOTS > 1 (a power of two): groups of SLOTS slots computed together (`_slot_group`).
    pdl_enter(USE_PDL)
    tok = tl.program_id(0).to(tl.int64)
    pid_n = tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_in = rn < N
    out = tl.zeros((BLOCK_N,), dtype=tl.float32)
    if SLOTS > 1:
        if W_SCALED:    # BLOCK_N divides 128: one row of block scales per expert
            ws_row = ws_ptr + (pid_n * BLOCK_N // SCALE_BLOCK) * stride_wsn
        else:
            ws_row = 0      # a tuple of jit arguments cannot hold None
        for s0 in range(0, TOP_K, SLOTS):
            out = _slot_group(out, tok, s0, h_ptr, w_ptr, topk_weights_ptr, ids_ptr, E, N, K, rn, n_in,
                              stride_hm, stride_hk, stride_we, stride_wn, stride_wk, TOP_K, SLOTS, BLOCK_N,
                              BLOCK_K, EVEN_K, UNROLL, W_EVICT, (ws_row, stride_wse, stride_wsk),
                              W_SCALED, STEP_SUM)
    else:
        for slot in range(0, TOP_K):            # ascending slot order: a fixed summation order
            pair = tok * TOP_K + slot
            e = tl.load(ids_ptr + pair)
            if (e >= 0) & (e < E):
                wt = tl.load(topk_weights_ptr + pair).to(tl.float32)
                h_row = h_ptr + pair * stride_hm
                d_ptrs = w_ptr + e.to(tl.int64) * stride_we + rn.to(tl.int64)[:, None] * stride_wn
                if W_SCALED:    # BLOCK_N divides 128: one row of block scales
                    s_row = (ws_ptr + e.to(tl.int64) * stride_wse
                             + (pid_n * BLOCK_N // SCALE_BLOCK) * stride_wsn)
                else:
                    s_row = ws_ptr
                acc = _step_zeros(BLOCK_N, BLOCK_K, STEP_SUM)
                for k0 in tl.range(0, K, BLOCK_K, loop_unroll_factor=UNROLL):
                    acc = _gemv_acc(acc, d_ptrs, h_row, n_in, k0, K, stride_wk, stride_hk, BLOCK_K, EVEN_K,
                                    W_EVICT, s_row, stride_wsk, W_SCALED, STEP_SUM)
                out += _step_total(acc, STEP_SUM) * wt
    o_ptrs = out_ptr + tok * stride_ot + rn * stride_on
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=n_in)
