"""H200 check of the Transformers integration: correctness, a timing table, torch.compile.

    python scripts/gpu_transformers.py OUT_DIR [--models qwen3_moe olmoe mixtral] [--tokens 1 64 4096]

For Qwen3-30B-A3B, OLMoE-1B-7B and Mixtral-8x7B at their full expert shapes (one decoder layer,
random weights, bfloat16):
  1. block: the MoE block's output with experts_implementation "eager", "grouped_mm", "batched_mm"
     and "moekit", each against an fp32 reference of the experts on the same routing; moekit passes
     when its error is at most 2x eager's (quack's rule) for every T.
  2. logits: the one-layer model's bf16 logits with eager and moekit experts, against the same model
     in fp32; moekit passes at <= 2x eager's error.
  3. timing: median ms of the block (router + experts) per implementation and T. An implementation
     whose check failed is reported as FAIL, never timed; batched_mm is skipped where its (S, 2I, H)
     weight copy would not fit in half the free memory.
  4. compile: torch.compile(block, fullgraph=True, dynamic=True) with moekit experts runs every T and
     passes the same 2x rule; its timing is a row of the table.
Writes transformers_check.csv (long format, with provenance) and transformers_check.md to OUT_DIR and
exits non-zero when any check fails. `--smoke` runs the same steps on tiny shapes on the CPU (fp32
reference, bf16 model) to check the script itself; its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import platform
import sys
import time
from pathlib import Path

import torch

import moekit
from moekit.bench.results import git_commit
from moekit.integrations.transformers import register
from moekit.reference import moe_experts_ref

IMPLS = ("eager", "grouped_mm", "batched_mm", "moekit")


def full_config(kind: str, smoke: bool = False):
    """The published model's sizes, one decoder layer (tiny sizes for --smoke)."""
    import transformers as tf

    common = dict(num_hidden_layers=1, max_position_embeddings=8192, pad_token_id=0, bos_token_id=1,
                  eos_token_id=2)
    if smoke:
        tiny = dict(vocab_size=256, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                    num_experts_per_tok=2, **common)
        if kind == "qwen3_moe":
            return tf.Qwen3MoeConfig(intermediate_size=128, moe_intermediate_size=48, num_experts=8,
                                     norm_topk_prob=True, **tiny)
        if kind == "olmoe":
            return tf.OlmoeConfig(intermediate_size=48, num_experts=8, **tiny)
        return tf.MixtralConfig(intermediate_size=48, num_local_experts=4, **tiny)
    if kind == "qwen3_moe":   # Qwen/Qwen3-30B-A3B
        return tf.Qwen3MoeConfig(vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                                 moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
                                 norm_topk_prob=True, num_attention_heads=32, num_key_value_heads=4,
                                 head_dim=128, **common)
    if kind == "olmoe":       # allenai/OLMoE-1B-7B-0924
        return tf.OlmoeConfig(vocab_size=50304, hidden_size=2048, intermediate_size=1024, num_experts=64,
                              num_experts_per_tok=8, norm_topk_prob=False, num_attention_heads=16,
                              num_key_value_heads=16, **common)
    if kind == "mixtral":     # mistralai/Mixtral-8x7B-v0.1
        return tf.MixtralConfig(vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                                num_local_experts=8, num_experts_per_tok=2, num_attention_heads=32,
                                num_key_value_heads=8, **common)
    raise ValueError(kind)


def build(kind: str, device: torch.device):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(full_config(kind, smoke=device.type == "cpu"),
                                                 dtype=torch.bfloat16)
    # 1/sqrt(fan_in) instead of std 0.02: a router with contrast and experts that move the output.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("experts.gate_up_proj", "experts.down_proj", "mlp.gate.weight")):
                p.normal_(0.0, p.shape[-1] ** -0.5)
    return model.eval()


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    if not torch.isfinite(out).all():
        return float("inf")
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def time_ms(fn, reps: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        if not torch.cuda.is_available():  # --smoke
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
            continue
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def batched_mm_fits(block, num_tokens: int) -> tuple[bool, str]:
    """batched_mm copies each pair's expert weights: (S, 2I, H) for gate_up at the peak."""
    gate_up = block.experts.gate_up_proj
    need = num_tokens * block.gate.top_k * gate_up[0].numel() * gate_up.element_size()
    if not gate_up.is_cuda:
        return True, ""
    free, _ = torch.cuda.mem_get_info()
    return need <= free // 2, f"needs {need / 2**30:.0f} GiB for its weight copy, {free / 2**30:.0f} GiB free"


def check_model(kind: str, device: torch.device, tokens: list[int], reps: int, do_compile: bool,
                rows: list[dict]) -> bool:
    model = build(kind, device)
    block = model.model.layers[0].mlp
    hidden = model.config.hidden_size
    ok = True
    gen = torch.Generator(device=device).manual_seed(0)

    def record(check, impl, num_tokens, **fields):
        rows.append(dict(model=kind, check=check, impl=impl, tokens=num_tokens, **fields))

    # 1 + 3: block correctness per implementation and T, then timing of the passing ones.
    compiled = None
    for num_tokens in tokens:
        x = torch.randn(1, num_tokens, hidden, device=device, dtype=torch.bfloat16, generator=gen)
        with torch.inference_mode():
            _, weights, ids = block.gate(x.view(-1, hidden))
            ref = moe_experts_ref(x.view(-1, hidden), block.experts.gate_up_proj, block.experts.down_proj,
                                  weights, ids)
            errs = {}
            for impl in IMPLS:
                if impl == "batched_mm":
                    fits, why = batched_mm_fits(block, num_tokens)
                    if not fits:
                        record("block", impl, num_tokens, status="skip", note=why)
                        continue
                model.set_experts_implementation(impl)
                errs[impl] = rel_err(block(x).view(-1, hidden), ref)
            eager_err = errs["eager"]
            for impl, err in errs.items():
                passed = err <= 2 * eager_err
                ok &= passed or impl != "moekit"
                fields = dict(rel_err=f"{err:.3e}", eager_rel_err=f"{eager_err:.3e}")
                if not passed:
                    record("block", impl, num_tokens, status="FAIL", **fields)
                    continue
                model.set_experts_implementation(impl)
                ms = time_ms(lambda x=x: block(x), reps)
                record("block", impl, num_tokens, status="pass", ms=f"{ms:.4f}", **fields)
            if do_compile:
                model.set_experts_implementation("moekit")
                if compiled is None:
                    torch._dynamo.reset()
                    compiled = torch.compile(block, fullgraph=True, dynamic=True)
                err = rel_err(compiled(x).view(-1, hidden), ref)
                passed = err <= 2 * eager_err
                ok &= passed
                fields = dict(rel_err=f"{err:.3e}", eager_rel_err=f"{eager_err:.3e}")
                ms = time_ms(lambda x=x, f=compiled: f(x), reps) if passed else None
                record("block", "moekit+compile", num_tokens, status="pass" if passed else "FAIL",
                       ms=f"{ms:.4f}" if ms is not None else "", **fields)

    # 2: one-layer model logits, bf16 eager and moekit against the fp32 model.
    ids = torch.randint(3, model.config.vocab_size, (2, 128), device=device, generator=gen)
    with torch.inference_mode():
        model.set_experts_implementation("eager")
        eager = model(ids).logits
        model.set_experts_implementation("moekit")
        mine = model(ids).logits
        model.float()
        model.set_experts_implementation("eager")
        ref = model(ids).logits
    e_err, m_err = rel_err(eager, ref), rel_err(mine, ref)
    passed = m_err <= 2 * e_err
    ok &= passed
    record("logits", "moekit", ids.numel(), status="pass" if passed else "FAIL", rel_err=f"{m_err:.3e}",
           eager_rel_err=f"{e_err:.3e}", note=f"vs eager bf16: {rel_err(mine, eager):.3e}")
    return ok  # the model is freed on return; main() empties the CUDA cache


def provenance() -> dict:
    import transformers
    import triton

    commit = git_commit() or "unknown"
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu (smoke)"
    return dict(gpu=gpu, commit=commit,
                date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                torch=torch.__version__, triton=triton.__version__, transformers=transformers.__version__,
                moekit=moekit.__version__, python=platform.python_version())


def markdown(rows: list[dict], prov: dict) -> str:
    lines = [f"# Transformers integration on {prov['gpu']}", "",
             ", ".join(f"{k} {v}" for k, v in prov.items() if k != "gpu"), "",
             "## MoE block, median ms (router + experts, bf16); rel. error vs fp32 in brackets", ""]
    impls = list(dict.fromkeys(r["impl"] for r in rows if r["check"] == "block"))
    for kind in dict.fromkeys(r["model"] for r in rows):
        block_rows = [r for r in rows if r["model"] == kind and r["check"] == "block"]
        tokens = list(dict.fromkeys(r["tokens"] for r in block_rows))
        lines += [f"### {kind}", "", "| T | " + " | ".join(impls) + " |", "|---" * (len(impls) + 1) + "|"]
        for t in tokens:
            cells = []
            for impl in impls:
                r = next((r for r in block_rows if r["tokens"] == t and r["impl"] == impl), None)
                if r is None:
                    cells.append("")
                elif r["status"] == "pass":
                    cells.append(f"{float(r['ms']):.3f} ({r['rel_err']})")
                else:
                    cells.append(r["status"] + (f" ({r['rel_err']})" if r.get("rel_err") else ""))
            lines.append(f"| {t} | " + " | ".join(cells) + " |")
        lines.append("")
    lines += ["## One-layer model logits (bf16 vs the fp32 model)", "",
              "| model | moekit rel. err | eager rel. err | status | note |", "|---|---|---|---|---|"]
    for r in rows:
        if r["check"] == "logits":
            lines.append(f"| {r['model']} | {r['rel_err']} | {r['eager_rel_err']} | {r['status']} "
                         f"| {r['note']} |")
    skips = [r for r in rows if r["status"] == "skip"]
    if skips:
        lines += ["", "Skipped: " + "; ".join(f"{r['model']} {r['impl']} T={r['tokens']} ({r['note']})"
                                              for r in skips)]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--models", nargs="+", default=["qwen3_moe", "olmoe", "mixtral"],
                        choices=["qwen3_moe", "olmoe", "mixtral"])
    parser.add_argument("--tokens", nargs="+", type=int, default=[1, 64, 4096])
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU: checks the script only")
    args = parser.parse_args()
    if not args.smoke and not torch.cuda.is_available():
        print("needs a CUDA GPU (or --smoke)", file=sys.stderr)
        return 2
    device = torch.device("cpu" if args.smoke else "cuda")
    register()
    rows: list[dict] = []
    ok = True
    for kind in args.models:
        print(f"{kind} ...", flush=True)
        ok &= check_model(kind, device, args.tokens, args.reps, not args.no_compile, rows)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    prov = provenance()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    fields = ["model", "check", "impl", "tokens", "status", "ms", "rel_err", "eager_rel_err", "note", *prov]
    tmp = args.out_dir / "transformers_check.csv.tmp"
    with tmp.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields, restval="")
        writer.writeheader()
        writer.writerows({**r, **prov} for r in rows)
    tmp.replace(args.out_dir / "transformers_check.csv")
    text = markdown(rows, prov)
    (args.out_dir / "transformers_check.md").write_text(text)
    print(text)
    print("ALL CHECKS PASSED" if ok else "SOME CHECKS FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
