"""Host time of the eager triton expert path and of MoELayer.forward at small T, kernels stubbed.

Every Triton launch of moekit's kernels is replaced by a no-op (the kernel's `run`, which
`kernel[grid](...)` calls, is shadowed by an instance attribute), so what is timed is the Python and
torch work around the launches: argument checks, config lookup, workspace allocation, argument
lists. Each phase is timed alone on the same arguments the layer call passes it (loops of
`time.perf_counter_ns`, the median of several repeats, one intra-op thread):

    router       route(): checks, F.linear (on the CPU this one computes), topk_softmax's launcher
    checks       moe_experts() up to the backend's entry (the entry replaced by a no-op)
    prepare      the triton backend's _prepare (config, TMA decision, contiguous ids and weights)
    align        align_pairs (workspaces + the align launch)
    gemm1        gemm1_swiglu (workspace h + launch)
    gemm2        gemm2_weighted (workspace y + launch)
    sum          moe_sum (launch; the output buffer is allocated by experts_triton)
    experts      moe_experts(..., backend="triton") as a whole
    layer        MoELayer.forward as a whole (router + experts)

Also per call: the torch ops issued (each a CUDA launch or an allocation on a GPU) and the Triton
launches. `--binder` estimates Triton's own per-launch host cost: the JIT's binder for the CUDA
backend (bound arguments, specialisation, cache key), run on the kernels' real argument lists (no
GPU needed: the binder is built for an sm_90 target as scripts/aot_compile_check.py builds it).

On a GPU (CUDA available, TRITON_INTERPRET unset) it also times real eager calls at T=1, 4 and 16:
N calls back to back, then torch.cuda.synchronize, per call; with the layer's eager graphs (the
default: a replay of the layer recorded for T, `moekit.eager_graphs`) and without (every launch).

    PYTHONPATH=src python scripts/host_overhead.py                   # this tree
    PYTHONPATH=src python scripts/host_overhead.py --baseline main   # and a git ref, side by side
    PYTHONPATH=src python scripts/host_overhead.py --profile         # + cProfile of layer.forward
    PYTHONPATH=src python scripts/host_overhead.py --smoke           # seconds: a tiny shape, few loops

The CPU calls pass validate=False, the CUDA default (on the CPU moe_experts would read the ids back).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import dataclasses
import importlib
import io
import json
import os
import pstats
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
# decode: the direct path (the default at small T); the backward's Triton and Gluon kernels for
# scripts/step_host.py's stubbed training step
KERNEL_MODULES = ("moekit.kernels.align", "moekit.kernels.grouped_gemm", "moekit.kernels.router",
                  "moekit.kernels.decode", "moekit.kernels.grouped_gemm_backward",
                  "moekit.kernels.gluon_wgrad", "moekit.kernels.gluon_swiglu_bwd")
PHASES = ("router", "checks", "prepare", "align", "gemm1", "gemm2", "sum", "experts", "layer")


def kernels() -> list:
    """moekit's @triton.jit and Gluon kernels (forward and backward), each once (a helper such as
    `moekit.kernels.pdl.pdl_enter` is imported by several modules)."""
    found = {}
    for name in KERNEL_MODULES:
        module = importlib.import_module(name)
        found.update({id(v): v for v in vars(module).values() if hasattr(v, "fn") and hasattr(v, "run")})
    return list(found.values())


@contextlib.contextmanager
def stubbed_launches(sink: list | None = None):
    """kernel[grid](...) runs nothing inside (appends (kernel, args, kwargs) to sink when given)."""
    # `moekit.bench.launches.patched_runs` does the same, but this script also runs against older
    # checkouts of moekit (--baseline), which lack it
    ks = kernels()
    saved = [k.__dict__.get("run") for k in ks]      # an enclosing stub's, restored on exit
    for k in ks:
        def run(*args, grid, warmup, _k=k, **kwargs):
            if sink is not None and not warmup:
                sink.append((_k, args, kwargs))
        k.run = run
    try:
        yield
    finally:
        for k, before in zip(ks, saved):
            if before is None:
                del k.run
            else:
                k.run = before


@contextlib.contextmanager
def dispatch_only():
    """A backend "dispatch-only": the triton backend's capabilities, an entry that returns at once."""
    from moekit.experts import registry

    triton = registry.get_backend("triton")
    registry.register_backend(dataclasses.replace(triton, name="dispatch-only",
                                                  run=lambda x, *rest: x))
    try:
        yield
    finally:
        del registry._REGISTRY["dispatch-only"]


class OpCounter(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the aten ops issued (allocations included: on a GPU each is host work too)."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func.overloadpacket.__name__))
        return func(*args, **(kwargs or {}))


CLOCKS = {"wall": time.perf_counter_ns, "cpu": time.thread_time_ns}


def time_call(fn, loops: int, repeats: int, clock: str = "wall") -> float:
    """The least over `repeats` of the mean ns per call over `loops` calls (the least: other work on
    the machine only ever adds). clock "cpu" counts this thread's CPU time, not time it waited."""
    now = CLOCKS[clock]
    for _ in range(max(3, loops // 10)):
        fn()
    samples = []
    for _ in range(repeats):
        t0 = now()
        for _ in range(loops):
            fn()
        samples.append((now() - t0) / loops)
    return min(samples)


def build(shape_name: str, tokens: int, dtype: torch.dtype, device: str):
    import moekit
    from moekit.layer import MoELayer

    # Weights are never read (kernels stubbed): skip the layer's random init.
    layer = torch.nn.utils.skip_init(MoELayer, shape_name, backend="triton", router_backend="triton",
                                     dtype=dtype, device=device)
    # The stubbed phases time the launches themselves: a graph recorded with stubbed kernels would
    # hold none. `time_eager` switches the layer's eager graphs on and off itself.
    layer.eager_graphs = False
    x = torch.randn(tokens, layer.shape.hidden_size, dtype=dtype, device=device)
    del moekit
    return layer, x


def measure(args) -> dict:
    """{phase: ns per call, "ops": {phase: [op names]}, "launches": {phase: n}} for this tree."""
    import moekit
    from moekit.experts import moe_experts
    from moekit.experts import triton as tb
    from moekit.grouped_gemm import gemm1_swiglu, gemm2_weighted, moe_sum
    from moekit.routing import route

    torch.set_num_threads(1)
    device = "cuda" if torch.cuda.is_available() and not os.environ.get("TRITON_INTERPRET") else "cpu"
    dtype = getattr(torch, args.dtype)
    layer, x = build(args.shape, args.tokens, dtype, device)
    s = layer.shape
    gu, down = layer.gate_up_proj, layer.down_proj
    opts = {"validate": False}
    with torch.no_grad(), stubbed_launches():
        weights, ids = route(x, layer.router_weight, s.top_k, renormalize=s.norm_topk_prob, backend="triton")
        ids.copy_(torch.arange(ids.numel()).view(ids.shape) % s.num_experts)   # (unread, but valid)
        weights.fill_(1.0 / s.top_k)
        config, w_c, ids_c = tb._prepare(x, gu, down, weights, ids, None)
        align = tb.align_pairs(ids_c, s.num_experts, config)
        h = gemm1_swiglu(x, gu, align, s.top_k, config)
        y = gemm2_weighted(h, down, w_c, align, config)
        out = torch.empty_like(x)
        calls = {
            "router": lambda: route(x, layer.router_weight, s.top_k, renormalize=s.norm_topk_prob,
                                    backend="triton"),
            "checks": lambda: moe_experts(x, gu, down, weights, ids, backend="dispatch-only", **opts),
            "prepare": lambda: tb._prepare(x, gu, down, weights, ids, None),
            "align": lambda: tb.align_pairs(ids_c, s.num_experts, config),
            "gemm1": lambda: gemm1_swiglu(x, gu, align, s.top_k, config),
            "gemm2": lambda: gemm2_weighted(h, down, w_c, align, config),
            "sum": lambda: moe_sum(y, ids_c, s.num_experts, out),
            "experts": lambda: moe_experts(x, gu, down, weights, ids, backend="triton", **opts),
            "layer": lambda: layer(x, **opts),
            "linear": lambda: torch.nn.functional.linear(x, layer.router_weight),
        }
        with dispatch_only():
            result = {name: time_call(fn, args.loops, args.repeats, args.clock) for name, fn in calls.items()}
        ops, launches = {}, {}
        for name in ("router", "prepare", "align", "gemm1", "gemm2", "sum", "experts", "layer"):
            sink: list = []
            with stubbed_launches(sink), OpCounter() as counter:
                calls[name]()
            ops[name], launches[name] = counter.ops, len(sink)
        if args.profile:
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(args.loops):
                layer(x, **opts)
            prof.disable()
            text = io.StringIO()
            pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(args.profile_lines)
            result["profile"] = text.getvalue()
    result["ops"], result["launches"] = ops, launches
    result["binder"] = None
    result["device"] = device
    result["moekit"] = str(Path(moekit.__file__).parent)
    if device == "cuda":
        result["eager"] = time_eager(layer, args)
    return result


def time_eager(layer, args) -> dict:
    """Real eager layer calls on the GPU: ms per call, `loops` calls then one synchronize; with the
    layer's eager graphs ("T=n") and with every kernel launched ("T=n, no graphs")."""
    out = {}
    with torch.no_grad():
        layer.reset_parameters(torch.Generator().manual_seed(0))    # real routing: finite weights
    for tokens in (1, 4, 16):
        x = torch.randn(tokens, layer.shape.hidden_size, dtype=layer.gate_up_proj.dtype, device="cuda")
        for graphs in (True, False):
            layer.eager_graphs = graphs
            with torch.no_grad():

                def call(x=x):
                    layer(x)

                for _ in range(20):
                    call()
                torch.cuda.synchronize()
                samples = []
                for _ in range(args.repeats):
                    t0 = time.perf_counter_ns()
                    for _ in range(args.loops):
                        call()
                    torch.cuda.synchronize()
                    samples.append((time.perf_counter_ns() - t0) / args.loops / 1e6)
            out[f"T={tokens}" + ("" if graphs else ", no graphs")] = statistics.median(samples)
    layer.eager_graphs = True
    return out


def measure_binder(args) -> dict:
    """Triton's per-launch binding on the CUDA backend (sm_90 target), per kernel: us per call of
    binder + cache key, on the argument lists the layer's launches pass. Imports moekit with
    TRITON_INTERPRET=0 (so the kernels are JITFunctions); run in its own process."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime import jit

    import moekit.layer  # noqa: F401  (its kernels compile-mode JITFunctions, before the switch below)

    os.environ["TRITON_INTERPRET"] = "1"     # moekit's launchers then accept CPU tensors
    torch.set_num_threads(1)
    layer, x = build(args.shape, args.tokens, getattr(torch, args.dtype), "cpu")
    sink: list = []
    with torch.no_grad(), stubbed_launches(sink):
        weights, ids = layer.route(x)
        ids.copy_(torch.arange(ids.numel()).view(ids.shape) % layer.shape.num_experts)
        sink.clear()
        layer(x, validate=False)
    backend = make_backend(GPUTarget("cuda", 90, 32))
    knobs = getattr(triton, "knobs", None)
    per_kernel = {}
    for kernel, kargs, kwargs in sink:
        binder = jit.create_function_from_signature(kernel.signature, kernel.params, backend)
        key_cache: dict = {}

        def bind(kernel=kernel, binder=binder, kargs=kargs, kwargs=kwargs, key_cache=key_cache):
            kw = dict(kwargs)
            kw["debug"] = kw.get("debug", kernel.debug) or (knobs.runtime.debug if knobs else False)
            if knobs is not None and hasattr(knobs.compilation, "instrumentation_mode"):
                kw["instrumentation_mode"] = knobs.compilation.instrumentation_mode
            bound, specialization, options = binder(*kargs, **kw)
            if hasattr(jit, "compute_cache_key"):
                jit.compute_cache_key(key_cache, specialization, options)
            else:                                 # older Tritons key on the strings themselves
                str(specialization) + str(options)
            return bound

        name = kernel.fn.__name__
        try:
            per_kernel[name] = time_call(bind, args.loops, args.repeats) / 1e3
        except Exception as exc:   # a Triton whose binder differs: say so, measure the rest
            per_kernel[name] = f"n/a ({type(exc).__name__}: {exc})"
    return {"triton": triton.__version__, "us_per_launch": per_kernel}


def binder_or_why(args) -> dict:
    try:
        return measure_binder(args)
    except Exception as exc:     # e.g. a Triton without its CUDA backend
        import triton

        return {"triton": triton.__version__, "us_per_launch": {}, "error": f"{type(exc).__name__}: {exc}"}


def run_child(src: Path, argv: list[str], binder: bool = False) -> dict:
    env = dict(os.environ, PYTHONPATH=str(src))
    if binder:
        env["TRITON_INTERPRET"] = "0"
    cmd = [sys.executable, str(Path(__file__).resolve()), *argv, "--child", "binder" if binder else "measure"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.splitlines()[-1])


def least(before: dict | None, new: dict) -> dict:
    """new, with each phase's time the least of before's and new's."""
    if before is not None:
        for phase in (*PHASES, "linear"):
            new[phase] = min(before[phase], new[phase])
    return new


def export_ref(ref: str, into: Path) -> Path:
    """src/ of a git ref, extracted under `into`."""
    archive = subprocess.run(["git", "-C", str(REPO), "archive", ref, "src"], capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
    return into / "src"


def table(columns: dict[str, dict]) -> str:
    names = list(columns)
    lines = [f"{'phase (kernels stubbed)':<26}" + "".join(f"{n:>14}" for n in names)
             + ("   change" if len(names) == 2 else "")]
    for phase in PHASES:
        vals = [columns[n][phase] / 1e3 for n in names]
        row = f"{phase + ' (us)':<26}" + "".join(f"{v:>14.1f}" for v in vals)
        if len(vals) == 2:
            row += f"   {vals[1] - vals[0]:+8.1f}"
        lines.append(row)
    for label, phase in (("  of router: F.linear", "router"), ("layer less F.linear", "layer")):
        vals = [columns[n]["linear"] if phase == "router" else columns[n]["layer"] - columns[n]["linear"]
                for n in names]
        lines.append(f"{label + ' (us)':<26}" + "".join(f"{v / 1e3:>14.1f}" for v in vals))
    for phase in ("router", "experts", "layer"):
        lines.append(f"{phase + ' torch ops/call':<26}" + "".join(f"{len(columns[n]['ops'][phase]):>14d}"
                                                                  for n in names))
    for phase in ("router", "experts", "layer"):
        lines.append(f"{phase + ' Triton launches':<26}" + "".join(f"{columns[n]['launches'][phase]:>14d}"
                                                                   for n in names))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="qwen3-30b-a3b")
    p.add_argument("--tokens", type=int, default=1)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--loops", type=int, default=300)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--clock", choices=tuple(CLOCKS), default="wall",
                   help="wall: time.perf_counter_ns; cpu: this thread's CPU time (a busy shared machine)")
    p.add_argument("--baseline", metavar="REF", help="also measure this git ref's src/ (e.g. main)")
    p.add_argument("--rounds", type=int, default=3, help="with --baseline: alternate the trees so often")
    p.add_argument("--binder", action="store_true", help="estimate Triton's per-launch binding cost")
    p.add_argument("--profile", action="store_true", help="cProfile of layer.forward")
    p.add_argument("--profile-lines", type=int, default=25)
    p.add_argument("--ops", action="store_true", help="list the torch ops of one layer call")
    p.add_argument("--smoke", action="store_true", help="a tiny shape and few loops (tests)")
    p.add_argument("--json", action="store_true", help="print the results as one JSON line")
    p.add_argument("--child", choices=("measure", "binder"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.smoke:
        args.shape, args.loops, args.repeats = "tiny", 5, 2
    forwarded = [a for a in (argv if argv is not None else sys.argv[1:])
                 if a not in ("--json", "--profile", "--ops", "--binder")]
    forwarded = [a for i, a in enumerate(forwarded) if a != "--baseline"
                 and (i == 0 or forwarded[i - 1] != "--baseline")]
    if args.child == "measure":
        print(json.dumps(measure(args)))
        return 0
    if args.child == "binder":
        print(json.dumps(binder_or_why(args)))
        return 0
    columns: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        if args.baseline:    # both trees in child processes, alternately: a busy machine slows both
            trees = {args.baseline: export_ref(args.baseline, Path(tmp)), "this tree": REPO / "src"}
            for _ in range(args.rounds):
                for name, src in trees.items():
                    columns[name] = least(columns.get(name), run_child(src, forwarded))
            here = columns["this tree"]
        else:
            here = columns["this tree"] = measure(args)
        if args.binder:
            here["binder"] = run_child(Path(here["moekit"]).parent, forwarded, binder=True)
    if args.json:
        print(json.dumps({name: {k: v for k, v in col.items() if k != "profile"}
                          for name, col in columns.items()}))
        return 0
    print(f"{args.shape}, T={args.tokens}, {args.dtype}, device={here['device']}, torch {torch.__version__}, "
          f"one intra-op thread; {args.clock} clock, least of {args.repeats} x {args.loops} calls")
    print(table(columns))
    if here["binder"]:
        b = here["binder"]
        print(f"\nTriton {b['triton']} JIT binding per launch (binder + cache key, CUDA sm_90 backend, us):")
        if b.get("error"):
            print(f"  not measured: {b['error']}")
        for name, us in b["us_per_launch"].items():
            print(f"  {name:<28} {us if isinstance(us, str) else f'{us:.1f}'}")
    if args.ops:
        print("\ntorch ops of one layer call:", ", ".join(here["ops"]["layer"]))
    if "eager" in here:
        print("\nreal eager layer calls (ms/call):", json.dumps(here["eager"]))
    if args.profile:
        print(here["profile"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
