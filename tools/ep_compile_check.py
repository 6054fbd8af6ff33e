"""Compile the expert-parallel kernels (`moekit.parallel.kernels`, and the masked layout's
`masked_layout_kernel` the low-latency mode runs) for sm_90 without a GPU.

The interpreter (TRITON_INTERPRET=1, what the CPU tests run) executes kernels op by op in NumPy and
does not see compiled-mode errors: a loop-carried variable changing type, a constexpr misused, an
op the GPU backend does not lower. This script runs the launchers of `moekit.parallel.fused` (and
`moekit.masked.masked_layout_triton`) on CPU tensors with the kernels swapped for recorders, then
compiles every recorded launch with `triton.compile(ASTSource(...), target=GPUTarget("cuda", 90,
128))` down to a cubin (ptxas, bundled with Triton), specializing integer arguments as the JIT does
(1 becomes a constexpr).

    python tools/ep_compile_check.py [--quick]        # exit status 1 if any fails

--quick compiles the first case's launches only (one per kernel;
tests/runtime/parallel/test_parallel_fused.py runs it). Each line gives the registers and spill bytes
per thread from `ptxas -v`.

It sets TRITON_INTERPRET=0 itself before importing Triton (the interpreter's @triton.jit objects
cannot be compiled).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "0"

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from moekit import masked  # noqa: E402
from moekit.parallel import fused  # noqa: E402
from moekit.parallel.dispatch import RoutePlan  # noqa: E402
from moekit.placement import Placement, contiguous_placement  # noqa: E402

TARGET = GPUTarget("cuda", 90, 128)
DTYPES = {torch.int8: "i8", torch.int16: "i16", torch.int32: "i32", torch.int64: "i64", torch.float32: "fp32",
          torch.bfloat16: "bf16", torch.float16: "fp16", torch.bool: "i1"}
KERNELS = ("ep_route_kernel", "ep_pack_kernel", "ep_reduce_kernel")


class Recorder:
    """Stands in for a JITFunction: `kernel[grid](*args, **kwargs)` records the call."""

    def __init__(self, fn, calls: list):
        self.fn, self.calls = fn, calls

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.calls.append((self.fn, args, kwargs))
        return launch


def _signature(fn, args, kwargs) -> tuple[dict, dict, dict]:
    options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages") if k in kwargs}
    sig, constexprs = {}, {}
    for name, value in zip(fn.arg_names, args):
        if isinstance(value, torch.Tensor):
            sig[name] = "*" + DTYPES[value.dtype]
        elif isinstance(value, bool):
            sig[name] = "i1"
        elif isinstance(value, int):
            if value == 1:                       # the JIT's specialization
                sig[name], constexprs[name] = "constexpr", 1
            else:
                sig[name] = "i32" if -2**31 <= value < 2**31 else "i64"
        else:
            raise TypeError(f"{name}: {type(value)}")
    for name, value in kwargs.items():
        sig[name], constexprs[name] = "constexpr", value
    return sig, constexprs, options


def record_launches(quick: bool = False) -> list:
    """Run every launcher on representative CPU inputs (normal and fixed blocks, replicas or not,
    int32 / int64 ids, bf16 / fp32 rows, top_k 1 and 8, N = 1 and 4); return the recorded launches."""
    calls: list = []
    for name in KERNELS:
        setattr(fused, name, Recorder(getattr(fused, name), calls))
    masked.masked_layout_kernel = Recorder(masked.masked_layout_kernel, calls)
    masked.check_triton_device = lambda name, t: None          # CPU tensors, no interpreter here
    gen = torch.Generator().manual_seed(0)
    cases = [  # (T, K, E, N, spare slots, ids dtype, x dtype, weights dtype, capacity)
        (4096, 8, 128, 2, 0, torch.int64, torch.bfloat16, torch.float32, None),
        (4096, 8, 128, 2, 1, torch.int32, torch.bfloat16, torch.float32, 4096),
        (1, 8, 128, 4, 2, torch.int64, torch.bfloat16, torch.bfloat16, 1),
        (37, 1, 8, 1, 0, torch.int32, torch.float32, torch.float32, 3),
        (5, 4, 4, 4, 0, torch.int64, torch.float16, torch.float16, None),
        (16384, 8, 128, 8, 4, torch.int64, torch.bfloat16, torch.float32, None),   # 32 replicas
    ]
    for t, k, e, n, spare, id_dtype, x_dtype, w_dtype, cap in cases[:2] if quick else cases:
        ids = torch.randint(0, e, (t, k), generator=gen).to(id_dtype)
        placement = contiguous_placement(e, n, spare)
        if spare:
            # `spare` copies per rank of the next rank's first experts (R = N * spare when N > 1)
            slots = [s + placement.slots[(r + 1) % n][:spare] if n > 1 else s
                     for r, s in enumerate(placement.slots)]
            placement = Placement(e, tuple(slots), placement.slots_per_rank)
        hidden = 2048 if t > 64 else 64
        x = torch.zeros(t, hidden, dtype=x_dtype)
        w = torch.zeros(t, k, dtype=w_dtype)
        dest = torch.zeros(t, k, dtype=torch.int64)
        hit = torch.zeros(t, n, dtype=torch.bool)
        counts = torch.zeros(n, dtype=torch.int64)
        fused.route(ids, placement, 0, None, cap)
        plan = RoutePlan(dest, dest.clone(), hit, counts, torch.zeros(t, n, dtype=torch.int32),
                         torch.zeros(2, n, dtype=torch.int64), cap)
        if cap is None:
            fused.pack(x, w, plan, t)
        else:
            fused.pack_fixed(x, w, plan, cap)
        fused.reduce(torch.zeros(t * min(k, n) + 1, hidden, dtype=x_dtype),
                     torch.zeros(t, min(k, n), dtype=torch.int64), x_dtype)
    layouts = [  # (R, K, E, C, ids dtype): the low-latency mode's received ids, the masked backend's
        (256, 8, 32, 64, torch.int64), (1, 8, 128, 1, torch.int32), (0, 2, 4, 3, torch.int64),
        (4096, 8, 256, 128, torch.int32), (16, 1, 4096, 16, torch.int64),
    ]
    for r, k, e, cap, id_dtype in layouts[:2] if quick else layouts:
        masked.masked_layout_triton(torch.zeros(r, k, dtype=id_dtype), e, cap)
    return calls


def _ptxas_usage(ptx: str) -> str:
    """Registers and spill bytes per thread, from `ptxas -v` on the PTX (Triton's bundled ptxas)."""
    bin_dir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    log = ""
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(ptx)
        for name in ("ptxas-blackwell", "ptxas"):       # the one that reads this PTX version
            if (bin_dir / name).exists():
                out = subprocess.run([str(bin_dir / name), "-v", "--gpu-name", "sm_90a", str(src), "-o",
                                      str(Path(tmp) / "k.o")], capture_output=True, text=True)
                log = out.stdout + out.stderr
                if out.returncode == 0:
                    break
    regs = re.search(r"Used (\d+) registers", log)
    spills = re.search(r"(\d+) bytes spill stores", log)
    return f"{regs.group(1) if regs else '?'} registers, {spills.group(1) if spills else '?'} B spilled"


def main() -> int:
    failed = 0
    calls = record_launches(quick="--quick" in sys.argv[1:])
    seen = set()
    for fn, args, kwargs in calls:
        sig, constexprs, options = _signature(fn, args, dict(kwargs))
        key = (fn.__name__, tuple(sorted(sig.items())), tuple(sorted(constexprs.items())))
        if key in seen:
            continue
        seen.add(key)
        label = f"{fn.__name__} " + " ".join(f"{k}={v}" for k, v in constexprs.items())
        by_index = {(fn.arg_names.index(k),): v for k, v in constexprs.items()}   # the form every 3.x takes
        try:
            compiled = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=by_index), target=TARGET,
                                      options=options)
            usage = _ptxas_usage(compiled.asm["ptx"])
            print(f"ok    {label}  ({usage}, num_warps={options.get('num_warps')})")
        except Exception:
            failed += 1
            print(f"FAIL  {label}\n{traceback.format_exc()}")
    print(f"{len(seen)} launches compiled for sm_90, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
