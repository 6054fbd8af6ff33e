"""Grouped GEMMs over the masked layout (DeepGEMM's decode layout), and its dispatch and combine.

Legend: T tokens, K top_k, S = T*K pairs, E experts, C capacity (rows per expert), H hidden,
I intermediate, BM/BN/BK tile sizes.

    GEMM1    x (E, C, H) rows [0, count_e) of expert e @ gate_up[e]^T -> gate, up (two fp32 accs)
             -> silu(gate) * up -> h (E, C, I), rows [0, count_e) only
    GEMM2    h (E, C, I) rows [0, count_e) @ down[e]^T (* row weight, fp32) -> y (E, C, H)
    FP8      both GEMMs on block-scaled e4m3 weights (one fp32 scale per 128 x 128 block): GEMM1
             quantizes x's rows per 128 channels as it loads them and h per 128 columns in its
             epilogue (hq e4m3, hs fp32); each 128-deep dot is scaled into the fp32 accumulator
    DISPATCH x (T, H) row p // K -> x_masked flat row dest[p] (E * C rows) for pairs with dest >= 0
    COMBINE  out[t] = sum over slots j with dest[t*K + j] >= 0 of w[t, j] * y_flat[dest[t*K + j]],
             in fp32, in slot order (deterministic)
    LAYOUT   ids (S,) -> dest (S,), counts (E,), dropped: one program walks the pairs in blocks of
             BP in pair order with a carried per-expert counter (no atomics: deterministic)

The GEMM grid is fixed by (E, C, tiles): program (e, m, n) with m * BM >= count_e exits at once, so
the host never needs the counts and the launch can be captured in a CUDA graph. Counts are clamped
to [0, C], so a count out of range reads nothing past the buffer. Rows at or past count_e are never
read or written: whatever they hold (NaN, stale rows) cannot reach a valid row.
"""

import moekit.kernels  # noqa: F401  (first: the interpreter switch, before triton is imported)

# isort: split
import triton
import triton.language as tl

from moekit.grouped_gemm.kernels import k_loop, store_token_tile, swiglu_k_loop, token_tile
from moekit.quant.kernels import quantize_groups

SCALE_BLOCK = tl.constexpr(128)     # `moekit.quant.FP8_BLOCK`: the span of one activation or weight scale


@triton.jit
def _masked_tile(counts_ptr, C, num_m, num_n, BLOCK_M: tl.constexpr):
    """(e, pid_m, pid_n, valid rows of e, live). Within an expert the row blocks of one column tile
    are adjacent programs, so they share the weight tile while it is in L2."""
    pid = tl.program_id(0)
    per_expert = num_m * num_n
    e = pid // per_expert
    r = pid % per_expert
    pid_n = r // num_m
    pid_m = r % num_m
    count = tl.load(counts_ptr + e)                                    # int32 or int64
    count = tl.minimum(tl.maximum(count, 0), C).to(tl.int32)           # clamp before narrowing
    return e, pid_m, pid_n, count, pid_m * BLOCK_M < count


@triton.jit
def _tile_rows(e, pid_m, pid_n, count, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """(e as int64, rows int64 [BM], rows below the count [BM], columns rn [BN], rn < N) of a tile;
    a new name for the int64 e, since Triton keeps a variable's type across an if."""
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    return e.to(tl.int64), rows.to(tl.int64), rows < count, rn, rn < N


@triton.jit
def masked_gemm1_swiglu_kernel(
    x_ptr, w_ptr, h_ptr, counts_ptr,
    C, N, K, num_m, num_n,
    stride_xe, stride_xm, stride_xk, stride_we, stride_wn, stride_wk, stride_he, stride_hm, stride_hn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    # N = I (columns of each half), K = H.
    e, pid_m, pid_n, count, live = _masked_tile(counts_ptr, C, num_m, num_n, BLOCK_M)
    if live:
        ex, rows, valid, rn, n_in = _tile_rows(e, pid_m, pid_n, count, N, BLOCK_M, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)                                     # [BK]

        a_ptrs = x_ptr + ex * stride_xe + rows[:, None] * stride_xm + rk[None, :] * stride_xk    # [BM, BK]
        g_ptrs = w_ptr + ex * stride_we + rn.to(tl.int64)[None, :] * stride_wn + rk[:, None] * stride_wk
        u_ptrs = g_ptrs + N * stride_wn                                                        # [BK, BN]

        acc_g, acc_u = swiglu_k_loop(a_ptrs, g_ptrs, u_ptrs, valid, n_in, K, stride_xk, stride_wk,
                                     BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, DOT_PRECISION)

        h = acc_g * tl.sigmoid(acc_g) * acc_u                          # silu(gate) * up, fp32
        h_ptrs = h_ptr + ex * stride_he + rows[:, None] * stride_hm + rn[None, :] * stride_hn
        tl.store(h_ptrs, h.to(h_ptr.dtype.element_ty), mask=valid[:, None] & n_in[None, :])


@triton.jit
def masked_gemm2_kernel(
    h_ptr, w_ptr, y_ptr, rw_ptr, counts_ptr,
    C, N, K, num_m, num_n,
    stride_he, stride_hm, stride_hk, stride_we, stride_wn, stride_wk, stride_ye, stride_ym, stride_yn,
    stride_re, stride_rm,
    HAS_ROW_WEIGHTS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    # N = H, K = I.
    e, pid_m, pid_n, count, live = _masked_tile(counts_ptr, C, num_m, num_n, BLOCK_M)
    if live:
        ex, rows, valid, rn, n_in = _tile_rows(e, pid_m, pid_n, count, N, BLOCK_M, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)                                     # [BK]

        a_ptrs = h_ptr + ex * stride_he + rows[:, None] * stride_hm + rk[None, :] * stride_hk    # [BM, BK]
        b_ptrs = w_ptr + ex * stride_we + rn.to(tl.int64)[None, :] * stride_wn + rk[:, None] * stride_wk

        acc = k_loop(a_ptrs, b_ptrs, valid, n_in, K, stride_hk, stride_wk, BLOCK_M, BLOCK_N, BLOCK_K,
                     EVEN_K, DOT_PRECISION, True)

        if HAS_ROW_WEIGHTS:
            wt = tl.load(rw_ptr + ex * stride_re + rows * stride_rm, mask=valid, other=0.0)
            acc = acc * wt.to(tl.float32)[:, None]
        y_ptrs = y_ptr + ex * stride_ye + rows[:, None] * stride_ym + rn[None, :] * stride_yn
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=valid[:, None] & n_in[None, :])


@triton.jit
def masked_dispatch_kernel(
    x_ptr, dest_ptr, xm_ptr, S, H, stride_xt, stride_xh,
    TOP_K: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """x_masked flat (E * C, H), contiguous: row dest[p] = x[p // K] for pairs with dest[p] >= 0."""
    rp = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)            # [BP] pairs
    rh = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)            # [BH]
    dest = tl.load(dest_ptr + rp, mask=rp < S, other=-1)               # int64
    keep = (dest >= 0)[:, None] & (rh < H)[None, :]
    tok = (rp // TOP_K).to(tl.int64)
    row = tl.load(x_ptr + tok[:, None] * stride_xt + rh[None, :] * stride_xh, mask=keep)
    tl.store(xm_ptr + dest[:, None] * H + rh[None, :], row, mask=keep)


@triton.jit
def masked_combine_kernel(
    y_ptr, dest_ptr, w_ptr, out_ptr, T, H, stride_ot, stride_oh,
    TOP_K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """out[t] = sum over slots j with dest >= 0 of w[t, j] * y_flat[dest[t*K + j]], fp32, slot order.
    y_flat (E * C, H) and w (T, K) contiguous."""
    rt, rh, t_in, h_in, acc = token_tile(T, H, BLOCK_T, BLOCK_H)
    for j in tl.static_range(TOP_K):
        pair = rt.to(tl.int64) * TOP_K + j
        dest = tl.load(dest_ptr + pair, mask=t_in, other=-1)           # int64
        use = dest >= 0
        wt = tl.load(w_ptr + pair, mask=use, other=0.0).to(tl.float32)
        y = tl.load(y_ptr + dest[:, None] * H + rh[None, :], mask=use[:, None] & h_in[None, :], other=0.0)
        acc += y.to(tl.float32) * wt[:, None]
    store_token_tile(out_ptr, acc, rt, rh, t_in, h_in, stride_ot, stride_oh)


@triton.jit
def masked_layout_kernel(ids_ptr, dest_ptr, counts_ptr, dropped_ptr, S, E, C,
                         BLOCK_P: tl.constexpr, BLOCK_E: tl.constexpr):
    """One program: pair p (in pair order) with id e in [0, E) takes rank seen[e] (+ the pairs of e
    before it in its block: an exclusive cumsum of the (BP, BE) one-hot tile), dest = e * C + rank
    if rank < C else -1 (dropped, counted); other ids get -1. counts = min(seen, C), int32."""
    experts = tl.arange(0, BLOCK_E)
    seen = tl.zeros([BLOCK_E], dtype=tl.int32)
    dropped = tl.zeros([BLOCK_P], dtype=tl.int32)
    for start in range(0, S, BLOCK_P):
        p = start + tl.arange(0, BLOCK_P)
        in_range = p < S
        e = tl.load(ids_ptr + p, mask=in_range, other=-1).to(tl.int64)
        valid = (e >= 0) & (e < E)
        hit = (e[:, None] == experts[None, :]) & valid[:, None]
        hit_i = hit.to(tl.int32)
        before = tl.cumsum(hit_i, axis=0) - hit_i                      # earlier pairs of e in the block
        rank = tl.sum(tl.where(hit, before + seen[None, :], 0), axis=1)
        seen += tl.sum(hit_i, axis=0)
        kept = valid & (rank < C)
        tl.store(dest_ptr + p, tl.where(kept, e * C + rank, -1), mask=in_range)
        dropped += (valid & (rank >= C)).to(tl.int32)
    tl.store(counts_ptr + experts, tl.minimum(seen, C).to(tl.int32), mask=experts < E)
    tl.store(dropped_ptr, tl.sum(dropped.to(tl.int64), axis=0))


@triton.jit
def masked_gemm1_swiglu_fp8_kernel(
    x_ptr, w_ptr, ws_ptr, h_ptr, hs_ptr, counts_ptr,
    C, N, K, num_m, num_n,
    stride_xe, stride_xm, stride_xk, stride_we, stride_wn, stride_wk, stride_wse, stride_wsn, stride_wsk,
    stride_he, stride_hm, stride_hn, stride_hse, stride_hsm,
    BLOCK_M: tl.constexpr, UE8M0: tl.constexpr, STANDIN: tl.constexpr,
):
    # Block-scaled FP8 weights (w8a8). N = I, K = H, both multiples of 128; the column tile and each
    # reduction step are one 128 scale block. Each step's x rows are quantized per row as they are
    # loaded (DeepGEMM's 1 x 128 activation groups): no pass over the rows past the counts. h is
    # quantized per row per 128 columns in the epilogue: hq (E, C, I) and hs (E, C, I / 128).
    e, pid_m, pid_n, count, live = _masked_tile(counts_ptr, C, num_m, num_n, BLOCK_M)
    if live:
        ex, rows, valid, rn, n_in = _tile_rows(e, pid_m, pid_n, count, N, BLOCK_M, SCALE_BLOCK)
        rk = tl.arange(0, SCALE_BLOCK)
        a_ptrs = x_ptr + ex * stride_xe + rows[:, None] * stride_xm + rk[None, :] * stride_xk    # [BM, B]
        g_ptrs = w_ptr + ex * stride_we + rn.to(tl.int64)[None, :] * stride_wn + rk[:, None] * stride_wk
        u_ptrs = g_ptrs + N * stride_wn                                                        # [B, B]
        gs_ptr = ws_ptr + ex * stride_wse + pid_n * stride_wsn
        us_ptr = gs_ptr + (N // SCALE_BLOCK) * stride_wsn
        acc_g = tl.zeros((BLOCK_M, SCALE_BLOCK), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, SCALE_BLOCK), dtype=tl.float32)
        for kb in range(0, K // SCALE_BLOCK):
            a = tl.load(a_ptrs, mask=valid[:, None], other=0.0).to(tl.float32)
            q, a_s = quantize_groups(a, UE8M0, STANDIN)                # rows past the count: 0
            q = q.to(w_ptr.dtype.element_ty)
            g = tl.load(g_ptrs)
            u = tl.load(u_ptrs)
            g_s = tl.load(gs_ptr + kb * stride_wsk)
            u_s = tl.load(us_ptr + kb * stride_wsk)
            acc_g += tl.dot(q, g) * (a_s[:, None] * g_s)
            acc_u += tl.dot(q, u) * (a_s[:, None] * u_s)
            a_ptrs += SCALE_BLOCK * stride_xk
            g_ptrs += SCALE_BLOCK * stride_wk
            u_ptrs += SCALE_BLOCK * stride_wk
        h = acc_g * tl.sigmoid(acc_g) * acc_u                          # silu(gate) * up, fp32
        hq, h_s = quantize_groups(h, UE8M0, STANDIN)
        h_ptrs = h_ptr + ex * stride_he + rows[:, None] * stride_hm + rn[None, :] * stride_hn
        tl.store(h_ptrs, hq.to(h_ptr.dtype.element_ty), mask=valid[:, None])
        tl.store(hs_ptr + ex * stride_hse + rows * stride_hsm + pid_n, h_s, mask=valid)


@triton.jit
def masked_gemm2_fp8_kernel(
    h_ptr, hs_ptr, w_ptr, ws_ptr, y_ptr, rw_ptr, counts_ptr,
    C, N, K, num_m, num_n,
    stride_he, stride_hm, stride_hk, stride_hse, stride_hsm, stride_hsk,
    stride_we, stride_wn, stride_wk, stride_wse, stride_wsn, stride_wsk,
    stride_ye, stride_ym, stride_yn, stride_re, stride_rm,
    HAS_ROW_WEIGHTS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    # Block-scaled FP8 (w8a8). N = H, K = I (a multiple of 128); BLOCK_K divides 128, so each step
    # has one scale of hq's row and one of each weight row's block.
    e, pid_m, pid_n, count, live = _masked_tile(counts_ptr, C, num_m, num_n, BLOCK_M)
    if live:
        ex, rows, valid, rn, n_in = _tile_rows(e, pid_m, pid_n, count, N, BLOCK_M, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        a_ptrs = h_ptr + ex * stride_he + rows[:, None] * stride_hm + rk[None, :] * stride_hk    # [BM, BK]
        as_ptrs = hs_ptr + ex * stride_hse + rows * stride_hsm                                 # [BM]
        b_ptrs = w_ptr + ex * stride_we + rn.to(tl.int64)[None, :] * stride_wn + rk[:, None] * stride_wk
        bs_ptrs = ws_ptr + ex * stride_wse + (rn // SCALE_BLOCK) * stride_wsn                  # [BN]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kb = k0 // SCALE_BLOCK
            a = tl.load(a_ptrs, mask=valid[:, None], other=0.0)
            a_s = tl.load(as_ptrs + kb * stride_hsk, mask=valid, other=0.0)
            b = tl.load(b_ptrs, mask=n_in[None, :], other=0.0)
            b_s = tl.load(bs_ptrs + kb * stride_wsk, mask=n_in, other=0.0)
            acc += tl.dot(a, b) * (a_s[:, None] * b_s[None, :])
            a_ptrs += BLOCK_K * stride_hk
            b_ptrs += BLOCK_K * stride_wk
        if HAS_ROW_WEIGHTS:
            wt = tl.load(rw_ptr + ex * stride_re + rows * stride_rm, mask=valid, other=0.0)
            acc = acc * wt.to(tl.float32)[:, None]
        y_ptrs = y_ptr + ex * stride_ye + rows[:, None] * stride_ym + rn[None, :] * stride_yn
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=valid[:, None] & n_in[None, :])
