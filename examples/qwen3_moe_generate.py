"""Generate with a small random-weight Qwen3-MoE model, with Transformers' eager experts and with moekit's.

Nothing is downloaded: the model is built from a config. Prints both outputs (token ids: there is no
tokenizer) and their timings. Greedy decoding, so the two runs agree token for token unless a
rounding difference flips a near-tie (possible in bfloat16).

    python examples/qwen3_moe_generate.py                      # CPU: a tiny model in float32
    python examples/qwen3_moe_generate.py --size qwen3-30b-a3b  # GPU: Qwen3-30B-A3B's MoE shape, 4 layers
"""

from __future__ import annotations

import argparse
import time

import torch

import moekit.kernels  # noqa: F401  (sets TRITON_INTERPRET on a machine without CUDA)
from moekit.integrations.transformers import register

SIZES = {
    # hidden, moe_intermediate, experts, top_k, layers, heads, kv_heads, head_dim, vocab
    "tiny": (256, 128, 16, 4, 2, 4, 2, 64, 1024),
    "qwen3-30b-a3b": (2048, 768, 128, 8, 4, 32, 4, 128, 151936),
}


def build_model(size: str, device: torch.device, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    hidden, inter, experts, top_k, layers, heads, kv_heads, head_dim, vocab = SIZES[size]
    config = Qwen3MoeConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * hidden, moe_intermediate_size=inter,
        num_experts=experts, num_experts_per_tok=top_k, norm_topk_prob=True, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
        max_position_embeddings=4096, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    # Transformers' default init (std 0.02) routes almost uniformly; 1/sqrt(fan_in) gives the router
    # and experts realistic contrast.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("experts.gate_up_proj", "experts.down_proj", "mlp.gate.weight")):
                p.normal_(0.0, p.shape[-1] ** -0.5)
    return model.eval()


def timed_generate(model, prompt: torch.Tensor, new_tokens: int) -> tuple[torch.Tensor, float]:
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    model.generate(prompt, **{**kwargs, "max_new_tokens": 2, "min_new_tokens": 2})  # warm-up (JIT, caches)
    if prompt.is_cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = model.generate(prompt, **kwargs)
    if prompt.is_cuda:
        torch.cuda.synchronize()
    return out[:, prompt.shape[1]:], time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=sorted(SIZES), default=None,
                        help="model size (default: qwen3-30b-a3b on CUDA, tiny on CPU)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                        help="default: bfloat16 on CUDA, float32 on CPU")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=24)
    args = parser.parse_args()

    device = torch.device(args.device)
    size = args.size or ("qwen3-30b-a3b" if device.type == "cuda" else "tiny")
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    model = build_model(size, device, dtype)
    vocab = model.config.vocab_size
    prompt = torch.randint(3, vocab, (args.batch, args.prompt_len),
                           generator=torch.Generator().manual_seed(1)).to(device)
    print(f"Qwen3-MoE '{size}' with random weights on {device} in {str(dtype).removeprefix('torch.')}: "
          f"{model.config.num_hidden_layers} layers, {model.config.num_experts} experts, "
          f"top-{model.config.num_experts_per_tok}; batch {args.batch}, prompt {args.prompt_len}, "
          f"{args.new_tokens} new tokens\n")

    register()  # makes experts_implementation="moekit" available to Transformers
    results = {}
    for impl in ("eager", "moekit"):
        model.set_experts_implementation(impl)
        with torch.inference_mode():
            results[impl] = timed_generate(model, prompt, args.new_tokens)

    for impl, (tokens, seconds) in results.items():
        rate = tokens.numel() / seconds
        print(f"{impl:>7}: {seconds * 1e3:8.1f} ms  ({rate:8.1f} tokens/s)")
        for row in tokens.tolist():
            print(f"         {row}")
    same = torch.equal(results["eager"][0], results["moekit"][0])
    speedup = results["eager"][1] / results["moekit"][1]
    print(f"\nidentical outputs: {same}; moekit speed-up over eager: {speedup:.2f}x")


if __name__ == "__main__":
    main()
