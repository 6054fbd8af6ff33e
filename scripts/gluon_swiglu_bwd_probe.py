"""Gluon SwiGLU-backward probe: a persistent, warp-specialized Gluon (sm_90) fused SwiGLU backward
against moekit's Triton `moe_swiglu_bwd_kernel` (reading the saved pre-activations), checked and timed
on an H200. A go/no-go measurement.

Per sorted row r of expert e (t = sorted_ids[r] // K its token, w_p its routing weight), in fp32:

    g = dout[t] @ down_e          (down_proj (E, H, I): down_e is (H, I), g is (I,))
    a, b = pre[r] (L, 2I) = [gate | up] pre-activations; sig = sigmoid(a), silu = a sig, h = silu b
    dpre_w[r] = w_p [g b sig (1 + a (1 - sig)), g silu]   (L, 2I) bf16
    h_w[r]    = w_p h                                     (L, I) bf16
    part[r, tile] = sum over the tile's I columns of g h  (fp32) -> d topk_weights[p] = sum over tiles
    padding rows (pair >= S): dpre_w, h_w rows 0, part 0.

moekit gathers the dout rows by token through sorted_ids inside its GEMM loop. Here dout is first
pre-gathered into sorted-row order (dout_sorted[r] = dout[t(r)], zeros on padding rows: the gather kernel
of scripts/gluon_wgrad_probe.py, timed on its own: in training the same dout_sorted also feeds the
d down weight gradient, so its cost is shared), so the GEMM's A operand is plain rows loaded by TMA:

    A = dout_sorted [64 rows, BK] boxes (K-major: as wgmma's A wants it)
    B = down_proj viewed as (E * H, I), [BK rows of H, BN columns of I] boxes at row e * H + k: B lies
        as it does for A @ B, N contiguous ("MN-major" B, which wgmma reads for 16-bit types)

The kernel is moekit's runtime one (`moekit.kernels.gluon_swiglu_bwd`, whose docstring describes the
schedule: persistent, a 1-warp TMA producer, two ping-pong wgmma consumer warpgroups, the pre tiles
fetched into the epilogue slots during the main loop, a TMA-store epilogue), launched through
`moekit.grouped_gemm_backward.gluon_swiglu_backward`; the probe times its tile variants (`VARIANTS`:
pp_64x128 (BN 128, 4 stages), pp_64x128_s5 (5 stages: the runtime's GLUON_SWIGLU_128), pp_64x64 (BN 64,
8 stages: GLUON_SWIGLU_64)) against moekit's Triton kernel. Session 10's probe had its own copy of the
kernel, with a pointer-store epilogue variant as well (slower: not kept).
d topk_weights: part (L, I / BN) fp32 reduced by moekit's `moe_tile_sum_kernel` (its tile order).

Compared per T in (1024, 4096, 16384) on Qwen3-30B-A3B (E=128, H=2048, I=768, K=8, bf16), routing
softmax(randn(T, E)).topk(K) renormalised, the last expert never picked, align_block_size(backend=
"triton") at the tuned config's block_m; pre random bf16 (L, 2I), dout random bf16, down random / sqrt(I):
    moekit   swiglu_backward(..., pre=pre, tiles=BackwardTiles.fit(...)): the Triton kernel (tiles named:
             no Gluon dispatch), its tile sum included
    gather   dout -> dout_sorted
    pp_*     the Gluon kernel + the tile sum; also reported with the gather added
Correctness first: outputs NaN-filled (moekit's workspace poisoned), relative Frobenius error of
dpre_w, h_w (rows < num_padded) and d topk_weights against the fp32 twin `swiglu_backward_torch(...,
pre=pre)` at most 2x the same twin's in bf16 (compute_dtype=torch.bfloat16), per output; padding rows
(< num_padded) of dpre_w and h_w exactly 0. Timing: CUDA events, a 256 MB write (L2 flush) before each
call, round robin, medians; TFLOP/s = 2 S H I / t.

Hangs: each variant first runs alone with a flushed line before and a synchronize after; run under an
outer `timeout`. A failing variant is reported, the others go on. `--aot` needs no GPU: compiles each
variant (and the gather) for sm_90 and prints OK with shared memory, registers, local memory (0; WARN
when the register allocator spilled: the variant still runs), or FAIL (exit 1).

Usage:
    PYTHONPATH=src timeout 300 python scripts/gluon_swiglu_bwd_probe.py --out swiglu_gluon.jsonl  # H200
    PYTHONPATH=src python scripts/gluon_swiglu_bwd_probe.py --tokens 4096 --variants pp_64x128
    PYTHONPATH=src /tmp/t36/bin/python scripts/gluon_swiglu_bwd_probe.py --aot [--dump DIR]   # CPU only
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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gluon_probe import Recorder, _error_head, compiled_facts, dump_compiled, print_device  # noqa: E402

import moekit.grouped_gemm_backward as gb  # noqa: E402
from moekit.grouped_gemm_backward import GATHER_BLOCK_C, GATHER_BLOCK_R  # noqa: E402
from moekit.kernels import gluon_swiglu_bwd as gluon_swiglu_kernels  # noqa: E402
from moekit.kernels.gluon_swiglu_bwd import gluon_swiglu_bwd_kernel  # noqa: E402
from moekit.kernels.gluon_wgrad import GLUON_ERROR  # noqa: E402
from moekit.kernels.grouped_gemm_backward import moe_gather_rows_kernel as gather_rows_kernel  # noqa: E402
from moekit.tuning import GLUON_SWIGLU_64, GLUON_SWIGLU_128, SHARED_MEMORY_LIMIT, GluonSwigluTiles  # noqa: E402


def gather_rows(src, sorted_ids, num_padded, top_k, out):
    """out (L, H): src's token rows in sorted-row order, zeros on padding rows (moekit's gather kernel,
    the one `moekit.grouped_gemm_backward.sorted_rows` launches, into a given buffer)."""
    rows, cols = out.shape
    gather_rows_kernel[(triton.cdiv(rows, GATHER_BLOCK_R), triton.cdiv(cols, GATHER_BLOCK_C))](
        src, out, sorted_ids, num_padded, src.shape[0] * top_k, cols, src.stride(0), src.stride(1),
        out.stride(0), out.stride(1), TOP_K=top_k, BLOCK_R=GATHER_BLOCK_R, BLOCK_C=GATHER_BLOCK_C,
        num_warps=4)
    return out
SMEM_LIMIT = SHARED_MEMORY_LIMIT     # sm_90's largest dynamic shared memory a block (227 KB)
PRESET = "qwen3-30b-a3b"
TOKENS = (1024, 4096, 16384)
FLUSH_BYTES = 256 << 20
DEVICE = "cuda"
BK = gluon_swiglu_kernels.BLOCK_K   # H a step


# --------------------------------------------------------------------------------------------------
# The kernel: moekit's runtime one (`moekit.kernels.gluon_swiglu_bwd`, launched by
# `moekit.grouped_gemm_backward.gluon_swiglu_backward`), with the variants' tiles
# --------------------------------------------------------------------------------------------------

VARIANTS = {
    "pp_64x128": GluonSwigluTiles(block_n=128, stages=4, producer_regs=24, consumer_regs=240),
    "pp_64x128_s5": GLUON_SWIGLU_128,        # the runtime's tiles where 128 divides I
    "pp_64x64": GLUON_SWIGLU_64,             # ... and where only 64 does
}
PRE_STEP = gluon_swiglu_kernels.PRE_STEP


def smem_bytes(variant, itemsize=2) -> int:
    """The ring (A [64, BK] + B [BK, BN] a stage) and both consumers' epilogue slots, barriers aside."""
    return VARIANTS[variant].smem_bytes(itemsize)


def gluon_swiglu_bwd(dout_sorted, down_proj, pre, topk_weights, align, dpre, h, part, variant):
    """dpre (L, 2I), h (L, I), part (L, I / BN) fp32 of the rows < num_padded (see the module docstring);
    dout_sorted (L, H) in sorted-row order (zeros on padding rows), pre (L, 2I), topk_weights (T, K), the
    alignment (or anything with its sorted_ids, expert_ids, num_padded, num_pairs and block_m)."""
    tiles = VARIANTS[variant]
    assert smem_bytes(variant) <= SMEM_LIMIT
    gb.gluon_swiglu_backward(dout_sorted, down_proj, pre, topk_weights, align, tiles, dpre=dpre, h=h,
                             part=part)
    return dpre, h, part


def tile_sum(part, align, out):
    """d topk_weights (S,) fp32 from part (L, n_tiles): moekit's tile-sum kernel (pairs never placed: 0)."""
    from moekit._host import next_power_of_2
    from moekit.kernels.grouped_gemm_backward import moe_tile_sum_kernel

    n_tiles = part.shape[1]
    out.zero_()
    moe_tile_sum_kernel[(align.max_blocks,)](
        part, out, align.sorted_ids, align.num_padded, align.num_pairs, n_tiles, part.stride(0),
        BLOCK_M=align.block_m, BLOCK_T=min(64, max(16, next_power_of_2(n_tiles))), num_warps=4)
    return out


# --------------------------------------------------------------------------------------------------
# --aot
# --------------------------------------------------------------------------------------------------

def run_aot(args) -> int:
    from aot_compile_check import capture_launches, compile_launch  # --aot only: it turns interpreting off
    from triton.backends.compiler import GPUTarget

    if GLUON_ERROR:
        print(f"no Gluon ({GLUON_ERROR})")
        return 1
    target = GPUTarget("cuda", 90, 32)
    e, hidden, inter, rows, k = 8, 2048, 768, 8 * 256, 8
    bf = torch.bfloat16
    dout_sorted = torch.empty(rows, hidden, dtype=bf)
    down = torch.empty(e, hidden, inter, dtype=bf)
    pre = torch.empty(rows, 2 * inter, dtype=bf)
    dpre = torch.empty(rows, 2 * inter, dtype=bf)
    h = torch.empty(rows, inter, dtype=bf)
    w = torch.empty(rows // k, k, dtype=torch.float32)
    sid = torch.zeros(rows, dtype=torch.int32)
    eid = torch.zeros(rows // 64, dtype=torch.int32)
    npad = torch.zeros((), dtype=torch.int32)
    align = types.SimpleNamespace(sorted_ids=sid, expert_ids=eid, num_padded=npad, num_pairs=rows, block_m=64)
    checks = {}
    for name, tiles in VARIANTS.items():
        part = torch.empty(rows, inter // tiles.block_n, dtype=torch.float32)
        checks[name] = (lambda name=name, part=part: gluon_swiglu_bwd(
            dout_sorted, down, pre, w, align, dpre, h, part, name), gluon_swiglu_bwd_kernel)
    checks["gather"] = (lambda: gather_rows(torch.empty(256, hidden, dtype=bf), sid, npad, k, dout_sorted),
                        gather_rows_kernel)
    failed = 0
    for name, (call, kernel) in checks.items():
        if args.variants and name not in args.variants:
            continue
        started = time.perf_counter()
        try:
            (kern, kargs, kwargs), = capture_launches(call, (kernel,))
            compiled = compile_launch(kern, kargs, kwargs, target)
            facts = compiled_facts(compiled)
            local, shared, ptx = facts.local, facts.shared, facts.ptx
            tma_ops = len(re.findall(r"cp\.async\.bulk\.tensor", ptx))
            bad = [f"shared {shared} B > {SMEM_LIMIT}"] if shared > SMEM_LIMIT else []
            # spills: WARN (runs; a few loop-invariant scalars spilled cost a few L1 loads an item)
            head = "FAIL " + "; ".join(bad) + " | " if bad else (
                f"WARN local memory {local} B (spills) | " if local else "OK   ")
            status = head + (
                f"shared {shared} B, {facts.regs} regs, local {local} B, {facts.hgmma} HGMMA, "
                f"{tma_ops} TMA ops (PTX), setmaxnreg {'yes' if 'setmaxnreg' in ptx else 'no'}, "
                f"warps {compiled.metadata.num_warps}"
                f"{', maxnreg ' + str(kwargs['maxnreg']) if kwargs.get('maxnreg') else ''}")
            failed += bool(bad)
            if args.dump:
                dump_compiled(compiled, facts, args.dump, name)
        except Exception as exc:
            failed += 1
            status = "FAIL " + _error_head(exc, 12)
        print(f"{name:<18} {status}  ({time.perf_counter() - started:.1f} s)", flush=True)
    return 1 if failed else 0


# --------------------------------------------------------------------------------------------------
# GPU run
# --------------------------------------------------------------------------------------------------

def rel_err(got, want) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()   # NaN if any NaN


def make_case(tokens, gen):
    from moekit.align import align_block_size
    from moekit.grouped_gemm_backward import swiglu_backward_torch
    from moekit.shapes import PRESETS
    from moekit.tuning import get_config

    shape = PRESETS[PRESET]
    e, hidden, inter, k = shape.num_experts, shape.hidden_size, shape.intermediate_size, shape.top_k
    cfg = get_config(shape, tokens, torch.bfloat16, "cuda")
    dev = DEVICE
    logits = torch.randn(tokens, e, device=dev, generator=gen)
    logits[:, -1] = float("-inf")
    w, ids = torch.softmax(logits, -1).topk(k, -1)
    w = (w / w.sum(-1, keepdim=True)).float().contiguous()
    align = align_block_size(ids, e, cfg.block_m, backend="triton")
    rows = align.sorted_ids.numel()
    bf = torch.bfloat16
    pre = torch.randn(rows, 2 * inter, device=dev, generator=gen).to(bf)
    dout = torch.randn(tokens, hidden, device=dev, generator=gen).to(bf)
    down = (torch.randn(e, hidden, inter, device=dev, generator=gen) / inter ** 0.5).to(bf)
    x = torch.zeros(1, device=dev, dtype=bf).expand(tokens, hidden)              # shapes only
    gate_up = torch.zeros(1, device=dev, dtype=bf).expand(e, 2 * inter, hidden)
    npad = int(align.num_padded)
    ref = swiglu_backward_torch(x, gate_up, down, dout, w, align, k, pre=pre)
    plain = swiglu_backward_torch(x, gate_up, down, dout, w, align, k, pre=pre, compute_dtype=bf)
    refs = {"dpre_w": ref.dpre_w[:npad], "h_w": ref.h_w[:npad], "d_topk_w": ref.topk_weights}
    base_err = {"dpre_w": rel_err(plain.dpre_w[:npad], refs["dpre_w"]),
                "h_w": rel_err(plain.h_w[:npad], refs["h_w"]),
                "d_topk_w": rel_err(plain.topk_weights, refs["d_topk_w"])}
    del plain
    pad = align.sorted_ids[:npad] >= tokens * k
    s = tokens * k
    return types.SimpleNamespace(tokens=tokens, top_k=k, cfg=cfg, align=align, rows=rows, npad=npad, pad=pad,
                                 x=x, gate_up=gate_up, down=down, dout=dout, pre=pre, w=w, refs=refs,
                                 base_err=base_err, pairs=s, flops=2.0 * s * hidden * inter)


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


def check(case, dpre, h, dw) -> tuple[dict, str | None]:
    n = case.npad
    errs = {"dpre_w": rel_err(dpre[:n], case.refs["dpre_w"]), "h_w": rel_err(h[:n], case.refs["h_w"]),
            "d_topk_w": rel_err(dw, case.refs["d_topk_w"])}
    problems = [f"{key} error {err:.3e} > 2 x plain bf16's {case.base_err[key]:.3e}"
                for key, err in errs.items() if not err <= 2 * case.base_err[key]]
    for name, t in (("dpre_w", dpre), ("h_w", h)):
        if bool((t[:n][case.pad] != 0).any()):                 # NaN (never written) counts too
            problems.append(f"{name}: a padding row is not 0")
    return errs, "; ".join(problems) or None


def bench(fns: dict, rounds: int, warmup: int, flush_buf) -> dict:
    """Median ms per call; every round runs each call once in turn, each after an L2 flush."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    torch.cuda.synchronize()
    events = {name: [] for name in fns}
    sleep = getattr(torch.cuda, "_sleep", None)
    for _ in range(rounds):
        # a spin first lets the host queue the round's launches ahead of the GPU
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
    from moekit.grouped_gemm_backward import BackwardTiles, swiglu_backward

    gen = torch.Generator(device=DEVICE).manual_seed(tokens)
    case = make_case(tokens, gen)
    al, k = case.align, case.top_k
    inter = case.down.shape[2]
    print(f"\n== T={tokens}: {case.pairs} pairs, block_m {al.block_m}, {case.npad} rows used of {case.rows}; "
          f"plain bf16 errors dpre_w {case.base_err['dpre_w']:.3e}, h_w {case.base_err['h_w']:.3e}, "
          f"d topk_w {case.base_err['d_topk_w']:.3e}", flush=True)
    fns, rows = {}, {}

    if "moekit" not in broken:
        triton_tiles = BackwardTiles.fit(case.cfg, 2, DEVICE, recompute=False)   # explicit: the Triton kernel

        def moekit_call():
            return swiglu_backward(case.x, case.gate_up, case.down, case.dout, case.w, al, k, case.cfg,
                                   pre=case.pre, tiles=triton_tiles)
        got = {}
        with poisoning():
            err = first_run("moekit", lambda: got.__setitem__("r", moekit_call()))
        if err is None:
            r = got.pop("r")
            rows["moekit"] = check(case, r.dpre_w, r.h_w, r.topk_weights)
            fns["moekit"] = moekit_call
            del r
        else:
            print(f"    {err}")
            rec.add(tokens=tokens, variant="moekit", error=err)

    dout_sorted = torch.empty(case.rows, case.dout.shape[1], device=DEVICE, dtype=torch.bfloat16)
    gathered = False
    if GLUON_ERROR:
        print(f"  Gluon variants skipped: {GLUON_ERROR}")
    else:
        dout_sorted.fill_(float("nan"))

        def gather_call():
            return gather_rows(case.dout, al.sorted_ids, al.num_padded, k, dout_sorted)
        err = first_run("gather", gather_call)
        if err is None:
            pair = al.sorted_ids[:case.npad].long()
            valid = pair < case.pairs
            want = case.dout[torch.where(valid, pair // k, 0)] * valid[:, None]
            gathered = torch.equal(dout_sorted[:case.npad], want)
            print(f"    gather exact: {'yes' if gathered else 'NO'}")
            if gathered:
                fns["gather"] = gather_call
            else:
                rec.add(tokens=tokens, variant="gather", error="gathered rows differ from torch indexing")
            del pair, valid, want
        else:
            print(f"    {err}")
            rec.add(tokens=tokens, variant="gather", error=err)

    for name in VARIANTS:
        if not gathered or (args.variants and name not in args.variants):
            continue
        if name in broken:
            print(f"  [{name}] skipped (failed earlier: {broken[name].splitlines()[0][:120]})")
            continue
        block_n = VARIANTS[name].block_n
        dpre = torch.full((case.rows, 2 * inter), float("nan"), device=DEVICE, dtype=torch.bfloat16)
        h = torch.full((case.rows, inter), float("nan"), device=DEVICE, dtype=torch.bfloat16)
        part = torch.full((case.rows, inter // block_n), float("nan"), device=DEVICE, dtype=torch.float32)
        dw = torch.full((case.pairs,), float("nan"), device=DEVICE, dtype=torch.float32)

        def call(name=name, dpre=dpre, h=h, part=part, dw=dw):
            gluon_swiglu_bwd(dout_sorted, case.down, case.pre, case.w, al, dpre, h, part, name)
            tile_sum(part, al, dw)
        err = first_run(name, call)
        if err is not None:
            print(f"    {err}")
            broken[name] = err
            rec.add(tokens=tokens, variant=name, error=err)
            continue
        rows[name] = check(case, dpre, h, dw)
        fns[name] = call

    timed = {name: fn for name, fn in fns.items() if name == "gather" or rows[name][1] is None}
    ms = bench(timed, args.rounds, args.warmup, flush_buf) if timed else {}
    g_ms = ms.get("gather")
    base = ms.get("moekit")
    print(f"  {'variant':<18}{'dpre_w err':>11}{'h_w err':>10}{'dtw err':>10}{'ok':>4}{'ms':>9}{'TFLOP/s':>9}"
          f"{'speed-up':>10}{'+gather':>9}{'speed-up':>10}")
    if g_ms is not None:
        print(f"  {'gather':<18}{'':>35}{g_ms:>9.4f}")
        rec.add(tokens=tokens, variant="gather", ms=g_ms)
    for name, (errs, problem) in rows.items():
        t = ms.get(name)
        tflops = case.flops / t / 1e9 if t else None
        speed = base / t if t and base else None
        with_g = t + g_ms if t and g_ms is not None and name != "moekit" else None
        speed_g = base / with_g if with_g and base else None
        line = (f"  {name:<18}{errs['dpre_w']:>11.2e}{errs['h_w']:>10.2e}{errs['d_topk_w']:>10.2e}"
                f"{'yes' if problem is None else 'NO':>4}")
        if t:
            line += f"{t:>9.4f}{tflops:>9.1f}{speed or float('nan'):>9.2f}x"
            if with_g:
                line += f"{with_g:>9.4f}{speed_g or float('nan'):>9.2f}x"
        if problem:
            line += f"   {problem}"
        print(line)
        rec.add(tokens=tokens, variant=name, block_m=al.block_m, errors=errs, base_errors=case.base_err,
                ok=problem is None, problem=problem, ms=t, tflops=tflops, speedup=speed,
                ms_with_gather=with_g, speedup_with_gather=speed_g)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="See the module docstring for what is measured and how.")
    parser.add_argument("--out", help="write results as JSON lines to this file (truncated first)")
    parser.add_argument("--aot", action="store_true",
                        help="no GPU: compile every variant for sm_90 and report")
    parser.add_argument("--dump", help="with --aot: write each variant's TTGIR, PTX and SASS here")
    parser.add_argument("--tokens", type=lambda s: [int(v) for v in s.split(",") if v], default=list(TOKENS),
                        help="comma-separated T values (default 1024,4096,16384)")
    parser.add_argument("--variants", type=lambda s: [v for v in s.split(",") if v],
                        help="comma-separated subset of the Gluon variants (" + ", ".join(VARIANTS)
                             + "; with --aot also 'gather'); moekit and the gather always run")
    parser.add_argument("--rounds", type=int, default=25, help="timed rounds (default 25)")
    parser.add_argument("--warmup", type=int, default=3, help="warm-up rounds (default 3)")
    args = parser.parse_args(argv)

    if args.aot:
        return run_aot(args)
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to run (use --aot for the compile check)")
        return 1
    print_device(GLUON_ERROR)
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
