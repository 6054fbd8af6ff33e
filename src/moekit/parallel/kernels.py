"""Expert-parallel routing, packing and the per-token reduce (`moekit.parallel.fused` launches them).

Legend: T tokens, K top_k, E global experts, N ranks, L slots per rank, H hidden, C capacity (rows
per destination block, low-latency mode), R replicated experts (more than one copy), D = min(K, N).
Pairs are p = t * K + k; a slot is rank * L + local index (`Placement.copy_table`).

    ROUTE   grid (N,): program d walks the tokens in blocks of BLOCK_T, carrying its counters, and
            for each token: the pairs' slots (copy 0, or for a replicated expert copy
            (j + source_rank) mod n_e, j = the expert's earlier pairs in pair order, carried per
            replicated expert), hit[t, d], pos[t, d] = tokens before t with a pair on d, and at
            the end send_counts[d] (and, for the low-latency mode, the rows and pairs past C).
            Program 0 also writes dest / local of every pair. Every program computes the same
            slots, so no program waits for another: one launch, no atomics.
    PACK    grid (token blocks [+ fill blocks], H blocks): each token's row goes to each destination
            it hits, at start_d + pos (normal: start_d = the destinations before d's rows, from
            the device counts) or d * C + pos (fixed blocks, pos < C; past C: dropped). The
            x tile is read once and stored once per destination; the H-block-0 programs write the
            metadata row (ids, weight bits[, source token]) and combine_index. Fill programs
            (fixed blocks only) write the empty slots [count_d, C) of every block: zero rows, ids
            -1, weights 0, token -1; program (0, 0) sums the per-destination drop counters.
    REDUCE  grid (T blocks, H blocks): out[t] = sum_j back[combine_index[t, j]] in fp32, j in order;
            a bf16 output is rounded by hand (to nearest even, as torch), since the interpreter's
            cast truncates.

Integer outputs equal the torch twins' (`moekit.parallel.dispatch`, `low_latency`) exactly and
the rows are copies (same bits). Written for both modes: loop bounds are kernel arguments; a
tile's column c is read with a masked sum (`_column`), never by indexing registers; a name keeps
its type (only constexpr `if`s assign it in two branches); a program-dependent condition enters a
mask as a bound (`T * (pid == 0)`), since the interpreter cannot AND a vector with a scalar mask.
`tools/ep_compile_check.py` compiles every launch for sm_90 without a GPU.
"""

import moekit.kernels  # noqa: F401  (first: the interpreter switch, before triton is imported)

# isort: split
import triton
import triton.language as tl


@triton.jit
def _column(tile, cols, c):
    """tile[:, c] (cols = the tile's column indices), in registers."""
    return tl.sum(tl.where(cols[None, :] == c, tile, 0), axis=1)


@triton.jit
def _replica_copies(rep, e_valid, ncopy_ptr, e, seen_before, source_rank, rk, rr,
                    K: tl.constexpr, BLOCK_T: tl.constexpr, K_PAD: tl.constexpr, R_PAD: tl.constexpr):
    """(copy index (BLOCK_T, K_PAD) int64, pairs of each replicated expert in the block (R_PAD,)).

    rep: (BLOCK_T, K_PAD) the pair's replicated-expert index, -1 for others; seen_before (R_PAD,):
    each replicated expert's pairs in earlier blocks. A pair's j = its expert's pairs before it in
    pair order (t, then k): earlier blocks + earlier tokens of the block + earlier slots of t.
    """
    per_token = tl.zeros((BLOCK_T, R_PAD), tl.int32)
    for k in range(K):
        rep_k = _column(rep, rk, k)
        per_token += (rep_k[:, None] == rr[None, :]).to(tl.int32)
    seen = seen_before[None, :] + tl.cumsum(per_token, axis=0) - per_token    # before token t
    j = tl.zeros((BLOCK_T, K_PAD), tl.int32)
    for k in range(K):
        rep_k = _column(rep, rk, k)
        one = (rep_k[:, None] == rr[None, :]).to(tl.int32)
        j_k = tl.sum(one * seen, axis=1)
        seen += one
        j = tl.where(rk[None, :] == k, j_k[:, None], j)
    n_copies = tl.load(ncopy_ptr + e, mask=e_valid, other=1)                   # int64
    copy = tl.where(rep >= 0, (j + source_rank).to(tl.int64) % n_copies, 0)
    return copy, tl.sum(per_token, axis=0)


@triton.jit
def ep_route_kernel(
    ids_ptr, table_ptr, ncopy_ptr, rep_ptr,
    dest_ptr, local_ptr, hit_ptr, pos_ptr, counts_ptr, drops_ptr,
    T, E, N, L, source_rank, capacity,
    stride_it, stride_ik, stride_te,
    K: tl.constexpr, K_PAD: tl.constexpr, R_PAD: tl.constexpr, BLOCK_T: tl.constexpr,
    HAS_REPLICAS: tl.constexpr, COUNT_DROPS: tl.constexpr,
):
    d = tl.program_id(0)
    rt = tl.arange(0, BLOCK_T)
    rk = tl.arange(0, K_PAD)
    rr = tl.arange(0, R_PAD)
    pair_tokens = T * (d == 0).to(tl.int32)   # program 0 writes dest / local
    rows = tl.zeros((), tl.int32)              # tokens with a pair on d so far
    rep_seen = tl.zeros((R_PAD,), tl.int32)    # pairs of each replicated expert so far
    drop_rows = tl.zeros((), tl.int32)
    drop_pairs = tl.zeros((), tl.int32)
    for t0 in range(0, T, BLOCK_T):
        tok = (t0 + rt).to(tl.int64)
        t_in = tok < T
        m2 = t_in[:, None] & (rk[None, :] < K)
        ids = tl.load(ids_ptr + tok[:, None] * stride_it + rk[None, :] * stride_ik, mask=m2, other=-1)
        valid = m2 & (ids >= 0) & (ids < E)            # in the ids' own dtype: no int64 wrap-around
        e = tl.where(valid, ids, 0).to(tl.int64)
        if HAS_REPLICAS:
            rep = tl.load(rep_ptr + e, mask=valid, other=-1)
            copy, block_seen = _replica_copies(rep, valid, ncopy_ptr, e, rep_seen, source_rank, rk, rr,
                                               K, BLOCK_T, K_PAD, R_PAD)
            rep_seen += block_seen
        else:
            copy = tl.zeros((BLOCK_T, K_PAD), tl.int64)
        slot = tl.load(table_ptr + e * stride_te + copy, mask=valid, other=0)
        dest = tl.where(valid, slot // L, N)
        local = tl.where(valid, slot % L, -1)
        pair = tok[:, None] * K + rk[None, :]
        m_pairs = (tok < pair_tokens)[:, None] & (rk[None, :] < K)
        tl.store(dest_ptr + pair, dest, mask=m_pairs)
        tl.store(local_ptr + pair, local, mask=m_pairs)
        npair = tl.sum((dest == d).to(tl.int32), axis=1)          # t's pairs on d
        hit = (npair > 0).to(tl.int32)
        pos = rows + tl.cumsum(hit, axis=0) - hit
        cell = tok * N + d
        tl.store(hit_ptr + cell, hit.to(tl.int8), mask=t_in)
        tl.store(pos_ptr + cell, pos, mask=t_in)
        if COUNT_DROPS:
            over = (hit > 0) & (pos >= capacity)
            drop_rows += tl.sum(over.to(tl.int32), axis=0)
            drop_pairs += tl.sum(tl.where(over, npair, 0), axis=0)
        rows += tl.sum(hit, axis=0)
    tl.store(counts_ptr + d, rows.to(tl.int64))
    if COUNT_DROPS:
        tl.store(drops_ptr + d, drop_rows.to(tl.int64))
        tl.store(drops_ptr + N + d, drop_pairs.to(tl.int64))


@triton.jit
def _pack_tokens(
    pid, pid_h, x_ptr, w_ptr, dest_ptr, local_ptr, hit_ptr, pos_ptr, counts_ptr,
    send_x_ptr, meta_ptr, cidx_ptr,
    T, H, N, sentinel, capacity,
    stride_xt, stride_xh, stride_wt, stride_wk, stride_st, stride_mt,
    K: tl.constexpr, K_PAD: tl.constexpr, N_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, FIXED: tl.constexpr,
):
    tok = (pid * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    t_in = tok < T
    rn = tl.arange(0, N_PAD)
    rk = tl.arange(0, K_PAD)
    rd = tl.arange(0, D_PAD)
    cols = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    h_in = cols < H
    meta_on = tok < T * (pid_h == 0).to(tl.int32)       # H block 0 writes the metadata

    cell = tok[:, None] * N + rn[None, :]
    m_tn = t_in[:, None] & (rn[None, :] < N)
    hit = tl.load(hit_ptr + cell, mask=m_tn, other=0).to(tl.int32)               # (BT, NP)
    pos = tl.load(pos_ptr + cell, mask=m_tn, other=0).to(tl.int64)
    if FIXED:
        keep = ((hit > 0) & (pos < capacity)).to(tl.int32)
        row = tl.where(keep > 0, rn[None, :].to(tl.int64) * capacity + pos, sentinel)
    else:
        counts = tl.load(counts_ptr + rn, mask=rn < N, other=0)                   # int64 (NP,)
        start = tl.cumsum(counts, axis=0) - counts
        keep = hit
        row = tl.where(keep > 0, start[None, :] + pos, sentinel)
    jth = tl.cumsum(hit, axis=1) - hit                  # d's place among t's destinations

    m2 = t_in[:, None] & (rk[None, :] < K)
    pair = tok[:, None] * K + rk[None, :]
    dest = tl.load(dest_ptr + pair, mask=m2, other=N)
    local = tl.load(local_ptr + pair, mask=m2, other=-1)
    w = tl.load(w_ptr + tok[:, None] * stride_wt + rk[None, :] * stride_wk, mask=m2, other=0.0)
    w = w.to(tl.float32)
    x = tl.load(x_ptr + tok[:, None] * stride_xt + cols[None, :] * stride_xh,
                mask=t_in[:, None] & h_in[None, :])

    cidx = tl.full((BLOCK_T, D_PAD), sentinel, tl.int64)
    for d in range(N):
        hit_d = _column(hit, rn, d) > 0
        keep_d = _column(keep, rn, d) > 0
        row_d = _column(row, rn, d)
        j_d = _column(jth, rn, d)
        cidx = tl.where(hit_d[:, None] & (rd[None, :] == j_d[:, None]), row_d[:, None], cidx)
        tl.store(send_x_ptr + row_d[:, None] * stride_st + cols[None, :], x,
                 mask=keep_d[:, None] & h_in[None, :])
        same = dest == d
        ids = tl.where(same, local, -1).to(tl.int32)
        bits = tl.where(same, w, 0.0).to(tl.int32, bitcast=True)
        m_meta = (keep_d & meta_on)[:, None] & (rk[None, :] < K)
        meta_row = meta_ptr + row_d[:, None] * stride_mt
        tl.store(meta_row + rk[None, :], ids, mask=m_meta)
        tl.store(meta_row + K + rk[None, :], bits, mask=m_meta)
        if FIXED:
            tl.store(meta_ptr + row_d * stride_mt + 2 * K, tok.to(tl.int32), mask=keep_d & meta_on)
    tl.store(cidx_ptr + tok[:, None] * D + rd[None, :], cidx, mask=meta_on[:, None] & (rd[None, :] < D))


@triton.jit
def _fill_empty(
    f, pid_h, counts_ptr, send_x_ptr, meta_ptr, H, N, capacity, stride_st, stride_mt,
    K: tl.constexpr, M_PAD: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """Fixed blocks: rows [count_d, C) of block d are empty: zero row, ids -1, weights 0, token -1."""
    r = (f * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    r_in = r < N * capacity
    meta_on = r < N * capacity * (pid_h == 0).to(tl.int32)
    d = r // capacity
    count = tl.load(counts_ptr + d, mask=r_in, other=0)
    empty = r_in & (r % capacity >= count)
    cols = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    zeros = tl.zeros((BLOCK_T, BLOCK_H), send_x_ptr.dtype.element_ty)
    tl.store(send_x_ptr + r[:, None] * stride_st + cols[None, :], zeros,
             mask=empty[:, None] & (cols[None, :] < H))
    rm = tl.arange(0, M_PAD)
    meta = tl.where((rm >= K) & (rm < 2 * K), 0, -1)
    meta = tl.zeros((BLOCK_T, M_PAD), tl.int32) + meta[None, :]
    tl.store(meta_ptr + r[:, None] * stride_mt + rm[None, :], meta,
             mask=(empty & meta_on)[:, None] & (rm[None, :] < 2 * K + 1))


@triton.jit
def ep_pack_kernel(
    x_ptr, w_ptr, dest_ptr, local_ptr, hit_ptr, pos_ptr, counts_ptr, drops_ptr,
    send_x_ptr, meta_ptr, cidx_ptr, dropped_ptr,
    T, H, N, sentinel, capacity, token_blocks,
    stride_xt, stride_xh, stride_wt, stride_wk, stride_st, stride_mt,
    K: tl.constexpr, K_PAD: tl.constexpr, N_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
    M_PAD: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, FIXED: tl.constexpr,
):
    pid = tl.program_id(0)
    pid_h = tl.program_id(1)
    if pid < token_blocks:
        _pack_tokens(pid, pid_h, x_ptr, w_ptr, dest_ptr, local_ptr, hit_ptr, pos_ptr, counts_ptr,
                     send_x_ptr, meta_ptr, cidx_ptr, T, H, N, sentinel, capacity,
                     stride_xt, stride_xh, stride_wt, stride_wk, stride_st, stride_mt,
                     K, K_PAD, N_PAD, D, D_PAD, BLOCK_T, BLOCK_H, FIXED)
    else:
        if FIXED:
            _fill_empty(pid - token_blocks, pid_h, counts_ptr, send_x_ptr, meta_ptr, H, N, capacity,
                        stride_st, stride_mt, K, M_PAD, BLOCK_T, BLOCK_H)
    if FIXED:
        rn = tl.arange(0, N_PAD)
        first = ((pid == 0) & (pid_h == 0)).to(tl.int32)
        rows = tl.sum(tl.load(drops_ptr + rn, mask=rn < N, other=0), axis=0)
        pairs = tl.sum(tl.load(drops_ptr + N + rn, mask=rn < N, other=0), axis=0)
        r2 = tl.arange(0, 2)
        tl.store(dropped_ptr + r2, tl.where(r2 == 0, rows, pairs), mask=r2 < 2 * first)


@triton.jit
def _to_bf16_bits(acc):
    """fp32 -> bf16 bits as int16, rounded to nearest even (NaN -> 0x7FC0, as torch on CPU): the
    interpreter's own cast truncates, so both modes round here, the same way."""
    u = acc.to(tl.uint32, bitcast=True)
    r = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    return tl.where(acc != acc, 0x7FC0, r).to(tl.int16)


@triton.jit
def ep_reduce_kernel(
    back_ptr, cidx_ptr, out_ptr, T, H, stride_bt, stride_bh, stride_ot, stride_oh,
    D: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, OUT_BF16: tl.constexpr,
):
    """out_ptr: the output, or its int16 view when OUT_BF16."""
    tok = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    t_in = tok < T
    m = t_in[:, None] & (cols[None, :] < H)
    r = tl.load(cidx_ptr + tok * D, mask=t_in, other=0)
    acc = tl.load(back_ptr + r[:, None] * stride_bt + cols[None, :] * stride_bh, mask=m, other=0.0)
    acc = acc.to(tl.float32)
    for j in range(1, D):
        r = tl.load(cidx_ptr + tok * D + j, mask=t_in, other=0)
        part = tl.load(back_ptr + r[:, None] * stride_bt + cols[None, :] * stride_bh, mask=m, other=0.0)
        acc += part.to(tl.float32)
    out = out_ptr + tok[:, None] * stride_ot + cols[None, :] * stride_oh
    if OUT_BF16:
        tl.store(out, _to_bf16_bits(acc), mask=m)
    else:
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m)
