"""Count the host-side work of expert-parallel plan / pack / reduce, torch twins vs fused kernels.

Each torch op a step issues costs host launch overhead (and, on a GPU, usually one kernel); the
fused path replaces them with one Triton launch per step. This script runs the steps of one rank
on CPU under torch.profiler and counts, per step:

    torch ops       top-level aten ops issued from Python (allocations and views included)
    device ops      those that would run device work on a GPU (not an allocation or a view:
                    empty*, view, slice, select, as_strided, transpose, expand, ... ; reshape, to
                    and contiguous count only when they copy)
    triton          Triton launches (the fused path; interpreted here: their inner NumPy work is
                    not counted, it is one kernel on a GPU)

    PYTHONPATH=src python scripts/ep_ops.py [--tokens 64] [--experts 128] [--top-k 8] [--ranks 2]

No timings: the counts are what a CPU run can say. The shape defaults to Qwen3-30B-A3B's routing
(E = 128, K = 8) on 2 ranks with a small hidden size (the counts do not depend on it). Run against
a tree without `moekit.parallel.fused` (e.g. an older commit), it counts the torch path alone.
"""

from __future__ import annotations

import argparse
import contextlib
import os
from functools import partial

os.environ.setdefault("TRITON_INTERPRET", "1")   # CPU: the kernels run interpreted
os.environ.setdefault("KINETO_LOG_LEVEL", "5")     # the profiler's start / stop lines

import importlib  # noqa: E402

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile, record_function  # noqa: E402

import moekit  # noqa: E402
import moekit.kernels  # noqa: E402,F401
from moekit.bench.scenarios import make_scenario  # noqa: E402
from moekit.placement import contiguous_placement, replicate_hot_experts  # noqa: E402

# (moekit.parallel exports a function named `dispatch`: import the modules by name)
dispatch_mod = importlib.import_module("moekit.parallel.dispatch")
ll_mod = importlib.import_module("moekit.parallel.low_latency")
try:
    fused = importlib.import_module("moekit.parallel.fused")
except ImportError:   # a tree from before the fused path
    fused = None

NO_DEVICE_WORK = {
    "aten::empty", "aten::empty_like", "aten::empty_strided", "aten::view", "aten::_unsafe_view",
    "aten::slice", "aten::select", "aten::as_strided", "aten::t", "aten::transpose", "aten::expand",
    "aten::unsqueeze", "aten::squeeze", "aten::permute", "aten::alias", "aten::detach", "aten::lift_fresh",
    "aten::split", "aten::split_with_sizes", "aten::narrow", "aten::resolve_conj", "aten::resolve_neg",
    "aten::unbind", "aten::_reshape_alias", "aten::numpy_T", "aten::result_type", "aten::is_nonzero",
}
COPY_IF_CHILD = {"aten::reshape", "aten::to", "aten::contiguous", "aten::flatten", "aten::type_as"}


@contextlib.contextmanager
def _count_launches(counts: dict):
    """Every Triton launch (interpreted here) counted and wrapped in a record_function scope, so the
    NumPy / torch work inside the interpreter does not show up as top-level ops."""
    from triton.runtime.interpreter import InterpretedFunction

    real = InterpretedFunction.run

    def run(self, *args, **kwargs):
        counts["triton"] = counts.get("triton", 0) + 1
        with record_function(f"triton::{getattr(self.fn, '__name__', 'kernel')}"):
            return real(self, *args, **kwargs)

    InterpretedFunction.run = run
    try:
        yield
    finally:
        InterpretedFunction.run = real


def _subtree(evt) -> list:
    out, stack = [], list(evt.cpu_children)
    while stack:
        e = stack.pop()
        out.append(e)
        stack.extend(e.cpu_children)
    return out


VERBOSE = False


def count(fn) -> dict:
    """Run fn under the profiler: {"torch ops", "device ops", "triton"} of its top-level calls."""
    counts: dict = {}
    with _count_launches(counts), profile(activities=[ProfilerActivity.CPU]) as prof, record_function("step"):
        fn()
    step = next(e for e in prof.events() if e.name == "step")
    ops = [e for e in step.cpu_children if e.name.startswith("aten::")]
    collectives = sum(1 for e in step.cpu_children if e.name.startswith("c10d::"))
    if VERBOSE:
        print("   ", " ".join(e.name.removeprefix("aten::") for e in step.cpu_children))
    device = 0
    for e in ops:
        if e.name in COPY_IF_CHILD:
            device += any(c.name in ("aten::copy_", "aten::clone", "aten::_to_copy") for c in _subtree(e))
        elif e.name not in NO_DEVICE_WORK:
            device += 1
    return {"torch ops": len(ops), "device ops": device, "triton": counts.get("triton", 0),
            "collectives": collectives}


def _paths() -> list[str]:
    return ["torch", "fused"] if fused is not None else ["torch"]


def _use(path: str):
    if fused is None:
        return contextlib.nullcontext()
    return fused.use_path("triton" if path == "fused" else "torch")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--verbose", action="store_true", help="list each step's top-level ops")
    args = ap.parse_args()
    global VERBOSE
    VERBOSE = args.verbose
    t, e, k, n = args.tokens, args.experts, args.top_k, args.ranks
    w, ids = make_scenario("zipf-1.0", t, e, k, seed=0)
    x = torch.randn(t, args.hidden)
    base = contiguous_placement(e, n, spare_slots=2)
    placements = {"contiguous": contiguous_placement(e, n),
                  "replicated": replicate_hot_experts(torch.bincount(ids.reshape(-1), minlength=e), base)}
    cap = max(1, t)
    takes_capacity = fused is not None
    rows = []
    for label, placement in placements.items():
        tables = placement.copy_table("cpu")
        for path in _paths():
            with _use(path):
                plan_kw = {"capacity": cap} if takes_capacity else {}
                dispatch_mod.plan_routes(ids, placement, 0, tables)            # warm-up (tables, JIT)
                plan = dispatch_mod.plan_routes(ids, placement, 0, tables)
                num_rows = int(plan.send_counts.sum())
                ll_plan = dispatch_mod.plan_routes(ids, placement, 0, tables, **plan_kw)
                send = dispatch_mod.pack(x, w, plan, num_rows)
                back = torch.zeros(num_rows + 1, args.hidden)
                route = partial(dispatch_mod.plan_routes, ids, placement, 0, tables)
                steps = {
                    "normal plan": route,
                    "normal pack": partial(dispatch_mod.pack, x, w, plan, num_rows),
                    "low-latency plan": partial(route, **plan_kw),
                    "low-latency pack": partial(ll_mod.pack_fixed, x, w, ll_plan, cap),
                    "combine reduce": partial(dispatch_mod.reduce_partials, back, send[2], x.dtype),
                }
                for name, fn in steps.items():
                    if VERBOSE:
                        print(f"{label} {path} {name}:")
                    rows.append((label, path, name, count(fn)))
    print(f"T={t} E={e} K={k} N={n} (one rank's steps, CPU profile; capacity {cap} for the low-latency pack)")
    print(f"{'placement':<11} {'path':<6} {'step':<17} {'torch ops':>9} {'device ops':>10} {'triton':>6}")
    for label, path, name, c in rows:
        print(f"{label:<11} {path:<6} {name:<17} {c['torch ops']:>9} {c['device ops']:>10} {c['triton']:>6}")
    print("\nplan + pack per layer call (device ops + triton launches):")
    for label in placements:
        for path in _paths():
            for mode in ("normal", "low-latency"):
                total = sum(c["device ops"] + c["triton"] for lb, p, name, c in rows
                            if lb == label and p == path and name.startswith(mode))
                print(f"  {label:<11} {path:<6} {mode:<12} {total:>4}")
    whole_layer()
    return 0


def whole_layer() -> None:
    """One whole layer call in a gloo world of 1 (this process): dispatch, experts, combine, both
    modes; a small shape (the counts of routing and packing do not depend on it; the interpreted
    experts would be slow at a real one)."""
    import torch.distributed as dist

    from moekit.parallel import ep_moe_experts
    from moekit.tuning import default_config

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    e, k, t, h, i = 16, 4, 8, 32, 32
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(t, h, generator=gen)
    gate_up, down = torch.randn(e, 2 * i, h, generator=gen), torch.randn(e, h, i, generator=gen)
    w, ids = make_scenario("zipf-1.0", t, e, k, seed=0)
    placement = contiguous_placement(e, 1)
    tables = placement.copy_table("cpu")
    cfg = default_config(moekit.MoEShape(1, h, i, 1), t, 4)
    calls = {
        "normal": partial(ep_moe_experts, x, gate_up, down, w, ids, placement=placement, tables=tables,
                          backend="grouped_mm"),
        "low-latency": partial(ep_moe_experts, x, gate_up, down, w, ids, placement=placement, tables=tables,
                               mode="low_latency", capacity=t, config=cfg),
    }
    print(f"\nwhole layer call, gloo world of 1 (E={e} K={k} T={t}; experts included: grouped_mm in the "
          "normal mode, the masked kernels in the low-latency one):")
    print(f"{'mode':<12} {'path':<6} {'torch ops':>9} {'device ops':>10} {'triton':>6} {'collectives':>11}")
    for mode, fn in calls.items():
        for path in _paths():
            with _use(path), torch.no_grad():
                fn()
                c = count(fn)
            print(f"{mode:<12} {path:<6} {c['torch ops']:>9} {c['device ops']:>10} {c['triton']:>6} "
                  f"{c['collectives']:>11}")


if __name__ == "__main__":
    raise SystemExit(main())
