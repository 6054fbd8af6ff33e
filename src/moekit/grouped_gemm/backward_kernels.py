"""Backward of the grouped GEMM family: fused SwiGLU backward, per-expert weight gradients, and the
reduction of the routing-weight gradient.

Legend as in the forward (`moekit.grouped_gemm.kernels`): T tokens, K top_k, S = T*K pairs, E experts,
H hidden, I intermediate, L padded rows, BM/BN/BK tiles. r is a sorted row, p = sorted_ids[r] its pair,
t = p // K its token, e its expert, w_p its routing weight; dout (T, H) is the gradient of the output.

    SWIGLU_BWD  per sorted row block (one expert) and I tile, one loop over H:
                g = dout[t] @ down_e                                  (fp32 acc)
                a, b = pre[r] (L, 2I): the forward's GEMM1 saved them (STORE_PRE), loaded as fp32
                   or, RECOMPUTE: a = x[t] @ gate_e^T, b = x[t] @ up_e^T in the same loop (3 accs)
                -> h = silu(a) * b, dpre = [g * b * silu'(a), g * silu(a)]   (fp32)
                -> dpre_w (L, 2I) = w_p * dpre at the sorted row (for d gate_up, dx)
                -> h_w (L, I) = w_p * h at the sorted row (for d down)
                   (each rounded once from fp32; w_p = 0 on padding rows)
                -> part (L, n_tiles) = sum over the tile's columns of g * h, unscaled (d topk_weights)
    TILE_SUM    dw[p] = sum over the I tiles of part[r], in tile order, stored at the pair row
    WGRAD       C[e] (N, C) = sum over e's rows of A[row]^T @ B[row] (SCALE: w_p * A[row]^T @ B[row]):
                one program per (e, N tile, C tile) walking the expert's rows in order, BM at a
                time (its own tiles, `moekit.tuning.WgradConfig`). No atomics: deterministic.
                d down_e     = dout[t]^T @ h_w[r]        A gathered by token, B sorted rows
                d gate_up_e  = dpre_w[r]^T @ x[t]        A sorted rows, B gathered by token
                (SCALE: d down_e = (w dout[t])^T @ h[r], for an unscaled h: the forward's GEMM1
                recomputing h alone when only down_proj needs a gradient)
    dx          the forward's GEMM2 on (dpre_w, gate_up_e viewed as (H, 2I)) without the routing-
                weight epilogue (MUL_W off), then SUM over the slots.
    GATHER_ROWS x_sorted[r] = x[t] (or dout): the gathered operand copied into sorted-row order, 0 on
                padding rows, for the Hopper Gluon weight gradient (`moekit.grouped_gemm.gluon_wgrad`),
                which reads both operands by TMA.

dpre_w and h_w carry the routing weight (dh = w_p * g), applied once in the SwiGLU backward's fp32
epilogue, so the weight gradients feed both tiles straight to the dot and dx needs no multiply;
d topk_weights = <g, h> uses the unscaled h. Padding rows (and columns past I) load zeros, from x,
dout and the saved pre-activations alike (masked loads, so whatever a padding row of pre holds never
reaches a result), so every row of a live block is written (zeros there); pairs whose id lies
outside [0, E) are never placed, so never gathered.
"""

import moekit.kernels  # noqa: F401  (first: the interpreter switch, before triton is imported)

# isort: split
import triton
import triton.language as tl

from moekit.grouped_gemm.kernels import _tile_ids
from moekit.kernels.pdl import pdl_enter


@triton.jit
def _swiglu_bwd_epilogue(acc_g, a, b, wt, rows64, rn64, n_in, col, num_part_cols, N,
                         dpre_ptr, h_ptr, part_ptr, stride_pm, stride_pn, stride_hm, stride_hn, stride_qm,
                         STORE_DPRE: tl.constexpr, STORE_H: tl.constexpr, STORE_PART: tl.constexpr):
    """One column tile's outputs from g (acc_g) and a, b (fp32 [BM, BN]): part column `col` (if
    it exists: a second half past N has none), h_w and dpre_w; wt [BM, 1] the routing weights."""
    sig = tl.sigmoid(a)                                                # [BM, BN] fp32
    silu = a * sig
    h = silu * b
    if STORE_PART:   # d topk_weights: the unscaled <g, h>
        if col < num_part_cols:
            part = tl.sum(acc_g * h, axis=1)                           # [BM]; masked columns are 0
            tl.store(part_ptr + rows64 * stride_qm + col, part)
    if STORE_H:
        h_ptrs = h_ptr + rows64[:, None] * stride_hm + rn64[None, :] * stride_hn
        tl.store(h_ptrs, (wt * h).to(h_ptr.dtype.element_ty), mask=n_in[None, :])
    if STORE_DPRE:
        gw = wt * acc_g                                                # dh = w_p g
        d_gate = gw * b * sig * (1.0 + a * (1.0 - sig))                # silu'(a) = s (1 + a (1 - s))
        d_up = gw * silu
        p_ptrs = dpre_ptr + rows64[:, None] * stride_pm + rn64[None, :] * stride_pn      # gate half
        tl.store(p_ptrs, d_gate.to(dpre_ptr.dtype.element_ty), mask=n_in[None, :])
        tl.store(p_ptrs + N * stride_pn, d_up.to(dpre_ptr.dtype.element_ty), mask=n_in[None, :])


@triton.jit
def _load_pre(pre_ptr, rows64, rn64, valid, n_in, N, stride_am, stride_an):
    """(a, b) [BM, BN] in the saved dtype: the gate and up pre-activations of these rows and
    columns; padding rows and columns past N read 0 (whatever the buffer holds there)."""
    pre_mask = valid[:, None] & n_in[None, :]
    a_ptrs = pre_ptr + rows64[:, None] * stride_am + rn64[None, :] * stride_an         # gate half
    return (tl.load(a_ptrs, mask=pre_mask, other=0.0),
            tl.load(a_ptrs + N * stride_an, mask=pre_mask, other=0.0))                # up half


@triton.jit
def _pre_f32(pre_ptr, rows64, rn64, valid, n_in, N, stride_am, stride_an, a_early, b_early,
             PRE_FIRST: tl.constexpr):
    """(a, b) fp32 [BM, BN]: the tiles loaded before the loop (PRE_FIRST), else loaded now."""
    if PRE_FIRST:
        a, b = a_early, b_early
    else:
        a, b = _load_pre(pre_ptr, rows64, rn64, valid, n_in, N, stride_am, stride_an)
    return a.to(tl.float32), b.to(tl.float32)


@triton.jit
def moe_swiglu_bwd_kernel(
    x_ptr, dout_ptr, w1_ptr, w2_ptr, pre_ptr, topk_weights_ptr, dpre_ptr, h_ptr, part_ptr,
    sorted_ids_ptr, expert_ids_ptr, num_padded_ptr,
    S, N, K, num_n_tiles, num_part_cols,
    stride_xt, stride_xk, stride_dt, stride_dk,
    stride_w1e, stride_w1n, stride_w1k, stride_w2e, stride_w2k, stride_w2n,
    stride_am, stride_an, stride_pm, stride_pn, stride_hm, stride_hn, stride_qm,
    TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, EVEN_K: tl.constexpr, RECOMPUTE: tl.constexpr, STORE_DPRE: tl.constexpr,
    STORE_H: tl.constexpr, STORE_PART: tl.constexpr, DOT_PRECISION: tl.constexpr,
    PRE_FIRST: tl.constexpr = False, HALVES: tl.constexpr = 1,
):
    # N = I, K = H. w1 = gate_up (E, 2I, H), w2 = down (E, H, I). RECOMPUTE: a, b from x and w1 in
    # the loop over H (pre_ptr unused); else from pre (L, 2I) [gate | up] at the sorted rows (x_ptr,
    # w1_ptr unused). topk_weights (S,) contiguous: w_p scales the stored dpre and h.
    # HALVES 2 (reading pre only): a program owns 2 * BLOCK_N columns as two halves with an
    # accumulator each, sharing every dout tile the loop loads (half the row-tile reads of two
    # programs), then runs the epilogue half by half. part has num_part_cols = cdiv(N, BLOCK_N)
    # columns either way; num_n_tiles counts the programs' column tiles.
    tl.static_assert(HALVES == 1 or (HALVES == 2 and not RECOMPUTE), "HALVES 2 reads the saved pre")
    pid_m, pid_n, live = _tile_ids(num_padded_ptr, num_n_tiles, BLOCK_M, GROUP_M)
    if live:
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)                 # sorted rows [BM]
        pair = tl.load(sorted_ids_ptr + rows)                          # pair ids; S = padding
        valid = pair < S
        tok = (pair // TOP_K).to(tl.int64)
        e = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
        rn = pid_n * (HALVES * BLOCK_N) + tl.arange(0, BLOCK_N)        # [BN], the first half
        n_in = rn < N
        rn64 = rn.to(tl.int64)
        rows64 = rows.to(tl.int64)
        rk = tl.arange(0, BLOCK_K)                                     # [BK]
        if HALVES == 2:
            rn_hi = rn + BLOCK_N
            n_in_hi = rn_hi < N
            rn64_hi = rn_hi.to(tl.int64)

        d_ptrs = dout_ptr + tok[:, None] * stride_dt + rk[None, :] * stride_dk            # [BM, BK]
        v_ptrs = w2_ptr + e * stride_w2e + rk[:, None] * stride_w2k + rn64[None, :] * stride_w2n  # [BK, BN]
        a_early = None          # the pre-activation tiles loaded before the loop (PRE_FIRST)
        b_early = None
        a_early_hi = None
        b_early_hi = None
        if not RECOMPUTE:
            if PRE_FIRST:   # issued before the loop: the loads land while the GEMM runs
                a_early, b_early = _load_pre(pre_ptr, rows64, rn64, valid, n_in, N, stride_am, stride_an)
                if HALVES == 2:
                    a_early_hi, b_early_hi = _load_pre(pre_ptr, rows64, rn64_hi, valid, n_in_hi, N,
                                                       stride_am, stride_an)
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if HALVES == 2:
            acc_hi = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if RECOMPUTE:
            x_ptrs = x_ptr + tok[:, None] * stride_xt + rk[None, :] * stride_xk           # [BM, BK]
            g_ptrs = w1_ptr + e * stride_w1e + rn64[None, :] * stride_w1n + rk[:, None] * stride_w1k
            u_ptrs = g_ptrs + N * stride_w1n                                               # [BK, BN]
            acc_a = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            acc_b = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            if EVEN_K:
                row_mask = valid[:, None]
                col_mask = n_in[None, :]
                if HALVES == 2:
                    col_mask_hi = n_in_hi[None, :]
            else:
                k_in = rk + k0 < K
                row_mask = valid[:, None] & k_in[None, :]
                col_mask = k_in[:, None] & n_in[None, :]
                if HALVES == 2:
                    col_mask_hi = k_in[:, None] & n_in_hi[None, :]
            da = tl.load(d_ptrs, mask=row_mask, other=0.0)
            v = tl.load(v_ptrs, mask=col_mask, other=0.0)
            if RECOMPUTE:
                xa = tl.load(x_ptrs, mask=row_mask, other=0.0)
                g = tl.load(g_ptrs, mask=col_mask, other=0.0)
                u = tl.load(u_ptrs, mask=col_mask, other=0.0)
                acc_a = tl.dot(xa, g, acc_a, input_precision=DOT_PRECISION)
                acc_b = tl.dot(xa, u, acc_b, input_precision=DOT_PRECISION)
                x_ptrs += BLOCK_K * stride_xk
                g_ptrs += BLOCK_K * stride_w1k
                u_ptrs += BLOCK_K * stride_w1k
            acc_g = tl.dot(da.to(v.dtype), v, acc_g, input_precision=DOT_PRECISION)
            if HALVES == 2:
                v_hi = tl.load(v_ptrs + BLOCK_N * stride_w2n, mask=col_mask_hi, other=0.0)
                acc_hi = tl.dot(da.to(v_hi.dtype), v_hi, acc_hi, input_precision=DOT_PRECISION)
            d_ptrs += BLOCK_K * stride_dk
            v_ptrs += BLOCK_K * stride_w2k

        if RECOMPUTE:
            a = acc_a
            b = acc_b
        else:
            a, b = _pre_f32(pre_ptr, rows64, rn64, valid, n_in, N, stride_am, stride_an, a_early, b_early,
                            PRE_FIRST)
        wt = tl.load(topk_weights_ptr + pair, mask=valid, other=0.0).to(tl.float32)[:, None]  # [BM, 1]
        _swiglu_bwd_epilogue(acc_g, a, b, wt, rows64, rn64, n_in, HALVES * pid_n, num_part_cols, N,
                             dpre_ptr, h_ptr, part_ptr, stride_pm, stride_pn, stride_hm, stride_hn, stride_qm,
                             STORE_DPRE, STORE_H, STORE_PART)
        if HALVES == 2:
            a_hi, b_hi = _pre_f32(pre_ptr, rows64, rn64_hi, valid, n_in_hi, N, stride_am, stride_an,
                                  a_early_hi, b_early_hi, PRE_FIRST)
            _swiglu_bwd_epilogue(acc_hi, a_hi, b_hi, wt, rows64, rn64_hi, n_in_hi, 2 * pid_n + 1,
                                 num_part_cols, N, dpre_ptr, h_ptr, part_ptr, stride_pm, stride_pn,
                                 stride_hm, stride_hn, stride_qm, STORE_DPRE, STORE_H, STORE_PART)


@triton.jit
def moe_tile_sum_kernel(
    part_ptr, out_ptr, sorted_ids_ptr, num_padded_ptr, S, num_tiles, stride_qm,
    BLOCK_M: tl.constexpr, BLOCK_T: tl.constexpr, USE_PDL: tl.constexpr = False,
):
    """out[p] = sum over tiles of part[r] (tile order) for each placed pair p = sorted_ids[r].
    USE_PDL: launched with programmatic dependent launch (`moekit.launch_hints`)."""
    pdl_enter(USE_PDL)
    pid = tl.program_id(0)
    if pid * BLOCK_M < tl.load(num_padded_ptr):
        rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)                   # [BM]
        pair = tl.load(sorted_ids_ptr + rows)
        valid = pair < S
        rt = tl.arange(0, BLOCK_T)                                     # [BT]
        q_ptrs = part_ptr + rows.to(tl.int64)[:, None] * stride_qm + rt[None, :]
        acc = tl.zeros((BLOCK_M,), dtype=tl.float32)
        for t0 in range(0, num_tiles, BLOCK_T):
            q = tl.load(q_ptrs, mask=(rt + t0 < num_tiles)[None, :], other=0.0)   # [BM, BT]
            acc += tl.sum(q, axis=1)
            q_ptrs += BLOCK_T
        tl.store(out_ptr + pair.to(tl.int64), acc.to(out_ptr.dtype.element_ty), mask=valid)


@triton.jit
def _operand_tiles(a_cols, b_cols, rows, tok, a_mask, b_mask, stride_ar, stride_br,
                   A_BY_TOKEN: tl.constexpr, B_BY_TOKEN: tl.constexpr):
    """The weight gradient's two tiles at one row step: a's [BLOCK_N, BLOCK_M] and b's [BLOCK_M,
    BLOCK_C], each operand's rows by token (tok) or in sorted-row order (rows)."""
    ra = tok if A_BY_TOKEN else rows
    rb = tok if B_BY_TOKEN else rows
    a = tl.load(a_cols + ra.to(tl.int64)[None, :] * stride_ar, mask=a_mask, other=0.0)   # [BN, BM]
    b = tl.load(b_cols + rb.to(tl.int64)[:, None] * stride_br, mask=b_mask, other=0.0)   # [BM, BC]
    return a, b


@triton.jit
def moe_wgrad_kernel(
    a_ptr, b_ptr, scale_ptr, c_ptr, sorted_ids_ptr, row_starts_ptr,
    S, N, C, num_n_tiles, num_c_tiles,
    stride_ar, stride_an, stride_br, stride_bc, stride_ce, stride_cn, stride_cc,
    TOP_K: tl.constexpr, A_BY_TOKEN: tl.constexpr, B_BY_TOKEN: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr, NUM_STAGES: tl.constexpr,
    DOT_PRECISION: tl.constexpr, SCALE: tl.constexpr, PADDING_ZERO: tl.constexpr = False,
):
    """C[e] (N, C) = sum over expert e's sorted rows r of [scale[p] *] A[ra]^T B[rb].

    ra / rb is the token t = p // K when *_BY_TOKEN, else the sorted row r. Rows of e lie in
    [row_starts[e], row_starts[e + 1]); an expert with no rows gets an exact zero tile. Programs
    run expert by expert (e slowest), so the programs in flight share one expert's rows in L2 and
    walk them in step. Row, pair and token indices are int32 (fewer than 2**31 pairs); element
    offsets are int64 (T * H may not be). SCALE False (the training step's launches: the SwiGLU
    backward stores dpre and h already scaled): both tiles go from global memory to the dot
    untouched, so the pipeliner streams both asynchronously; scale_ptr is not read. SCALE: the
    routing weight scales the smaller operand tile (B on a tie), in fp32 with one rounding back,
    as w * A would be; only the other tile is streamed asynchronously.
    PADDING_ZERO: the sorted-row operand holds zeros on the expert's padding rows (the SwiGLU
    backward writes them so), so its loads need no index: masked by rows < end alone, they no longer
    wait for the sorted_ids load and the pipeliner can fetch them ahead. The gathered operand's
    padding rows then read the expert's first token (a row that is the expert's own; its product
    with the zero rows is 0) instead of being masked. With neither operand by token (the gathered
    one copied into sorted-row order beforehand, finite on its padding rows, the other zero there)
    and no scale, the loop loads no index at all.
    """
    pid = tl.program_id(0)
    tiles = num_n_tiles * num_c_tiles
    e = pid // tiles
    pid_n = (pid % tiles) // num_c_tiles
    pid_c = pid % num_c_tiles
    start = tl.load(row_starts_ptr + e)
    end = tl.load(row_starts_ptr + e + 1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)                       # [BN]
    rc = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)                       # [BC]
    n_in = rn < N
    c_in = rc < C
    a_cols = a_ptr + rn.to(tl.int64)[:, None] * stride_an              # [BN, 1]
    b_cols = b_ptr + rc.to(tl.int64)[None, :] * stride_bc              # [1, BC]
    rm = tl.arange(0, BLOCK_M)                                         # [BM]

    acc = tl.zeros((BLOCK_N, BLOCK_C), dtype=tl.float32)
    INDEXED: tl.constexpr = not PADDING_ZERO or A_BY_TOKEN or B_BY_TOKEN or SCALE
    if PADDING_ZERO:   # an expert with rows has a pair in its first row
        tl.static_assert(not (A_BY_TOKEN and B_BY_TOKEN), "PADDING_ZERO needs a sorted-row operand")
        first_tok = tl.load(sorted_ids_ptr + start, mask=start < end, other=0) // TOP_K
    for r0 in tl.range(start, end, BLOCK_M, num_stages=NUM_STAGES):
        rows = r0 + rm
        if INDEXED:
            pair = tl.load(sorted_ids_ptr + rows, mask=rows < end, other=S)
            valid = pair < S
        else:             # both operands in sorted-row order: no index at all
            pair = rows
            valid = rows < end
        if PADDING_ZERO:
            tok = tl.where(valid, pair // TOP_K, first_tok)
            a_mask = n_in[:, None] if A_BY_TOKEN else (rows < end)[None, :] & n_in[:, None]
            b_mask = c_in[None, :] if B_BY_TOKEN else (rows < end)[:, None] & c_in[None, :]
        else:
            tok = pair // TOP_K
            a_mask = valid[None, :] & n_in[:, None]
            b_mask = valid[:, None] & c_in[None, :]
        a, b = _operand_tiles(a_cols, b_cols, rows, tok, a_mask, b_mask, stride_ar, stride_br,
                              A_BY_TOKEN, B_BY_TOKEN)                       # [BN, BM], [BM, BC]
        if SCALE:
            w = tl.load(scale_ptr + pair, mask=valid, other=0.0).to(tl.float32)      # [BM]
            if BLOCK_N < BLOCK_C:
                a = (a.to(tl.float32) * w[None, :]).to(b.dtype)
            else:
                a = a.to(b.dtype)
                b = (b.to(tl.float32) * w[:, None]).to(b.dtype)
        else:
            a = a.to(b.dtype)                                          # the same dtype: no conversion
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)

    c_ptrs = (c_ptr + e.to(tl.int64) * stride_ce + rn.to(tl.int64)[:, None] * stride_cn
              + rc.to(tl.int64)[None, :] * stride_cc)
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=n_in[:, None] & c_in[None, :])


@triton.jit
def moe_wgrad_range_kernel(
    a_ptr, b_ptr, c_ptr, sorted_ids_ptr, expert_ids_ptr, row_starts_ptr,
    S, E, N, C, num_n_tiles, num_c_tiles,
    stride_ar, stride_an, stride_br, stride_bc, stride_ce, stride_cn, stride_cc,
    TOP_K: tl.constexpr, A_BY_TOKEN: tl.constexpr, B_BY_TOKEN: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr, ALIGN_M: tl.constexpr,
    EXPERTS: tl.constexpr, EXPERTS_POW2: tl.constexpr, NUM_STAGES: tl.constexpr,
    DOT_PRECISION: tl.constexpr, PADDING_ZERO: tl.constexpr = False,
):
    """`moe_wgrad_kernel`'s unscaled sums, a program owning one (BN, BC) tile of EXPERTS consecutive
    experts' gradients [e0, e0 + EXPERTS): one loop over their sorted rows, which are contiguous
    ([row_starts[e0], row_starts[e0 + EXPERTS])), BM at a time, storing the accumulator and
    starting afresh where an expert's group ends. With a few hundred rows an expert, one program
    per expert tile runs a loop of a few steps whose pipeline fills and drains each time; here the
    pipeline runs across the experts' boundaries and fills once per EXPERTS tiles.

    Every expert's group is a whole number of ALIGN_M-row blocks (the align block size) and BLOCK_M
    divides ALIGN_M, so a step's rows lie in one block, of one expert: expert_ids[r0 // ALIGN_M].
    A step is its expert's last where the next step's block belongs to another expert (or the range
    ends): both come from loads that depend on r0 alone, so the pipeliner fetches them ahead with
    the sorted_ids. Experts of the range with no rows have no block: their zero tiles are stored
    before the loop (the range's row starts come in one gather; the scalar loop runs only when one
    of them is empty). EXPERTS_POW2: EXPERTS rounded up to a power of two. PADDING_ZERO as in
    `moe_wgrad_kernel`; a gathered operand's padding rows read the token of their block's first
    row (a pair of the same expert: every block starts with one).
    """
    pid = tl.program_id(0)
    tiles = num_n_tiles * num_c_tiles
    e0 = (pid // tiles) * EXPERTS                                      # groups slowest: L2 reuse
    pid_n = (pid % tiles) // num_c_tiles
    pid_c = pid % num_c_tiles
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)                       # [BN]
    rc = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)                       # [BC]
    n_in = rn < N
    c_in = rc < C
    c_mask = n_in[:, None] & c_in[None, :]
    c_tile = c_ptr + rn.to(tl.int64)[:, None] * stride_cn + rc.to(tl.int64)[None, :] * stride_cc
    a_cols = a_ptr + rn.to(tl.int64)[:, None] * stride_an              # [BN, 1]
    b_cols = b_ptr + rc.to(tl.int64)[None, :] * stride_bc              # [1, BC]
    rm = tl.arange(0, BLOCK_M)                                         # [BM]

    re = e0 + tl.arange(0, EXPERTS_POW2)                               # the range's experts, padded
    in_range = (re < e0 + EXPERTS) & (re < E)
    starts = tl.load(row_starts_ptr + re, mask=in_range, other=0)      # one gather, not a chain of
    ends = tl.load(row_starts_ptr + re + 1, mask=in_range, other=0)    # dependent scalar loads
    if tl.sum((in_range & (starts == ends)).to(tl.int32)) > 0:        # experts with no rows: 0
        for j in tl.static_range(EXPERTS):
            e = e0 + j
            if e < E:
                if tl.load(row_starts_ptr + e) == tl.load(row_starts_ptr + e + 1):
                    tl.store(c_tile + e.to(tl.int64) * stride_ce,
                             tl.zeros((BLOCK_N, BLOCK_C), dtype=c_ptr.dtype.element_ty), mask=c_mask)
    lo = tl.min(tl.where(in_range, starts, 2147483647))
    hi = tl.max(tl.where(in_range, ends, 0))

    acc = tl.zeros((BLOCK_N, BLOCK_C), dtype=tl.float32)
    for r0 in tl.range(lo, hi, BLOCK_M, num_stages=NUM_STAGES):
        rows = r0 + rm
        block = r0 // ALIGN_M
        e_here = tl.load(expert_ids_ptr + block)
        e_next = tl.load(expert_ids_ptr + (r0 + BLOCK_M) // ALIGN_M, mask=r0 + BLOCK_M < hi, other=-1)
        pair = tl.load(sorted_ids_ptr + rows)                          # rows < hi <= num_padded
        valid = pair < S
        if PADDING_ZERO:
            own_tok = tl.load(sorted_ids_ptr + block * ALIGN_M) // TOP_K
            tok = tl.where(valid, pair // TOP_K, own_tok)
            a_mask = n_in[:, None]
            b_mask = c_in[None, :]
        else:
            tok = pair // TOP_K
            a_mask = valid[None, :] & n_in[:, None]
            b_mask = valid[:, None] & c_in[None, :]
        a, b = _operand_tiles(a_cols, b_cols, rows, tok, a_mask, b_mask, stride_ar, stride_br,
                              A_BY_TOKEN, B_BY_TOKEN)                       # [BN, BM], [BM, BC]
        acc = tl.dot(a.to(b.dtype), b, acc, input_precision=DOT_PRECISION)
        if e_next != e_here:                                           # e_here's last step
            tl.store(c_tile + e_here.to(tl.int64) * stride_ce, acc.to(c_ptr.dtype.element_ty), mask=c_mask)
            acc = tl.zeros((BLOCK_N, BLOCK_C), dtype=tl.float32)


@triton.jit
def moe_gather_rows_kernel(
    src_ptr, dst_ptr, sorted_ids_ptr, num_padded_ptr, S, C,
    stride_st, stride_sc, stride_dr, stride_dc,
    TOP_K: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, USE_PDL: tl.constexpr = False,
):
    """dst[r] = src[t] for each sorted row r < num_padded of pair p = sorted_ids[r] < S (t = p // K),
    0 on its padding rows (p = S); rows at or past num_padded are not written (nobody reads them).
    A weight gradient's gathered operand copied into sorted-row order, so the Gluon kernel reads
    both operands by TMA with no index. USE_PDL: as `moe_tile_sum_kernel`'s."""
    pdl_enter(USE_PDL)
    pid_r = tl.program_id(0)
    num_padded = tl.load(num_padded_ptr)
    if pid_r * BLOCK_R < num_padded:
        rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)                 # [BR]
        live = rows < num_padded
        pair = tl.load(sorted_ids_ptr + rows, mask=live, other=S)      # in [0, S] below num_padded
        valid = pair < S
        tok = (pair // TOP_K).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)      # [BC]
        c_in = cols < C
        cols64 = cols.to(tl.int64)
        v = tl.load(src_ptr + tok[:, None] * stride_st + cols64[None, :] * stride_sc,
                    mask=valid[:, None] & c_in[None, :], other=0.0)     # [BR, BC]
        tl.store(dst_ptr + rows.to(tl.int64)[:, None] * stride_dr + cols64[None, :] * stride_dc, v,
                 mask=live[:, None] & c_in[None, :])
