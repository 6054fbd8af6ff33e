"""Which implementation runs a family of kernels that have pure-torch twins: "triton" on CUDA
tensors, "torch" on CPU tensors, unless the environment says otherwise (<PREFIX>_TORCH=1: the twins
everywhere, to compare; <PREFIX>_TRITON=1: the kernels on CPU tensors too, interpreted under
TRITON_INTERPRET=1, the tests). `PathSwitch.use` overrides both inside a block, in this process.
Used by the expert-parallel steps (`moekit.parallel.fused`, MOEKIT_EP_*) and the masked layout
(`moekit.masked`, MOEKIT_LAYOUT_*).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from moekit import env
from moekit._validation import interpreting

PATHS = ("auto", "torch", "triton")


class PathSwitch:
    """The path choice of one kernel family, read from `prefix`_TORCH / `prefix`_TRITON."""

    def __init__(self, prefix: str):
        self.torch_env, self.triton_env = f"{prefix}_TORCH", f"{prefix}_TRITON"
        self.forced: str | None = None

    def requested(self) -> str:
        if self.forced is not None:
            return self.forced
        if env.flag(self.torch_env):
            return "torch"
        if env.flag(self.triton_env):
            return "triton"
        return "auto"

    def path_for(self, t: torch.Tensor) -> str:
        """"triton" or "torch": which implementation runs on t's device (module docstring)."""
        want = self.requested()
        if want == "torch":
            return "torch"
        if t.is_cuda:
            return "triton"
        return "triton" if want == "triton" and t.device.type == "cpu" and interpreting() else "torch"

    @contextlib.contextmanager
    def use(self, path: str) -> Iterator[None]:
        """Run the family with `path` ("auto", "torch" or "triton") inside the block."""
        if path not in PATHS:
            raise ValueError(f"path must be one of {PATHS}, got {path!r}")
        before, self.forced = self.forced, (None if path == "auto" else path)
        try:
            yield
        finally:
            self.forced = before
