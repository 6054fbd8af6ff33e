"""Grouped GEMM over pairs sorted by expert, and the final weighted sum.

Legend: T tokens, K top_k, S = T*K pairs, E experts, H hidden, I intermediate,
L = padded rows (`Alignment.sorted_ids` length), BM/BN/BK tile sizes.

    GEMM1  x (T, H) --gather rows pair//K--> [BM, BK] @ gate_up[e]^T -> gate, up (two fp32 accs)
           -> silu(gate) * up -> h (L, I), stored at the SORTED row (padding rows get zeros)
    GEMM2  h (L, I) contiguous sorted rows @ down[e]^T -> * routing weight (fp32)
           -> y (S, H), stored at the PAIR row (scatter on store; padding rows store nothing)
    SUM    out[t] = sum over slots j with a valid expert id of y[t*K + j], in fp32

Keeping h in sorted order makes GEMM2's loads contiguous. Each program owns one BM-row block (one
expert, from expert_ids) and one BN-column tile; programs past num_padded return at once, so the
grid can be sized from the fixed upper bound and the launch captured in a CUDA graph. With PAIRED,
experts are padded to BM rows but computed in tiles of 2 * BM where two of an expert's blocks
follow each other (`Alignment.block_codes`): big tiles for the bulk, padding bounded by BM.
The epilogues can be switched off (constexpr SWIGLU, MUL_W; the lab's `moekit ablate` measures
what fusing them saves): GEMM1 then stores [gate | up] pre-activations, h (L, 2I), and GEMM2 the
unweighted rows.

Extended expert math (`moekit.activation`), each a constexpr flag off by default, so the default
kernels compile as before:
    HAS_BIAS     GEMM1: + gate_up_bias[e] on the fp32 accumulators, before the activation (padding
                 rows then stored as zeros, as GEMM2 needs); GEMM2: + down_bias[e], before the
                 routing weight multiplies the row
    GPT_OSS      GEMM1's activation: (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g) with
                 g = min(gate, limit), in fp32 (alpha, limit runtime floats)
    INTERLEAVED  gate_up rows alternate gate, up: one [BK, 2 BN] tile of consecutive rows per step,
                 one dot, gate and up split in the epilogue (tl.reshape + tl.split)

For training, GEMM1's STORE_PRE (off by default; plain SwiGLU only: no bias, not interleaved, not
gpt_oss) stores, beside h, the fp32 gate and up accumulators rounded to the input dtype into a
contiguous (L, 2I) buffer at the sorted row ([gate | up], the layout SWIGLU False gives h; padding
rows zeros): the backward reads them instead of recomputing x @ gate_up^T
(`moekit.grouped_gemm.backward_kernels`). It is an epilogue store only, so it runs with TMA_W,
PAIRED and PERSISTENT alike.

With TMA_W (Hopper and later, `ExpertsConfig.tma_weights`), the weight operand `w` is a TMA tensor
descriptor over the weights' 2D view (E * rows, K) (rows = 2I for gate_up, H for down) with block
[BN, BK]; expert e's tile of columns n0.. starts at row e * rows + n0 (gate), + I (up). With
INTERLEAVED the block is [2 BN, BK] from row e * 2I + 2 n0: the same consecutive rows the pointer
path reads, one box per step. The gathered rows of x stay pointer loads: they are scattered. A tile
that runs past N (N not a multiple of BN) reads the rows after it (the up half, or the next
expert): those accumulator columns are dropped by the store mask (n_in), and past the last expert
TMA fills zeros. Columns past K read zeros. TMA_W changes only where the weight tiles come from:
the bias, activation and routing-weight epilogues are the pointer path's.

With PERSISTENT (`ExpertsConfig.persistent`), the launchers start as many programs as the device
holds at once (at most the tile bound) and each loops over tiles program_id, + num_programs, ...
(`_for_each_tile`) up to the live count, num_padded // BLOCK_M row blocks times the column tiles,
read on the device (no host sync; the grid stays a host-side bound, so the launch is graph-safe).
Tile numbers map to (row block, column tile) as the one-tile-per-program grid's do (`_swizzle`: GROUP_M
row blocks, in sorted order so one expert's blocks, then the next column tile): the programs in flight
share each weight tile in L2. The tile itself (TMA_W or pointers, PAIRED, every epilogue) is unchanged.
With PAIRED a persistent tile number covers two row blocks (a pair's second block holds no work: a
round robin over single blocks would hand some programs mostly empty tiles).
"""

import moekit.kernels  # noqa: F401  (first: the interpreter switch, before triton is imported)

# isort: split
import triton
import triton.language as tl

from moekit.kernels.pdl import pdl_enter


@triton.jit
def _swizzle(tile, num_m, num_n_tiles, GROUP_M: tl.constexpr):
    """(pid_m, pid_n) of tile number `tile`: GROUP_M row blocks share each weight tile while it is
    in L2 (the row blocks of a group, then the next column tile)."""
    per_group = GROUP_M * num_n_tiles
    first_m = (tile // per_group) * GROUP_M
    group_rows = tl.minimum(num_m - first_m, GROUP_M)
    group_rows = tl.maximum(group_rows, 1)
    pid_m = first_m + (tile % per_group) % group_rows
    pid_n = (tile % per_group) // group_rows
    return pid_m, pid_n


@triton.jit
def _tile_ids(num_padded_ptr, num_n_tiles, BLOCK_M: tl.constexpr, GROUP_M: tl.constexpr):
    """(pid_m, pid_n, live) of this program's tile (`_swizzle`); live False past num_padded."""
    pid = tl.program_id(0)
    num_m = tl.load(num_padded_ptr) // BLOCK_M
    live = pid < num_m * num_n_tiles
    pid_m, pid_n = _swizzle(pid, num_m, num_n_tiles, GROUP_M)
    return pid_m, pid_n, live


@triton.jit
def swiglu_k_loop(a_ptrs, g_ptrs, u_ptrs, valid, n_in, K, stride_ak, stride_wk,
                  M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  EVEN_K: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """(gate, up) fp32 [M, BLOCK_N] accumulators of rows a [M, K] times the gate and up tiles
    [K, BLOCK_N]; rows with valid False read as 0. Shared by the contiguous and masked layouts."""
    rk = tl.arange(0, BLOCK_K)
    acc_g = tl.zeros((M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=valid[:, None], other=0.0)
            g = tl.load(g_ptrs, mask=n_in[None, :], other=0.0)
            u = tl.load(u_ptrs, mask=n_in[None, :], other=0.0)
        else:
            k_in = rk + k0 < K
            a = tl.load(a_ptrs, mask=valid[:, None] & k_in[None, :], other=0.0)
            g = tl.load(g_ptrs, mask=k_in[:, None] & n_in[None, :], other=0.0)
            u = tl.load(u_ptrs, mask=k_in[:, None] & n_in[None, :], other=0.0)
        acc_g = tl.dot(a, g, acc_g, input_precision=DOT_PRECISION)
        acc_u = tl.dot(a, u, acc_u, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K * stride_ak
        g_ptrs += BLOCK_K * stride_wk
        u_ptrs += BLOCK_K * stride_wk
    return acc_g, acc_u


@triton.jit
def k_loop(a_ptrs, b_ptrs, valid, n_in, K, stride_ak, stride_bk,
           M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
           EVEN_K: tl.constexpr, DOT_PRECISION: tl.constexpr, MASK_ROWS: tl.constexpr):
    """fp32 [M, BLOCK_N] accumulator of rows a [M, K] times a tile b [K, BLOCK_N]. MASK_ROWS:
    rows with valid False read as 0; else every row is read (its memory holds zeros)."""
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            if MASK_ROWS:
                a = tl.load(a_ptrs, mask=valid[:, None], other=0.0)
            else:
                a = tl.load(a_ptrs)
            b = tl.load(b_ptrs, mask=n_in[None, :], other=0.0)
        else:
            k_in = rk + k0 < K
            a_mask = valid[:, None] & k_in[None, :] if MASK_ROWS else k_in[None, :]
            a = tl.load(a_ptrs, mask=a_mask, other=0.0)
            b = tl.load(b_ptrs, mask=k_in[:, None] & n_in[None, :], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    return acc


@triton.jit
def _rows_tile(a_ptrs, valid, k0, K, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, MASK_ROWS: tl.constexpr):
    """The [M, BLOCK_K] tile of rows a at columns k0..: rows with valid False (MASK_ROWS) and
    columns past K read as 0."""
    if EVEN_K:
        if MASK_ROWS:
            a = tl.load(a_ptrs, mask=valid[:, None], other=0.0)
        else:
            a = tl.load(a_ptrs)
    else:
        k_in = tl.arange(0, BLOCK_K) + k0 < K
        a_mask = valid[:, None] & k_in[None, :] if MASK_ROWS else k_in[None, :]
        a = tl.load(a_ptrs, mask=a_mask, other=0.0)
    return a


@triton.jit
def swiglu_k_loop_tma(a_ptrs, w_desc, g_row, u_row, valid, K, stride_ak,
                      M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      EVEN_K: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """`swiglu_k_loop` with the gate and up tiles [BLOCK_N, BLOCK_K] read through w_desc from
    rows g_row and u_row (int32) of the weights' 2D view."""
    acc_g = tl.zeros((M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        a = _rows_tile(a_ptrs, valid, k0, K, BLOCK_K, EVEN_K, True)    # [M, BK]
        g = w_desc.load([g_row, k0])                                    # [BN, BK]
        u = w_desc.load([u_row, k0])
        acc_g = tl.dot(a, g.T, acc_g, input_precision=DOT_PRECISION)
        acc_u = tl.dot(a, u.T, acc_u, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K * stride_ak
    return acc_g, acc_u


@triton.jit
def k_loop_tma(a_ptrs, w_desc, b_row, valid, K, stride_ak,
               M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               EVEN_K: tl.constexpr, DOT_PRECISION: tl.constexpr, MASK_ROWS: tl.constexpr):
    """`k_loop` with the tile [BLOCK_N, BLOCK_K] read through w_desc from row b_row (int32) of
    the weights' 2D view."""
    acc = tl.zeros((M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        a = _rows_tile(a_ptrs, valid, k0, K, BLOCK_K, EVEN_K, MASK_ROWS)  # [M, BK]
        b = w_desc.load([b_row, k0])                                      # [BN, BK]
        acc = tl.dot(a, b.T, acc, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K * stride_ak
    return acc


@triton.jit
def _store_gate_up(ptrs, acc_g, acc_u, n_in, up_offset):
    """Store the gate and up accumulators [M, BN], rounded to the buffer's dtype, at ptrs (the gate
    columns) and ptrs + up_offset (the up columns): the [gate | up] layout of an (L, 2N) buffer."""
    tl.store(ptrs, acc_g.to(ptrs.dtype.element_ty), mask=n_in[None, :])
    tl.store(ptrs + up_offset, acc_u.to(ptrs.dtype.element_ty), mask=n_in[None, :])


@triton.jit
def sorted_rows(sorted_ids_ptr, row0, S, TOP_K: tl.constexpr, M: tl.constexpr):
    """(rows, pair, valid, tok) of M sorted rows from row0: their pair ids (S marks padding),
    whether each holds a pair, and the token (int64) whose row of x it gathers."""
    rows = row0 + tl.arange(0, M)                                      # sorted rows [M]
    pair = tl.load(sorted_ids_ptr + rows)                              # pair ids; S = padding
    valid = pair < S
    return rows, pair, valid, (pair // TOP_K).to(tl.int64)


@triton.jit
def _gemm1_tile(x_ptr, w, h_ptr, pre_ptr, sorted_ids_ptr, row0, e, pid_n, S, N, K, strides, epilogue,
                TOP_K: tl.constexpr, M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                EVEN_K: tl.constexpr, DOT_PRECISION: tl.constexpr, flags):
    """One [M, BLOCK_N] tile of h: M sorted rows from row0, all of expert e (`_paired`'s signature:
    strides of x, gate_up and h; flags (SWIGLU, HAS_BIAS, GPT_OSS, INTERLEAVED, TMA_W, STORE_PRE)).
    SWIGLU False: gate and up stored unfused, at columns rn and N + rn of h (L, 2N). STORE_PRE
    (plain SwiGLU only, the launcher checks): h as usual, and the same [gate | up] pre-activations
    also in pre_ptr, a contiguous (L, 2N) buffer (padding rows: zeros, their x rows read as 0).
    w: the gate_up pointer, or with TMA_W its descriptor over (E * 2N, K)."""
    stride_xt, stride_xk, stride_we, stride_wn, stride_wk, stride_hm, stride_hn = strides
    bias_ptr, stride_be, stride_bn, alpha, limit = epilogue
    SWIGLU: tl.constexpr = flags[0]     # annotated: a plain or tuple assignment makes a constexpr a tensor
    HAS_BIAS: tl.constexpr = flags[1]
    GPT_OSS: tl.constexpr = flags[2]
    INTERLEAVED: tl.constexpr = flags[3]
    TMA_W: tl.constexpr = flags[4]
    STORE_PRE: tl.constexpr = flags[5]
    rows, pair, valid, tok = sorted_rows(sorted_ids_ptr, row0, S, TOP_K, M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)                       # [BN]
    n_in = rn < N
    rk = tl.arange(0, BLOCK_K)                                         # [BK]

    a_ptrs = x_ptr + tok[:, None] * stride_xt + rk[None, :] * stride_xk                   # [M, BK]
    if INTERLEAVED:    # rows 2n (gate) and 2n + 1 (up): 2 BN consecutive rows, one dot, split after
        rw = pid_n * (2 * BLOCK_N) + tl.arange(0, 2 * BLOCK_N)                            # [2BN]
        w_in = rw < 2 * N
        if TMA_W:
            w_row = (e * (2 * N) + pid_n * (2 * BLOCK_N)).to(tl.int32)  # the launcher checks E * 2N < 2**31
            acc = k_loop_tma(a_ptrs, w, w_row, valid, K, stride_xk, M, 2 * BLOCK_N, BLOCK_K, EVEN_K,
                             DOT_PRECISION, True)
        else:
            b_ptrs = w + e * stride_we + rw.to(tl.int64)[None, :] * stride_wn + rk[:, None] * stride_wk
            acc = k_loop(a_ptrs, b_ptrs, valid, w_in, K, stride_xk, stride_wk, M, 2 * BLOCK_N, BLOCK_K,
                         EVEN_K, DOT_PRECISION, True)
        if HAS_BIAS:
            bias = tl.load(bias_ptr + e * stride_be + rw * stride_bn, mask=w_in, other=0.0)
            acc = acc + bias.to(tl.float32)[None, :]
        acc_g, acc_u = tl.split(tl.reshape(acc, (M, BLOCK_N, 2)))
    else:
        if TMA_W:
            g_row = (e * (2 * N) + pid_n * BLOCK_N).to(tl.int32)      # the launcher checks E * 2N < 2**31
            acc_g, acc_u = swiglu_k_loop_tma(a_ptrs, w, g_row, g_row + N, valid, K, stride_xk,
                                             M, BLOCK_N, BLOCK_K, EVEN_K, DOT_PRECISION)
        else:
            g_ptrs = w + e * stride_we + rn.to(tl.int64)[None, :] * stride_wn + rk[:, None] * stride_wk
            u_ptrs = g_ptrs + N * stride_wn                                               # [BK, BN]
            acc_g, acc_u = swiglu_k_loop(a_ptrs, g_ptrs, u_ptrs, valid, n_in, K, stride_xk, stride_wk,
                                         M, BLOCK_N, BLOCK_K, EVEN_K, DOT_PRECISION)
        if HAS_BIAS:
            b_ptrs = bias_ptr + e * stride_be + rn * stride_bn
            acc_g = acc_g + tl.load(b_ptrs, mask=n_in, other=0.0).to(tl.float32)[None, :]
            acc_u = acc_u + tl.load(b_ptrs + N * stride_bn, mask=n_in, other=0.0).to(tl.float32)[None, :]

    h_ptrs = h_ptr + rows.to(tl.int64)[:, None] * stride_hm + rn[None, :] * stride_hn
    if SWIGLU:
        if GPT_OSS:
            gate = tl.minimum(acc_g, limit)
            up = tl.minimum(tl.maximum(acc_u, -limit), limit)
            h = (up + 1.0) * (gate * tl.sigmoid(gate * alpha))         # gpt-oss's clamped SwiGLU, fp32
        else:
            h = acc_g * tl.sigmoid(acc_g) * acc_u                      # silu(gate) * up, fp32
        if HAS_BIAS:                                                   # padding rows: zeros, as GEMM2 needs
            h = tl.where(valid[:, None], h, 0.0)
        tl.store(h_ptrs, h.to(h_ptr.dtype.element_ty), mask=n_in[None, :])
        if STORE_PRE:                                                  # contiguous (L, 2N)
            pre_ptrs = pre_ptr + rows.to(tl.int64)[:, None] * (2 * N) + rn[None, :]
            _store_gate_up(pre_ptrs, acc_g, acc_u, n_in, N)
    else:
        _store_gate_up(h_ptrs, acc_g, acc_u, n_in, N * stride_hn)


@triton.jit
def _paired(TILE: tl.constexpr, block_codes_ptr, expert_ids_ptr, pid_m, pid_n, a_ptr, w, o_ptr,
            aux_ptr, sorted_ids_ptr, S, N, K, strides, epilogue, TOP_K: tl.constexpr, BLOCK_M: tl.constexpr,
            BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
            PAIRED: tl.constexpr, flags):
    """Run TILE (`_gemm1_tile` or `_gemm2_tile`) for row block pid_m: a lone block of BLOCK_M rows,
    or, when PAIRED, per `Alignment.block_codes`: 2 = a tile of this and the next block, 1 = this
    block alone, 0 = nothing (the block before covers it). The groups both GEMMs pass through come
    as tuples the tile unpacks: strides, the 7 strides of a (2), w (3) and o (2); epilogue =
    (bias_ptr, stride_be, stride_bn, alpha, limit); flags = the constexprs (EPILOGUE, HAS_BIAS,
    GPT_OSS, INTERLEAVED, TMA_W[, STORE_PRE]), EPILOGUE the tile's fused epilogue switch (SWIGLU of
    GEMM1, MUL_W of GEMM2), the others as in the module docstring (GEMM2 reads HAS_BIAS and TMA_W
    only; STORE_PRE is GEMM1's). aux_ptr: GEMM1's pre-activations buffer (None without STORE_PRE),
    GEMM2's routing weights. w: weights pointer, or descriptor when TMA_W."""
    e = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    row0 = pid_m * BLOCK_M
    code = tl.load(block_codes_ptr + pid_m) if PAIRED else 1
    if code == 2:
        TILE(a_ptr, w, o_ptr, aux_ptr, sorted_ids_ptr, row0, e, pid_n, S, N, K, strides, epilogue, TOP_K,
             2 * BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, DOT_PRECISION, flags)
    elif code == 1:
        TILE(a_ptr, w, o_ptr, aux_ptr, sorted_ids_ptr, row0, e, pid_n, S, N, K, strides, epilogue, TOP_K,
             BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, DOT_PRECISION, flags)


@triton.jit
def _for_each_tile(TILE: tl.constexpr, PERSISTENT: tl.constexpr, num_padded_ptr, num_n_tiles,
                   block_codes_ptr, expert_ids_ptr, a_ptr, w, o_ptr, aux_ptr, sorted_ids_ptr, S, N, K,
                   strides, epilogue, TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, EVEN_K: tl.constexpr,
                   DOT_PRECISION: tl.constexpr, PAIRED: tl.constexpr, flags, FLATTEN: tl.constexpr):
    """Run `_paired(TILE, ...)` on this program's tile (`_tile_ids`: one tile, none past num_padded),
    or with PERSISTENT on tiles program_id, program_id + num_programs, ... below the live count
    (num_padded // BLOCK_M row blocks times num_n_tiles, read on the device), in `_swizzle` order.
    PERSISTENT and PAIRED: a tile is two row blocks (2u, 2u + 1), each run as `_paired` runs it, so
    that every tile holds work (a pair's second block alone holds none) and the static round robin
    stays balanced; (GROUP_M + 1) // 2 such tiles share a weight tile. FLATTEN (experimental, PERSISTENT
    without PAIRED): `tl.range(..., flatten=True)`, the compiler fuses the tile loop and the K loop into
    one software-pipelined loop (the next tile's loads overlap this tile's last steps and epilogue)."""
    if PERSISTENT:
        num_m = tl.load(num_padded_ptr) // BLOCK_M
        if PAIRED:
            num_units = (num_m + 1) // 2
            for tile in tl.range(tl.program_id(0), num_units * num_n_tiles, tl.num_programs(0)):
                pid_u, pid_n = _swizzle(tile, num_units, num_n_tiles, (GROUP_M + 1) // 2)
                for pid_m in tl.range(2 * pid_u, tl.minimum(2 * pid_u + 2, num_m)):
                    _paired(TILE, block_codes_ptr, expert_ids_ptr, pid_m, pid_n, a_ptr, w, o_ptr, aux_ptr,
                            sorted_ids_ptr, S, N, K, strides, epilogue, TOP_K, BLOCK_M, BLOCK_N, BLOCK_K,
                            EVEN_K, DOT_PRECISION, PAIRED, flags)
        else:
            for tile in tl.range(tl.program_id(0), num_m * num_n_tiles, tl.num_programs(0), flatten=FLATTEN):
                pid_m, pid_n = _swizzle(tile, num_m, num_n_tiles, GROUP_M)
                _paired(TILE, block_codes_ptr, expert_ids_ptr, pid_m, pid_n, a_ptr, w, o_ptr, aux_ptr,
                        sorted_ids_ptr, S, N, K, strides, epilogue, TOP_K, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K,
                        DOT_PRECISION, PAIRED, flags)
    else:
        pid_m, pid_n, live = _tile_ids(num_padded_ptr, num_n_tiles, BLOCK_M, GROUP_M)
        if live:
            _paired(TILE, block_codes_ptr, expert_ids_ptr, pid_m, pid_n, a_ptr, w, o_ptr, aux_ptr,
                    sorted_ids_ptr, S, N, K, strides, epilogue, TOP_K, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K,
                    DOT_PRECISION, PAIRED, flags)


@triton.jit
def moe_gemm1_swiglu_kernel(
    x_ptr, w, h_ptr, sorted_ids_ptr, expert_ids_ptr, block_codes_ptr, num_padded_ptr,
    S, N, K, num_n_tiles,
    stride_xt, stride_xk, stride_we, stride_wn, stride_wk, stride_hm, stride_hn,
    bias_ptr, stride_be, stride_bn, alpha, limit, pre_ptr,
    TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, EVEN_K: tl.constexpr, DOT_PRECISION: tl.constexpr, PAIRED: tl.constexpr,
    SWIGLU: tl.constexpr, HAS_BIAS: tl.constexpr, GPT_OSS: tl.constexpr, INTERLEAVED: tl.constexpr,
    TMA_W: tl.constexpr, PERSISTENT: tl.constexpr = False, FLATTEN: tl.constexpr = False,
    STORE_PRE: tl.constexpr = False, USE_PDL: tl.constexpr = False,
):
    # N = I (columns of each half), K = H. PAIRED: a block that starts a pair of its expert's
    # blocks computes both (2 * BLOCK_M rows); the second block's program does nothing.
    # w: gate_up (E, 2N, K), or with TMA_W its descriptor over (E * 2N, K), block [BLOCK_N, BLOCK_K]
    # ([2 * BLOCK_N, BLOCK_K] when INTERLEAVED). PERSISTENT: each program loops over tiles.
    # pre_ptr: with STORE_PRE the contiguous (L, 2N) pre-activations buffer, else None (a constexpr:
    # the kernel compiles exactly as without it). USE_PDL: launched with programmatic dependent launch
    # (`moekit.launch_hints`).
    pdl_enter(USE_PDL)
    strides = (stride_xt, stride_xk, stride_we, stride_wn, stride_wk, stride_hm, stride_hn)
    _for_each_tile(_gemm1_tile, PERSISTENT, num_padded_ptr, num_n_tiles, block_codes_ptr,
                   expert_ids_ptr, x_ptr, w, h_ptr, pre_ptr, sorted_ids_ptr, S, N, K, strides,
                   (bias_ptr, stride_be, stride_bn, alpha, limit), TOP_K, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M,
                   EVEN_K, DOT_PRECISION, PAIRED, (SWIGLU, HAS_BIAS, GPT_OSS, INTERLEAVED, TMA_W, STORE_PRE),
                   FLATTEN)


@triton.jit
def _gemm2_tile(h_ptr, w, y_ptr, topk_weights_ptr, sorted_ids_ptr, row0, e, pid_n, S, N, K, strides, epilogue,
                TOP_K: tl.constexpr, M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                EVEN_K: tl.constexpr, DOT_PRECISION: tl.constexpr, flags):
    """One [M, BLOCK_N] tile of y: M sorted rows from row0 (expert e), scattered to pair rows
    (`_paired`'s signature: strides of h, down and y; flags (MUL_W, HAS_BIAS, GPT_OSS, INTERLEAVED,
    TMA_W); TOP_K, alpha, limit, GPT_OSS and INTERLEAVED unused), plus down_bias[e] when HAS_BIAS,
    times the routing weight when MUL_W. w: the down pointer, or with TMA_W its descriptor over
    (E * N, K)."""
    stride_hm, stride_hk, stride_we, stride_wn, stride_wk, stride_ym, stride_yn = strides
    bias_ptr, stride_be, stride_bn, _alpha, _limit = epilogue
    MUL_W: tl.constexpr = flags[0]
    HAS_BIAS: tl.constexpr = flags[1]
    TMA_W: tl.constexpr = flags[4]
    rows, pair, valid, _tok = sorted_rows(sorted_ids_ptr, row0, S, 1, M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_in = rn < N
    rk = tl.arange(0, BLOCK_K)

    a_ptrs = h_ptr + rows.to(tl.int64)[:, None] * stride_hm + rk[None, :] * stride_hk
    # Padding rows of h hold zeros: no row mask needed (MASK_ROWS False).
    if TMA_W:
        b_row = (e * N + pid_n * BLOCK_N).to(tl.int32)                # the launcher checks E * N < 2**31
        acc = k_loop_tma(a_ptrs, w, b_row, valid, K, stride_hk, M, BLOCK_N, BLOCK_K, EVEN_K,
                         DOT_PRECISION, False)
    else:
        b_ptrs = w + e * stride_we + rn.to(tl.int64)[None, :] * stride_wn + rk[:, None] * stride_wk
        acc = k_loop(a_ptrs, b_ptrs, valid, n_in, K, stride_hk, stride_wk, M, BLOCK_N, BLOCK_K, EVEN_K,
                     DOT_PRECISION, False)

    if HAS_BIAS:                                       # before the routing weight, as gpt-oss adds it
        bias = tl.load(bias_ptr + e * stride_be + rn * stride_bn, mask=n_in, other=0.0)
        acc = acc + bias.to(tl.float32)[None, :]
    store_pair_rows(acc, y_ptr, topk_weights_ptr, pair, valid, rn, n_in, stride_ym, stride_yn, MUL_W)


@triton.jit
def store_pair_rows(acc, y_ptr, topk_weights_ptr, pair, valid, rn, n_in, stride_ym, stride_yn,
                    MUL_W: tl.constexpr):
    """GEMM2's epilogue: the [M, BN] fp32 rows acc, times each pair's routing weight when MUL_W,
    stored at the pairs' own rows of y (rows of padding, valid False, store nothing)."""
    if MUL_W:
        wt = tl.load(topk_weights_ptr + pair, mask=valid, other=0.0).to(tl.float32)
        acc = acc * wt[:, None]
    y_ptrs = y_ptr + pair.to(tl.int64)[:, None] * stride_ym + rn[None, :] * stride_yn
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=valid[:, None] & n_in[None, :])


@triton.jit
def moe_gemm2_kernel(
    h_ptr, w, y_ptr, topk_weights_ptr, sorted_ids_ptr, expert_ids_ptr, block_codes_ptr,
    num_padded_ptr, S, N, K, num_n_tiles,
    stride_hm, stride_hk, stride_we, stride_wn, stride_wk, stride_ym, stride_yn,
    bias_ptr, stride_be, stride_bn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, EVEN_K: tl.constexpr, DOT_PRECISION: tl.constexpr, PAIRED: tl.constexpr,
    MUL_W: tl.constexpr, HAS_BIAS: tl.constexpr, TMA_W: tl.constexpr, PERSISTENT: tl.constexpr = False,
    FLATTEN: tl.constexpr = False, USE_PDL: tl.constexpr = False,
):
    # N = H, K = I. Every row of a live block was written by GEMM1 (zeros for padding rows).
    # w: down (E, N, K), or with TMA_W its descriptor over (E * N, K), block [BLOCK_N, BLOCK_K].
    # PERSISTENT: each program loops over tiles. USE_PDL: as GEMM1's.
    pdl_enter(USE_PDL)
    strides = (stride_hm, stride_hk, stride_we, stride_wn, stride_wk, stride_ym, stride_yn)
    _for_each_tile(_gemm2_tile, PERSISTENT, num_padded_ptr, num_n_tiles, block_codes_ptr,
                   expert_ids_ptr, h_ptr, w, y_ptr, topk_weights_ptr, sorted_ids_ptr, S, N, K, strides,
                   (bias_ptr, stride_be, stride_bn, 0.0, 0.0), 1, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, EVEN_K,
                   DOT_PRECISION, PAIRED, (MUL_W, HAS_BIAS, False, False, TMA_W), FLATTEN)


@triton.jit
def token_tile(T, H, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr):
    """(rt, rh, t_in, h_in, acc) of this program's [BLOCK_T, BLOCK_H] tile of a (T, H) output summed
    over top_k slots: token rows rt [BT], columns rh [BH], their masks, a zero fp32 accumulator.
    Shared by the contiguous and masked layouts; `store_token_tile` writes acc."""
    rt = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)             # [BT]
    rh = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)             # [BH]
    acc = tl.zeros((BLOCK_T, BLOCK_H), dtype=tl.float32)
    return rt, rh, rt < T, rh < H, acc


@triton.jit
def store_token_tile(out_ptr, acc, rt, rh, t_in, h_in, stride_ot, stride_oh):
    """Store `token_tile`'s accumulator in out's dtype."""
    o_ptrs = out_ptr + rt.to(tl.int64)[:, None] * stride_ot + rh[None, :] * stride_oh
    tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=t_in[:, None] & h_in[None, :])


@triton.jit
def moe_sum_kernel(
    y_ptr, ids_ptr, out_ptr, T, H, E, stride_ot, stride_oh,
    TOP_K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, USE_PDL: tl.constexpr = False,
):
    """out[t] = sum of y[t*K + j] over slots j whose expert id is in [0, E), in fp32."""
    pdl_enter(USE_PDL)
    rt, rh, t_in, h_in, acc = token_tile(T, H, BLOCK_T, BLOCK_H)
    for j in tl.static_range(TOP_K):
        pair = rt.to(tl.int64) * TOP_K + j
        e = tl.load(ids_ptr + pair, mask=t_in, other=-1)
        use = t_in & (e >= 0) & (e < E)
        y = tl.load(y_ptr + pair[:, None] * H + rh[None, :], mask=use[:, None] & h_in[None, :], other=0.0)
        acc += y.to(tl.float32)
    store_token_tile(out_ptr, acc, rt, rh, t_in, h_in, stride_ot, stride_oh)
