"""@triton.jit code only; launchers live beside the ops that use them (routing, align, experts)."""
