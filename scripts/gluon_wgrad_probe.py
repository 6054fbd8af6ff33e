"""Gluon weight-gradient probe: a persistent, warp-specialized Gluon (sm_90) grouped weight gradient
against moekit's Triton `moe_wgrad_kernel`, checked and timed on an H200. A go/no-go measurement.

The training backward's two weight gradients (`moekit.grouped_gemm_backward`), per expert e:

    d gate_up_e (2I, H) = sum over e's sorted rows r of dpre_w[r]^T x[t(r)]
    d down_e    (H, I)  = sum over e's sorted rows r of dout[t(r)]^T h_w[r]

moekit computes them with one Triton program per (expert, output tile), loading the token-major operand
(x, dout) gathered row by row (`moe_wgrad_kernel`, or the range kernel at few rows an expert). Here the
gathered operand is first pre-gathered into sorted-row order (x_sorted[r] = x[t(r)], zeros on padding
rows: `gather_rows_kernel`, timed on its own), so both operands are plain sorted rows and TMA loads them:

    C_e (N, C) = A[rows_e]^T @ B[rows_e]      A (L, N), B (L, C) row-major bf16; C (E, N, C) bf16

gate_up: A = dpre_w, B = x_sorted; down: A = dout_sorted, B = h_w. The reduction runs over rows, so
both wgmma operands are MN-major: a TMA tile of A is [BK rows, BN] (N contiguous) and wgmma reads its
permuted view [BN, BK] (the NVMMA layout's transposed form), a tile of B is [BK, BC] as it lies.

The kernel (`gluon_wgrad_kernel`): persistent (one program an SM), work items (expert, N tile, C tile),
expert slowest (the programs in flight share an expert's rows in L2), strided over the programs. A
1-warp producer partition walks the program's items and each item's row steps (BK = 64 rows, or the
align block size where smaller; each
expert's rows are [row_starts[e], row_starts[e + 1]), a multiple of the align block size) and fills a
ring of shared-memory stages with TMA, ready/empty mbarriers, across item boundaries: the ring never
drains between experts (with ~4 row steps an item, the per-item pipeline fill dominates a
program-per-tile kernel). Two consumer warpgroups issue async wgmma, release stages, and store their
bf16 tile through shared memory with a TMA store that overlaps the next item. An expert with no rows
has items with no steps: its consumers store the zero accumulator (an exact zero tile). Two schedules:

    coop   both warpgroups work on every item, each on 64 of its 128 N rows (CUTLASS "cooperative");
           tile 128 x 256, 3 stages. The epilogue (registers -> shared) stalls the tensor cores.
    pp     "ping-pong": the warpgroups take alternate items, each a whole tile, so one's epilogue runs
           under the other's main loop. Both read the one ring in order; an order barrier pair makes
           each warpgroup start an item's main loop only after the other finished the previous item's
           (else a warpgroup could wait on a stage's ready barrier a whole ring pass early, where the
           mbarrier parity cannot tell the passes apart). pp_128x128 (4 stages; _s5: 5), pp_64x256 (4).

Variants compared, per T in (1024, 4096, 16384) on Qwen3-30B-A3B (E=128, H=2048, I=768, K=8, bf16), the
routing softmax(randn(T, E)).topk(K) with the last expert never picked, align_block_size(backend=
"triton") at the tuned config's block_m:
    moekit      gate_up_proj_grad / down_proj_grad(..., padding_zero=True), default tiles (row_starts
                passed in, computed once as a backward does; likewise for the Gluon kernels)
    gather      the two pre-gathers (x, dout) into sorted order
    coop_*, pp_*  the Gluon kernel (`VARIANTS`), both launches; also reported with the gathers added
Correctness first: outputs NaN-filled (moekit's workspace poisoned), relative Frobenius error against
the fp32 twin (`*_proj_grad_torch`) at most 2x plain bf16 PyTorch's (per-expert bf16 matmuls), the
empty expert's gradient exactly 0. Timing: CUDA events around each launch, a 256 MB write (L2 flush)
before each, round robin over all launches, medians; TFLOP/s over placed pairs (2 S N C a launch).

Hangs: mbarrier mistakes hang rather than fail, so each variant first runs alone with a flushed line
before and a synchronize after (the log names the hung variant); run under an outer `timeout`. A variant
that fails is reported and the others go on. `--aot` needs no GPU: compiles each Gluon variant (and the
gather kernel) for sm_90 and prints OK with shared memory, registers, local memory (must be 0).

Usage:
    PYTHONPATH=src timeout 300 python scripts/gluon_wgrad_probe.py --out wgrad_gluon.jsonl   # H200, < 90 s
    PYTHONPATH=src python scripts/gluon_wgrad_probe.py --tokens 4096 --variants pp_128x128
    PYTHONPATH=src python scripts/gluon_wgrad_probe.py --aot [--dump DIR]        # CPU only
"""

from __future__ import annotations

import os
import sys

if "--aot" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "0"     # compile, never interpret (before triton is imported)

import argparse
import re
import statistics
import time
import types

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gluon_probe import Recorder, _capture, _compile, _cuobjdump, _error_head  # noqa: E402

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonTensorDescriptor

    tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared      # 3.6 names
    tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global
    GLUON_ERROR = None
except ImportError as exc:          # no Gluon: the kernels are defined but never launched
    GLUON_ERROR = f"{type(exc).__name__}: {exc}"
    gluon = types.SimpleNamespace(jit=lambda fn=None, **_: fn, constexpr_function=lambda fn: fn)
    gl = types.SimpleNamespace(constexpr=None)
    fence_async_shared = mbarrier = tma = tma_load = tma_store = warpgroup_mma = warpgroup_mma_wait = None
    GluonTensorDescriptor = None

H200_SMS = 132
SMEM_LIMIT = 232448          # sm_90's largest dynamic shared memory a block (227 KB)
PRESET = "qwen3-30b-a3b"
TOKENS = (1024, 4096, 16384)
FLUSH_BYTES = 256 << 20
DEVICE = "cuda"


# --------------------------------------------------------------------------------------------------
# Gluon kernel
# --------------------------------------------------------------------------------------------------

@gluon.constexpr_function
def _acc_layout(ACC_N, BLOCK_C):
    # wgmma accumulator of one warpgroup: 4 warps stacked along N (16 rows each per instruction),
    # the widest instruction n = BLOCK_C (<= 256).
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_C, 16])


@gluon.jit
def _item(t, tiles_per_expert, c_tiles, row_starts_ptr, BLOCK_N: gl.constexpr, BLOCK_C: gl.constexpr):
    """Work item t -> (expert, first N row, first C column, the expert's first and end row)."""
    e = t // tiles_per_expert
    rem = t % tiles_per_expert
    off_n = (rem // c_tiles) * BLOCK_N
    off_c = (rem % c_tiles) * BLOCK_C
    start = gl.load(row_starts_ptr + e)
    end = gl.load(row_starts_ptr + e + 1)
    return e, off_n, off_c, start, end


@gluon.jit
def _wg_producer(a_desc, b_desc, a_bufs, b_bufs, ready_bars, empty_bars, row_starts_ptr, num_items,
                 tiles_per_expert, c_tiles, BLOCK_N: gl.constexpr):
    """1 warp: for every item of this program and every BK-row step of its expert, the A tile(s)
    [BK, A_W] (A_PARTS of them side by side along N) and the B tile [BK, BC] into the next stage."""
    BK: gl.constexpr = b_desc.block_type.shape[0]
    BLOCK_C: gl.constexpr = b_desc.block_type.shape[1]
    A_W: gl.constexpr = a_desc.block_type.shape[1]
    STAGES: gl.constexpr = b_bufs.type.shape[0]
    A_PARTS: gl.constexpr = a_bufs.type.shape[0] // STAGES
    NBYTES: gl.constexpr = A_PARTS * a_desc.block_type.nbytes + b_desc.block_type.nbytes
    it = 0                          # stage uses so far, across this program's items
    for t in range(gl.program_id(0), num_items, gl.num_programs(0)):
        e, off_n, off_c, start, end = _item(t, tiles_per_expert, c_tiles, row_starts_ptr, BLOCK_N, BLOCK_C)
        for r in range(start, end, BK):
            s = it % STAGES
            # Pass it // STAGES over the ring: the first pass finds the stages empty (waiting on the
            # parity before a fresh barrier's returns at once), later ones wait for the release.
            mbarrier.wait(empty_bars.index(s), ((it // STAGES) & 1) ^ 1)
            ready = ready_bars.index(s)
            mbarrier.expect(ready, NBYTES)
            for i in gl.static_range(A_PARTS):
                tma_load(a_desc, [r, off_n + i * A_W], ready, a_bufs.index(s * A_PARTS + i))
            tma_load(b_desc, [r, off_c], ready, b_bufs.index(s))
            it += 1


@gluon.jit
def _wg_consumer(a_bufs, b_bufs, ready_bars, empty_bars, order_bars, c_desc, c_smem, row_starts_ptr,
                 num_items, tiles_per_expert, c_tiles, N, CONSUMER: gl.constexpr, PINGPONG: gl.constexpr,
                 A_PART: gl.constexpr, ROW_OFF: gl.constexpr, BLOCK_N: gl.constexpr):
    """One warpgroup. coop (PINGPONG False): every item, its accumulator the N rows [ROW_OFF, ROW_OFF
    + ACC_N) of the tile, from A sub-tile A_PART. pp: the items j (counting this program's) with
    j % 2 == CONSUMER, the whole tile."""
    ACC_N: gl.constexpr = c_desc.block_type.shape[0]
    BLOCK_C: gl.constexpr = c_desc.block_type.shape[1]
    STAGES: gl.constexpr = b_bufs.type.shape[0]
    BK: gl.constexpr = b_bufs.type.shape[1]
    A_PARTS: gl.constexpr = a_bufs.type.shape[0] // STAGES
    SPLIT: gl.constexpr = 2 if PINGPONG else 1
    MINE: gl.constexpr = CONSUMER if PINGPONG else 0
    layout: gl.constexpr = _acc_layout(ACC_N, BLOCK_C)
    c_buf = c_smem.index(CONSUMER)

    it = 0                          # stage uses so far (both warpgroups' items)
    j = 0                           # items so far
    waits = 0                       # pp: order-barrier waits so far
    for t in range(gl.program_id(0), num_items, gl.num_programs(0)):
        e, off_n, off_c, start, end = _item(t, tiles_per_expert, c_tiles, row_starts_ptr, BLOCK_N, BLOCK_C)
        steps = (end - start) // BK
        if j % SPLIT == MINE:
            if PINGPONG:
                # The other warpgroup finished the previous item's main loop: every stage use before
                # this item's has landed, so no ready wait below can match an earlier pass's phase.
                mbarrier.wait(order_bars.index(CONSUMER), waits & 1, pred=j > 0)
                waits += (j > 0).to(gl.int32)
            acc = gl.zeros((ACC_N, BLOCK_C), gl.float32, layout)
            for ki in range(steps):
                k = it + ki
                s = k % STAGES
                mbarrier.wait(ready_bars.index(s), (k // STAGES) & 1)
                a = a_bufs.index(s * A_PARTS + A_PART).permute((1, 0))   # [A_W, BK], MN-major
                acc = warpgroup_mma(a, b_bufs.index(s), acc, is_async=True)
                # <= 1 in flight: the previous step's wgmma retired, release its stage.
                acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
                mbarrier.arrive(empty_bars.index((k + STAGES - 1) % STAGES), pred=ki > 0)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            mbarrier.arrive(empty_bars.index((it + steps + STAGES - 1) % STAGES), pred=steps > 0)
            if PINGPONG:
                mbarrier.arrive(order_bars.index(1 - CONSUMER))      # the other may start its next item
            # Epilogue: the previous TMA store from c_buf had a whole item to finish; the fence orders
            # the shared stores before the async proxy's read.
            c = acc.to(c_desc.dtype)
            tma.store_wait(pendings=0)
            c_buf.store(c)
            fence_async_shared()
            tma_store(c_desc, [e * N + off_n + ROW_OFF, off_c], c_buf)
        it += steps
        j += 1
    tma.store_wait(pendings=0)


@gluon.jit
def gluon_wgrad_kernel(a_desc, b_desc, c_desc, row_starts_ptr, num_items, tiles_per_expert, c_tiles, N,
                       STAGES: gl.constexpr, PINGPONG: gl.constexpr, PRODUCER_REGS: gl.constexpr,
                       CONSUMER_REGS: gl.constexpr):
    dtype: gl.constexpr = a_desc.dtype
    BK: gl.constexpr = a_desc.block_type.shape[0]
    A_W: gl.constexpr = a_desc.block_type.shape[1]
    ACC_N: gl.constexpr = c_desc.block_type.shape[0]
    BLOCK_C: gl.constexpr = c_desc.block_type.shape[1]
    # coop: two A sub-tiles of ACC_N (= A_W) rows, one a warpgroup; pp: one A tile, the whole item.
    A_PARTS: gl.constexpr = 1 if PINGPONG else 2
    BLOCK_N: gl.constexpr = ACC_N if PINGPONG else 2 * ACC_N

    a_bufs = gl.allocate_shared_memory(dtype, [STAGES * A_PARTS, BK, A_W], a_desc.layout)
    b_bufs = gl.allocate_shared_memory(dtype, [STAGES, BK, BLOCK_C], b_desc.layout)
    c_smem = gl.allocate_shared_memory(dtype, [2, ACC_N, BLOCK_C], c_desc.layout)
    ready_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    order_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready_bars.index(i), count=1)                        # the producer's expect()
        mbarrier.init(empty_bars.index(i), count=1 if PINGPONG else 2)     # the stage's consumer(s)
    for i in gl.static_range(2):
        mbarrier.init(order_bars.index(i), count=1)
    fence_async_shared()
    C0: gl.constexpr = 0
    C1: gl.constexpr = 1
    R0: gl.constexpr = 0
    R1: gl.constexpr = 0 if PINGPONG else ACC_N
    P1: gl.constexpr = 0 if PINGPONG else 1
    # Default partition (4 warps): consumer 0; workers: consumer 1 (4 warps), producer (1 warp).
    gl.warp_specialize([
        (_wg_consumer, (a_bufs, b_bufs, ready_bars, empty_bars, order_bars, c_desc, c_smem, row_starts_ptr,
                        num_items, tiles_per_expert, c_tiles, N, C0, PINGPONG, C0, R0, BLOCK_N)),
        (_wg_consumer, (a_bufs, b_bufs, ready_bars, empty_bars, order_bars, c_desc, c_smem, row_starts_ptr,
                        num_items, tiles_per_expert, c_tiles, N, C1, PINGPONG, P1, R1, BLOCK_N)),
        (_wg_producer, (a_desc, b_desc, a_bufs, b_bufs, ready_bars, empty_bars, row_starts_ptr, num_items,
                        tiles_per_expert, c_tiles, BLOCK_N)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


# --------------------------------------------------------------------------------------------------
# Pre-gather (plain Triton): dst[r] = src[sorted_ids[r] // K], zeros on padding rows
# --------------------------------------------------------------------------------------------------

@triton.jit
def gather_rows_kernel(src_ptr, dst_ptr, sorted_ids_ptr, num_padded_ptr, S, L, H, TOP_K: tl.constexpr,
                       BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr):
    pid_r = tl.program_id(0)
    if pid_r * BLOCK_R < tl.load(num_padded_ptr):        # rows past num_padded: nobody reads them
        rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
        r_in = rows < L
        pair = tl.load(sorted_ids_ptr + rows, mask=r_in, other=S)
        valid = pair < S
        tok = (pair // TOP_K).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        c_in = cols < H
        v = tl.load(src_ptr + tok[:, None] * H + cols[None, :], mask=valid[:, None] & c_in[None, :],
                    other=0.0)
        tl.store(dst_ptr + rows.to(tl.int64)[:, None] * H + cols[None, :], v,
                 mask=r_in[:, None] & c_in[None, :])


def gather_rows(src, sorted_ids, num_padded, top_k, out):
    """out (L, H): the rows of src (T, H), contiguous, at each sorted row's token, zeros on padding rows
    (pair id S = T * top_k), up to num_padded at least (whole blocks of 32 rows)."""
    rows, h = out.shape
    block_r, block_h = 32, 256
    gather_rows_kernel[(triton.cdiv(rows, block_r), triton.cdiv(h, block_h))](
        src, out, sorted_ids, num_padded, src.shape[0] * top_k, sorted_ids.numel(), h, TOP_K=top_k,
        BLOCK_R=block_r, BLOCK_H=block_h, num_warps=4)
    return out


# --------------------------------------------------------------------------------------------------
# Launcher
# --------------------------------------------------------------------------------------------------

# name -> (tile N, tile C, stages, ping-pong)
VARIANTS = {
    "coop_128x256": (128, 256, 3, False),
    "pp_128x128": (128, 128, 4, True),
    "pp_128x128_s5": (128, 128, 5, True),
    "pp_64x256": (64, 256, 4, True),
}
BK = 64                       # rows a step (fewer where the align block size is smaller: a step may
                              # not cross an expert's group)


def smem_bytes(variant, itemsize=2) -> int:
    """The kernel's shared memory: the ring and the two warpgroups' C tiles (coop: half the N rows
    each; pp: a whole tile each), barriers aside."""
    block_n, block_c, stages, pingpong = VARIANTS[variant]
    acc_n = block_n if pingpong else block_n // 2
    return (stages * BK * (block_n + block_c) + 2 * acc_n * block_c) * itemsize


def _gl_desc(t, block):
    layout = gl.NVMMASharedLayout.get_default_for(block, gl.bfloat16)
    return GluonTensorDescriptor.from_tensor(t, block, layout)


def gluon_wgrad(a, b, row_starts, out, variant, *, align_block=None, num_sms=None):
    """out (E, N, C) = per expert e: a[rows_e]^T @ b[rows_e] (bf16, fp32 accumulate), rows_e =
    [row_starts[e], row_starts[e + 1]); a (L, N), b (L, C) contiguous bf16 sorted rows, zeros on padding
    rows; row_starts int32 (E + 1,) on the device."""
    block_n, block_c, stages, pingpong = VARIANTS[variant]
    num_experts, n, c = out.shape
    assert a.shape[1] == n and b.shape[1] == c and a.shape[0] == b.shape[0]
    assert n % block_n == 0 and c % block_c == 0, "tiles must divide N and C (a tile may not cross experts)"
    bk = BK if align_block is None else min(BK, align_block)
    assert bk >= 16 and (align_block is None or align_block % bk == 0), "a row step may not cross experts"
    assert smem_bytes(variant) <= SMEM_LIMIT
    acc_n = block_n if pingpong else block_n // 2      # a warpgroup's accumulator rows (= A tile width)
    a_desc = _gl_desc(a, [bk, acc_n])
    b_desc = _gl_desc(b, [bk, block_c])
    c_desc = _gl_desc(out.view(num_experts * n, c), [acc_n, block_c])
    tiles_per_expert = (n // block_n) * (c // block_c)
    num_items = num_experts * tiles_per_expert
    sms = num_sms or torch.cuda.get_device_properties(a.device).multi_processor_count
    # 2 consumer warpgroups + the producer's (padded) warpgroup at 168 registers fill the 64K; setmaxnreg
    # then moves registers from the producer to the consumers.
    gluon_wgrad_kernel[(min(sms, num_items),)](
        a_desc, b_desc, c_desc, row_starts, num_items, tiles_per_expert, c // block_c, n,
        STAGES=stages, PINGPONG=pingpong, PRODUCER_REGS=40, CONSUMER_REGS=232, num_warps=4, maxnreg=168)
    return out


# --------------------------------------------------------------------------------------------------
# --aot
# --------------------------------------------------------------------------------------------------

def run_aot(args) -> int:
    from triton.backends.compiler import GPUTarget

    if GLUON_ERROR:
        print(f"no Gluon ({GLUON_ERROR})")
        return 1
    target = GPUTarget("cuda", 90, 32)
    e, n, c, rows = 8, 1536, 2048, 8 * 256        # the gate_up shape (down's differs in runtime ints only)
    a = torch.empty(rows, n, dtype=torch.bfloat16)
    b = torch.empty(rows, c, dtype=torch.bfloat16)
    out = torch.empty(e, n, c, dtype=torch.bfloat16)
    rs = torch.zeros(e + 1, dtype=torch.int32)
    checks = {name: (lambda name=name: gluon_wgrad(a, b, rs, out, name, num_sms=H200_SMS), gluon_wgrad_kernel)
              for name in VARIANTS}
    sid = torch.zeros(rows, dtype=torch.int32)
    npad = torch.zeros((), dtype=torch.int32)
    checks["gather"] = (lambda: gather_rows(torch.empty(256, c, dtype=torch.bfloat16), sid, npad, 8, b),
                        gather_rows_kernel)
    failed = 0
    for name, (call, kernel) in checks.items():
        if args.variants and name not in args.variants:
            continue
        started = time.perf_counter()
        try:
            (kern, kargs, kwargs), = _capture(call, (kernel,))
            compiled, _ = _compile(kern, kargs, kwargs, target)
            res = _cuobjdump(compiled.asm["cubin"], "-res-usage")
            regs = re.search(r"REG:(\d+)", res)
            local = sum(int(x) for x in re.findall(r"(?:LOCAL|STACK):(\d+)", res))
            sass = _cuobjdump(compiled.asm["cubin"], "-sass")
            hgmma = len(re.findall(r"\bHGMMA\.", sass))
            ptx = compiled.asm["ptx"]
            tma_ops = len(re.findall(r"cp\.async\.bulk\.tensor", ptx))
            shared = compiled.metadata.shared
            bad = []
            if local:
                bad.append(f"local memory {local} B (spills)")
            if shared > SMEM_LIMIT:
                bad.append(f"shared {shared} B > {SMEM_LIMIT}")
            status = ("FAIL " + "; ".join(bad) + " | " if bad else "OK   ") + (
                f"shared {shared} B, {regs.group(1) if regs else '?'} regs, local {local} B, {hgmma} HGMMA, "
                f"{tma_ops} TMA ops (PTX), setmaxnreg {'yes' if 'setmaxnreg' in ptx else 'no'}, "
                f"warps {compiled.metadata.num_warps}"
                f"{', maxnreg ' + str(kwargs['maxnreg']) if kwargs.get('maxnreg') else ''}")
            failed += bool(bad)
            if args.verbose:
                status += f"\n     tensordesc meta: {getattr(compiled.metadata, 'tensordesc_meta', None)}"
            if args.dump:
                os.makedirs(args.dump, exist_ok=True)
                for ext in ("ttgir", "ptx"):
                    with open(os.path.join(args.dump, f"{name}.{ext}"), "w") as f:
                        f.write(compiled.asm[ext])
                with open(os.path.join(args.dump, f"{name}.sass"), "w") as f:
                    f.write(sass)
        except Exception as exc:
            failed += 1
            status = "FAIL " + _error_head(exc, 12)
        print(f"{name:<14} {status}  ({time.perf_counter() - started:.1f} s)", flush=True)
    return 1 if failed else 0


# --------------------------------------------------------------------------------------------------
# GPU run
# --------------------------------------------------------------------------------------------------

def rel_err(got, want) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def make_case(tokens, gen):
    from moekit.align import align_block_size
    from moekit.grouped_gemm_backward import down_proj_grad_torch, gate_up_proj_grad_torch, wgrad_torch
    from moekit.shapes import PRESETS
    from moekit.tuning import get_config

    shape = PRESETS[PRESET]
    e, hidden, inter, k = shape.num_experts, shape.hidden_size, shape.intermediate_size, shape.top_k
    block_m = get_config(shape, tokens, torch.bfloat16, "cuda").block_m
    dev = DEVICE

    def randn(*size):
        return torch.randn(*size, device=dev, generator=gen).to(torch.bfloat16)

    logits = torch.randn(tokens, e, device=dev, generator=gen)
    logits[:, -1] = float("-inf")
    ids = torch.softmax(logits, -1).topk(k, -1).indices
    align = align_block_size(ids, e, block_m, backend="triton")
    rows = align.sorted_ids.numel()
    x, dout = randn(tokens, hidden), randn(tokens, hidden)
    dpre_w, h_w = randn(rows, 2 * inter), randn(rows, inter)
    pad = align.sorted_ids >= tokens * k
    dpre_w[pad] = 0
    h_w[pad] = 0
    row_starts = align.row_starts()
    refs = {"gate_up": gate_up_proj_grad_torch(dpre_w, x, None, align, k),
            "down": down_proj_grad_torch(dout, h_w, None, align, k)}
    plain = {"gate_up": wgrad_torch(dpre_w, x, None, align, k, a_by_token=False, b_by_token=True,
                                    compute_dtype=torch.bfloat16),
             "down": wgrad_torch(dout, h_w, None, align, k, a_by_token=True, b_by_token=False,
                                 compute_dtype=torch.bfloat16)}
    base_err = {name: rel_err(plain[name], refs[name]) for name in refs}
    del plain
    unused = (align.tokens_per_expert == 0).nonzero().flatten().tolist()
    s = tokens * k
    shapes = {"gate_up": (e, 2 * inter, hidden), "down": (e, hidden, inter)}
    flops = {name: 2.0 * s * n * c for name, (_, n, c) in shapes.items()}
    return types.SimpleNamespace(tokens=tokens, top_k=k, block_m=block_m, align=align, row_starts=row_starts,
                                 x=x, dout=dout, dpre_w=dpre_w, h_w=h_w, refs=refs, base_err=base_err,
                                 unused=unused, shapes=shapes, flops=flops, rows=rows, pairs=s)


def first_run(name, fn) -> str | None:
    print(f"  [{name}] first run ...", end="", flush=True)
    try:
        fn()
        torch.cuda.synchronize()
    except Exception as exc:
        print(" FAILED", flush=True)
        return _error_head(exc)
    print(" done", flush=True)
    return None


def check(case, launch, got) -> tuple[float, str | None]:
    err = rel_err(got, case.refs[launch])
    if not err <= 2 * case.base_err[launch]:
        return err, f"error {err:.3e} > 2 x plain bf16's {case.base_err[launch]:.3e}"
    for e in case.unused:
        if bool((got[e] != 0).any()):                   # NaN (never written) counts too
            return err, f"expert {e} (no rows) has a nonzero gradient"
    return err, None


def bench(fns: dict, rounds: int, warmup: int, flush_buf) -> dict:
    """Median ms per launch; every round runs each launch once in turn, each after an L2 flush."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    torch.cuda.synchronize()
    events = {name: [] for name in fns}
    sleep = getattr(torch.cuda, "_sleep", None)
    for _ in range(rounds):
        # A spin first lets the host queue the round's launches ahead of the GPU: the events then time
        # the kernels, not the launchers' host work (descriptors, binder, moekit's wrapper).
        if sleep is not None:
            sleep(10_000_000)
        for name, fn in fns.items():
            flush_buf.zero_()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            events[name].append((start, end))
        torch.cuda.synchronize()
    return {name: statistics.median(s.elapsed_time(e) for s, e in pairs) for name, pairs in events.items()}


def run_tokens(tokens, args, rec, flush_buf, broken):
    from moekit._workspace import poisoning
    from moekit.grouped_gemm_backward import down_proj_grad, gate_up_proj_grad

    gen = torch.Generator(device=DEVICE).manual_seed(tokens)
    case = make_case(tokens, gen)
    al, k, rs = case.align, case.top_k, case.row_starts
    print(f"\n== T={tokens}: {case.pairs} pairs, block_m {case.block_m}, {case.rows} rows allocated, "
          f"~{case.pairs / case.shapes['down'][0]:.0f} rows an expert, empty experts {case.unused}; "
          f"plain bf16 error gate_up {case.base_err['gate_up']:.3e}, down {case.base_err['down']:.3e}",
          flush=True)
    fns, rows = {}, {}          # timed launches; result rows by variant

    # moekit (its workspace poisoned: outputs start NaN). row_starts given, as a backward shares one.
    moe_out = {}
    moekit_calls = {
        "gate_up": lambda: moe_out.__setitem__("gate_up", gate_up_proj_grad(
            case.dpre_w, case.x, None, al, k, torch.bfloat16, padding_zero=True, row_starts=rs)),
        "down": lambda: moe_out.__setitem__("down", down_proj_grad(
            case.dout, case.h_w, None, al, k, torch.bfloat16, padding_zero=True, row_starts=rs)),
    }
    if "moekit" not in broken:
        with poisoning():
            err = first_run("moekit", lambda: [f() for f in moekit_calls.values()])
        if err is None:
            row = {}
            for launch in ("gate_up", "down"):
                e, problem = check(case, launch, moe_out[launch])
                row[launch] = (e, problem)
                fns[("moekit", launch)] = moekit_calls[launch]
            rows["moekit"] = row
        else:
            print(f"    {err}")
            rec.add(tokens=tokens, variant="moekit", error=err)
        moe_out.clear()

    # the pre-gathers
    x_sorted = torch.empty(case.rows, case.x.shape[1], device=DEVICE, dtype=torch.bfloat16)
    dout_sorted = torch.empty_like(x_sorted)
    gathers = {"x": lambda: gather_rows(case.x, al.sorted_ids, al.num_padded, k, x_sorted),
               "dout": lambda: gather_rows(case.dout, al.sorted_ids, al.num_padded, k, dout_sorted)}
    gathered = False
    if GLUON_ERROR:
        print(f"  Gluon variants skipped: {GLUON_ERROR}")
    else:
        x_sorted.fill_(float("nan"))
        dout_sorted.fill_(float("nan"))
        err = first_run("gather", lambda: [f() for f in gathers.values()])
        if err is None:
            npad = int(al.num_padded)
            pair = al.sorted_ids[:npad].long()
            valid = pair < case.pairs
            tok = torch.where(valid, pair // k, 0)
            want = case.x[tok] * valid[:, None]
            ok = torch.equal(x_sorted[:npad], want) and torch.equal(
                dout_sorted[:npad], case.dout[tok] * valid[:, None])
            print(f"    gather exact: {'yes' if ok else 'NO'}")
            if ok:
                gathered = True
                fns[("gather", "x")], fns[("gather", "dout")] = gathers["x"], gathers["dout"]
            else:
                rec.add(tokens=tokens, variant="gather", error="gathered rows differ from torch indexing")
            del pair, valid, tok, want
        else:
            print(f"    {err}")
            rec.add(tokens=tokens, variant="gather", error=err)

    outs = {}
    for name in VARIANTS:
        if not gathered or (args.variants and name not in args.variants):
            continue
        if name in broken:
            print(f"  [{name}] skipped (failed earlier: {broken[name].splitlines()[0][:120]})")
            continue
        o = {launch: torch.empty(*case.shapes[launch], device=DEVICE, dtype=torch.bfloat16)
             for launch in ("gate_up", "down")}
        calls = {
            "gate_up": lambda name=name, o=o: gluon_wgrad(case.dpre_w, x_sorted, rs, o["gate_up"], name,
                                                          align_block=case.block_m),
            "down": lambda name=name, o=o: gluon_wgrad(dout_sorted, case.h_w, rs, o["down"], name,
                                                       align_block=case.block_m),
        }
        for t in o.values():
            t.fill_(float("nan"))
        err = first_run(name, lambda calls=calls: [f() for f in calls.values()])
        if err is not None:
            print(f"    {err}")
            broken[name] = err
            rec.add(tokens=tokens, variant=name, error=err)
            continue
        row = {}
        for launch in ("gate_up", "down"):
            row[launch] = check(case, launch, o[launch])
            fns[(name, launch)] = calls[launch]
        rows[name] = row
        outs[name] = o

    # only correct launches are timed
    timed = {key: fn for key, fn in fns.items()
             if key[0] == "gather" or rows[key[0]][key[1]][1] is None}
    ms = bench(timed, args.rounds, args.warmup, flush_buf) if timed else {}
    gather_ms = (ms.get(("gather", "x")), ms.get(("gather", "dout")))
    base_total = (ms.get(("moekit", "gate_up")) or 0) + (ms.get(("moekit", "down")) or 0) \
        if ("moekit", "gate_up") in ms and ("moekit", "down") in ms else None
    print(f"  {'variant':<14}{'launch':<9}{'rel err':>10}{'ok':>4}{'ms':>9}{'TFLOP/s':>9}{'speed-up':>10}")
    if gather_ms[0] is not None:
        print(f"  {'gather':<14}{'x':<9}{'':>14}{gather_ms[0]:>9.4f}")
        print(f"  {'gather':<14}{'dout':<9}{'':>14}{gather_ms[1]:>9.4f}")
        rec.add(tokens=tokens, variant="gather", ms_x=gather_ms[0], ms_dout=gather_ms[1])
    for name, row in rows.items():
        total = 0.0
        for launch, (err, problem) in row.items():
            t = ms.get((name, launch))
            base = ms.get(("moekit", launch))
            tflops = case.flops[launch] / t / 1e9 if t else None
            speed = base / t if t and base else None
            total = total + t if (t is not None and total is not None) else None
            timing = (f"{t:>9.4f}{tflops:>9.1f}{speed if speed else float('nan'):>9.2f}x" if t
                      else f"{'-':>9}{'-':>9}{'-':>10}")
            print(f"  {name:<14}{launch:<9}{err:>10.2e}{'yes' if problem is None else 'NO':>4}{timing}"
                  + (f"   {problem}" if problem else ""))
            rec.add(tokens=tokens, variant=name, launch=launch, block_m=case.block_m, rel_err=err,
                    base_err=case.base_err[launch], ok=problem is None, problem=problem, ms=t,
                    tflops=tflops, speedup=speed)
        if total and name != "moekit":
            with_gather = total + sum(gather_ms) if gather_ms[0] is not None else None
            print(f"  {name:<14}{'both':<9}{'':>14}{total:>9.4f}{'':>9}"
                  f"{base_total / total if base_total else float('nan'):>9.2f}x"
                  f"   with the gathers {with_gather:.4f} ms: "
                  f"{base_total / with_gather if base_total else float('nan'):.2f}x")
            rec.add(tokens=tokens, variant=name, launch="both", ms=total, ms_with_gather=with_gather,
                    speedup=base_total / total if base_total else None,
                    speedup_with_gather=base_total / with_gather if base_total else None)
        elif total and name == "moekit":
            print(f"  {name:<14}{'both':<9}{'':>14}{total:>9.4f}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="See the module docstring for what is measured and how.")
    parser.add_argument("--out", help="write results as JSON lines to this file (truncated first)")
    parser.add_argument("--aot", action="store_true",
                        help="no GPU: compile every variant for sm_90 and report")
    parser.add_argument("--dump", help="with --aot: write each variant's TTGIR, PTX and SASS here")
    parser.add_argument("--verbose", action="store_true",
                        help="with --aot: print the TMA descriptor metadata")
    parser.add_argument("--tokens", type=lambda s: [int(v) for v in s.split(",") if v], default=list(TOKENS),
                        help="comma-separated T values (default 1024,4096,16384)")
    parser.add_argument("--variants", type=lambda s: [v for v in s.split(",") if v],
                        help="comma-separated subset of the Gluon variants (" + ", ".join(VARIANTS)
                             + "; with --aot also 'gather'); moekit and the gathers always run")
    parser.add_argument("--rounds", type=int, default=25, help="timed rounds (default 25)")
    parser.add_argument("--warmup", type=int, default=3, help="warm-up rounds (default 3)")
    args = parser.parse_args(argv)

    if args.aot:
        return run_aot(args)
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to run (use --aot for the compile check)")
        return 1
    props = torch.cuda.get_device_properties(0)
    print(f"device {props.name} ({props.multi_processor_count} SMs), torch {torch.__version__}, "
          f"triton {triton.__version__}, gluon {'yes' if not GLUON_ERROR else 'NO: ' + GLUON_ERROR}",
          flush=True)
    torch.backends.cuda.matmul.allow_tf32 = False          # the fp32 reference must be fp32
    rec = Recorder(args.out)
    flush_buf = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device=DEVICE)
    broken = {}
    started = time.perf_counter()
    for tokens in args.tokens:
        try:
            run_tokens(tokens, args, rec, flush_buf, broken)
        except Exception as exc:
            print(f"T={tokens} failed: {_error_head(exc)}", flush=True)
            rec.add(tokens=tokens, error=_error_head(exc))
        torch.cuda.empty_cache()
    print(f"\ntotal {time.perf_counter() - started:.0f} s" + (f"; results in {args.out}" if args.out else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
