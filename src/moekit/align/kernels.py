"""Sort token-expert pairs by expert, each expert's group padded to a multiple of BLOCK_M.

Legend: S pairs (= T * K), E experts (E_PAD = next power of two), C chunks of CHUNK pairs.
Outputs (see `moekit.align.Alignment`): sorted_ids, expert_ids, num_padded, tokens_per_expert.

Three launches when C > 1 above `moekit.align.ONE_LAUNCH_MAX_PAIRS` pairs (4,096 by default), all
parallel but the tiny scan:
    align_hist_kernel     (C programs)  counts[c, e] = pairs of chunk c on expert e (tl.histogram);
                                        fills sorted_ids with the sentinel S
    align_scan_kernel     (1 program)   padded group sizes, their prefix sum pad_end[e], and
                                        base[c, e] = pad_start[e] + (pairs of e in chunks < c)
                                                     - (pairs of experts < e in chunk c)
    align_scatter_kernel  (C programs)  sort the chunk's keys e * CHUNK + i; the element at sorted
                                        position p goes to row base[c, e] + p; writes expert_ids
One launch when C == 1 (FUSED): the scatter program does all three, in registers, and writes the
blocks' expert ids expert by expert (`_write_expert_ids_by_expert`: one program searching the
experts for every block would be most of the fused kernel's time).
One launch of C > 1 programs up to ONE_LAUNCH_MAX_PAIRS pairs (`align_one_launch_kernel`):
each program histograms all S ids itself (total[e], and before[e] from the chunks < c), so it has
its base[c, e] in registers; it scatters its chunk, and of its share of the blocks writes the
expert ids (expert by expert, clipped to the share) and the sentinel S into the rows no pair goes
to (the padding rows of the experts whose last block is in its share, and the rows at or past
num_padded): no program writes a row another program writes, so no fill-then-overwrite race.
Sorting keys (expert, index in chunk) keeps pair order within an expert, so the result equals a
stable sort. Pairs whose id is outside [0, E) get key E * CHUNK + i: they sort last and are never
placed (expert-parallel sentinels, graph padding rows).
Loop bounds are kernel arguments, never values derived from program_id. USE_PDL: launched with
programmatic dependent launch (`moekit.launch_hints`).
"""

import moekit.kernels  # noqa: F401  (first: the interpreter switch, before triton is imported)

# isort: split
import triton
import triton.language as tl

from moekit.kernels.pdl import pdl_enter


@triton.jit
def _chunk_keys(ids_ptr, c, S, E, CHUNK: tl.constexpr):
    """(expert per element with E for invalid/padding, sort keys) of chunk c."""
    i = tl.arange(0, CHUNK)
    offs = c * CHUNK + i
    e = tl.load(ids_ptr + offs, mask=offs < S, other=-1)
    # Range-check in the ids' own dtype: an int64 id such as 2**32 + 3 must not wrap into [0, E).
    e = tl.where((e >= 0) & (e < E), e, E).to(tl.int32)
    return e, e * CHUNK + i


@triton.jit
def _fill(ptr, value, start, count, length, BLOCK: tl.constexpr):
    for i in range(0, count, BLOCK):
        offs = start + i + tl.arange(0, BLOCK)
        in_range = (offs < start + count) & (offs < length)
        tl.store(ptr + offs, tl.full((BLOCK,), value, tl.int32), mask=in_range)


@triton.jit
def _write_expert_ids(expert_ids_ptr, block_codes_ptr, pad_end, num_padded, E, b0, count, max_blocks,
                      BLOCK_M: tl.constexpr, E_PAD: tl.constexpr, BLOCK_B: tl.constexpr):
    """expert_ids[b] and block_codes[b] for b in [b0, b0 + count): the owner is the number of
    experts whose padded end is <= the block's first row; see `Alignment.block_codes`."""
    cols = tl.arange(0, E_PAD)
    for i in range(0, count, BLOCK_B):
        blk = b0 + i + tl.arange(0, BLOCK_B)                            # [BLOCK_B]
        row0 = blk * BLOCK_M
        real = cols[None, :] < E
        done = (pad_end[None, :] <= row0[:, None]) & real               # [BLOCK_B, E_PAD]
        live = row0 < num_padded
        owner = tl.where(live, tl.sum(done.to(tl.int32), axis=1), -1)
        start = tl.max(tl.where(done, pad_end[None, :], 0), axis=1)     # the owner's first row
        end = tl.min(tl.where(done | ~real, 2147483647, pad_end[None, :]), axis=1)
        code = tl.where(row0 + BLOCK_M < end, 2, 1)
        code = tl.where(live & (((row0 - start) // BLOCK_M) % 2 == 0), code, 0)
        in_range = (blk < b0 + count) & (blk < max_blocks)
        tl.store(expert_ids_ptr + blk, owner, mask=in_range)
        tl.store(block_codes_ptr + blk, code, mask=in_range)


@triton.jit
def _block_code(j, nb):
    """The code of an expert's block j of nb (`Alignment.block_codes`): 2, a tile of this block and
    the next (same expert); 1, the expert's last block alone; 0, a pair's second block (an expert's
    tiles start at its even blocks)."""
    return tl.where(j % 2 == 0, tl.where(j + 1 < nb, 2, 1), 0)


@triton.jit
def _write_expert_ids_by_expert(expert_ids_ptr, block_codes_ptr, padded, pad_end, num_padded, max_blocks,
                                BLOCK_M: tl.constexpr, E_PAD: tl.constexpr, BLOCK_J: tl.constexpr):
    """expert_ids and block_codes of every block, as `_write_expert_ids` writes them, from the
    experts' side: expert e (padded[e] rows ending at pad_end[e]) writes its own blocks, BLOCK_J of
    them a step, every expert at once; then the blocks at or past num_padded get -1 and 0. No
    reduction over experts a block (one program: the fused align; at most S / BLOCK_M + 1 blocks
    an expert, so the loop is short even when every pair is on one expert)."""
    nb = padded // BLOCK_M                                              # [E_PAD] blocks of each expert
    first = (pad_end - padded) // BLOCK_M
    owner = tl.arange(0, E_PAD)
    rj = tl.arange(0, BLOCK_J)
    for j0 in range(0, tl.max(nb, axis=0), BLOCK_J):
        j = j0 + rj[None, :]                                            # [1, BLOCK_J]
        mine = j < nb[:, None]                                          # [E_PAD, BLOCK_J]
        blk = first[:, None] + j
        code = _block_code(j, nb[:, None])
        tl.store(expert_ids_ptr + blk, tl.broadcast_to(owner[:, None], (E_PAD, BLOCK_J)), mask=mine)
        tl.store(block_codes_ptr + blk, code, mask=mine)
    dead0 = num_padded // BLOCK_M
    for i in range(0, max_blocks, 1024):
        blk = i + tl.arange(0, 1024)
        dead = (blk >= dead0) & (blk < max_blocks)
        tl.store(expert_ids_ptr + blk, tl.full((1024,), -1, tl.int32), mask=dead)
        tl.store(block_codes_ptr + blk, tl.zeros((1024,), tl.int32), mask=dead)


@triton.jit
def _write_share(sorted_ids_ptr, expert_ids_ptr, block_codes_ptr, total, padded, pad_end, num_padded, S, E,
                 length, max_blocks, b0, count,
                 BLOCK_M: tl.constexpr, E_PAD: tl.constexpr, BLOCK_J: tl.constexpr, FILL_COLS: tl.constexpr):
    """Everything of blocks [b0, b0 + count) but their pairs' rows, for the one-launch align (each
    program its own blocks: disjoint from every other program's writes and from every pair's row):
    their expert ids and codes expert by expert (as `_write_expert_ids_by_expert`, each expert's
    blocks clipped to the range: no search over experts a block, and the same work in every program
    whatever the skew), the sentinel S into the padding rows [pad_start[e] + total[e], pad_end[e]) of
    each expert whose last block is in the range (fewer than BLOCK_M rows, FILL_COLS a step), and into
    the range's rows in [num_padded, length); its blocks at or past num_padded get -1 and 0."""
    re = tl.arange(0, E_PAD)
    b1 = tl.minimum(b0 + count, max_blocks)
    nb = padded // BLOCK_M                                              # [E_PAD] blocks of each expert
    first = (pad_end - padded) // BLOCK_M
    lo = tl.maximum(first, b0)                                          # the expert's blocks in range
    hi = tl.minimum(first + nb, b1)
    rj = tl.arange(0, BLOCK_J)
    for j0 in range(0, count, BLOCK_J):
        blk = lo[:, None] + j0 + rj[None, :]                            # [E_PAD, BLOCK_J]
        m = (blk < hi[:, None]) & (re[:, None] < E)
        j = blk - first[:, None]                                        # the block's index in its expert
        code = _block_code(j, nb[:, None])
        tl.store(expert_ids_ptr + blk, tl.broadcast_to(re[:, None], (E_PAD, BLOCK_J)), mask=m)
        tl.store(block_codes_ptr + blk, code, mask=m)
    last = first + nb - 1
    ours = (nb > 0) & (last >= b0) & (last < b1) & (re < E)
    pad_from = pad_end - padded + total                                 # [E_PAD] the first padding row
    for f0 in range(0, BLOCK_M, FILL_COLS):
        rows = pad_from[:, None] + f0 + tl.arange(0, FILL_COLS)[None, :]  # [E_PAD, FILL_COLS]
        m = ours[:, None] & (rows < pad_end[:, None])
        tl.store(sorted_ids_ptr + rows, tl.full((E_PAD, FILL_COLS), S, tl.int32), mask=m)
    dead0 = num_padded // BLOCK_M
    for i in range(0, count, 256):
        blk = b0 + i + tl.arange(0, 256)
        dead = (blk >= dead0) & (blk < b1)
        tl.store(expert_ids_ptr + blk, tl.full((256,), -1, tl.int32), mask=dead)
        tl.store(block_codes_ptr + blk, tl.zeros((256,), tl.int32), mask=dead)
    for i in range(0, count * BLOCK_M, 1024):
        offs = b0 * BLOCK_M + i + tl.arange(0, 1024)
        m = (offs >= num_padded) & (offs < length) & (offs < b1 * BLOCK_M)
        tl.store(sorted_ids_ptr + offs, tl.full((1024,), S, tl.int32), mask=m)


@triton.jit
def align_hist_kernel(ids_ptr, counts_ptr, sorted_ids_ptr, S, E, length, fill_chunk,
                      CHUNK: tl.constexpr, E_PAD: tl.constexpr, USE_PDL: tl.constexpr = False):
    pdl_enter(USE_PDL)
    c = tl.program_id(0)
    e, _ = _chunk_keys(ids_ptr, c, S, E, CHUNK)
    counts = tl.histogram(e, E_PAD, mask=e < E)
    tl.store(counts_ptr + c * E_PAD + tl.arange(0, E_PAD), counts)
    _fill(sorted_ids_ptr, S, c * fill_chunk, fill_chunk, length, 1024)


@triton.jit
def align_scan_kernel(counts_ptr, base_ptr, pad_end_ptr, num_padded_ptr, tokens_per_expert_ptr,
                      C, E, BLOCK_M: tl.constexpr, C_BLOCK: tl.constexpr, E_PAD: tl.constexpr,
                      USE_PDL: tl.constexpr = False):
    pdl_enter(USE_PDL)
    re = tl.arange(0, E_PAD)
    rc = tl.arange(0, C_BLOCK)
    e_in = re[None, :] < E
    total = tl.zeros((E_PAD,), dtype=tl.int32)
    for c0 in range(0, C, C_BLOCK):                                     # pass 1: pairs per expert
        offs = (c0 + rc)[:, None] * E_PAD + re[None, :]                 # [C_BLOCK, E_PAD]
        counts = tl.load(counts_ptr + offs, mask=((c0 + rc)[:, None] < C) & e_in, other=0)
        total += tl.sum(counts, axis=0)
    padded = (total + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    pad_end = tl.cumsum(padded, axis=0)
    pad_start = pad_end - padded
    tl.store(pad_end_ptr + re, pad_end)
    tl.store(num_padded_ptr, tl.sum(padded, axis=0))
    tl.store(tokens_per_expert_ptr + re, total, mask=re < E)
    carry = tl.zeros((E_PAD,), dtype=tl.int32)                          # pairs of e in earlier slabs
    for c0 in range(0, C, C_BLOCK):                                     # pass 2: each chunk's base
        offs = (c0 + rc)[:, None] * E_PAD + re[None, :]
        m = ((c0 + rc)[:, None] < C) & e_in
        counts = tl.load(counts_ptr + offs, mask=m, other=0)
        before_chunks = carry[None, :] + tl.cumsum(counts, axis=0) - counts  # pairs of e in chunks < c
        before_experts = tl.cumsum(counts, axis=1) - counts                  # pairs of experts < e in c
        tl.store(base_ptr + offs, pad_start[None, :] + before_chunks - before_experts, mask=m)
        carry += tl.sum(counts, axis=0)


@triton.jit
def align_scatter_kernel(
    ids_ptr, base_ptr, pad_end_ptr, num_padded_ptr, tokens_per_expert_ptr, sorted_ids_ptr,
    expert_ids_ptr, block_codes_ptr, S, E, length, max_blocks, blocks_per_program,
    BLOCK_M: tl.constexpr, CHUNK: tl.constexpr, E_PAD: tl.constexpr, BLOCK_B: tl.constexpr,
    FUSED: tl.constexpr, USE_PDL: tl.constexpr = False, IDS_BY_EXPERT: tl.constexpr = True,
):
    pdl_enter(USE_PDL)
    c = tl.program_id(0)
    e, keys = _chunk_keys(ids_ptr, c, S, E, CHUNK)
    sorted_keys = tl.sort(keys)
    se = sorted_keys // CHUNK                                           # expert at sorted position
    pair = c * CHUNK + sorted_keys % CHUNK
    placed = se < E
    pos = tl.arange(0, CHUNK)
    re = tl.arange(0, E_PAD)
    if FUSED:
        total = tl.histogram(e, E_PAD, mask=e < E)
        padded = (total + BLOCK_M - 1) // BLOCK_M * BLOCK_M
        pad_end = tl.cumsum(padded, axis=0)
        num_padded = tl.sum(padded, axis=0)
        base_e = pad_end - padded - (tl.cumsum(total, axis=0) - total)  # [E_PAD]
        base = tl.gather(base_e, tl.minimum(se, E_PAD - 1), 0)
        _fill(sorted_ids_ptr, S, 0, length, length, 1024)
        tl.debug_barrier()  # the fill must land before this program's scatter overwrites it
        tl.store(num_padded_ptr, num_padded)
        tl.store(tokens_per_expert_ptr + re, total, mask=re < E)
    else:
        base = tl.load(base_ptr + c * E_PAD + se, mask=placed, other=0)
        pad_end = tl.load(pad_end_ptr + re)
        num_padded = tl.load(num_padded_ptr)
    tl.store(sorted_ids_ptr + base + pos, pair, mask=placed)
    if FUSED and IDS_BY_EXPERT:   # one program: each expert writes its own blocks (no search a block)
        _write_expert_ids_by_expert(expert_ids_ptr, block_codes_ptr, padded, pad_end, num_padded, max_blocks,
                                    BLOCK_M, E_PAD, 4)
    else:       # C programs: the blocks split evenly between them, whatever the skew
        _write_expert_ids(expert_ids_ptr, block_codes_ptr, pad_end, num_padded, E, c * blocks_per_program,
                          blocks_per_program, max_blocks, BLOCK_M, E_PAD, BLOCK_B)


@triton.jit
def align_one_launch_kernel(
    ids_ptr, num_padded_ptr, tokens_per_expert_ptr, sorted_ids_ptr, expert_ids_ptr, block_codes_ptr,
    S, E, length, max_blocks, blocks_per_program, hist_steps,
    BLOCK_M: tl.constexpr, CHUNK: tl.constexpr, E_PAD: tl.constexpr, HIST: tl.constexpr,
    BLOCK_J: tl.constexpr, FILL_COLS: tl.constexpr, USE_PDL: tl.constexpr = False,
):
    """The three launches' work in one, C programs (no cross-program dependence): program c
    histograms all S ids (hist_steps steps of HIST) into total[e] and before[e] (the pairs of e in
    chunks < c), derives base[c, e] as `align_scan_kernel` does, scatters its chunk, and writes its
    share of the expert ids, block codes and sentinel rows (`_write_share`)."""
    pdl_enter(USE_PDL)
    c = tl.program_id(0)
    re = tl.arange(0, E_PAD)
    # One histogram of 2 E_PAD bins a step: bin e counts the pairs of e in chunks < c, E_PAD + e the rest.
    counts = tl.zeros((2 * E_PAD,), dtype=tl.int32)
    for step in range(0, hist_steps):
        e_all, _ = _chunk_keys(ids_ptr, step, S, E, HIST)
        later = step * HIST + tl.arange(0, HIST) >= c * CHUNK
        counts += tl.histogram(e_all + tl.where(later, E_PAD, 0), 2 * E_PAD, mask=e_all < E)
    counts = tl.reshape(counts, (2, E_PAD))
    before = tl.sum(tl.where(tl.arange(0, 2)[:, None] == 0, counts, 0), axis=0)
    total = tl.sum(counts, axis=0)
    e, keys = _chunk_keys(ids_ptr, c, S, E, CHUNK)
    mine = tl.histogram(e, E_PAD, mask=e < E)
    padded = (total + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    pad_end = tl.cumsum(padded, axis=0)
    pad_start = pad_end - padded
    num_padded = tl.sum(padded, axis=0)
    base_e = pad_start + before - (tl.cumsum(mine, axis=0) - mine)      # base[c, e]
    sorted_keys = tl.sort(keys)
    se = sorted_keys // CHUNK                                           # expert at sorted position
    pair = c * CHUNK + sorted_keys % CHUNK
    base = tl.gather(base_e, tl.minimum(se, E_PAD - 1), 0)
    tl.store(sorted_ids_ptr + base + tl.arange(0, CHUNK), pair, mask=se < E)
    if c == 0:
        tl.store(num_padded_ptr, num_padded)
        tl.store(tokens_per_expert_ptr + re, total, mask=re < E)
    _write_share(sorted_ids_ptr, expert_ids_ptr, block_codes_ptr, total, padded, pad_end, num_padded, S, E,
                 length, max_blocks, c * blocks_per_program, blocks_per_program, BLOCK_M, E_PAD, BLOCK_J,
                 FILL_COLS)


@triton.jit
def row_starts_kernel(tokens_per_expert_ptr, out_ptr, E, BLOCK_M: tl.constexpr, E_POW2: tl.constexpr,
                      USE_PDL: tl.constexpr = False):
    """out (E + 1,) int32: 0, then the running sum of each expert's rows rounded up to BLOCK_M (the
    first sorted row of each expert's padded group, then num_padded). One program. USE_PDL: as the
    align kernels'."""
    pdl_enter(USE_PDL)
    e = tl.arange(0, E_POW2)
    n = tl.load(tokens_per_expert_ptr + e, mask=e < E, other=0)
    padded = (n + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, 0)
    tl.store(out_ptr, 0)
    tl.store(out_ptr + 1 + e, ends.to(tl.int32), mask=e < E)
