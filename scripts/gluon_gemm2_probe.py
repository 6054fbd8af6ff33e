"""Gluon GEMM2 probe: moekit's GEMM2 (down projection x routing weight, scattered to pair rows) as a
persistent warp-specialized Gluon kernel for Hopper, checked and timed beside moekit's own Triton GEMM2.

A go/no-go measurement for replacing `moekit.grouped_gemm.gemm2_weighted` by a Gluon kernel. Same
semantics, same inputs (`moekit.align.align_block_size`'s Alignment, h (L, I) in sorted order,
down_proj (E, H, I), topk_weights (T, K) fp32), same output: y (S, H) bf16,
y[p] = w_p * (h[r] @ down_e^T) for each placed pair p = sorted_ids[r] (fp32 accumulate, the weight
multiplied in fp32, one rounding); rows of unplaced pairs are not written.

The kernel (`gemm2_kernel`): one program per SM, three partitions:
    producer     1 warp: TMA loads into a ring of STAGES shared-memory stages (ready/empty mbarriers):
                 A = h rows through a descriptor over h with a [64, BK] box (one or two boxes a step:
                 the tile's rows are contiguous sorted rows), B = down_proj viewed as (E*H, I) with a
                 [BN, BK] box at row e*H + n0.
    consumers    2 warpgroups, async wgmma, then the epilogue: x w_p (sorted_ids of the tile's rows,
                 topk_weights gathered), bf16, a masked pointer store to y[pair] (padding rows, pair
                 >= S, skipped). A 128-row tile: consumer c owns rows [64c, 64c + 64) x BN columns.
                 A 64-row tile (a lone block): both consumers share its 64 rows, consumer c owns
                 columns [c BN/2, (c + 1) BN/2) (no idle warpgroup; one A box a step).
Work items follow the alignment: with block_m 64 and paired blocks (`Alignment.block_codes`: 2 = a
128-row tile of this and the next block, 1 = a 64-row tile, 0 = nothing) a unit is two blocks (as
moekit's persistent paired launch: every unit holds 64..192 rows of work, so the static round robin
stays balanced); with block_m 128 a unit is one block (a 128-row tile). Items (unit, N tile), N tiles
fastest, are dealt round robin to NUM_SMS programs up to cdiv(num_padded / block_m, blocks a unit) x
N tiles, num_padded read on the device (no host sync; the grid is a host-side bound).

Variants: gluon (BN 256, 3 stages, the epilogue converts to a coalesced layout through shared memory:
16-byte stores, whole rows per warp), gluon_direct (BN 256, 4 stages, stores straight from the wgmma
layout: 4-byte stores), gluon_n128 (BN 128, 4 stages, converted epilogue). `--variants` picks.

Checks (before any timing), per token count: y NaN-filled first (moekit's through workspace poisoning);
relative Frobenius error over the placed rows against the fp32 twin
`moekit.grouped_gemm.gemm2_weighted_torch`, which must be <= 2x that of plain bf16 PyTorch (the same
per-expert loop in bf16: bf16 matmul, x weight in bf16); every placed row written. Placement: a second
routing with --unplaced (2%) of the ids set to -1 (left out, as expert-parallel maps mark pairs): both
kernels must leave exactly the unplaced pairs' rows untouched (NaN) and match the twin on the rest.

Timing: CUDA events around each call only, a 256 MB buffer written before each call (L2 flushed;
--no-flush leaves it warm), warm-up, then --rounds rounds that run every variant once in turn (round
robin), ~2 ms spin first so launches queue ahead; medians. Reported: ms, TFLOP/s on the placed pairs
(2 * S_placed * H * I / t) and the speed-up over moekit's Triton `gemm2_weighted` (with the table
config of that token count: `moekit.tuning.get_config`). Each token count runs with its table config
and (unless --no-alt) the other alignment: block_m 128 for the paired 64-row configs (2048, 4096
tokens) and block_m 64 paired (the 4096 config) for the 128-row ones (8192, 16384), so both kernels
are timed at both kinds of alignment.

Hangs: each kernel first runs once alone, a flushed line before it and torch.cuda.synchronize() after,
so the log names what hung; run under an outer `timeout`.

`--aot` (no GPU): compiles each Gluon variant for sm_90 (GPUTarget("cuda", 90, 32)) through the JIT's
binder as a launch would (scripts/gluon_probe.py's machinery) and prints OK with shared memory,
registers, local memory (spills), HGMMA count and setmaxnreg, or FAIL; exits 1 on any failure.

Usage:
    timeout 300 python scripts/gluon_gemm2_probe.py --out x.jsonl           # on the H200
    python scripts/gluon_gemm2_probe.py --tokens 4096 --variants gluon --rounds 20
    PYTHONPATH=src /tmp/t36/bin/python scripts/gluon_gemm2_probe.py --aot   # CPU: compile check
"""

from __future__ import annotations

import os
import sys

if "--aot" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "0"     # compile, never interpret (before triton is imported)

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import gluon_probe as gp  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from gluon_probe import GLUON_ERROR, gl, gluon  # noqa: E402

if GLUON_ERROR is None:
    from gluon_probe import mbarrier, tma_load, warpgroup_mma, warpgroup_mma_wait
else:
    mbarrier = tma_load = warpgroup_mma = warpgroup_mma_wait = None

from moekit import _workspace  # noqa: E402
from moekit.align import align_block_size  # noqa: E402
from moekit.grouped_gemm import gemm2_weighted, gemm2_weighted_torch  # noqa: E402
from moekit.shapes import PRESETS  # noqa: E402
from moekit.tuning import get_config  # noqa: E402

PRESET = "qwen3-30b-a3b"
TOKENS = (2048, 4096, 8192, 16384)
SUB_M_ROWS = 64         # rows of one consumer warpgroup (wgmma m64) and of one A box
SUB_M = tl.constexpr(SUB_M_ROWS)      # the same, for the kernels
H200_SMS = 132
FLUSH_BYTES = 256 << 20


# --------------------------------------------------------------------------------------------------
# The Gluon kernel
# --------------------------------------------------------------------------------------------------

@gluon.constexpr_function
def _acc_layout(tile_n):
    # wgmma accumulator of one warpgroup: m64 x tile_n (one instruction wide), 4 warps along M.
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, tile_n, 16])


@gluon.constexpr_function
def _store_layout(tile_n):
    # 8 bf16 (16 bytes) a thread, a warp's threads along the row first: whole rows per instruction.
    tpw_n = min(32, tile_n // 8)
    return gl.BlockedLayout([1, 8], [32 // tpw_n, tpw_n], [4, 1], [1, 0])


@gluon.jit
def _block_kind(b, expert_ids_ptr, codes_ptr, PAIRED: gl.constexpr, SINGLE_KIND: gl.constexpr):
    """(expert, kind) of row block b: kind 2 = a 128-row tile starts here, 1 = a 64-row tile, 0 = none."""
    e = gl.load(expert_ids_ptr + b)
    if PAIRED:
        kind = gl.load(codes_ptr + b)
    else:
        kind = (e >= 0).to(gl.int32) * SINGLE_KIND
    return e, kind


@gluon.jit
def _num_items(num_padded_ptr, N, ALIGN_M: gl.constexpr, BPU: gl.constexpr, BLOCK_N: gl.constexpr):
    """(items, N tiles, live blocks): units of BPU blocks times N tiles, from num_padded on the device."""
    n_tiles = gl.cdiv(N, BLOCK_N)
    num_blocks = gl.load(num_padded_ptr) // ALIGN_M
    return gl.cdiv(num_blocks, BPU) * n_tiles, n_tiles, num_blocks


@gluon.jit
def _producer(a_desc, b_desc, a_bufs, b_bufs, ready_bars, empty_bars, expert_ids_ptr, codes_ptr,
              num_padded_ptr, N, K, ALIGN_M: gl.constexpr, BPU: gl.constexpr, PAIRED: gl.constexpr,
              SINGLE_KIND: gl.constexpr):
    """1 warp: for each live tile and K step, wait for a free stage, then TMA one or two [64, BK] boxes
    of h (a 64- or 128-row tile) and a [BN, BK] box of the expert's down rows into it."""
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = b_desc.block_type.shape[0]
    STAGES: gl.constexpr = b_bufs.type.shape[0]
    A_BYTES: gl.constexpr = a_desc.block_type.nbytes
    B_BYTES: gl.constexpr = b_desc.block_type.nbytes
    num_items, n_tiles, num_blocks = _num_items(num_padded_ptr, N, ALIGN_M, BPU, BLOCK_N)
    k_tiles = gl.cdiv(K, BLOCK_K)
    it = 0
    for item in range(gl.program_id(0), num_items, gl.num_programs(0)):
        unit = item // n_tiles
        b_col = (item % n_tiles) * BLOCK_N
        for j in range(BPU):
            b = unit * BPU + j
            if b < num_blocks:
                e, kind = _block_kind(b, expert_ids_ptr, codes_ptr, PAIRED, SINGLE_KIND)
                if kind != 0:
                    row0 = b * ALIGN_M
                    b_row = e * N + b_col
                    full = kind == 2
                    for ki in range(k_tiles):
                        s = it % STAGES
                        # first pass over the ring: parity 1 of a fresh barrier returns at once
                        mbarrier.wait(empty_bars.index(s), ((it // STAGES) & 1) ^ 1)
                        ready = ready_bars.index(s)
                        mbarrier.expect(ready, 2 * A_BYTES + B_BYTES, pred=full)
                        mbarrier.expect(ready, A_BYTES + B_BYTES, pred=kind == 1)
                        tma_load(a_desc, [row0, ki * BLOCK_K], ready, a_bufs.index(2 * s))
                        tma_load(a_desc, [row0 + SUB_M, ki * BLOCK_K], ready, a_bufs.index(2 * s + 1),
                                 pred=full)
                        tma_load(b_desc, [b_row, ki * BLOCK_K], ready, b_bufs.index(s))
                        it += 1


@gluon.jit
def _tile(a_bufs, b_bufs, ready_bars, empty_bars, it, k_tiles, y_ptr, w_ptr, sorted_ids_ptr, row0, col0,
          S, N, A_HALF: gl.constexpr, B_PART: gl.constexpr, TILE_N: gl.constexpr, EPI_CONVERT: gl.constexpr):
    """One warpgroup's [64, TILE_N] part of a tile: rows row0 + [0, 64) (A half A_HALF of each stage),
    columns col0 + [0, TILE_N) (all of B's box when B_PART < 0, else its part B_PART); then the
    epilogue. Returns the ring counter after the tile's K steps."""
    STAGES: gl.constexpr = b_bufs.type.shape[0]
    layout: gl.constexpr = _acc_layout(TILE_N)
    acc = gl.zeros((SUB_M, TILE_N), gl.float32, layout)
    for ki in range(k_tiles):
        s = it % STAGES
        mbarrier.wait(ready_bars.index(s), (it // STAGES) & 1)
        b = b_bufs.index(s)
        if B_PART >= 0:
            b = b.slice(B_PART * TILE_N, TILE_N)              # rows (N) of the [BN, BK] box
        acc = warpgroup_mma(a_bufs.index(2 * s + A_HALF), b.permute((1, 0)), acc, use_acc=ki > 0,
                            is_async=True)
        # one wgmma in flight: the previous step's retired, its stage goes back (one arrival per
        # warpgroup; the empty barriers count two)
        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
        mbarrier.arrive(empty_bars.index((it + STAGES - 1) % STAGES), pred=ki > 0)
        it += 1
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    mbarrier.arrive(empty_bars.index((it + STAGES - 1) % STAGES))

    # epilogue: x routing weight in fp32, one rounding, scatter to the pairs' rows
    rows = row0 + gl.arange(0, SUB_M, layout=gl.SliceLayout(1, layout))
    pair = gl.load(sorted_ids_ptr + rows)
    valid = pair < S
    wt = gl.load(w_ptr + pair, mask=valid, other=0.0)
    c = (acc * wt[:, None]).to(y_ptr.dtype.element_ty)
    if EPI_CONVERT:
        out_layout: gl.constexpr = _store_layout(TILE_N)
        c = gl.convert_layout(c, out_layout)
        rows = row0 + gl.arange(0, SUB_M, layout=gl.SliceLayout(1, out_layout))
        pair = gl.load(sorted_ids_ptr + rows)
        valid = pair < S
    else:
        out_layout: gl.constexpr = layout
    cols = col0 + gl.arange(0, TILE_N, layout=gl.SliceLayout(0, out_layout))
    ptrs = y_ptr + pair.to(gl.int64)[:, None] * N + cols[None, :]
    gl.store(ptrs, c, mask=valid[:, None] & (cols < N)[None, :])
    return it


@gluon.jit
def _consumer(a_bufs, b_bufs, ready_bars, empty_bars, y_ptr, w_ptr, sorted_ids_ptr, expert_ids_ptr,
              codes_ptr, num_padded_ptr, S, N, K, BLOCK_N: gl.constexpr, CONSUMER: gl.constexpr,
              ALIGN_M: gl.constexpr, BPU: gl.constexpr, PAIRED: gl.constexpr, SINGLE_KIND: gl.constexpr,
              EPI_CONVERT: gl.constexpr):
    """Consumer warpgroup CONSUMER (0, 1): the producer's tile sequence, its part of each tile."""
    BLOCK_K: gl.constexpr = a_bufs.type.shape[2]
    HALF_N: gl.constexpr = BLOCK_N // 2
    num_items, n_tiles, num_blocks = _num_items(num_padded_ptr, N, ALIGN_M, BPU, BLOCK_N)
    k_tiles = gl.cdiv(K, BLOCK_K)
    it = 0
    for item in range(gl.program_id(0), num_items, gl.num_programs(0)):
        unit = item // n_tiles
        col0 = (item % n_tiles) * BLOCK_N
        for j in range(BPU):
            b = unit * BPU + j
            if b < num_blocks:
                e, kind = _block_kind(b, expert_ids_ptr, codes_ptr, PAIRED, SINGLE_KIND)
                row0 = b * ALIGN_M
                if kind == 2:       # 128 rows: this warpgroup's 64, all BN columns
                    it = _tile(a_bufs, b_bufs, ready_bars, empty_bars, it, k_tiles, y_ptr, w_ptr,
                               sorted_ids_ptr, row0 + CONSUMER * SUB_M, col0, S, N, CONSUMER, -1, BLOCK_N,
                               EPI_CONVERT)
                elif kind == 1:     # 64 rows: all of them, this warpgroup's half of the columns
                    it = _tile(a_bufs, b_bufs, ready_bars, empty_bars, it, k_tiles, y_ptr, w_ptr,
                               sorted_ids_ptr, row0, col0 + CONSUMER * HALF_N, S, N, 0, CONSUMER, HALF_N,
                               EPI_CONVERT)


@gluon.jit
def gemm2_kernel(a_desc, b_desc, y_ptr, w_ptr, sorted_ids_ptr, expert_ids_ptr, codes_ptr, num_padded_ptr,
                 S, N, K, STAGES: gl.constexpr, ALIGN_M: gl.constexpr, BPU: gl.constexpr,
                 PAIRED: gl.constexpr, SINGLE_KIND: gl.constexpr, EPI_CONVERT: gl.constexpr,
                 PRODUCER_REGS: gl.constexpr, CONSUMER_REGS: gl.constexpr):
    dtype: gl.constexpr = a_desc.dtype
    BLOCK_N: gl.constexpr = b_desc.block_type.shape[0]
    # A: two [64, BK] halves a stage (index 2s, 2s + 1); B: one [BN, BK] box a stage
    a_bufs = gl.allocate_shared_memory(dtype, [2 * STAGES] + a_desc.block_type.shape, a_desc.layout)
    b_bufs = gl.allocate_shared_memory(dtype, [STAGES] + b_desc.block_type.shape, b_desc.layout)
    ready_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready_bars.index(i), count=1)      # the producer's expect() arrival
        mbarrier.init(empty_bars.index(i), count=2)      # one arrival per consumer warpgroup
    gp.fence_async_shared()
    C0: gl.constexpr = 0
    C1: gl.constexpr = 1
    gl.warp_specialize([
        (_consumer, (a_bufs, b_bufs, ready_bars, empty_bars, y_ptr, w_ptr, sorted_ids_ptr, expert_ids_ptr,
                     codes_ptr, num_padded_ptr, S, N, K, BLOCK_N, C0, ALIGN_M, BPU, PAIRED, SINGLE_KIND,
                     EPI_CONVERT)),
        (_consumer, (a_bufs, b_bufs, ready_bars, empty_bars, y_ptr, w_ptr, sorted_ids_ptr, expert_ids_ptr,
                     codes_ptr, num_padded_ptr, S, N, K, BLOCK_N, C1, ALIGN_M, BPU, PAIRED, SINGLE_KIND,
                     EPI_CONVERT)),
        (_producer, (a_desc, b_desc, a_bufs, b_bufs, ready_bars, empty_bars, expert_ids_ptr, codes_ptr,
                     num_padded_ptr, N, K, ALIGN_M, BPU, PAIRED, SINGLE_KIND)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


def gluon_gemm2(h, down_proj, topk_weights, align, y=None, *, paired, block_n=256, block_k=64, stages=3,
                epi_convert=True, num_sms=None):
    """y (S, H) = moekit's gemm2_weighted(h, down_proj, topk_weights, align, cfg) with the Gluon kernel.
    paired: the config's pair_blocks == 2 (block_m 64 only)."""
    num_experts, hidden, inter = down_proj.shape
    align_m = align.block_m
    if align_m not in (64, 128) or (paired and align_m != 64):
        raise ValueError(f"block_m {align_m} (paired {paired}): the Gluon GEMM2 takes 64 (paired or not) "
                         "or 128")
    contiguous = h.is_contiguous() and down_proj.is_contiguous() and topk_weights.is_contiguous()
    if hidden % block_n or not contiguous:
        raise ValueError("H must be a multiple of block_n; h, down_proj and topk_weights contiguous")
    num_pairs = align.num_pairs
    if y is None:
        y = torch.empty(num_pairs, hidden, dtype=h.dtype, device=h.device)
    bpu = 2 if paired else 1
    a_desc = gp._gl_desc(h, [SUB_M_ROWS, block_k])
    b_desc = gp._gl_desc(down_proj.view(num_experts * hidden, inter), [block_n, block_k])
    # a bound: num_padded is on the device
    items = triton.cdiv(align.max_blocks, bpu) * (hidden // block_n)
    grid = (max(1, min(num_sms or gp._num_sms(None), items)),)
    gemm2_kernel[grid](a_desc, b_desc, y, topk_weights, align.sorted_ids, align.expert_ids, align.block_codes,
                       align.num_padded, num_pairs, hidden, inter, STAGES=stages, ALIGN_M=align_m, BPU=bpu,
                       PAIRED=paired, SINGLE_KIND=2 if align_m == 128 else 1, EPI_CONVERT=epi_convert,
                       PRODUCER_REGS=40, CONSUMER_REGS=232, num_warps=4, maxnreg=gp._ws_maxnreg(2))
    return y


# name -> launch options
VARIANTS = {
    "gluon": dict(block_n=256, stages=3, epi_convert=True),
    "gluon_direct": dict(block_n=256, stages=4, epi_convert=False),
    "gluon_n128": dict(block_n=128, stages=4, epi_convert=True),
}


# --------------------------------------------------------------------------------------------------
# GPU run
# --------------------------------------------------------------------------------------------------

def make_inputs(num_tokens, shape, gen, unplaced=0.0):
    num_experts, top_k = shape.num_experts, shape.top_k
    logits = torch.randn(num_tokens, num_experts, device="cuda", generator=gen)
    weights, ids = torch.softmax(logits, dim=-1).topk(top_k, dim=-1)
    ids = ids.to(torch.int32)
    if unplaced:
        drop = torch.rand(ids.shape, device="cuda", generator=gen) < unplaced
        ids = torch.where(drop, -1, ids)
    return ids, weights.float().contiguous()


def make_case(num_tokens, cfg, shape, gen, unplaced=0.0):
    ids, weights = make_inputs(num_tokens, shape, gen, unplaced)
    align = align_block_size(ids, shape.num_experts, cfg.block_m, backend="triton")
    length = align.sorted_ids.numel()
    h = torch.randn(length, shape.intermediate_size, device="cuda", dtype=torch.bfloat16, generator=gen)
    return ids, weights, align, h


def bf16_baseline(h, down, weights, align):
    """Plain bf16 PyTorch: the twin's per-expert loop in bf16 (bf16 matmul, x weight in bf16)."""
    from moekit.grouped_gemm import _placed_rows
    y = torch.zeros(align.num_pairs, down.shape[1], dtype=torch.bfloat16, device=h.device)
    rows, pair, expert = _placed_rows(align)
    w = weights.reshape(-1).to(torch.bfloat16)
    for e in expert.unique().tolist():
        sel = expert == e
        y[pair[sel]] = (h[rows[sel]] @ down[e].T) * w[pair[sel], None]
    return y


def rel_err(y, ref, placed) -> float:
    d = y[placed].float() - ref[placed]
    return (d.norm() / ref[placed].norm()).item()      # NaN when a placed row was not written


def check(name, y, ref, placed, tol) -> dict:
    """Relative error on the placed rows, every placed row written, no other row touched (NaN)."""
    err = rel_err(y, ref, placed)
    written = ~torch.isnan(y.float()).any(dim=1)
    same_rows = bool((written == placed).all())
    return dict(err=err, placement=same_rows, ok=bool(err <= tol) and same_rows)


def moekit_call(h, down, weights, align, cfg):
    return gemm2_weighted(h, down, weights, align, cfg)


def first_run(name, fn) -> str | None:
    print(f"  [{name}] first run ...", end="", flush=True)
    try:
        fn()
        torch.cuda.synchronize()
    except Exception as exc:
        print(" FAILED", flush=True)
        return gp._error_head(exc)
    print(" done", flush=True)
    return None


def bench(fns: dict, rounds: int, warmup: int, flush: torch.Tensor | None) -> dict:
    """Median ms per variant: round robin, the L2 flushed (when flush is given) before each call."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    torch.cuda.synchronize()
    events = {name: [] for name in fns}
    sleep = getattr(torch.cuda, "_sleep", None)
    for _ in range(rounds):
        if sleep is not None:
            sleep(2_000_000)
        for name, fn in fns.items():
            if flush is not None:
                flush.zero_()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            events[name].append((start, end))
    torch.cuda.synchronize()
    return {name: statistics.median(s.elapsed_time(e) for s, e in pairs) for name, pairs in events.items()}


def run_case(args, rec, shape, down, num_tokens, cfg, label, broken, flush):
    paired = cfg.pair_blocks == 2
    gen = torch.Generator(device="cuda").manual_seed(num_tokens)
    ids, weights, align, h = make_case(num_tokens, cfg, shape, gen)
    num_padded = int(align.num_padded)
    placed_pairs = int(((ids >= 0) & (ids < shape.num_experts)).sum())
    print(f"\n== T={num_tokens} {label}: block_m={cfg.block_m} pair_blocks={cfg.pair_blocks} "
          f"block_n2={cfg.block_n2} block_k2={cfg.block_k2} warps2={cfg.warps2} stages2={cfg.stages2} "
          f"tma={cfg.tma_weights} persistent={cfg.persistent}; S={align.num_pairs} rows used {num_padded} "
          f"of L={align.sorted_ids.numel()}", flush=True)
    ref = gemm2_weighted_torch(h, down, weights, align)
    base = bf16_baseline(h, down, weights, align)
    placed = torch.zeros(align.num_pairs, dtype=torch.bool, device="cuda")
    placed[align.sorted_ids[:num_padded].long()[align.sorted_ids[:num_padded] < align.num_pairs]] = True
    base_err = rel_err(base, ref, placed)
    tol = 2 * base_err
    print(f"  plain bf16 error {base_err:.3e}, tolerance {tol:.3e}")

    calls, results = {}, {}
    name = "moekit_triton"
    held = []

    def poisoned_call():
        with _workspace.poisoning():         # moekit's y starts NaN
            held.append(moekit_call(h, down, weights, align, cfg))

    err = first_run(f"{name} T={num_tokens} {label}", poisoned_call)
    if err is None:
        results[name] = check(name, held.pop(), ref, placed, tol)
        calls[name] = lambda: moekit_call(h, down, weights, align, cfg)
    else:
        print(f"    {err}")
        rec.add(kind="gemm2", T=num_tokens, config=label, variant=name, error=err)
    for name, opts in VARIANTS.items():
        if args.variants and name not in args.variants:
            continue
        if name in broken:
            continue
        y = torch.full((align.num_pairs, shape.hidden_size), float("nan"), device="cuda",
                       dtype=torch.bfloat16)
        call = lambda y=y, opts=opts: gluon_gemm2(h, down, weights, align, y, paired=paired, **opts)
        err = first_run(f"{name} T={num_tokens} {label}", call)
        if err is not None:
            print(f"    {err}")
            broken[name] = err
            rec.add(kind="gemm2", T=num_tokens, config=label, variant=name, error=err)
            continue
        results[name] = check(name, y, ref, placed, tol)
        calls[name] = call

    # placement with unplaced pairs (same config)
    gen_u = torch.Generator(device="cuda").manual_seed(num_tokens + 1)
    ids_u, weights_u, align_u, h_u = make_case(num_tokens, cfg, shape, gen_u, args.unplaced)
    ref_u = gemm2_weighted_torch(h_u, down, weights_u, align_u)
    npad_u = int(align_u.num_padded)
    placed_u = torch.zeros(align_u.num_pairs, dtype=torch.bool, device="cuda")
    sid = align_u.sorted_ids[:npad_u].long()
    placed_u[sid[sid < align_u.num_pairs]] = True
    n_unplaced = int((~placed_u).sum())
    base_u = rel_err(bf16_baseline(h_u, down, weights_u, align_u), ref_u, placed_u)
    for name in list(results):
        if name == "moekit_triton":
            with _workspace.poisoning():
                y_u = moekit_call(h_u, down, weights_u, align_u, cfg)
        else:
            y_u = torch.full((align_u.num_pairs, shape.hidden_size), float("nan"), device="cuda",
                             dtype=torch.bfloat16)
            gluon_gemm2(h_u, down, weights_u, align_u, y_u, paired=paired, **VARIANTS[name])
        torch.cuda.synchronize()
        cu = check(name, y_u, ref_u, placed_u, 2 * base_u)
        results[name].update(unplaced_err=cu["err"], unplaced_placement=cu["placement"])
        results[name]["ok"] = results[name]["ok"] and cu["ok"]

    ms = bench(calls, args.rounds, args.warmup, flush) if calls else {}
    flops = 2.0 * placed_pairs * shape.hidden_size * shape.intermediate_size
    t_ref = ms.get("moekit_triton")
    print(f"  ({n_unplaced} of {align.num_pairs} pairs unplaced in the placement check; "
          f"L2 {'flushed' if flush is not None else 'warm'})")
    print(f"  {'variant':<15}{'rel err':>11}{'placed ok':>10}{'unpl. err':>11}{'ok':>5}{'ms':>10}"
          f"{'TFLOP/s':>9}{'speed-up':>10}")
    for name, r in results.items():
        t = ms.get(name)
        tflops = flops / t / 1e9 if t else None
        speedup = t_ref / t if t and t_ref else None
        timing = (f"{t:>10.4f}{tflops:>9.1f}{speedup:>9.3f}x" if t and speedup
                  else f"{t or float('nan'):>10.4f}{tflops or float('nan'):>9.1f}{'-':>10}")
        placement = "yes" if r["placement"] and r["unplaced_placement"] else "NO"
        print(f"  {name:<15}{r['err']:>11.3e}{placement:>10}"
              f"{r['unplaced_err']:>11.3e}{'yes' if r['ok'] else 'NO':>5}{timing}")
        rec.add(kind="gemm2", T=num_tokens, config=label, variant=name, block_m=cfg.block_m,
                pair_blocks=cfg.pair_blocks, S=align.num_pairs, placed_pairs=placed_pairs,
                num_padded=num_padded,
                rel_err=r["err"], bf16_err=base_err, tol=tol, placement=r["placement"],
                unplaced_err=r["unplaced_err"], unplaced_placement=r["unplaced_placement"], ok=r["ok"], ms=t,
                tflops=tflops, speedup_vs_moekit=speedup, l2_flushed=flush is not None)
    return all(r["ok"] for r in results.values())


def run_gpu(args) -> int:
    gp.print_device(GLUON_ERROR)
    if GLUON_ERROR:
        return 1
    torch.backends.cuda.matmul.allow_tf32 = False
    shape = PRESETS[PRESET]
    rec = gp.Recorder(args.out)
    gen = torch.Generator(device="cuda").manual_seed(0)
    down = (torch.randn(shape.num_experts, shape.hidden_size, shape.intermediate_size, device="cuda",
                        dtype=torch.bfloat16, generator=gen) / shape.intermediate_size ** 0.5)
    flush = None if args.no_flush else torch.empty(FLUSH_BYTES, dtype=torch.uint8, device="cuda")
    started = time.perf_counter()
    ok = True
    broken = {}
    cfg_64 = get_config(shape, 4096, torch.bfloat16, "cuda")
    cfg_128 = get_config(shape, 8192, torch.bfloat16, "cuda")
    for num_tokens in args.tokens:
        cfg = get_config(shape, num_tokens, torch.bfloat16, "cuda")
        cases = [("table", cfg)]
        if args.alt:
            if cfg.pair_blocks == 2 or cfg.block_m < 128:
                cases.append(("alt block_m=128 (8192 config)", cfg_128))
            else:
                cases.append(("alt block_m=64 paired (4096 config)", cfg_64))
        for label, c in cases:
            try:
                ok &= run_case(args, rec, shape, down, num_tokens, c, label, broken, flush)
                torch.cuda.empty_cache()
            except Exception as exc:
                ok = False
                print(f"  case failed: {gp._error_head(exc)}", flush=True)
    print(f"\ntotal {time.perf_counter() - started:.0f} s" + (f"; results in {args.out}" if args.out else ""))
    return 0 if ok else 1


# --------------------------------------------------------------------------------------------------
# --aot
# --------------------------------------------------------------------------------------------------

def run_aot(args) -> int:
    from moekit.align import align_block_size_torch

    if GLUON_ERROR:
        print(f"no Gluon: {GLUON_ERROR}")
        return 1
    shape = PRESETS[PRESET]
    num_tokens = 256
    ids = torch.randint(0, shape.num_experts, (num_tokens, shape.top_k), dtype=torch.int32)
    weights = torch.empty(num_tokens, shape.top_k, dtype=torch.float32)
    down = torch.empty(shape.num_experts, shape.hidden_size, shape.intermediate_size, dtype=torch.bfloat16)

    def make_launch(align_m, paired, opts):
        align = align_block_size_torch(ids, shape.num_experts, align_m)
        h = torch.empty(align.sorted_ids.numel(), shape.intermediate_size, dtype=torch.bfloat16)
        y = torch.empty(align.num_pairs, shape.hidden_size, dtype=torch.bfloat16)
        return lambda: gluon_gemm2(h, down, weights, align, y, paired=paired, num_sms=H200_SMS, **opts)

    def extra_facts(facts, compiled, kwargs):
        return (f"setmaxnreg {'yes' if 'setmaxnreg' in facts.ptx else 'no'}, "
                f"warps {compiled.metadata.num_warps}, maxnreg {kwargs.get('maxnreg')}")

    return gp.aot_aligned_variants(args, VARIANTS, make_launch, gemm2_kernel, extra_facts)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="See the module docstring for what is measured and how.")
    parser.add_argument("--out", help="write results as JSON lines to this file (truncated first)")
    parser.add_argument("--aot", action="store_true", help="no GPU: compile the Gluon variants for sm_90")
    parser.add_argument("--dump", help="with --aot: write each variant's TTGIR, PTX and SASS here")
    parser.add_argument("--variants", type=lambda s: [v for v in s.split(",") if v],
                        help="comma-separated Gluon variants (moekit's Triton GEMM2 always runs): "
                             + ", ".join(VARIANTS))
    parser.add_argument("--tokens", type=lambda s: [int(v) for v in s.split(",") if v], default=list(TOKENS),
                        help="comma-separated token counts (default 2048,4096,8192,16384)")
    parser.add_argument("--no-alt", dest="alt", action="store_false",
                        help="only each token count's table config (not also the other alignment)")
    parser.add_argument("--no-flush", action="store_true", help="leave L2 warm between timed calls")
    parser.add_argument("--unplaced", type=float, default=0.02,
                        help="fraction of ids set to -1 in the placement check (default 0.02)")
    parser.add_argument("--rounds", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=5)
    args = parser.parse_args(argv)
    if args.aot:
        return run_aot(args)
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to run (use --aot for the compile check)")
        return 1
    return run_gpu(args)


if __name__ == "__main__":
    sys.exit(main())
