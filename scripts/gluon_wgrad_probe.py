"""Gluon weight-gradient probe: moekit's persistent, warp-specialized Gluon (sm_90) grouped weight
gradient (`moekit.kernels.gluon_wgrad`, launched by `moekit.grouped_gemm_backward.gluon_wgrad`) in
several tile variants against moekit's Triton `moe_wgrad_kernel`, checked and timed on an H200. It was
the go/no-go measurement for the kernel; `wgrad` now runs it on Hopper (`GLUON_PP_WGRAD` and
`GLUON_COOP_WGRAD` in `moekit.tuning`), and this script keeps comparing the variants.

The training backward's two weight gradients (`moekit.grouped_gemm_backward`), per expert e:

    d gate_up_e (2I, H) = sum over e's sorted rows r of dpre_w[r]^T x[t(r)]
    d down_e    (H, I)  = sum over e's sorted rows r of dout[t(r)]^T h_w[r]

moekit's Triton kernels run one program per (expert, output tile), loading the token-major operand
(x, dout) gathered row by row (`moe_wgrad_kernel`, or the range kernel at few rows an expert). The
Gluon path first copies the gathered operand into sorted-row order (x_sorted[r] = x[t(r)], zeros on
padding rows: `sorted_rows`, `moe_gather_rows_kernel`, timed on its own here), so both operands are
plain sorted rows and TMA loads them: C_e (N, C) = A[rows_e]^T @ B[rows_e] (gate_up: A = dpre_w,
B = x_sorted; down: A = dout_sorted, B = h_w). The kernel's schedule and barriers: the module
docstring of `moekit.kernels.gluon_wgrad`. Variants (`VARIANTS`, name -> `GluonWgradTiles`):

    coop_128x256    both warpgroups on every tile, each on 64 of its 128 N rows, 3 stages
    pp_128x128      "ping-pong": the warpgroups take alternate tiles, 4 stages; _s5: 5 stages
    pp_64x256       ping-pong, 64 x 256 tiles, 4 stages

Variants compared, per T in (1024, 4096, 16384) on Qwen3-30B-A3B (E=128, H=2048, I=768, K=8, bf16), the
routing softmax(randn(T, E)).topk(K) with the last expert never picked, align_block_size(backend=
"triton") at the tuned config's block_m:
    moekit      gate_up_proj_grad / down_proj_grad(..., padding_zero=True) on moekit's Triton kernels
                ($MOEKIT_GLUON_WGRAD=0), default tiles (row_starts passed in, computed once as a
                backward does; likewise for the others)
    moekit_gluon  the same calls with moekit's runtime dispatch ($MOEKIT_GLUON_WGRAD=1): the Gluon
                kernel where it applies (an align block size that is a multiple of 64), gathers included
    gather      the two pre-gathers (x, dout) into sorted order (`sorted_rows`)
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
import contextlib
import dataclasses
import re
import statistics
import time
import types

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gluon_probe import Recorder, _error_head, compiled_facts, dump_compiled, print_device  # noqa: E402

from moekit.grouped_gemm_backward import gluon_wgrad as moekit_gluon_wgrad  # noqa: E402
from moekit.grouped_gemm_backward import sorted_rows  # noqa: E402
from moekit.kernels.gluon_wgrad import GLUON_ERROR, gluon_wgrad_kernel  # noqa: E402
from moekit.kernels.grouped_gemm_backward import moe_gather_rows_kernel  # noqa: E402
from moekit.tuning import SHARED_MEMORY_LIMIT, GluonWgradTiles  # noqa: E402

SMEM_LIMIT = SHARED_MEMORY_LIMIT     # sm_90's largest dynamic shared memory a block (227 KB)
PRESET = "qwen3-30b-a3b"
TOKENS = (1024, 4096, 16384)
FLUSH_BYTES = 256 << 20
DEVICE = "cuda"
GLUON_ENV = "MOEKIT_GLUON_WGRAD"     # moekit's runtime switch: "0" forces its Triton kernels


# --------------------------------------------------------------------------------------------------
# The Gluon kernel (moekit.kernels.gluon_wgrad) and its variants
# --------------------------------------------------------------------------------------------------

VARIANTS = {
    "coop_128x256": GluonWgradTiles(128, 256, 3, False),      # moekit's GLUON_COOP_WGRAD
    "pp_128x128": GluonWgradTiles(128, 128, 4, True),
    "pp_128x128_s5": GluonWgradTiles(128, 128, 5, True),     # moekit's GLUON_PP_WGRAD
    "pp_64x256": GluonWgradTiles(64, 256, 4, True),
}
BK = 64                       # rows a step (fewer where the align block size is smaller: a step may
                              # not cross an expert's group)


def smem_bytes(variant, itemsize=2) -> int:
    """The kernel's shared memory: the ring and the two warpgroups' C tiles, barriers aside."""
    return VARIANTS[variant].smem_bytes(itemsize)


def gluon_wgrad(a, b, row_starts, out, variant, *, align_block=None):
    """out (E, N, C) = per expert e: a[rows_e]^T @ b[rows_e] (moekit's launcher `gluon_wgrad`) with the
    variant's tiles, row steps of BK or the align block size where smaller."""
    tiles = VARIANTS[variant]
    bk = BK if align_block is None else min(BK, align_block)
    assert bk >= 16 and (align_block is None or align_block % bk == 0), "a row step may not cross experts"
    assert out.shape[1] % tiles.block_n == 0 and out.shape[2] % tiles.block_c == 0
    assert tiles.smem_bytes() <= SMEM_LIMIT
    return moekit_gluon_wgrad(a, b, row_starts, out, dataclasses.replace(tiles, block_m=bk))


@contextlib.contextmanager
def gluon_switch(on: bool):
    """moekit's $MOEKIT_GLUON_WGRAD set inside the block (`wgrad` reads it at each call)."""
    before = os.environ.get(GLUON_ENV)
    os.environ[GLUON_ENV] = "1" if on else "0"
    try:
        yield
    finally:
        if before is None:
            del os.environ[GLUON_ENV]
        else:
            os.environ[GLUON_ENV] = before


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
    e, n, c, rows = 8, 1536, 2048, 8 * 256        # the gate_up shape (down's differs in runtime ints only)
    a = torch.empty(rows, n, dtype=torch.bfloat16)
    b = torch.empty(rows, c, dtype=torch.bfloat16)
    out = torch.empty(e, n, c, dtype=torch.bfloat16)
    rs = torch.zeros(e + 1, dtype=torch.int32)
    checks = {name: (lambda name=name: gluon_wgrad(a, b, rs, out, name), gluon_wgrad_kernel)
              for name in VARIANTS}
    from moekit.align import align_block_size

    align = align_block_size(torch.zeros(rows // 8, 8, dtype=torch.int64), e, 64, backend="torch")
    checks["gather"] = (lambda: sorted_rows(torch.empty(rows // 8, c, dtype=torch.bfloat16), align, 8),
                        moe_gather_rows_kernel)
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
            bad = []
            if local:
                bad.append(f"local memory {local} B (spills)")
            if shared > SMEM_LIMIT:
                bad.append(f"shared {shared} B > {SMEM_LIMIT}")
            status = ("FAIL " + "; ".join(bad) + " | " if bad else "OK   ") + (
                f"shared {shared} B, {facts.regs} regs, local {local} B, {facts.hgmma} HGMMA, "
                f"{tma_ops} TMA ops (PTX), setmaxnreg {'yes' if 'setmaxnreg' in ptx else 'no'}, "
                f"warps {compiled.metadata.num_warps}"
                f"{', maxnreg ' + str(kwargs['maxnreg']) if kwargs.get('maxnreg') else ''}")
            failed += bool(bad)
            if args.verbose:
                status += f"\n     tensordesc meta: {getattr(compiled.metadata, 'tensordesc_meta', None)}"
            if args.dump:
                dump_compiled(compiled, facts, args.dump, name)
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

    # moekit through its public launchers (its workspace poisoned: outputs start NaN), row_starts given,
    # as a backward shares one: "moekit" its Triton kernels ($MOEKIT_GLUON_WGRAD=0), "moekit_gluon" its
    # runtime dispatch (the Gluon kernel where it applies, gathers included).
    moe_out = {}

    def moekit_call(launch, gluon):
        def call():
            with gluon_switch(gluon):
                if launch == "gate_up":
                    got = gate_up_proj_grad(case.dpre_w, case.x, None, al, k, torch.bfloat16,
                                            padding_zero=True, row_starts=rs)
                else:
                    got = down_proj_grad(case.dout, case.h_w, None, al, k, torch.bfloat16, padding_zero=True,
                                         row_starts=rs)
            moe_out[launch] = got
        return call

    for name, gluon in (("moekit", False), ("moekit_gluon", True)):
        if name in broken or (gluon and GLUON_ERROR):
            continue
        moekit_calls = {launch: moekit_call(launch, gluon) for launch in ("gate_up", "down")}
        with poisoning():
            err = first_run(name, lambda calls=moekit_calls: [f() for f in calls.values()])
        if err is None:
            row = {}
            for launch in ("gate_up", "down"):
                e, problem = check(case, launch, moe_out[launch])
                row[launch] = (e, problem)
                fns[(name, launch)] = moekit_calls[launch]
            rows[name] = row
        else:
            print(f"    {err}")
            broken[name] = err
            rec.add(tokens=tokens, variant=name, error=err)
        moe_out.clear()

    # the pre-gathers (moekit's `sorted_rows`, into a fresh workspace buffer each call)
    sorted_ops = {}
    gathers = {"x": lambda: sorted_ops.__setitem__("x", sorted_rows(case.x, al, k)),
               "dout": lambda: sorted_ops.__setitem__("dout", sorted_rows(case.dout, al, k))}
    gathered = False
    if GLUON_ERROR:
        print(f"  Gluon variants skipped: {GLUON_ERROR}")
    else:
        with poisoning():
            err = first_run("gather", lambda: [f() for f in gathers.values()])
        if err is None:
            npad = int(al.num_padded)
            pair = al.sorted_ids[:npad].long()
            valid = pair < case.pairs
            tok = torch.where(valid, pair // k, 0)
            want = case.x[tok] * valid[:, None]
            ok = torch.equal(sorted_ops["x"][:npad], want) and torch.equal(
                sorted_ops["dout"][:npad], case.dout[tok] * valid[:, None])
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
            "gate_up": lambda name=name, o=o: gluon_wgrad(case.dpre_w, sorted_ops["x"], rs, o["gate_up"],
                                                          name, align_block=case.block_m),
            "down": lambda name=name, o=o: gluon_wgrad(sorted_ops["dout"], case.h_w, rs, o["down"], name,
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
        if total and name not in ("moekit", "moekit_gluon"):
            with_gather = total + sum(gather_ms) if gather_ms[0] is not None else None
            print(f"  {name:<14}{'both':<9}{'':>14}{total:>9.4f}{'':>9}"
                  f"{base_total / total if base_total else float('nan'):>9.2f}x"
                  f"   with the gathers {with_gather:.4f} ms: "
                  f"{base_total / with_gather if base_total else float('nan'):.2f}x")
            rec.add(tokens=tokens, variant=name, launch="both", ms=total, ms_with_gather=with_gather,
                    speedup=base_total / total if base_total else None,
                    speedup_with_gather=base_total / with_gather if base_total else None)
        elif total:
            speed = base_total / total if base_total and name != "moekit" else None
            tail = f"{'':>9}{speed:>9.2f}x" if speed else ""
            print(f"  {name:<14}{'both':<9}{'':>14}{total:>9.4f}{tail}")
            rec.add(tokens=tokens, variant=name, launch="both", ms=total, speedup=speed)


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
