"""End to end in Transformers: prefill, eager decode and static-cache compiled decode, per experts
implementation, as a user of `generate` sees them.

    python scripts/generate_bench.py OUT_DIR [--layers 8] [--prompt 4096] [--new-tokens 32] [--reps 5]
        [--impls grouped_mm batched_mm moekit] [--modes prefill eager compiled]

The model is a Qwen3-MoE built from Qwen3-30B-A3B's config (hidden 2,048, 128 experts of
intermediate 768, top-8, 32 heads, 4 KV heads, vocabulary 151,936) with `--layers` decoder layers and
random weights (experts and router drawn with std 1/sqrt(fan_in), so the router has contrast), in
bfloat16 on one GPU. Nothing is downloaded. One model; `set_experts_implementation` switches it
between implementations, so every implementation runs the same weights and the same prompts.

    prefill   one forward of a `--prompt`-token prompt with a fresh cache, logits of the last position
              only (what `generate` computes): median ms
    eager     greedy `generate` with the default (dynamic) cache after a 32-token prompt: ms per new
              token = (time of N new tokens - time of 1) / (N - 1), so the prompt's prefill is not in it
    compiled  the same with `cache_implementation="static"`, which makes `generate` compile the
              decoding forward (Transformers' auto-compile on CUDA; compiled once per implementation
              before timing, since switching implementations changes the graph)

`--no-graphs` adds "moekit-no-graphs": moekit's experts with every kernel launched at each call
(`register(eager_graphs=False)`), beside moekit's default, which replays a CUDA graph of the experts
per token count for eager calls of at most 16 tokens that need no gradient (`moekit.eager_graphs`).

`--blocks` adds "moekit-blocks": moekit with the sparse MoE blocks patched
(`patch_moe_blocks`), so that a decoding call replays one graph of the post-attention norm and the
whole block (router and experts) instead of the norm's launches, Transformers' router and the
experts function; and "moekit-blocks-unfolded", the same without the norm in the graph
(`patch_moe_blocks(fold_norm=False)`).

`--bound` adds two implementations that compute nothing, so their rows are what the rest of the
model costs: "free-experts", an experts function that returns zeros (one torch op, no expert math):
no experts implementation can be faster; and "free-block", every sparse MoE block returning zeros
(no router either): no implementation of the block can be faster. They bound the speed-up that
replacing the experts, or the block, can give end to end.

Each timing is the median of `--reps` repetitions; the implementations run in turn inside each
repetition (interleaved, so a drift of the machine affects all of them alike). The speed-ups over
grouped_mm are given as the ratio of the medians and, in brackets, the median of the repetitions'
own ratios (each repetition's pair measured within seconds of each other: the steadier figure when
the host's speed drifts, as it does in eager decoding). Every implementation's
greedy tokens are compared with grouped_mm's (`tokens_match`): in bfloat16 a rounding difference can
flip a near-tie, so a mismatch is reported, not fatal. batched_mm is skipped for a prefill whose
per-pair weight copy would not fit in half the free memory.

Writes generate_bench.csv (long format, with provenance) and generate_bench.md (ms and the speed-up
of moekit over each other implementation) to OUT_DIR. `--smoke` runs a tiny model in float32 on the
CPU (prefill and eager only): it checks the script, its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import csv
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_transformers import batched_mm_fits, provenance  # noqa: E402

from moekit.integrations.transformers import patch_moe_blocks, register  # noqa: E402

IMPLS = ("grouped_mm", "batched_mm", "moekit")
BOUND = "free-experts"   # --bound: an experts function that computes nothing (one torch op)
FREE_BLOCK = "free-block"        # --bound: sparse MoE blocks that compute nothing (one torch op)
NO_GRAPHS = "moekit-no-graphs"   # --no-graphs: moekit with every kernel launched eagerly
BLOCKS = "moekit-blocks"         # --blocks: moekit with whole-block graphs (patch_moe_blocks)
UNFOLDED = "moekit-blocks-unfolded"   # --blocks: the same, the post-attention norm launched by itself
BASE = "grouped_mm"              # the speed-ups are over it
MODES = ("prefill", "eager", "compiled")
DECODE_PROMPT = 32


def config(layers: int, smoke: bool):
    from transformers import Qwen3MoeConfig

    common = dict(num_hidden_layers=layers, norm_topk_prob=True, pad_token_id=0, bos_token_id=1,
                  eos_token_id=2, max_position_embeddings=8192)
    if smoke:
        return Qwen3MoeConfig(vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=48,
                              num_experts=8, num_experts_per_tok=2, num_attention_heads=4,
                              num_key_value_heads=2, head_dim=16, **common)
    return Qwen3MoeConfig(vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                          moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
                          num_attention_heads=32, num_key_value_heads=4, head_dim=128, **common)


def build(layers: int, device: torch.device, dtype: torch.dtype, smoke: bool):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config(layers, smoke), dtype=dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("experts.gate_up_proj", "experts.down_proj", "mlp.gate.weight")):
                p.normal_(0.0, p.shape[-1] ** -0.5)
    return model.eval()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def wall_ms(fn, device: torch.device):
    """(ms, result) of one call, the device synchronised before and after."""
    sync(device)
    start = time.perf_counter()
    result = fn()
    sync(device)
    return (time.perf_counter() - start) * 1e3, result


def generate(model, prompt: torch.Tensor, new_tokens: int, static: bool) -> torch.Tensor:
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    if static:
        kwargs["cache_implementation"] = "static"
    else:
        kwargs["disable_compile"] = True
    return model.generate(prompt, **kwargs)[:, prompt.shape[1]:]


def run(model, device: torch.device, impls: list[str], modes: list[str], prompt_len: int, new_tokens: int,
        reps: int) -> list[dict]:
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(3, vocab, (1, prompt_len), generator=gen).to(device)
    short = torch.randint(3, vocab, (1, DECODE_PROMPT), generator=gen).to(device)
    rows: list[dict] = []
    times: dict[tuple[str, str], list[float]] = {}
    tokens: dict[tuple[str, str], torch.Tensor] = {}
    skipped: dict[tuple[str, str], str] = {}
    for impl in impls:
        if impl == "batched_mm" and "prefill" in modes:
            fits, why = batched_mm_fits(model.model.layers[0].mlp, prompt_len)
            if not fits:
                skipped[(impl, "prefill")] = why

    def prefill() -> float:
        with torch.no_grad():
            ms, _ = wall_ms(lambda: model(prompt, use_cache=True, logits_to_keep=1), device)
        return ms

    def decode(impl: str, mode: str) -> float:
        static = mode == "compiled"
        ms_n, out = wall_ms(lambda: generate(model, short, new_tokens, static), device)
        ms_1, _ = wall_ms(lambda: generate(model, short, 1, static), device)
        tokens[(impl, mode)] = out.cpu()
        return (ms_n - ms_1) / (new_tokens - 1)

    def measure(impl: str, mode: str) -> float:
        if BLOCKS in impls:       # the blocks' fast path only for those implementations
            patch_moe_blocks(model, enabled=impl in (BLOCKS, UNFOLDED), fold_norm=impl != UNFOLDED)
        for layer in model.model.layers:     # free-block: each sparse block's forward is zeros_like
            if impl == FREE_BLOCK:
                layer.mlp.forward = torch.zeros_like
            else:
                layer.mlp.__dict__.pop("forward", None)
        experts = {BLOCKS: "moekit", UNFOLDED: "moekit", FREE_BLOCK: BASE}.get(impl, impl)
        model.set_experts_implementation(experts)
        return prefill() if mode == "prefill" else decode(impl, mode)

    cases = [(impl, mode) for mode in modes for impl in impls if (impl, mode) not in skipped]
    for impl, mode in cases:          # warm-up: JIT, autotune caches, and the compile of each graph
        print(f"warm-up {impl} {mode} ...", flush=True)
        measure(impl, mode)
        measure(impl, mode)
    for rep in range(reps):
        for impl, mode in cases:
            times.setdefault((impl, mode), []).append(measure(impl, mode))
        print(f"rep {rep + 1}/{reps} done", flush=True)
    for (impl, mode), why in skipped.items():
        rows.append(dict(impl=impl, mode=mode, status="skip", note=why))
    for (impl, mode), ts in times.items():
        ref = tokens.get((BASE, mode))
        mine = tokens.get((impl, mode))
        free = impl in (BOUND, FREE_BLOCK)
        match = "" if ref is None or mine is None or free else str(bool(torch.equal(ref, mine)))
        base = times.get((BASE, mode))
        pairs = [b / t for b, t in zip(base or [], ts) if t]
        per_rep = f"{statistics.median(pairs):.4f}" if pairs else ""
        rows.append(dict(impl=impl, mode=mode, status="ok", ms=f"{statistics.median(ts):.4f}",
                         ms_min=f"{min(ts):.4f}", ms_max=f"{max(ts):.4f}", reps=len(ts),
                         unit="ms per call" if mode == "prefill" else "ms per new token",
                         tokens_match=match, speedup_per_rep=per_rep, times=" ".join(f"{t:.4f}" for t in ts)))
    return rows


def markdown(rows: list[dict], prov: dict, args) -> str:
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    others = [i for i in impls if i != BASE]
    lines = [f"# End to end in Transformers on {prov['gpu']}", "",
             ", ".join(f"{k} {v}" for k, v in prov.items() if k != "gpu"), "",
             f"Qwen3-MoE with Qwen3-30B-A3B's config, {args.layers} decoder layers, random weights, "
             f"{'float32 (smoke)' if args.smoke else 'bfloat16'}; prefill of {args.prompt} tokens; decode of "
             f"{args.new_tokens} new tokens after a {DECODE_PROMPT}-token prompt; median of {args.reps} "
             f"repetitions (min–max in brackets). {BASE} ÷ X: the ratio of the medians (in brackets, the "
             "median of the repetitions' own ratios).", "",
             "| mode | " + " | ".join(impls) + " | " + " | ".join(f"{BASE} ÷ {o}" for o in others) + " |",
             "|---" * (1 + len(impls) + len(others)) + "|"]
    for mode in dict.fromkeys(r["mode"] for r in rows):
        by = {r["impl"]: r for r in rows if r["mode"] == mode}
        cells, ratios = [], []
        for impl in impls:
            r = by.get(impl)
            if r is None:
                cells.append("")
            elif r["status"] != "ok":
                cells.append(r["status"])
            else:
                match = "" if r["tokens_match"] in ("", "True") else ", tokens differ"
                spread = f"{float(r['ms_min']):.3f}–{float(r['ms_max']):.3f}"
                cells.append(f"{float(r['ms']):.3f} ({spread}{match})")
        base = by.get(BASE)
        for impl in others:
            other = by.get(impl)
            ok = base and other and base["status"] == "ok" and other["status"] == "ok"
            per_rep = other.get("speedup_per_rep") if ok else ""
            per_rep = f" ({float(per_rep):.2f}×)" if per_rep else ""
            ratios.append(f"{float(base['ms']) / float(other['ms']):.2f}×{per_rep}" if ok else "")
        unit = "ms per call" if mode == "prefill" else "ms per token"
        lines.append(f"| {mode} ({unit}) | " + " | ".join(cells) + " | " + " | ".join(ratios) + " |")
    skips = [r for r in rows if r["status"] == "skip"]
    if skips:
        lines += ["", "Skipped: " + "; ".join(f"{r['impl']} {r['mode']} ({r['note']})" for r in skips)]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=4096, help="prefill tokens")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--impls", nargs="+", default=list(IMPLS), choices=IMPLS)
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--bound", action="store_true",
                        help=f"also time {BOUND!r} and {FREE_BLOCK!r}: experts, or whole sparse blocks, that "
                             "cost one op (the bounds of any speed-up)")
    parser.add_argument("--no-graphs", action="store_true",
                        help=f"also time {NO_GRAPHS!r}: moekit without its eager graphs at decode sizes")
    parser.add_argument("--blocks", action="store_true",
                        help=f"also time {BLOCKS!r}: moekit with its whole-block graphs at decode sizes "
                             "(patch_moe_blocks: the post-attention norm, router and experts in one replay), "
                             f"and {UNFOLDED!r} (the same, the norm launched by itself)")
    parser.add_argument("--smoke", action="store_true",
                        help="a tiny float32 model on the CPU: checks the script")
    args = parser.parse_args(argv)
    if args.new_tokens < 2:
        parser.error("--new-tokens must be at least 2 (per-token time is (t(N) - t(1)) / (N - 1))")
    if not args.smoke and not torch.cuda.is_available():
        print("needs a CUDA GPU (or --smoke)", file=sys.stderr)
        return 2
    device = torch.device("cpu" if args.smoke else "cuda")
    # "compiled" recompiles the decoding forward once per implementation (each one changes the
    # graph): room for all of them, so that none falls back to eager past Dynamo's default limit (8)
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, max(64, getattr(torch._dynamo.config, name)))
    modes = [m for m in args.modes if not (args.smoke and m == "compiled")]
    register()
    impls = list(args.impls)
    if args.bound:
        from transformers.integrations.moe import ExpertsInterface

        ExpertsInterface.register(BOUND, lambda self, hidden_states, *_: torch.zeros_like(hidden_states))
        impls += [BOUND, FREE_BLOCK]
    if args.no_graphs:
        register(NO_GRAPHS, eager_graphs=False)
        impls.append(NO_GRAPHS)
    if args.blocks:
        impls += [BLOCKS, UNFOLDED]
    model = build(args.layers, device, torch.float32 if args.smoke else torch.bfloat16, args.smoke)
    rows = run(model, device, impls, modes, args.prompt, args.new_tokens, args.reps)
    prov = provenance()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    fields = ["impl", "mode", "status", "ms", "ms_min", "ms_max", "reps", "unit", "tokens_match",
              "speedup_per_rep", "times", "note", *prov]
    with (args.out_dir / "generate_bench.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields, restval="")
        writer.writeheader()
        writer.writerows({**r, **prov} for r in rows)
    text = markdown(rows, prov, args)
    (args.out_dir / "generate_bench.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
