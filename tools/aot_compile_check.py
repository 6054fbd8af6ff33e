"""Ahead-of-time compile check of the forward grouped GEMMs for Hopper (sm_90), no GPU needed.

Each variant calls the real launchers (`moekit.grouped_gemm.gemm1_swiglu`, `gemm2_weighted`) on
uninitialised CPU tensors of the preset's shape (top_k experts, each token routed to all of them:
the expert count is no part of a kernel's specialization, top_k is), with the kernels' launches
intercepted: the arguments are bound by the JIT's own binder for the CUDA backend (the signature,
constexprs and divisibility attributes a launch on the GPU computes) and compiled by
`triton.compile(ASTSource(...), target=GPUTarget("cuda", 90, 32))` through PTX to a cubin (ptxas).
A tensor-descriptor argument reaches the compiler as `tensordesc<bf16[BN, BK]>`.

Paths (GEMM1's flags; GEMM2 takes HAS_BIAS and TMA_W):
    default               the pointer path, SwiGLU, no bias
    tma                   + TMA_W (`ExpertsConfig.tma_weights`)
    gpt-oss+bias          GPT_OSS, HAS_BIAS on both GEMMs
    gpt-oss+bias+tma      + TMA_W
    interleaved           INTERLEAVED (SwiGLU, no bias)
    interleaved+tma       + TMA_W (gate_up box [2 BN, BK])
    gpt-oss               GPT_OSS, HAS_BIAS, INTERLEAVED: gpt-oss's experts
    gpt-oss+tma           + TMA_W
    persistent            PERSISTENT (`ExpertsConfig.persistent`): the tile loop, SwiGLU, no bias
    persistent+tma        + TMA_W
    gpt-oss+persistent+tma  gpt-oss's experts (GPT_OSS, HAS_BIAS, INTERLEAVED), PERSISTENT and TMA_W
    flatten, flatten+tma  persistent (+ TMA_W) with FLATTEN (experimental `PERSISTENT_FLATTEN`: the
                          tile and K loops fused; paired tiles run without it)
    store-pre             GEMM1 with STORE_PRE (`gemm1_swiglu_with_pre`: the training forward, the
                          pre-activations stored beside h), SwiGLU, no bias
    store-pre+tma, store-pre+persistent+tma   + TMA_W (+ PERSISTENT)
over the Qwen3-30B-A3B tiles (bf16) below, paired tiles on and off. A path whose TMA the runtime
would refuse (`resolve_tma`: e.g. an interleaved box over 256 rows) is reported as such, not compiled.

Prints one line per variant, OK (GEMM1/GEMM2 shared memory in bytes, and with --regs the registers
per thread and any local memory (spills) from `cuobjdump -res-usage`) or FAIL with the error, and
exits 1 on any failure; 2 when this Triton has no CUDA backend, ptxas or cuobjdump. `--dump DIR`
writes each kernel's PTX and SASS (cuobjdump) there; `--compare DIR` then checks them against
another commit's dump (same instructions: PTX without its debug lines and labels, SASS as is). The
paths without TMA (or PERSISTENT) run on commits that predate it, e.g. to show that the flags off
compile to main's kernels:

    PYTHONPATH=<main>/src python tools/aot_compile_check.py --paths default,gpt-oss --dump /tmp/main
    python tools/aot_compile_check.py --paths default,gpt-oss --dump /tmp/new --compare /tmp/main

`--wgrad [all|old,default,<i>,...]` checks the weight-gradient kernel instead (`moe_wgrad_kernel`,
both launches of a training step, unscaled: d gate_up_proj, A by sorted row and B by token; d
down_proj, A by token and B by sorted row; then d down_proj in the scaled mode, which the backward
runs when only down_proj needs a gradient) with its tiles (`moekit.tuning.WgradConfig`): the old
ones (the forward's L tiles capped at 64), the default and `moekit.bench.wgrad.CANDIDATES` (by
index); with --regs its lines give shared memory, registers and spills per launch.

`--backward` checks the SwiGLU backward instead (`moe_swiglu_bwd_kernel` and the tile sum, for each
--tiles, with `BackwardTiles.fit`'s tiles): reading the saved pre-activations (what the autograd
Function runs) and RECOMPUTE (the custom op's backward), every output stored; --regs as above.

`--gluon-wgrad` checks the Hopper Gluon weight gradient instead (`moekit.grouped_gemm.gluon_wgrad`, both
tiles `moekit.grouped_gemm.backward.wgrad` picks from, `moekit.tuning.GLUON_PP_WGRAD` and
`GLUON_COOP_WGRAD`, and the row gather that feeds it); a Gluon kernel compiles through Gluon's own AST
source; --regs as above, and spills or shared memory past the limit fail. Exit 2 without Gluon.

`--gluon-swiglu` checks the Hopper Gluon SwiGLU backward instead (`moekit.grouped_gemm.gluon_swiglu_bwd`, both
tiles `moekit.grouped_gemm.backward.swiglu_backward` picks from, `GLUON_SWIGLU_128` and `GLUON_SWIGLU_64`,
in bf16 and fp16, and the 128-column tiles with only dpre_w stored); shared memory past the limit fails;
spills are reported (the 128-column tiles spill loop counters: 72 B with Triton 3.6, 184 B with 3.9).

`--decode [all|default,<i>,...]` checks the direct decode kernels instead (`moekit.decode.kernels`:
GEMV1 + SwiGLU and GEMV2 + slot sum, at T = 1, int64 ids) with the default tiles
(`moekit.decode.DEFAULT_DECODE`) and `DECODE_TILES` (by index), on bf16 and on block-scaled e4m3
weights; --regs as above.

`--masked` checks the masked layout's GEMMs instead (`moekit.masked.masked_experts`): the dense
kernels at `masked_config`'s tiles for 8 and 512 rows an expert, and the FP8 kernels at the tiles
`masked_fp8_tiles` makes of 16- to 128-row tiles; --regs as above.

`--fp8` checks the grouped FP8 path instead (`moekit.experts.fp8.experts_triton_fp8`): the activation
quantizer and both FP8 GEMMs at the tiles the packaged H200 table gives 16 to 16,384 tokens, with
float32 scales and at the last count UE8M0 ones; --regs as above.

`--align` checks the align kernels instead (`moekit.align.kernels`, as `align_block_size_triton`
launches them): the one-program kernel, the one-launch kernel of a program a chunk (up to
`ONE_LAUNCH_MAX_PAIRS` pairs, run at `ONE_LAUNCH_CANDIDATE`) and the three launches, over the pair
counts, expert counts, block sizes and id dtypes of `ALIGN_CASES`; --regs as above (the scan kernel
of the three launches spills 136 B at 32,768 pairs with Triton 3.8).

Usage: python tools/aot_compile_check.py [--preset qwen3-30b-a3b] [--tiles S,M,MP,L] [--paths ...]
       [--quick] [--regs] [--dump DIR [--compare DIR]]
       python tools/aot_compile_check.py --wgrad [all|old,default,0,3,...] [--regs] [--dump DIR]
       python tools/aot_compile_check.py --backward [--tiles S,M,MP,L] [--regs] [--dump DIR]
       python tools/aot_compile_check.py --decode [all|default,0,1,...] [--regs] [--dump DIR]
       python tools/aot_compile_check.py --gluon-wgrad [--regs] [--dump DIR]
       python tools/aot_compile_check.py --gluon-swiglu [--regs] [--dump DIR]
       python tools/aot_compile_check.py --align [--regs] [--dump DIR]
       python tools/aot_compile_check.py --masked [--regs] [--dump DIR]
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "0"   # compile, never interpret: before triton and moekit import

import argparse
import dataclasses
import functools
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import triton

import moekit
from moekit.activation import SWIGLU, GatedActivation
from moekit.align import align_block_size
from moekit.grouped_gemm import gemm1_swiglu, gemm2_weighted
from moekit.grouped_gemm.kernels import moe_gemm1_swiglu_kernel, moe_gemm2_kernel

TARGET = ("cuda", 90, 32)    # GPUTarget(backend, arch, warp_size): sm_90, 32-thread warps
NUM_TOKENS = 64
KERNELS = (moe_gemm1_swiglu_kernel, moe_gemm2_kernel)

# Tiles of the kinds the H200 table picks for Qwen3-30B-A3B in bf16 (T = 16 ... 16384): block_m 16, 64
# (also paired) and 128, block_n 64 / 128, block_k 64, 3-4 stages, 4 / 8 warps.
TILES = {
    "S": moekit.ExpertsConfig(block_m=16, block_n1=64, block_k1=64, warps1=4, stages1=3,
                              block_n2=64, block_k2=64, warps2=4, stages2=3, group_m=1),
    "M": moekit.ExpertsConfig(block_m=64, block_n1=64, block_k1=64, warps1=4, stages1=3,
                              block_n2=128, block_k2=64, warps2=4, stages2=3, group_m=8),
    "MP": moekit.ExpertsConfig(block_m=64, block_n1=128, block_k1=64, warps1=8, stages1=4,
                               block_n2=128, block_k2=64, warps2=8, stages2=4, group_m=8, pair_blocks=2),
    "L": moekit.ExpertsConfig(block_m=128, block_n1=128, block_k1=64, warps1=8, stages1=4,
                              block_n2=128, block_k2=64, warps2=8, stages2=4, group_m=8),
}
# name: (activation, biases, interleaved, tma, persistent: False, True or "flatten", store_pre)
PATHS = {
    "default": ("swiglu", False, False, False, False, False),
    "tma": ("swiglu", False, False, True, False, False),
    "gpt-oss+bias": ("gpt_oss", True, False, False, False, False),
    "gpt-oss+bias+tma": ("gpt_oss", True, False, True, False, False),
    "interleaved": ("swiglu", False, True, False, False, False),
    "interleaved+tma": ("swiglu", False, True, True, False, False),
    "gpt-oss": ("gpt_oss", True, True, False, False, False),
    "gpt-oss+tma": ("gpt_oss", True, True, True, False, False),
    "persistent": ("swiglu", False, False, False, True, False),
    "persistent+tma": ("swiglu", False, False, True, True, False),
    "gpt-oss+persistent+tma": ("gpt_oss", True, True, True, True, False),
    "flatten": ("swiglu", False, False, False, "flatten", False),
    "flatten+tma": ("swiglu", False, False, True, "flatten", False),
    "store-pre": ("swiglu", False, False, False, False, True),
    "store-pre+tma": ("swiglu", False, False, True, False, True),
    "store-pre+persistent+tma": ("swiglu", False, False, True, True, True),
}
# the CPU test's subset
QUICK = (("S", "default"), ("S", "gpt-oss+tma"), ("M", "persistent"), ("MP", "store-pre+persistent+tma"))


def cuda_backend_missing() -> str | None:
    """Why this Triton cannot compile for CUDA here, or None."""
    from triton.backends import backends

    if "nvidia" not in backends:
        return "this Triton build has no CUDA backend"
    try:
        from triton import knobs
        from triton.backends.nvidia.compiler import get_ptxas

        get_ptxas(TARGET[1])
        assert knobs.nvidia.cuobjdump.path    # --dump's SASS
    except Exception as exc:
        return f"no ptxas or cuobjdump: {type(exc).__name__}: {exc}"
    return None


def capture_launches(call, kernels=KERNELS) -> list[tuple]:
    """(kernel, args, kwargs) of each launch of `kernels` that `call` makes; nothing runs."""
    seen = []
    for kernel in kernels:      # JITFunction[grid](...) calls self.run: an instance attribute wins
        kernel.run = lambda *args, grid, warmup, _k=kernel, **kwargs: seen.append((_k, args, kwargs))
    try:
        call()
    finally:
        for kernel in kernels:
            del kernel.run
    return seen


def fail_status(exc: BaseException) -> str:
    """A variant's FAIL line: the exception's type and the last line of its message."""
    text = str(exc).strip().splitlines()
    return f"FAIL {type(exc).__name__}: {text[-1][:300] if text else ''}"


def compile_launch(kernel, args, kwargs, target):
    """The kernel as a launch with these arguments would compile it on `target`: the JIT's binder
    gives the signature, constexprs and attributes; triton.compile does the rest."""
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    backend = make_backend(target)
    kwargs = dict(kwargs, debug=False)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, _ = binder(*args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound, specialization, None)
    if getattr(kernel, "is_gluon", lambda: False)():      # a Gluon kernel (`moekit.grouped_gemm.gluon_wgrad`)
        from triton.experimental.gluon._runtime import GluonASTSource

        src = GluonASTSource(kernel, signature, constexprs, attrs)
    else:
        src = ASTSource(kernel, signature, constexprs, attrs)
    return triton.compile(src, target=target, options=options.__dict__)


def sass(cubin: bytes) -> str:
    from triton import knobs

    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([knobs.nvidia.cuobjdump.path, "-sass", f.name], capture_output=True, text=True,
                              check=True).stdout


@dataclasses.dataclass
class Inputs:
    x: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor
    w: torch.Tensor
    ids: torch.Tensor
    gate_up_bias: torch.Tensor
    down_bias: torch.Tensor


def make_inputs(shape: moekit.MoEShape, dtype: torch.dtype) -> Inputs:
    e, h, i, k = shape.top_k, shape.hidden_size, shape.intermediate_size, shape.top_k
    ids = torch.arange(k).repeat(NUM_TOKENS, 1)
    return Inputs(torch.empty(NUM_TOKENS, h, dtype=dtype), torch.empty(e, 2 * i, h, dtype=dtype),
                  torch.empty(e, h, i, dtype=dtype), torch.ones(ids.shape), ids,
                  torch.empty(e, 2 * i, dtype=dtype), torch.empty(e, h, dtype=dtype))


def resource_usage(cubin: bytes) -> str:
    """'<registers>r', plus ' local <bytes>B' (spills) when it uses local memory: a cubin's kernel, from
    `cuobjdump -res-usage`."""
    from triton import knobs

    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([knobs.nvidia.cuobjdump.path, "-res-usage", f.name], capture_output=True,
                             text=True, check=True).stdout
    regs = re.search(r"REG:(\d+)", out)
    # Spilled registers live in local memory, which cuobjdump reports as the kernel's STACK frame
    # (LOCAL counts other local variables): either, when nonzero, is a spill.
    local = sum(int(m) for m in re.findall(r"(?:LOCAL|STACK):(\d+)", out))
    spills = f" local {local}B" if local else ""
    return f"{regs.group(1) if regs else '?'}r{spills}"


def compile_launches(launches: list[tuple], target, dump: Path | None, names: list[str], regs: bool) -> str:
    """'<shared>B[ <regs>r[ local <n>B]]' per launch, '/'-joined; each kernel's PTX and SASS dumped
    as <name>.<kernel>.ptx / .sass."""
    notes = []
    for (kernel, args, kwargs), name in zip(launches, names, strict=True):
        compiled = compile_launch(kernel, args, kwargs, target)
        usage = f" {resource_usage(compiled.asm['cubin'])}" if regs else ""
        notes.append(f"{compiled.metadata.shared}B{usage}")
        if dump is not None:
            stem = f"{name}.{kernel.__name__}"
            (dump / f"{stem}.ptx").write_text(compiled.asm["ptx"])
            (dump / f"{stem}.sass").write_text(sass(compiled.asm["cubin"]))
    return "/".join(notes)


def wgrad_variants(spec: str) -> dict[str, object]:
    """name -> tiles per launch ({"gate_up": WgradConfig, "down": WgradConfig}) for --wgrad SPEC."""
    from moekit.bench.wgrad import CANDIDATES, LAUNCHES, legacy_tiles
    from moekit.tuning import WgradConfig

    named = {"old": legacy_tiles(TILES["L"]), "default": dict.fromkeys(LAUNCHES, WgradConfig())}
    named.update({str(i): dict.fromkeys(LAUNCHES, t) for i, t in enumerate(CANDIDATES)})
    keys = list(named) if spec == "all" else spec.split(",")
    unknown = [k for k in keys if k not in named]
    if unknown:
        raise SystemExit(f"--wgrad: unknown {unknown}; names are old, default, 0..{len(CANDIDATES) - 1}")
    return {k: named[k] for k in keys}


def run_wgrad(inp: Inputs, tiles: dict, target, dump: Path | None, name: str, regs: bool) -> str:
    """'OK  shared gate_up/down ...' for the two weight-gradient launches with these tiles."""
    from moekit.grouped_gemm.backward import down_proj_grad, gate_up_proj_grad, wgrad
    from moekit.grouped_gemm.backward_kernels import moe_wgrad_kernel, moe_wgrad_range_kernel

    top_k = inp.ids.shape[1]
    align = align_block_size(inp.ids, inp.gate_up.shape[0], 64, backend="torch")
    dpre_w = torch.empty(align.sorted_ids.numel(), inp.gate_up.shape[1], dtype=inp.x.dtype)
    h = torch.empty(align.sorted_ids.numel(), inp.down.shape[2], dtype=inp.x.dtype)

    def call():
        gate_up_proj_grad(dpre_w, inp.x, None, align, top_k, inp.x.dtype, tiles["gate_up"])
        down_proj_grad(inp.x, h, None, align, top_k, inp.x.dtype, tiles["down"])
        down_proj_grad(inp.x, h, inp.w, align, top_k, inp.x.dtype, tiles["down"])     # scaled
        # the training step's launches: dpre_w and h_w zero on padding rows
        gate_up_proj_grad(dpre_w, inp.x, None, align, top_k, inp.x.dtype, tiles["gate_up"], padding_zero=True)
        down_proj_grad(inp.x, h, None, align, top_k, inp.x.dtype, tiles["down"], padding_zero=True)
        # both operands in sorted-row order (the gathered one copied there first): no index read
        wgrad(dpre_w, dpre_w, None, align, top_k, (inp.gate_up.shape[0], dpre_w.shape[1], dpre_w.shape[1]),
              inp.x.dtype, a_by_token=False, b_by_token=False, tiles=tiles["gate_up"], padding_zero=True)

    launches = capture_launches(call, (moe_wgrad_kernel, moe_wgrad_range_kernel))
    label = " / ".join(dict.fromkeys(t.label() for t in tiles.values()))
    names = [f"{name}.{launch}" for launch in ("gate_up", "down", "down_scaled", "gate_up_pz", "down_pz",
                                               "sorted_pz")]
    usage = compile_launches(launches, target, dump, names, regs)
    return f"OK  shared {usage}  [{label}]"


def check_backward(inp: Inputs, tiles: list[str], target, dump: Path | None, regs: bool) -> int:
    """One line per (tiles, mode): the SwiGLU backward and the tile sum as `swiglu_backward` launches
    them, reading the saved pre-activations (saved) or recomputing them (recompute), every output
    stored (shared memory, registers, spills)."""
    from moekit.grouped_gemm.backward import BackwardTiles, swiglu_backward
    from moekit.grouped_gemm.backward_kernels import moe_swiglu_bwd_kernel, moe_tile_sum_kernel

    top_k = inp.ids.shape[1]
    failed = total = 0
    for key in tiles:
        cfg = TILES[key]
        align = align_block_size(inp.ids, inp.gate_up.shape[0], cfg.block_m, backend="torch")
        pre = torch.empty(align.sorted_ids.numel(), inp.gate_up.shape[1], dtype=inp.x.dtype)
        for mode in ("saved", "saved_h2", "recompute"):
            total += 1
            started = time.perf_counter()
            fit = BackwardTiles.fit(cfg, inp.x.element_size(), recompute=mode == "recompute")
            if mode == "saved_h2":      # two halves a program (BackwardTiles.halves)
                fit = dataclasses.replace(fit, halves=2, pre_first=False)
            name = f"backward.{key}.{mode}"
            saved = None if mode == "recompute" else pre
            try:
                launches = capture_launches(
                    lambda c=cfg, a=align, s=saved, t=fit: swiglu_backward(
                        inp.x, inp.gate_up, inp.down, inp.x, inp.w, a, top_k, c, pre=s, tiles=t),
                    (moe_swiglu_bwd_kernel, moe_tile_sum_kernel))
                for kernel, _, kwargs in launches:
                    if kernel is moe_swiglu_bwd_kernel and kwargs["RECOMPUTE"] is not (mode == "recompute"):
                        raise RuntimeError(f"launched with RECOMPUTE={kwargs['RECOMPUTE']} for {mode}")
                usage = compile_launches(launches, target, dump, [name] * len(launches), regs)
                status = f"OK  shared {usage}"
            except Exception as exc:
                failed += 1
                status = fail_status(exc)
            label = f"m{cfg.block_m} {fit.label()}"
            print(f"{name:<28} {status}  [{label}]  ({time.perf_counter() - started:.1f} s)", flush=True)
    print(f"{total - failed}/{total} backward variants compile" + (f", {failed} FAILED" if failed else ""))
    return 1 if failed else 0


# (T, E, K, block_m, ids dtype): one program (S <= FUSED_MAX_PAIRS), one launch of a program a
# chunk (the limit set to ONE_LAUNCH_CANDIDATE pairs; Qwen3-30B-A3B at 256 and 512 tokens, E_PAD 4
# and 512), three.
ALIGN_CASES = ((64, 128, 8, 16, torch.int32), (129, 128, 8, 16, torch.int32), (256, 128, 8, 16, torch.int64),
               (512, 128, 8, 64, torch.int32), (1000, 4, 3, 128, torch.int64), (331, 257, 5, 16, torch.int32),
               (4096, 128, 8, 64, torch.int32))


def check_align(target, dump: Path | None, regs: bool) -> int:
    """Compile each `ALIGN_CASES` align's launches; 1 on a failure."""
    import moekit.align as align_mod
    from moekit.align import kernels

    names = ("align_scatter_kernel", "align_hist_kernel", "align_scan_kernel", "align_one_launch_kernel")
    launched = tuple(getattr(kernels, n) for n in names if hasattr(kernels, n))
    checked, limit = align_mod.check_triton_device, getattr(align_mod, "ONE_LAUNCH_MAX_PAIRS", 0)
    align_mod.check_triton_device = lambda *a, **k: None      # CPU tensors stand in for the GPU's
    align_mod.ONE_LAUNCH_MAX_PAIRS = getattr(align_mod, "ONE_LAUNCH_CANDIDATE", 0)
    failed = 0
    try:
        for num_tokens, num_experts, top_k, block_m, dtype in ALIGN_CASES:
            ids = torch.zeros(num_tokens, top_k, dtype=dtype)
            name = f"align.T{num_tokens}.E{num_experts}.K{top_k}.m{block_m}.{str(dtype)[-5:]}"
            started = time.perf_counter()
            try:
                call = functools.partial(align_mod.align_block_size_triton, ids, num_experts, block_m)
                launches = capture_launches(call, launched)
                status = compile_launches(launches, target, dump, [name] * len(launches), regs)
                status = f"OK  {'+'.join(k.__name__ for k, _, _ in launches)}  shared {status}"
            except Exception as exc:
                failed += 1
                status = fail_status(exc)
            print(f"{name:<34} {status}  ({time.perf_counter() - started:.1f} s)", flush=True)
    finally:
        align_mod.check_triton_device, align_mod.ONE_LAUNCH_MAX_PAIRS = checked, limit
    print(f"{len(ALIGN_CASES) - failed}/{len(ALIGN_CASES)} align cases compile"
          + (f", {failed} FAILED" if failed else ""))
    return 1 if failed else 0


def run_variant(inp: Inputs, cfg: moekit.ExpertsConfig, path: str, target, dump: Path | None, name: str,
                regs: bool = False):
    """'OK ...' or 'SKIP ...' for one (tiles, path); raises when a kernel fails to compile."""
    activation, biases, interleaved, tma, persistent, store_pre = PATHS[path]
    act = SWIGLU if activation == "swiglu" else GatedActivation(activation)
    cfg = dataclasses.replace(cfg, tma_weights=True) if tma else cfg
    # The field is named only when asked for: the other paths also run on commits without it.
    cfg = dataclasses.replace(cfg, persistent=True) if persistent else cfg
    align = align_block_size(inp.ids, inp.gate_up.shape[0], cfg.block_m, backend="torch")

    def call():
        if store_pre:   # imported here: the other paths also run on commits without it
            from moekit.grouped_gemm import gemm1_swiglu_with_pre

            h, _ = gemm1_swiglu_with_pre(inp.x, inp.gate_up, align, inp.ids.shape[1], cfg)
        else:
            h = gemm1_swiglu(inp.x, inp.gate_up, align, inp.ids.shape[1], cfg, activation=act,
                             interleaved=interleaved, bias=inp.gate_up_bias if biases else None)
        gemm2_weighted(h, inp.down, inp.w, align, cfg, bias=inp.down_bias if biases else None)

    if persistent == "flatten":
        import moekit.grouped_gemm as gg

        gg.PERSISTENT_FLATTEN = True
        try:
            return run_variant(inp, cfg, path.replace("flatten", "persistent"), target, dump, name, regs)
        finally:
            gg.PERSISTENT_FLATTEN = False
    if tma:   # TMA names are imported here only: the other paths also run on commits without them
        import moekit.grouped_gemm as gg

        has_tma = gg._device_has_tma
        gg._device_has_tma = lambda device: True     # the target is sm_90: descriptors as on an H200
        try:
            if gg.resolve_tma(cfg, inp.gate_up, inp.down, interleaved=interleaved) != cfg:
                return "SKIP (resolve_tma: the pointer path runs this config)"
            launches = capture_launches(call)
        finally:
            gg._device_has_tma = has_tma
    else:
        launches = capture_launches(call)
    for kernel, _, kwargs in launches:
        if kwargs.get("TMA_W", False) is not tma:
            raise RuntimeError(f"{kernel.__name__} launched with TMA_W={kwargs.get('TMA_W')}, wanted {tma}")
        if kernel is moe_gemm1_swiglu_kernel and kwargs.get("STORE_PRE", False) is not store_pre:
            raise RuntimeError(f"GEMM1 launched with STORE_PRE={kwargs.get('STORE_PRE')}, wanted {store_pre}")
        if kwargs.get("PERSISTENT", False) is not persistent:
            raise RuntimeError(f"{kernel.__name__} launched with PERSISTENT={kwargs.get('PERSISTENT')}, "
                               f"wanted {persistent}")
    return "OK  shared " + compile_launches(launches, target, dump, [name] * len(launches), regs)


DEBUG_LABEL = re.compile(r"\$L__tmp\d+:")


def instructions(path: Path) -> list[str]:
    """A dumped kernel's instructions: SASS as is; PTX without comments, .loc/.file lines, the
    DWARF sections (they name source lines, which move when unrelated code does) and the $L__tmp
    labels (they only delimit inlined calls for the debug info: one more @triton.jit call level
    between a kernel and its code renumbers them, and nothing branches to them)."""
    if path.suffix == ".sass":
        return path.read_text().splitlines()
    lines = []
    for line in (raw.strip() for raw in path.read_text().splitlines()):
        if line.startswith(".section") and ".debug" in line:
            break
        if line and not line.startswith(("//", ".loc", ".file")) and not DEBUG_LABEL.fullmatch(line):
            lines.append(line)
    return lines


def compare(ours: Path, theirs: Path) -> int:
    """SAME/DIFF per kernel dumped in both folders; the number that differ (missing counts)."""
    differ = 0
    for path in sorted(ours.glob("*.ptx")) + sorted(ours.glob("*.sass")):
        other = theirs / path.name
        same = other.exists() and instructions(path) == instructions(other)
        differ += not same
        print(f"{'SAME' if same else 'DIFF' if other.exists() else 'MISSING'} {path.name}")
    return differ


def decode_variants(spec: str) -> dict[str, object]:
    """name -> `moekit.decode.DecodeConfig` for --decode SPEC."""
    from moekit.decode import DECODE_TILES, DEFAULT_DECODE

    named = {"default": DEFAULT_DECODE, **{str(i): t for i, t in enumerate(DECODE_TILES)}}
    keys = list(named) if spec == "all" else spec.split(",")
    unknown = [k for k in keys if k not in named]
    if unknown:
        raise SystemExit(f"--decode: unknown {unknown}; names are default, 0..{len(DECODE_TILES) - 1}")
    return {k: named[k] for k in keys}


def check_decode(inp: Inputs, variants: dict, target, dump: Path | None, regs: bool) -> int:
    """One line per decode tile choice and weight format (the dtype's, then block-scaled e4m3 with
    float32 scales): both kernels at T = 1 (shared memory, registers, spills)."""
    from moekit.decode import experts_decode
    from moekit.decode.kernels import decode_gemm1_swiglu_kernel, decode_gemm2_sum_kernel
    from moekit.quant import FP8_BLOCK, FP8_DTYPE

    x, ids, w = inp.x[:1], inp.ids[:1], inp.w[:1]

    def scales(t: torch.Tensor) -> torch.Tensor:
        return torch.ones(t.shape[0], t.shape[1] // FP8_BLOCK, t.shape[2] // FP8_BLOCK)

    formats = {"": (inp.gate_up, inp.down, None),
               ".fp8": (inp.gate_up.to(FP8_DTYPE), inp.down.to(FP8_DTYPE),
                        (scales(inp.gate_up), scales(inp.down)))}
    failed = 0
    for name, tiles in variants.items():
        for suffix, (gate_up, down, block_scales) in formats.items():
            started = time.perf_counter()
            try:
                launches = capture_launches(
                    lambda t=tiles, g=gate_up, d=down, s=block_scales: experts_decode(
                        x, g, d, w, ids, torch.empty_like(x), t, s),
                    (decode_gemm1_swiglu_kernel, decode_gemm2_sum_kernel))
                status = "OK  shared " + compile_launches(launches, target, dump,
                                                          [f"decode.{name}{suffix}"] * 2, regs)
            except Exception as exc:
                failed += 1
                status = fail_status(exc)
            print(f"decode {name + suffix:<12} {status}  [{tiles.label()}]  "
                  f"({time.perf_counter() - started:.1f} s)", flush=True)
    print(f"{len(variants) * len(formats) - failed}/{len(variants) * len(formats)} decode variants compile"
          + (f", {failed} FAILED" if failed else ""))
    return 1 if failed else 0


def check_masked(shape: moekit.MoEShape, target, dump: Path | None, regs: bool) -> int:
    """One line per masked-layout GEMM pair (`moekit.masked.masked_experts`): the dense kernels (bf16)
    at `masked_config`'s tiles for 8 and 512 rows an expert, and the FP8 kernels (e4m3 weights, bf16
    activations) at `masked_fp8_tiles` of 16- to 128-row tiles."""
    import moekit.masked as masked
    from moekit.masked.kernels import (
        masked_gemm1_swiglu_fp8_kernel,
        masked_gemm1_swiglu_kernel,
        masked_gemm2_fp8_kernel,
        masked_gemm2_kernel,
    )
    from moekit.quant import FP8_BLOCK, FP8_DTYPE, Fp8Weight
    from moekit.tuning import ExpertsConfig

    e, h, i = shape.num_experts, shape.hidden_size, shape.intermediate_size
    counts = torch.zeros(e, dtype=torch.int32)
    gate_up, down = torch.empty(e, 2 * i, h, dtype=torch.bfloat16), torch.empty(e, h, i, dtype=torch.bfloat16)
    gate_up8 = Fp8Weight(gate_up.to(FP8_DTYPE), torch.ones(e, 2 * i // FP8_BLOCK, h // FP8_BLOCK))
    down8 = Fp8Weight(down.to(FP8_DTYPE), torch.ones(e, h // FP8_BLOCK, i // FP8_BLOCK))
    checks = {}
    for cap in (8, 512):
        cfg = masked.masked_config(cap, h, i, 2)
        checks[f"bf16.c{cap}"] = (cap, gate_up, down, cfg, (masked_gemm1_swiglu_kernel, masked_gemm2_kernel))
    for block_m in (16, 32, 64, 128):
        tiles = ExpertsConfig(block_m=block_m, block_n2=128, warps2=8 if block_m > 32 else 4)
        cfg = masked.masked_fp8_tiles(tiles)
        checks[f"fp8.bm{block_m}"] = (64, gate_up8, down8, cfg,
                                      (masked_gemm1_swiglu_fp8_kernel, masked_gemm2_fp8_kernel))
    checked = masked.check_triton_device
    masked.check_triton_device = lambda *a, **k: None      # CPU tensors stand in for the GPU's
    failed = 0
    try:
        for name, (cap, gu, dn, cfg, kernels) in checks.items():
            started = time.perf_counter()
            x = torch.empty(e, cap, h, dtype=torch.bfloat16)
            try:
                launches = capture_launches(
                    lambda x=x, gu=gu, dn=dn, cfg=cfg: masked.masked_experts(x, counts, gu, dn, config=cfg,
                                                                             validate=False), kernels)
                names = [f"masked.{name}"] * 2
                status = "OK  shared " + compile_launches(launches, target, dump, names, regs)
            except Exception as exc:
                failed += 1
                status = fail_status(exc)
            print(f"masked {name:<10} {status}  [bm{cfg.block_m} w{cfg.warps1}/{cfg.warps2} "
                  f"s{cfg.stages1}/{cfg.stages2}]  ({time.perf_counter() - started:.1f} s)", flush=True)
    finally:
        masked.check_triton_device = checked
    print(f"{len(checks) - failed}/{len(checks)} masked variants compile"
          + (f", {failed} FAILED" if failed else ""))
    return 1 if failed else 0


def check_fp8(shape: moekit.MoEShape, target, dump: Path | None, regs: bool) -> int:
    """One line per token count of the grouped FP8 path (`moekit.experts.fp8`'s launches: the
    activation quantizer, `gemm1_swiglu_fp8`, `gemm2_weighted_fp8`) at the tiles the packaged H200
    table gives that count (`moekit.tuning.get_config` keyed e4m3), on e4m3 weights with float32
    scales (UE8M0 scales at the last count too); --regs as above."""
    import moekit.grouped_gemm as gg
    from moekit import tuning
    from moekit.grouped_gemm.fp8 import gemm1_swiglu_fp8, gemm2_weighted_fp8
    from moekit.grouped_gemm.fp8_kernels import moe_gemm1_fp8_kernel, moe_gemm2_fp8_kernel
    from moekit.quant import FP8_BLOCK, FP8_DTYPE, Fp8Weight, quantize_rows
    from moekit.quant.kernels import quantize_rows_kernel

    e, h, i, k = shape.top_k, shape.hidden_size, shape.intermediate_size, shape.top_k

    def weight(n: int, kk: int) -> Fp8Weight:
        scales = torch.ones(e, n // FP8_BLOCK, kk // FP8_BLOCK)
        return Fp8Weight(torch.empty(e, n, kk, dtype=FP8_DTYPE), scales)

    gate_up, down = weight(2 * i, h), weight(h, i)
    table = tuning.packaged_table("nvidia-h200")
    checks = [(t, False) for t in (16, 256, 2048, 16384)] + [(16384, True)]
    has_tma = gg._device_has_tma
    gg._device_has_tma = lambda device: True     # the target is sm_90: descriptors as on an H200
    failed = 0
    try:
        for t, ue8m0 in checks:
            name = f"fp8.t{t}" + (".ue8m0" if ue8m0 else "")
            started = time.perf_counter()
            cfg = tuning.fp8_tiles(tuning.get_config(shape, t, FP8_DTYPE, torch.device("cpu"), table=table))
            ids = torch.arange(k).repeat(t, 1)
            x, w = torch.empty(t, h, dtype=torch.bfloat16), torch.ones(ids.shape)
            align = align_block_size(ids, e, cfg.block_m, backend="torch")

            def call(x=x, w=w, cfg=cfg, align=align, u=ue8m0):
                xq, xs = quantize_rows(x, ue8m0=u, dtype=FP8_DTYPE)
                hq, hs = gemm1_swiglu_fp8(xq, xs, gate_up, align, k, cfg, ue8m0=u)
                gemm2_weighted_fp8(hq, hs, down, w, align, cfg, torch.bfloat16)

            kernels = (quantize_rows_kernel, moe_gemm1_fp8_kernel, moe_gemm2_fp8_kernel)
            try:
                launches = capture_launches(call, kernels)
                names = [name] * len(launches)
                status = "OK  shared " + compile_launches(launches, target, dump, names, regs)
            except Exception as exc:
                failed += 1
                status = fail_status(exc)
            tiles = " ".join(f"{a}={b}" for a, b in cfg.to_dict().items())
            print(f"{name:<16} {status}  [{tiles}]  ({time.perf_counter() - started:.1f} s)", flush=True)
    finally:
        gg._device_has_tma = has_tma
    print(f"{len(checks) - failed}/{len(checks)} fp8 variants compile"
          + (f", {failed} FAILED" if failed else ""))
    return 1 if failed else 0


def check_wgrad(inp: Inputs, variants: dict, target, dump: Path | None, regs: bool) -> int:
    failed = 0
    for name, tiles in variants.items():
        started = time.perf_counter()
        try:
            status = run_wgrad(inp, tiles, target, dump, f"wgrad.{name}", regs)
        except Exception as exc:
            failed += 1
            status = fail_status(exc)
        print(f"wgrad {name:<22} {status}  ({time.perf_counter() - started:.1f} s)", flush=True)
    print(f"{len(variants) - failed}/{len(variants)} wgrad variants compile"
          + (f", {failed} FAILED" if failed else ""))
    return 1 if failed else 0


def check_gluon_wgrad(target, dump: Path | None, regs: bool) -> int:
    """One line per Gluon weight-gradient tiles (`moekit.tuning.GLUON_PP_WGRAD`, `GLUON_COOP_WGRAD`, as
    `moekit.grouped_gemm.backward.gluon_wgrad` launches them on the d gate_up shape, in bf16 and fp16;
    d down's differs in runtime integers only) and the gather that feeds them (`sorted_rows`): shared
    memory (at most `moekit.tuning.SHARED_MEMORY_LIMIT`), with --regs registers and spills (none
    allowed). Exit 2 where this Triton has no Gluon."""
    from moekit.grouped_gemm import gluon_wgrad as kernels
    from moekit.grouped_gemm.backward import gluon_wgrad, sorted_rows
    from moekit.grouped_gemm.backward_kernels import moe_gather_rows_kernel
    from moekit.tuning import GLUON_COOP_WGRAD, GLUON_PP_WGRAD

    if not kernels.GLUON_AVAILABLE:
        print(f"cannot check: no Gluon ({kernels.GLUON_ERROR})")
        return 2
    e, n, c, rows, top_k = 8, 1536, 2048, 8 * 256, 8     # Qwen3-30B-A3B's d gate_up, 256 rows an expert
    row_starts = torch.zeros(e + 1, dtype=torch.int32)
    align = align_block_size(torch.zeros(rows // top_k, top_k, dtype=torch.int64), e, 64, backend="torch")
    x = torch.empty(rows // top_k, c, dtype=torch.bfloat16)
    checks = {}
    for dtype, suffix in ((torch.bfloat16, ""), (torch.float16, ".fp16")):
        a, b = torch.empty(rows, n, dtype=dtype), torch.empty(rows, c, dtype=dtype)
        out = torch.empty(e, n, c, dtype=dtype)
        dout_tok = torch.empty(rows // top_k, n, dtype=dtype)       # as d down's dout, by token
        for t in (GLUON_PP_WGRAD, GLUON_COOP_WGRAD):
            for name, args, gather in (("", (a, b), None), (".gather-a", (dout_tok, b), (align, top_k))):
                call = functools.partial(gluon_wgrad, *args, row_starts, out, t, gather_a=gather)
                checks[t.label() + suffix + name] = (call, kernels.gluon_wgrad_kernel)
    checks["gather_rows"] = (lambda: sorted_rows(x, align, top_k), moe_gather_rows_kernel)
    return run_gluon_checks("gluon-wgrad", "gluon wgrad kernels", checks, target, dump, regs,
                            allow_local=False)


def run_gluon_checks(prefix: str, what: str, checks: dict, target, dump: Path | None, regs: bool, *,
                     allow_local: bool) -> int:
    """Compile each check's launch ({name: (call, kernel)}: the kernel's launch that call makes) for
    the target and print a line a check: shared memory (at most `moekit.tuning.SHARED_MEMORY_LIMIT`),
    with --regs registers and local memory (spills fail unless allow_local); then the count."""
    from moekit.tuning import SHARED_MEMORY_LIMIT

    failed = 0
    for name, (call, kernel) in checks.items():
        started = time.perf_counter()
        try:
            launches = capture_launches(call, (kernel,))
            compiled = compile_launch(*launches[0], target)
            shared = compiled.metadata.shared
            usage = f" {resource_usage(compiled.asm['cubin'])}" if regs else ""
            if shared > SHARED_MEMORY_LIMIT or (" local " in usage and not allow_local):
                raise RuntimeError(f"shared {shared}B (limit {SHARED_MEMORY_LIMIT}B){usage}")
            status = f"OK  shared {shared}B{usage}"
            if dump is not None:
                stem = prefix.replace("-", "_")
                (dump / f"{stem}.{name}.ptx").write_text(compiled.asm["ptx"])
                (dump / f"{stem}.{name}.sass").write_text(sass(compiled.asm["cubin"]))
        except Exception as exc:
            failed += 1
            status = fail_status(exc)
        print(f"{prefix} {name:<24} {status}  ({time.perf_counter() - started:.1f} s)", flush=True)
    print(f"{len(checks) - failed}/{len(checks)} {what} compile" + (f", {failed} FAILED" if failed else ""))
    return 1 if failed else 0


def gluon_alignment(rows: int):
    """The alignment fields a Gluon launcher reads, for `rows` sorted rows in 64-row blocks (values
    unread: the kernel is compiled, not run)."""
    import types

    return types.SimpleNamespace(sorted_ids=torch.zeros(rows, dtype=torch.int32),
                                 expert_ids=torch.zeros(rows // 64, dtype=torch.int32),
                                 num_padded=torch.zeros((), dtype=torch.int32), num_pairs=rows, block_m=64)


def check_gluon_swiglu(target, dump: Path | None, regs: bool) -> int:
    """One line per Gluon SwiGLU-backward launch (`moekit.tuning.GLUON_SWIGLU_128`, `GLUON_SWIGLU_64`
    in bf16 and fp16, and the 128-column tiles storing dpre_w alone, as
    `moekit.grouped_gemm.backward.gluon_swiglu_backward` launches them at Qwen3-30B-A3B's H and I):
    shared memory (at most `moekit.tuning.SHARED_MEMORY_LIMIT`), with --regs registers and spills.
    Exit 2 where this Triton has no Gluon."""

    from moekit.grouped_gemm import gluon_swiglu_bwd as kernels
    from moekit.grouped_gemm.backward import gluon_swiglu_backward
    from moekit.tuning import GLUON_SWIGLU_64, GLUON_SWIGLU_128

    if kernels.gluon_swiglu_bwd_kernel is None:
        print("cannot check: no Gluon")
        return 2
    e, hidden, inter, rows, top_k = 8, 2048, 768, 8 * 256, 8
    align = gluon_alignment(rows)
    w = torch.empty(rows // top_k, top_k)
    checks = {}
    for dtype, suffix in ((torch.bfloat16, ""), (torch.float16, ".fp16")):
        dout = torch.empty(rows // top_k, hidden, dtype=dtype)      # by token: the producer gathers rows
        down = torch.empty(e, hidden, inter, dtype=dtype)
        pre, dpre = torch.empty(rows, 2 * inter, dtype=dtype), torch.empty(rows, 2 * inter, dtype=dtype)
        h = torch.empty(rows, inter, dtype=dtype)
        for t in (GLUON_SWIGLU_128, GLUON_SWIGLU_64):
            part = torch.empty(rows, inter // t.block_n)
            checks[t.label() + suffix] = functools.partial(
                gluon_swiglu_backward, dout, down, pre, w, align, t, top_k, dpre=dpre, h=h, part=part)
        if dtype == torch.bfloat16:
            checks[GLUON_SWIGLU_128.label() + ".dpre-only"] = functools.partial(
                gluon_swiglu_backward, dout, down, pre, w, align, GLUON_SWIGLU_128, top_k, dpre=dpre, h=None,
                part=None)
    kernel = kernels.gluon_swiglu_bwd_kernel
    return run_gluon_checks("gluon-swiglu", "gluon swiglu kernels",
                            {n: (c, kernel) for n, c in checks.items()}, target, dump, regs, allow_local=True)


def check_gluon_fp8(target, dump: Path | None, regs: bool) -> int:
    """The Hopper Gluon FP8 GEMMs (`moekit.grouped_gemm.gluon_fp8`, as
    `moekit.grouped_gemm.fp8.gluon_gemm1_swiglu_fp8` and `gluon_gemm2_weighted_fp8` launch them at
    Qwen3-30B-A3B's H and I: GEMM1 with float32 and UE8M0 scales, GEMM2 to bf16 and fp16, both in the
    dual schedule, and each in the ping-pong one): shared memory (at
    most `moekit.tuning.SHARED_MEMORY_LIMIT`), with --regs registers; spills fail. Exit 2 where this Triton
    has no Gluon."""

    import moekit.grouped_gemm.backward as gb
    from moekit.grouped_gemm import gluon_fp8 as kernels
    from moekit.grouped_gemm.fp8 import gluon_gemm1_swiglu_fp8, gluon_gemm2_weighted_fp8
    from moekit.quant import FP8_DTYPE, Fp8Weight

    if kernels.gluon_gemm1_fp8_kernel is None:
        print("cannot check: no Gluon")
        return 2
    e, hidden, inter, rows, top_k = 8, 2048, 768, 8 * 256, 8
    align = gluon_alignment(rows)
    xq = torch.empty(rows // top_k, hidden, dtype=FP8_DTYPE)
    xs = torch.empty(rows // top_k, hidden // 128)
    gate_up = Fp8Weight(torch.empty(e, 2 * inter, hidden, dtype=FP8_DTYPE),
                        torch.ones(e, 2 * inter // 128, hidden // 128))
    checks = {}
    for ue8m0, dual in ((False, True), (True, True), (False, False)):
        checks["gemm1" + (".ue8m0" if ue8m0 else "") + ("" if dual else ".pingpong")] = (
            functools.partial(gluon_gemm1_swiglu_fp8, xq, xs, gate_up, align, top_k, ue8m0=ue8m0, dual=dual),
            kernels.gluon_gemm1_fp8_kernel)
    hq, hs = torch.empty(rows, inter, dtype=FP8_DTYPE), torch.empty(rows, inter // 128)
    down = Fp8Weight(torch.empty(e, hidden, inter, dtype=FP8_DTYPE),
                     torch.ones(e, hidden // 128, inter // 128))
    for dtype, dual, suffix in ((torch.bfloat16, True, ""), (torch.float16, True, ".fp16"),
                                (torch.bfloat16, False, ".pingpong")):
        checks["gemm2" + suffix] = (
            functools.partial(gluon_gemm2_weighted_fp8, hq, hs, down, torch.empty(rows), align, dtype,
                              dual=dual),
            kernels.gluon_gemm2_fp8_kernel)
    real_sm90 = gb._sm90
    gb._sm90 = lambda device: True          # the launcher's device check: compiled for sm_90 here
    try:
        return run_gluon_checks("gluon-fp8", "gluon fp8 kernels", checks, target, dump, regs,
                                allow_local=True)
    finally:
        gb._sm90 = real_sm90


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="qwen3-30b-a3b")
    p.add_argument("--tiles", default=",".join(TILES), help=f"of {', '.join(TILES)}")
    p.add_argument("--paths", default=",".join(PATHS), help=f"of {', '.join(PATHS)}")
    p.add_argument("--quick", action="store_true", help="the CPU test's subset: " + str(QUICK))
    p.add_argument("--dump", type=Path, default=None, help="write each kernel's PTX and SASS here")
    p.add_argument("--compare", type=Path, default=None, help="compare the dump with this one (needs --dump)")
    p.add_argument("--regs", action="store_true",
                   help="also registers per thread and local memory (cuobjdump)")
    p.add_argument("--wgrad", nargs="?", const="all", default=None,
                   help="the weight-gradient kernel's tiles instead: all, or old,default,<index>,...")
    p.add_argument("--backward", action="store_true",
                   help="the SwiGLU backward (saved pre-activations and RECOMPUTE) for --tiles instead")
    p.add_argument("--gluon-wgrad", action="store_true",
                   help="the Hopper Gluon weight gradient's tiles and its row gather instead")
    p.add_argument("--gluon-fp8", action="store_true",
                   help="check the Hopper Gluon FP8 GEMM1 instead")
    p.add_argument("--gluon-swiglu", action="store_true",
                   help="the Hopper Gluon SwiGLU backward's tiles instead")
    p.add_argument("--decode", nargs="?", const="all", default=None,
                   help="the direct decode kernels' tiles instead: all, or default,<index>,...")
    p.add_argument("--align", action="store_true", help="the align kernels instead (ALIGN_CASES)")
    p.add_argument("--masked", action="store_true",
                   help="the masked layout's GEMMs instead, dense and on FP8 weights")
    p.add_argument("--fp8", action="store_true",
                   help="the grouped FP8 path instead: the activation quantizer and both FP8 GEMMs")
    args = p.parse_args()
    if args.compare is not None and args.dump is None:
        p.error("--compare needs --dump")
    why = cuda_backend_missing()
    if why:
        print(f"cannot check: {why}")
        return 2
    from triton.backends.compiler import GPUTarget

    target = GPUTarget(*TARGET)
    if args.dump is not None:
        shutil.rmtree(args.dump, ignore_errors=True)
        args.dump.mkdir(parents=True)
    inp = make_inputs(moekit.get_shape(args.preset), torch.bfloat16)
    print(f"triton {triton.__version__}, target {TARGET}, {args.preset} bf16, T={NUM_TOKENS}", flush=True)
    if args.wgrad is not None:
        return check_wgrad(inp, wgrad_variants(args.wgrad), target, args.dump, args.regs)
    if args.gluon_wgrad:
        return check_gluon_wgrad(target, args.dump, args.regs)
    if args.gluon_swiglu:
        return check_gluon_swiglu(target, args.dump, args.regs)
    if args.gluon_fp8:
        return check_gluon_fp8(target, args.dump, args.regs)
    if args.backward:
        return check_backward(inp, args.tiles.split(","), target, args.dump, args.regs)
    if args.align:
        return check_align(target, args.dump, args.regs)
    if args.masked:
        return check_masked(moekit.get_shape(args.preset), target, args.dump, args.regs)
    if args.fp8:
        return check_fp8(moekit.get_shape(args.preset), target, args.dump, args.regs)
    if args.decode is not None:
        return check_decode(inp, decode_variants(args.decode), target, args.dump, args.regs)
    pairs = QUICK if args.quick else [(t, p) for t in args.tiles.split(",") for p in args.paths.split(",")]
    for tiles in dict.fromkeys(t for t, _ in pairs):
        print(f"  tiles {tiles}: " + " ".join(f"{k}={v}" for k, v in TILES[tiles].to_dict().items()))
    failed = 0
    for tiles, path in pairs:
        name = f"{tiles}.{path}"
        started = time.perf_counter()
        try:
            status = run_variant(inp, TILES[tiles], path, target, args.dump, name, args.regs)
        except Exception as exc:
            failed += 1
            status = fail_status(exc)
        print(f"{name:<28} {status}  ({time.perf_counter() - started:.1f} s)", flush=True)
    print(f"{len(pairs) - failed}/{len(pairs)} variants compile" + (f", {failed} FAILED" if failed else ""))
    if args.compare is not None:
        differ = compare(args.dump, args.compare)
        print(f"{differ} kernel files differ from {args.compare}" if differ
              else f"same instructions as {args.compare}")
        failed += differ
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
