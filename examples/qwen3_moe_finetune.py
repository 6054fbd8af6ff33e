"""Fine-tune a small random-weight Qwen3-MoE with moekit's experts and with Transformers' eager ones.

Nothing is downloaded: the model is built from a config. Both runs start from the same weights and
take the same AdamW steps (fp32 master weights) on one fixed batch (a memorisation task, so the
loss goes down); the script prints both loss curves step by step, checks that they match, and ends
with one verdict line ("verdict: PASS ..." or "verdict: FAIL ...", exit status 1):

    python examples/qwen3_moe_finetune.py                                  # CPU, float32 (~30 s)
    python examples/qwen3_moe_finetune.py --device cuda --dtype bfloat16   # GPU

Bounds. float32: each step's loss within 1e-4 relative of eager's (the two differ only in the
order of the sums, ~1e-6 here). bfloat16: a third run, eager in float32, is the oracle; the
largest relative deviation of moekit's bf16 curve from it must stay within twice that of eager's
bf16 curve (the project's rule for low precision: moekit may not be worse than plain PyTorch in the
same dtype by more than 2x), floored at 2^-8 (bf16's unit roundoff) so that a baseline that is
close by luck cannot set a bound below one rounding.

On CPU the triton backend runs in the Triton interpreter (float32 only: it computes bf16 dots
wrongly); `--backend auto` runs the CPU's differentiable backend (loop) instead.
"""

from __future__ import annotations

import argparse
import copy
import math
import sys
import time
import warnings

import torch

import moekit.kernels  # noqa: F401  (sets TRITON_INTERPRET on a machine without CUDA)
from moekit.integrations.transformers import register

# hidden, moe_intermediate, experts, top_k, layers, heads, kv_heads, head_dim, vocab
TINY = (64, 48, 16, 2, 2, 4, 2, 16, 128)


def build_model(seed: int = 0):
    """A tiny float32 Qwen3-MoE on the CPU; router and experts drawn at 1/sqrt(fan_in) (Transformers'
    default std 0.02 routes almost uniformly)."""
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    hidden, inter, experts, top_k, layers, heads, kv_heads, head_dim, vocab = TINY
    config = Qwen3MoeConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, moe_intermediate_size=inter,
        num_experts=experts, num_experts_per_tok=top_k, norm_topk_prob=True, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
        max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("experts.gate_up_proj", "experts.down_proj", "mlp.gate.weight")):
                p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)
    return model


def finetune(model, impl: str, batch: torch.Tensor, steps: int, lr: float, dtype: torch.dtype,
             device: torch.device) -> tuple[list[float], float]:
    """(loss per step, seconds): AdamW on fp32 master copies of the weights; forward and backward
    run on a copy of the model in `dtype` (the same tensors when dtype is float32)."""
    work = copy.deepcopy(model).to(device=device, dtype=dtype).train()
    work.set_experts_implementation(impl)
    params = list(work.parameters())
    master = [p.detach().float().clone() if dtype != torch.float32 else p for p in params]
    opt = torch.optim.AdamW(master, lr=lr)
    losses = []
    start = time.perf_counter()
    for _ in range(steps):
        loss = work(batch, labels=batch).loss
        loss.backward()
        if dtype != torch.float32:
            for m, p in zip(master, params):
                m.grad = p.grad.float()
        opt.step()
        opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            for m, p in zip(master, params):
                if m is not p:
                    p.copy_(m)
                    p.grad = None
        losses.append(loss.item())
    if device.type == "cuda":
        torch.cuda.synchronize()
    return losses, time.perf_counter() - start


def rel_dev(curve: list[float], ref: list[float]) -> list[float]:
    return [abs(a - b) / abs(b) for a, b in zip(curve, ref, strict=True)]


def largest(values: list[float]) -> float:
    """max(values), NaN when any is NaN (max() would skip a NaN that is not first)."""
    return math.nan if any(math.isnan(v) for v in values) else max(values)


def device_arg(text: str) -> torch.device:
    try:
        return torch.device(text)
    except (RuntimeError, ValueError):
        raise argparse.ArgumentTypeError(f"expected cpu, cuda or cuda:N, got {text!r}") from None


def at_least(low: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = low - 1
        if value < low:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {text!r}")
        return value

    return parse


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", type=device_arg, default=torch.device("cpu"),
                        help="cpu (default), cuda or cuda:N")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--backend", default="triton", help="moekit experts backend (default: triton)")
    parser.add_argument("--steps", type=at_least(2), default=20,
                        help="AdamW steps, at least 2 to see the loss go down (default 20)")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--batch", type=at_least(1), default=2)
    parser.add_argument("--seq-len", type=at_least(1), default=8)
    args = parser.parse_args()

    device, dtype = args.device, getattr(torch, args.dtype)
    if device.type == "cpu" and dtype == torch.bfloat16 and args.backend == "triton":
        parser.error("bfloat16 with the triton backend needs CUDA (the Triton interpreter computes bf16 "
                     "dots wrongly); use --backend auto on the CPU")
    register("moekit", backend=args.backend)   # experts_implementation="moekit" runs moekit's kernels
    # A moekit fallback to Transformers' own experts would make this comparison moot: make it fatal.
    warnings.filterwarnings("error", message="moekit: .* running Transformers' grouped_mm experts")

    model = build_model()
    cfg = model.config
    batch = torch.randint(3, cfg.vocab_size, (args.batch, args.seq_len),
                          generator=torch.Generator().manual_seed(1)).to(device)
    print(f"Qwen3-MoE with random weights on {device} in {args.dtype}: {cfg.num_hidden_layers} layers, "
          f"{cfg.num_experts} experts, top-{cfg.num_experts_per_tok}, hidden {cfg.hidden_size}; "
          f"batch {args.batch} x {args.seq_len} tokens, AdamW lr {args.lr:g}, {args.steps} steps, "
          f"moekit backend {args.backend!r}\n")

    runs = {"eager": ("eager", dtype), "moekit": ("moekit", dtype)}
    if dtype != torch.float32:
        runs["eager fp32"] = ("eager", torch.float32)   # the oracle of the low-precision bound
    curves, seconds = {}, {}
    for label, (impl, run_dtype) in runs.items():
        curves[label], seconds[label] = finetune(model, impl, batch, args.steps, args.lr, run_dtype, device)

    oracle = curves.get("eager fp32", curves["eager"])
    print("step  " + "  ".join(f"{label:>10}" for label in runs) + "   moekit vs eager")
    for step in range(args.steps):
        row = "  ".join(f"{curves[label][step]:10.6f}" for label in runs)
        print(f"{step:4d}  {row}   {rel_dev(curves['moekit'], curves['eager'])[step]:.1e}")
    print("\n" + ", ".join(f"{label}: {s:.1f} s" for label, s in seconds.items()))

    eager, moe = curves["eager"], curves["moekit"]
    worst = largest(rel_dev(moe, oracle))
    if dtype == torch.float32:
        bound, why = 1e-4, "fp32: the same arithmetic up to summation order"
    else:
        baseline = largest(rel_dev(eager, oracle))
        bound = max(2 * baseline, 2.0**-8)
        why = (f"2x eager {args.dtype}'s largest deviation from eager fp32 ({baseline:.1e}), at least "
               "2^-8")
    ref_name = "eager fp32" if dtype != torch.float32 else "eager"
    print(f"loss {eager[0]:.4f} -> {eager[-1]:.4f} (eager), {moe[0]:.4f} -> {moe[-1]:.4f} (moekit); "
          f"largest relative difference of moekit from {ref_name}: {worst:.1e}, bound {bound:.1e} ({why})")
    problems = []
    if not (eager[-1] < eager[0] and moe[-1] < moe[0]):
        problems.append("the loss did not go down")
    if not worst <= bound:            # NaN fails too
        problems.append(f"moekit's loss curve left the bound: {worst:.2e} > {bound:.2e}")
    if problems:
        print(f"verdict: FAIL ({'; '.join(problems)})")
        return 1
    print(f"verdict: PASS (moekit {args.backend!r} trains as eager does: {args.steps} steps on {device}, "
          f"{args.dtype})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
