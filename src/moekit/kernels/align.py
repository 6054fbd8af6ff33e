"""Sort token-expert pairs by expert, each expert's group padded to a multiple of BLOCK_M.

Legend: S pairs (= T * K), E experts (padded to E_PAD), C chunks of pairs, one program per chunk.
Outputs (see `moekit.align.Alignment`): sorted_ids, expert_ids, num_padded, tokens_per_expert.

Two launches for large S:
    align_count_kernel    counts[c, e] = pairs of chunk c on expert e; fills sorted_ids with S.
    align_scatter_kernel  global padded offsets from the counts table, then each pair's slot =
                          its expert's start + pairs of that expert in earlier chunks + rank in
                          its own chunk (pair order is kept: a stable sort); writes expert_ids.
One launch when C == 1 (FUSED): the scatter kernel counts, fills, then scatters after a barrier.
Pairs whose id is outside [0, E) are never placed (expert-parallel sentinels, graph padding).
Loop bounds are kernel arguments, never values derived from program_id (the interpreter cannot
iterate over those with NumPy >= 2.4).
"""

import triton
import triton.language as tl


@triton.jit
def _chunk_counts(ids_ptr, S, E, start, chunk, SUB: tl.constexpr, E_PAD: tl.constexpr):
    cols = tl.arange(0, E_PAD)
    counts = tl.zeros((E_PAD,), dtype=tl.int32)
    for i in range(0, chunk, SUB):
        offs = start + i + tl.arange(0, SUB)                          # [SUB]
        e = tl.load(ids_ptr + offs, mask=(offs < start + chunk) & (offs < S), other=-1).to(tl.int32)
        onehot = (e[:, None] == cols[None, :]) & (e[:, None] < E)     # [SUB, E_PAD]
        counts += tl.sum(onehot.to(tl.int32), axis=0)
    return counts


@triton.jit
def _fill(ptr, value, start, count, length, BLOCK: tl.constexpr):
    for i in range(0, count, BLOCK):
        offs = start + i + tl.arange(0, BLOCK)
        tl.store(ptr + offs, tl.full((BLOCK,), value, tl.int32),
                 mask=(offs < start + count) & (offs < length))


@triton.jit
def align_count_kernel(
    ids_ptr, counts_ptr, sorted_ids_ptr, S, E, chunk, length, fill_chunk,
    SUB: tl.constexpr, E_PAD: tl.constexpr,
):
    c = tl.program_id(0)
    start = c * chunk
    counts = _chunk_counts(ids_ptr, S, E, start, chunk, SUB, E_PAD)
    tl.store(counts_ptr + c * E_PAD + tl.arange(0, E_PAD), counts)
    _fill(sorted_ids_ptr, S, c * fill_chunk, fill_chunk, length, 1024)


@triton.jit
def align_scatter_kernel(
    ids_ptr, counts_ptr, sorted_ids_ptr, expert_ids_ptr, num_padded_ptr, tokens_per_expert_ptr,
    S, E, chunk, length, num_chunks, max_blocks, blocks_per_program,
    BLOCK_M: tl.constexpr, SUB: tl.constexpr, E_PAD: tl.constexpr, BLOCK_B: tl.constexpr,
    FUSED: tl.constexpr,
):
    c = tl.program_id(0)
    cols = tl.arange(0, E_PAD)
    start = c * chunk

    if FUSED:
        total = _chunk_counts(ids_ptr, S, E, start, chunk, SUB, E_PAD)
        before = tl.zeros((E_PAD,), dtype=tl.int32)
        _fill(sorted_ids_ptr, S, 0, length, length, 1024)
        tl.debug_barrier()  # the fill must land before this program's scatter overwrites it
    else:
        total = tl.zeros((E_PAD,), dtype=tl.int32)
        before = tl.zeros((E_PAD,), dtype=tl.int32)
        for cc in range(0, num_chunks):
            row = tl.load(counts_ptr + cc * E_PAD + cols)
            total += row
            before += tl.where(cc < c, row, 0)

    padded = (total + BLOCK_M - 1) // BLOCK_M * BLOCK_M                # [E_PAD]
    pad_end = tl.cumsum(padded, axis=0)
    base = pad_end - padded + before                                  # next slot per expert

    for i in range(0, chunk, SUB):
        offs = start + i + tl.arange(0, SUB)                          # [SUB] pair ids
        e = tl.load(ids_ptr + offs, mask=(offs < start + chunk) & (offs < S), other=-1).to(tl.int32)
        onehot = ((e[:, None] == cols[None, :]) & (e[:, None] < E)).to(tl.int32)  # [SUB, E_PAD]
        rank = tl.sum(onehot * (tl.cumsum(onehot, axis=0) - 1), axis=1)
        dest = tl.sum(onehot * base[None, :], axis=1) + rank
        placed = tl.sum(onehot, axis=1) > 0
        tl.store(sorted_ids_ptr + dest, offs, mask=placed)
        base += tl.sum(onehot, axis=0)

    num_padded = tl.sum(padded, axis=0)
    b0 = c * blocks_per_program
    for i in range(0, blocks_per_program, BLOCK_B):
        blk = b0 + i + tl.arange(0, BLOCK_B)                          # [BLOCK_B]
        row0 = blk * BLOCK_M
        owner = tl.sum(((pad_end[None, :] <= row0[:, None]) & (cols[None, :] < E)).to(tl.int32), axis=1)
        owner = tl.where(row0 < num_padded, owner, -1)
        tl.store(expert_ids_ptr + blk, owner, mask=(blk < b0 + blocks_per_program) & (blk < max_blocks))

    if c == 0:
        tl.store(num_padded_ptr, num_padded)
        tl.store(tokens_per_expert_ptr + cols, total, mask=cols < E)
