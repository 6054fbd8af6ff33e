"""Block-scaled FP8 (w8a8) tiles of the grouped GEMMs, on the bf16 kernels' tile loop
(`moekit.grouped_gemm.kernels._for_each_tile`: paired blocks, persistent grid, swizzle alike).

Legend: T tokens, K top_k, S = T * K pairs, E experts, H hidden, I intermediate, L padded rows,
B = 128 (the scale block), BM/BN/BK tile sizes (BK divides B).

    GEMM1  xq (T, H) e4m3, xs (T, H / B) --gather rows pair // K--> per BK step:
           dot(xq rows, gate_e^T) * xs[row, k / B] * gate_scale[e, n / B, k / B]  (same for up), fp32
           -> silu(gate) * up -> quantized per row per B columns (BN = B: one group a tile)
           -> hq (L, I) e4m3 and hs (L, I / B) at the SORTED row (padding rows: zeros)
    GEMM2  hq rows (sorted, contiguous) @ down_e^T per BK step, times hs[row, k / B] and
           down_scale[e, n / B, k / B] -> * routing weight -> y (S, H) in the output dtype at the
           PAIR row

Each BK step's dot starts from zero and is scaled into the fp32 accumulator (DeepGEMM's and vLLM's
promotion per scale block: the tensor cores' fp8 accumulation never runs past one block). Issuing
the next step's dot before scaling in the last one measured slower on the H200 (Triton waits on
the dot at once either way, and the extra products spill). With TMA_W the weight tiles come through
a TMA descriptor over the data's 2D view, as in the bf16 kernels. STANDIN:
operands are float16 stand-ins (Triton's interpreter) and h is rounded to the e4m3 grid
arithmetically (`moekit.quant.kernels`).
"""

import moekit.kernels  # noqa: F401  (first: the interpreter switch, before triton is imported)

# isort: split
import triton
import triton.language as tl

from moekit.grouped_gemm.kernels import _for_each_tile, sorted_rows, store_pair_rows
from moekit.kernels.pdl import pdl_enter
from moekit.quant.kernels import quantize_groups

SCALE_BLOCK = tl.constexpr(128)


@triton.jit
def _gemm1_fp8_tile(x_ptr, w_ptr, h_ptr, hs_ptr, sorted_ids_ptr, row0, e, pid_n, S, N, K, strides, scales,
                    TOP_K: tl.constexpr, M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    EVEN_K: tl.constexpr, DOT_PRECISION: tl.constexpr, flags):
    """One [M, BLOCK_N = 128] tile of hq and its [M] scales: M sorted rows from row0, all of expert e
    (`_paired`'s signature; strides of xq, gate_up and hq; scales = (xs, its 2 strides, gate_up's
    scales, their 3 strides, the stride of hs's rows); flags = (UE8M0, STANDIN, TMA_W)). w_ptr: the
    gate_up data, or with TMA_W its descriptor over (E * 2N, K) with block [BLOCK_N, BLOCK_K]."""
    stride_xt, stride_xk, stride_we, stride_wn, stride_wk, stride_hm, stride_hn = strides
    xs_ptr, stride_xst, stride_xsk, ws_ptr, stride_wse, stride_wsn, stride_wsk, stride_hsm = scales
    UE8M0: tl.constexpr = flags[0]
    STANDIN: tl.constexpr = flags[1]
    TMA_W: tl.constexpr = flags[2]
    rows, pair, valid, tok = sorted_rows(sorted_ids_ptr, row0, S, TOP_K, M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)                       # [BN], N % BN == 0
    rk = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + tok[:, None] * stride_xt + rk[None, :] * stride_xk                       # [M, BK]
    as_ptrs = xs_ptr + tok * stride_xst                                                       # [M]
    if TMA_W:
        g_row = (e * (2 * N) + pid_n * BLOCK_N).to(tl.int32)     # the launcher checks E * 2N < 2**31
        g_ptrs = w_ptr
        u_ptrs = w_ptr
    else:
        g_row = 0
        g_ptrs = w_ptr + e * stride_we + rn.to(tl.int64)[None, :] * stride_wn + rk[:, None] * stride_wk
        u_ptrs = g_ptrs + N * stride_wn
    gs_ptr = ws_ptr + e * stride_wse + (pid_n * BLOCK_N // SCALE_BLOCK) * stride_wsn
    us_ptr = gs_ptr + (N // SCALE_BLOCK) * stride_wsn
    acc_g = tl.zeros((M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kb = k0 // SCALE_BLOCK
        a = tl.load(a_ptrs, mask=valid[:, None], other=0.0)
        a_s = tl.load(as_ptrs + kb * stride_xsk, mask=valid, other=0.0)
        if TMA_W:
            g = w_ptr.load([g_row, k0]).T                              # [BK, BN]
            u = w_ptr.load([g_row + N, k0]).T
        else:
            g = tl.load(g_ptrs)
            u = tl.load(u_ptrs)
            g_ptrs += BLOCK_K * stride_wk
            u_ptrs += BLOCK_K * stride_wk
        g_s = tl.load(gs_ptr + kb * stride_wsk)
        u_s = tl.load(us_ptr + kb * stride_wsk)
        acc_g += tl.dot(a, g) * (a_s[:, None] * g_s)
        acc_u += tl.dot(a, u) * (a_s[:, None] * u_s)
        a_ptrs += BLOCK_K * stride_xk
    h = acc_g * tl.sigmoid(acc_g) * acc_u                              # silu(gate) * up, fp32
    q, scale = quantize_groups(h, UE8M0, STANDIN)                      # padding rows: h = 0, q = 0
    h_ptrs = h_ptr + rows.to(tl.int64)[:, None] * stride_hm + rn[None, :] * stride_hn
    tl.store(h_ptrs, q.to(h_ptr.dtype.element_ty))
    tl.store(hs_ptr + rows.to(tl.int64) * stride_hsm + pid_n, scale)


@triton.jit
def moe_gemm1_fp8_kernel(
    x_ptr, w_ptr, h_ptr, sorted_ids_ptr, expert_ids_ptr, block_codes_ptr, num_padded_ptr,
    S, N, K, num_n_tiles,
    stride_xt, stride_xk, stride_we, stride_wn, stride_wk, stride_hm, stride_hn,
    xs_ptr, stride_xst, stride_xsk, ws_ptr, stride_wse, stride_wsn, stride_wsk, hs_ptr, stride_hsm,
    TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, PAIRED: tl.constexpr, UE8M0: tl.constexpr, STANDIN: tl.constexpr,
    TMA_W: tl.constexpr = False, PERSISTENT: tl.constexpr = False, FLATTEN: tl.constexpr = False,
    USE_PDL: tl.constexpr = False,
):
    # N = I (columns of each half), K = H; w: gate_up data (E, 2N, K), or with TMA_W its descriptor;
    # hs (L, N / 128) fp32.
    pdl_enter(USE_PDL)
    strides = (stride_xt, stride_xk, stride_we, stride_wn, stride_wk, stride_hm, stride_hn)
    scales = (xs_ptr, stride_xst, stride_xsk, ws_ptr, stride_wse, stride_wsn, stride_wsk, stride_hsm)
    _for_each_tile(_gemm1_fp8_tile, PERSISTENT, num_padded_ptr, num_n_tiles, block_codes_ptr, expert_ids_ptr,
                   x_ptr, w_ptr, h_ptr, hs_ptr, sorted_ids_ptr, S, N, K, strides, scales, TOP_K, BLOCK_M,
                   BLOCK_N, BLOCK_K, GROUP_M, True, "", PAIRED, (UE8M0, STANDIN, TMA_W), FLATTEN)


@triton.jit
def _gemm2_fp8_tile(h_ptr, w_ptr, y_ptr, topk_weights_ptr, sorted_ids_ptr, row0, e, pid_n, S, N, K, strides,
                    scales, TOP_K: tl.constexpr, M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, DOT_PRECISION: tl.constexpr, flags):
    """One [M, BLOCK_N] tile of y: M sorted rows from row0 (expert e), weighted, scattered to pair
    rows (`_paired`'s signature; strides of hq, down and y; scales = (hs, its 2 strides, down's
    scales, their 3 strides, unused); flags = (unused, unused, TMA_W)). w_ptr: the down data, or
    with TMA_W its descriptor over (E * N, K) with block [BLOCK_N, BLOCK_K]."""
    stride_hm, stride_hk, stride_we, stride_wn, stride_wk, stride_ym, stride_yn = strides
    hs_ptr, stride_hsm, stride_hsk, ws_ptr, stride_wse, stride_wsn, stride_wsk, _unused = scales
    TMA_W: tl.constexpr = flags[2]
    rows, pair, valid, _tok = sorted_rows(sorted_ids_ptr, row0, S, 1, M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_in = rn < N
    rk = tl.arange(0, BLOCK_K)
    # Padding rows of hq hold zeros (GEMM1 wrote them): no row mask.
    a_ptrs = h_ptr + rows.to(tl.int64)[:, None] * stride_hm + rk[None, :] * stride_hk         # [M, BK]
    as_ptrs = hs_ptr + rows.to(tl.int64) * stride_hsm
    if TMA_W:
        b_row = (e * N + pid_n * BLOCK_N).to(tl.int32)                # the launcher checks E * N < 2**31
        b_ptrs = w_ptr
    else:
        b_row = 0
        b_ptrs = w_ptr + e * stride_we + rn.to(tl.int64)[None, :] * stride_wn + rk[:, None] * stride_wk
    bs_ptrs = ws_ptr + e * stride_wse + (rn // SCALE_BLOCK) * stride_wsn                     # [BN]
    acc = tl.zeros((M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kb = k0 // SCALE_BLOCK
        a = tl.load(a_ptrs)
        a_s = tl.load(as_ptrs + kb * stride_hsk)
        if TMA_W:       # rows past N (the next expert's, or zeros past the last) are dropped at the store
            b = w_ptr.load([b_row, k0]).T
        else:
            b = tl.load(b_ptrs, mask=n_in[None, :], other=0.0)
            b_ptrs += BLOCK_K * stride_wk
        b_s = tl.load(bs_ptrs + kb * stride_wsk, mask=n_in, other=0.0)
        acc += tl.dot(a, b) * (a_s[:, None] * b_s[None, :])
        a_ptrs += BLOCK_K * stride_hk
    store_pair_rows(acc, y_ptr, topk_weights_ptr, pair, valid, rn, n_in, stride_ym, stride_yn, True)


@triton.jit
def moe_gemm2_fp8_kernel(
    h_ptr, w_ptr, y_ptr, topk_weights_ptr, sorted_ids_ptr, expert_ids_ptr, block_codes_ptr, num_padded_ptr,
    S, N, K, num_n_tiles,
    stride_hm, stride_hk, stride_we, stride_wn, stride_wk, stride_ym, stride_yn,
    hs_ptr, stride_hsm, stride_hsk, ws_ptr, stride_wse, stride_wsn, stride_wsk,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    PAIRED: tl.constexpr, TMA_W: tl.constexpr = False, PERSISTENT: tl.constexpr = False,
    FLATTEN: tl.constexpr = False, USE_PDL: tl.constexpr = False,
):
    # N = H, K = I; w: down data (E, N, K); hq (L, K) and hs (L, K / 128) from GEMM1.
    pdl_enter(USE_PDL)
    strides = (stride_hm, stride_hk, stride_we, stride_wn, stride_wk, stride_ym, stride_yn)
    scales = (hs_ptr, stride_hsm, stride_hsk, ws_ptr, stride_wse, stride_wsn, stride_wsk, 0)
    _for_each_tile(_gemm2_fp8_tile, PERSISTENT, num_padded_ptr, num_n_tiles, block_codes_ptr, expert_ids_ptr,
                   h_ptr, w_ptr, y_ptr, topk_weights_ptr, sorted_ids_ptr, S, N, K, strides, scales, 1,
                   BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, True, "", PAIRED, (False, False, TMA_W), FLATTEN)
