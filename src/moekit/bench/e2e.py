"""`moekit e2e`: Transformers end to end, per experts implementation, as a user of `generate` sees it.

The model is built from a published config (`MODELS`: Qwen3-30B-A3B, OLMoE-1B-7B, Mixtral-8x7B) with
`--layers` decoder layers and random weights (experts and router drawn with std 1/sqrt(fan_in), so
the router has contrast); nothing is downloaded. One model: `set_experts_implementation` switches it
between implementations, so every one runs the same weights and prompts.

    --what prefill    one forward of a `--prompt`-token prompt, logits of the last position only
    --what eager      greedy `generate` after a 32-token prompt, default cache: ms per new token,
                      (time of N new tokens - time of 1) / (N - 1)
    --what compiled   the same with the static cache, with which `generate` compiles the decoding
                      forward (CUDA only; compiled once per implementation before timing)

Implementations: Transformers' grouped_mm and batched_mm, moekit, and on request moekit-no-graphs
(every kernel launched at each call), moekit-blocks (`patch_moe_blocks`: one graph of the norm and
the whole block a decoding call) and free-experts (zeros: what the rest of the model costs). The
implementations run in turn inside each repetition (a drift of the machine affects all alike); each
call is timed by `time_fn` (one call, no flush). Greedy tokens are compared with grouped_mm's (in
bfloat16 a rounding difference can flip a near-tie: reported, not fatal). On a CPU-only machine the
model is a tiny stand-in of the config (`TINY`) in float32: a check of the pipeline, not a figure; its
rows say so (`model_note`, in the report's section titles) and the report carries the CPU-run note.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch

from moekit.bench import args as arg_types
from moekit.bench.args import usage_error
from moekit.bench.lab import first_line, report, run_study
from moekit.bench.results import Provenance
from moekit.bench.study import FILES, Files, Study, cpu_run_note
from moekit.bench.timing import TimingStats, time_fn

PROG = "moekit e2e"
WHAT = ("prefill", "eager", "compiled")
BASE = "grouped_mm"
IMPLS = (BASE, "batched_mm", "moekit", "moekit-no-graphs", "moekit-blocks", "free-experts")
DEFAULT_IMPLS = IMPLS[:3]
DECODE_PROMPT = 32
_COMMON = dict(max_position_embeddings=8192, pad_token_id=0, bos_token_id=1, eos_token_id=2)
# The published models' sizes (config class, its arguments); TINY: the same families at CPU sizes.
MODELS = {
    "qwen3_moe": ("Qwen3MoeConfig", dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                                         moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
                                         norm_topk_prob=True, num_attention_heads=32, num_key_value_heads=4,
                                         head_dim=128)),
    "olmoe": ("OlmoeConfig", dict(vocab_size=50304, hidden_size=2048, intermediate_size=1024, num_experts=64,
                                  num_experts_per_tok=8, norm_topk_prob=False, num_attention_heads=16,
                                  num_key_value_heads=16)),
    "mixtral": ("MixtralConfig", dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                                      num_local_experts=8, num_experts_per_tok=2, num_attention_heads=32,
                                      num_key_value_heads=8)),
}
_TINY = dict(vocab_size=256, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             num_experts_per_tok=2)
TINY = {"qwen3_moe": dict(_TINY, intermediate_size=128, moe_intermediate_size=48, num_experts=8,
                          norm_topk_prob=True),
        "olmoe": dict(_TINY, intermediate_size=48, num_experts=8),
        "mixtral": dict(_TINY, intermediate_size=48, num_local_experts=4)}


def build_model(kind: str, device: torch.device, dtype: torch.dtype = torch.bfloat16, layers: int = 1,
                tiny: bool | None = None):
    """A causal LM of `kind` with random weights (`tiny`: CPU sizes; default: on a CPU device)."""
    import transformers as tf

    name, sizes = MODELS[kind]
    if device.type == "cpu" if tiny is None else tiny:
        sizes = TINY[kind]
    config = getattr(tf, name)(num_hidden_layers=layers, **sizes, **_COMMON)
    torch.manual_seed(0)
    with torch.device(device):
        model = tf.AutoModelForCausalLM.from_config(config, dtype=dtype)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith(("experts.gate_up_proj", "experts.down_proj", "mlp.gate.weight")):
                p.normal_(0.0, p.shape[-1] ** -0.5)
    return model.eval()


def stand_in_note(config) -> str:
    """A tiny model's `model_note`: what stands in for the published model, with its sizes."""
    experts = getattr(config, "num_experts", None) or config.num_local_experts
    return f"tiny stand-in: hidden {config.hidden_size}, {experts} experts"


@dataclass(frozen=True)
class E2ERow(Provenance):
    """One implementation in one phase: its run's `Provenance`, the model, then the timing over the
    repetitions (ms a call for prefill, a new token for eager / compiled); speedup: grouped_mm's
    median over this one's; tokens_match: greedy tokens equal grouped_mm's (1 / 0; empty: not compared);
    model_note: "tiny stand-in: hidden .., .. experts" where the model is `TINY`'s, not the published
    config's sizes (a CPU run; empty otherwise, and in files written before the column)."""

    model: str
    layers: int
    tokens: int
    impl: str
    what: str
    status: str
    reason: str
    median_ms: float
    p20_ms: float
    p80_ms: float
    n_rep: int | None
    speedup: float
    tokens_match: int | None
    model_note: str = ""


def model_label(r: E2ERow) -> str:
    """The model as the report names it: the config's name, and what stands in for it if not its sizes."""
    return f"{r.model} ({r.model_note})" if r.model_note else r.model


def render(rows: Sequence[E2ERow], files: Files = FILES) -> dict[str, str]:
    return {files.report: report(
        rows, "moekit e2e", lambda r: f"{r.what}: {model_label(r)}, {r.layers} layers, {r.tokens} tokens",
        ("impl", "status", "median_ms", "speedup", "p20_ms", "p80_ms", "n_rep", "tokens_match", "reason"),
        [*cpu_run_note(rows, "the model is a tiny stand-in of the published config, in float32: a check "
                             "of the pipeline, not a measurement of the published model or of GPU "
                             "performance."),
         "- prefill: ms a call; eager and compiled: ms a new token; speedup: grouped_mm's median over "
         "the row's"])}


STUDY = Study("e2e", E2ERow, render)


class Runner:
    """The model, its prompts and how each (implementation, phase) is called."""

    def __init__(self, model, device: torch.device, prompt: int, new_tokens: int):
        from moekit.integrations.transformers import register

        register()
        register("moekit-no-graphs", eager_graphs=False)
        from transformers.integrations.moe import ExpertsInterface

        ExpertsInterface.register("free-experts", lambda self, x, *_: torch.zeros_like(x))
        self.model, self.device, self.new_tokens = model, device, new_tokens
        gen = torch.Generator().manual_seed(1)
        vocab = model.config.vocab_size
        self.prompt = torch.randint(3, vocab, (1, prompt), generator=gen).to(device)
        self.short = torch.randint(3, vocab, (1, DECODE_PROMPT), generator=gen).to(device)
        self.tokens: dict[tuple[str, str], torch.Tensor] = {}

    def _generate(self, n: int, static: bool) -> torch.Tensor:
        kwargs = dict(max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
        kwargs.update(cache_implementation="static") if static else kwargs.update(disable_compile=True)
        return self.model.generate(self.short, **kwargs)[:, self.short.shape[1]:]

    def _time(self, fn) -> float:
        return time_fn(fn, warmup=0, rep=1, flush_l2=False, device=self.device).median_ms

    def measure(self, impl: str, what: str) -> float:
        """One timing (ms a call, or a new token) of impl in phase `what`."""
        from moekit.integrations.transformers import patch_moe_blocks

        patch_moe_blocks(self.model, enabled=impl == "moekit-blocks")
        self.model.set_experts_implementation("moekit" if impl == "moekit-blocks" else impl)
        with torch.no_grad():
            if what == "prefill":
                return self._time(lambda: self.model(self.prompt, use_cache=True, logits_to_keep=1))
            static = what == "compiled"
            out = []
            ms_n = self._time(lambda: out.append(self._generate(self.new_tokens, static)))
            ms_1 = self._time(lambda: self._generate(1, static))
        self.tokens[(impl, what)] = out[-1].cpu()
        return (ms_n - ms_1) / (self.new_tokens - 1)


def e2e_rows(runner: Runner, impls: Sequence[str], whats: Sequence[str], reps: int, head: dict,
             progress) -> list[E2ERow]:
    cases = [(i, w) for w in whats for i in impls]
    samples: dict[tuple[str, str], list[float]] = {c: [] for c in cases}
    errors: dict[tuple[str, str], str] = {}
    for rep in range(reps + 1):       # the first round warms up: JIT, autotune caches, compiles
        for case in cases:
            if case in errors:
                continue
            progress(f"{'warm-up' if rep == 0 else f'rep {rep}/{reps}'} {case[0]} {case[1]}")
            try:
                ms = runner.measure(*case)
            except Exception as exc:  # e.g. batched_mm's weight copy out of memory: one row lost
                errors[case] = first_line(exc)
                continue
            if rep:
                samples[case].append(ms)
    stats = {c: TimingStats.from_samples(s) for c, s in samples.items() if s and c not in errors}
    rows = []
    for impl, what in cases:
        st, base = stats.get((impl, what)), stats.get((BASE, what))
        ref, mine = runner.tokens.get((BASE, what)), runner.tokens.get((impl, what))
        match = None if ref is None or mine is None or impl == "free-experts" else int(torch.equal(ref, mine))
        rows.append(E2ERow(
            **head, tokens=runner.prompt.shape[1] if what == "prefill" else runner.new_tokens, impl=impl,
            what=what, status="ok" if st else "error", reason=errors.get((impl, what), ""),
            median_ms=st.median_ms if st else math.nan, p20_ms=st.p20_ms if st else math.nan,
            p80_ms=st.p80_ms if st else math.nan, n_rep=st.n if st else None,
            speedup=base.median_ms / st.median_ms if st and base else math.nan, tokens_match=match))
    return rows


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--what", type=arg_types.names(lambda: WHAT, "phase"), default=None,
                   help=f"comma-separated, from {', '.join(WHAT)} (default: all on a GPU; prefill,eager on "
                        "the CPU)")
    p.add_argument("--model", choices=tuple(MODELS), default="qwen3_moe",
                   help="the published config the model is built from (default: qwen3_moe)")
    p.add_argument("--impls", type=arg_types.names(lambda: IMPLS, "implementation"),
                   default=list(DEFAULT_IMPLS),
                   help=f"experts implementations, comma-separated, from {', '.join(IMPLS)} (default: "
                        f"{','.join(DEFAULT_IMPLS)}; {BASE} is always run: the speed-ups are over it)")
    p.add_argument("--layers", type=arg_types.int_range(1), default=None,
                   help="decoder layers (default: 8 on a GPU, 1 on the CPU)")
    p.add_argument("--prompt", type=arg_types.int_range(1), default=None,
                   help="prefill tokens (default: 4096 on a GPU, 16 on the CPU)")
    p.add_argument("--new-tokens", type=arg_types.int_range(2), default=None,
                   help="new tokens a decode (default: 32 on a GPU, 3 on the CPU; at least 2)")
    p.add_argument("--rep", type=arg_types.int_range(1), default=None,
                   help="repetitions after the warm-up round (default: 5 on a GPU, 1 on the CPU)")
    arg_types.add_device(p)
    arg_types.add_out(p, "e2e-<UTC timestamp>", STUDY.result_names)
    arg_types.add_threads(p)


def run(args: argparse.Namespace) -> int:
    from moekit.bench.peers import transformers_version

    device = arg_types.resolve_device(args.device)
    whats = arg_types.pick(args.what, device, list(WHAT), ["prefill", "eager"])
    if transformers_version() is None:
        return usage_error(PROG, "needs Transformers: pip install 'moekit[transformers]'")
    if "compiled" in whats and device.type != "cuda":
        return usage_error(PROG, "--what compiled needs a CUDA device")
    impls = list(dict.fromkeys([BASE, *args.impls]))
    layers = arg_types.pick(args.layers, device, 8, 1)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if "compiled" in whats:   # one recompile per implementation: room for all, none falls back to eager
        for name in ("recompile_limit", "cache_size_limit"):
            if hasattr(torch._dynamo.config, name):
                setattr(torch._dynamo.config, name, max(64, getattr(torch._dynamo.config, name)))

    def measure(console, ceilings, prov) -> list[E2ERow]:
        tiny = device.type == "cpu"
        model = build_model(args.model, device, dtype, layers, tiny=tiny)
        runner = Runner(model, device, arg_types.pick(args.prompt, device, 4096, 16),
                        arg_types.pick(args.new_tokens, device, 32, 3))
        head = {**asdict(prov), "model": args.model, "layers": layers,
                "model_note": stand_in_note(model.config) if tiny else ""}
        return e2e_rows(runner, impls, whats, arg_types.pick(args.rep, device, 5, 1), head,
                        lambda m: console.print(f"  {m}", highlight=False))

    return run_study(PROG, args, STUDY, device, dtype, measure, lambda r: f"{r.impl} {r.what}",
                     rep=1 if device.type == "cpu" else None, transformers_version=transformers_version())
