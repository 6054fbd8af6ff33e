"""Hugging Face Transformers (>= 5.0): moekit as an experts implementation, and block <-> MoELayer.

    from moekit.integrations.transformers import register
    register()                                                   # once per process; idempotent
    model = AutoModelForCausalLM.from_pretrained(name, experts_implementation="moekit")

- `experts`: `register` installs `experts_forward`, Transformers' experts signature on moekit's
  kernels (inference, training, decoding graphs, expert-parallel sentinel ids); `unsupported_reason`
  says why a module falls back to Transformers' own path.
- `fp8`: FineGrainedFP8 experts (quantization_config quant_method "fp8", weight_block_size
  [128, 128]) on moekit's FP8 path, inference only.
- `convert`: `from_transformers` / `to_transformers`, a sparse MoE block <-> a `MoELayer` sharing
  its Parameters.
- `patch`: `patch_llama4` runs Llama-4's block (no MoELayer form) on moekit's experts op;
  `patch_moe_blocks` lets the supported blocks decode through one graph of the whole block.

`transformers` is an optional dependency, imported on the first call that needs it, so
`import moekit` works without it.
"""

from moekit.integrations.transformers.convert import from_transformers, to_transformers
from moekit.integrations.transformers.experts import experts_forward, register, unsupported_reason
from moekit.integrations.transformers.patch import llama4_moe_forward, patch_llama4, patch_moe_blocks

__all__ = ["experts_forward", "from_transformers", "llama4_moe_forward", "patch_llama4", "patch_moe_blocks",
           "register", "to_transformers", "unsupported_reason"]
