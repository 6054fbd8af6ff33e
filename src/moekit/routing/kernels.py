"""Fused router epilogue: softmax, top-k and renormalisation of (T, E) logits in one kernel.

Legend: T tokens, E experts, K top_k. One program handles BLOCK_T rows; E is padded to E_PAD.
The top-k is taken on unique int64 keys built exactly as `moekit.reference.routing_keys` does,
so ids are identical to the torch backend's, ties go to the lower id and NaN ranks lowest.
"""

import moekit.kernels  # noqa: F401  (first: the interpreter switch, before triton is imported)

# isort: split
import triton
import triton.language as tl

from moekit.kernels.pdl import pdl_enter


@triton.jit
def topk_softmax_kernel(
    logits_ptr, weights_ptr, ids_ptr, num_valid_ptr,
    T, E, stride_lt, stride_le,
    TOP_K: tl.constexpr, K_PAD: tl.constexpr, E_PAD: tl.constexpr, BLOCK_T: tl.constexpr,
    RENORMALIZE: tl.constexpr, HAS_NUM_VALID: tl.constexpr, USE_PDL: tl.constexpr = False,
):
    pdl_enter(USE_PDL)          # USE_PDL: launched with programmatic dependent launch (moekit.launch_hints)
    pid = tl.program_id(0)
    rows = pid * BLOCK_T + tl.arange(0, BLOCK_T)                      # [BLOCK_T]
    cols = tl.arange(0, E_PAD)                                        # [E_PAD]
    row_in = rows < T
    col_in = cols < E
    mask = row_in[:, None] & col_in[None, :]
    ptrs = logits_ptr + rows.to(tl.int64)[:, None] * stride_lt + cols[None, :] * stride_le
    x = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32) + 0.0     # [BLOCK_T, E_PAD]; -0 -> +0
    is_nan = x != x

    # Softmax over sanitised logits (inf -> +-float32 max, NaN -> -max), padded columns excluded.
    big: tl.constexpr = 3.4028234663852886e38
    xs = tl.where(is_nan, -big, tl.minimum(tl.maximum(x, -big), big))
    xs = tl.where(col_in[None, :], xs, -float("inf"))
    row_max = tl.max(xs, axis=1)
    p = tl.exp(xs - row_max[:, None])
    p = p / tl.sum(p, axis=1)[:, None]

    # Order-preserving int64 keys: float bits in the high word, (2^32 - 1 - id) in the low word.
    bits = x.to(tl.int32, bitcast=True)
    key32 = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    key32 = tl.where(is_nan, -2147483648, key32)
    low = 4294967295 - cols.to(tl.int64)
    key = key32.to(tl.int64) * 4294967296 + low[None, :]
    taken: tl.constexpr = -9223372036854775808
    key = tl.where(col_in[None, :], key, taken)

    kcols = tl.arange(0, K_PAD)                                       # [K_PAD]
    w_acc = tl.zeros((BLOCK_T, K_PAD), dtype=tl.float32)
    id_acc = tl.zeros((BLOCK_T, K_PAD), dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        best = tl.max(key, axis=1)                                    # [BLOCK_T]
        idx = (4294967295 - (best & 4294967295)).to(tl.int32)
        hit = cols[None, :] == idx[:, None]
        w = tl.sum(tl.where(hit, p, 0.0), axis=1)
        key = tl.where(hit, taken, key)
        w_acc = tl.where(kcols[None, :] == j, w[:, None], w_acc)
        id_acc = tl.where(kcols[None, :] == j, idx[:, None], id_acc)

    if RENORMALIZE:
        total = tl.sum(w_acc, axis=1)
        w_acc = w_acc / tl.maximum(total, 1.1754943508222875e-38)[:, None]
    if HAS_NUM_VALID:
        # Rows past the valid count (CUDA-graph padding) route nowhere: id -1, weight 0.
        live = rows < tl.load(num_valid_ptr)
        w_acc = tl.where(live[:, None], w_acc, 0.0)
        id_acc = tl.where(live[:, None], id_acc, -1)

    out_mask = row_in[:, None] & (kcols[None, :] < TOP_K)
    out_off = rows.to(tl.int64)[:, None] * TOP_K + kcols[None, :]
    tl.store(weights_ptr + out_off, w_acc, mask=out_mask)
    tl.store(ids_ptr + out_off, id_acc, mask=out_mask)
