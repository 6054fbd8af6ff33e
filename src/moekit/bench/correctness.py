"""The correctness gate every backend passes before it is timed (STYLE.md items 6 and 11): its
output (`expected_output`), and for `moekit bench --backward` its gradients (`expected_grads`).

Rule (quack's): against the fp32 reference, a backend's largest error may be at most twice the
largest error of plain PyTorch computing the same thing in the same dtype. "Plain PyTorch" is the
arithmetic of Transformers' eager experts loop: every op in the dtype, the K contributions added
into a dtype buffer with index_add_.

In fp32 that baseline *is* the reference's arithmetic, so its error is 0 and the rule would demand
bit-identical results. The baseline error is therefore floored at the rounding of fp32 sums of the
layer's reduction length, eps_fp32 * sqrt(H + I) * max|ref|, the least error any fp32-accumulating
backend can promise. In bf16 and fp16 the floor is about 1000 times below the baseline error and
changes nothing.

Gradients follow the same rule, one budget per input (hidden_states, gate_up_proj, down_proj,
topk_weights): the fp32 reference is torch autograd through `moe_experts_ref` on fp32 copies of the
inputs; the baseline is autograd through the same plain-PyTorch loop in the dtype. The fp32 floor
uses the backward's longest reduction, H + 2I + T (the SwiGLU gradient sums over H, dx over the 2I
gate and up columns, a weight gradient over up to T rows of its expert).

Calls on block-scaled FP8 weights (`moekit.bench.fp8`) follow the same rule (`budget`) with the
reference of their path and, as baseline, this loop on the weights dequantized to the dtype, with
their quantization of x and h (`experts_same_dtype`'s h_pass).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from moekit.reference import moe_experts_ref

TOLERANCE_FACTOR = 2.0
GRAD_NAMES = ("hidden_states", "gate_up_proj", "down_proj", "topk_weights")


@dataclass(frozen=True)
class Check:
    """Outcome of comparing one backend's output with the reference.

    Attributes:
        ok: passed the gate.
        max_err: largest |out - ref| (inf for NaN/Inf or a wrong shape).
        tol: the largest error allowed.
        reason: why it failed ("" when ok).
    """

    ok: bool
    max_err: float
    tol: float
    reason: str = ""


@dataclass(frozen=True)
class Expected:
    """The reference output of one workload and the error budget derived from it."""

    ref: torch.Tensor          # float32 (T, H)
    baseline_err: float        # max error of PyTorch in the workload's dtype
    tol: float

    def check(self, out: object) -> Check:
        return _compare(out, self.ref, self.baseline_err, self.tol)


@dataclass(frozen=True)
class Finished(Expected):
    """An `Expected` whose check first maps a call's output to the layer's (T, H) output (a piece of
    the path, or the dense pair's (T * K, H) rows), outside the timed call."""

    finish: Callable[[object], torch.Tensor] | None = None

    def check(self, out: object) -> Check:
        try:
            layer_out = self.finish(out) if self.finish is not None else out
        except Exception as exc:   # a malformed output is a failed check, not a crash
            return Check(False, math.inf, self.tol, f"output unusable ({type(exc).__name__}: {exc})")
        return super().check(layer_out)


def _compare(out: object, ref: torch.Tensor, baseline_err: float, tol: float, name: str = "") -> Check:
    """`out` against `ref` within `tol` (2x the baseline error). `name`: the gradient compared, named
    in the reason ("": the forward output)."""
    what, lead = (f"d {name}", f"d {name}: ") if name else ("output", "")
    if not isinstance(out, torch.Tensor):
        return Check(False, math.inf, tol, f"{lead}returned {type(out).__name__}, not a tensor")
    if tuple(out.shape) != tuple(ref.shape):
        return Check(False, math.inf, tol, f"{what} shape {tuple(out.shape)}, expected {tuple(ref.shape)}")
    diff = (out.detach().float() - ref).abs()
    if not torch.isfinite(diff).all():
        return Check(False, math.inf, tol, f"{what} has NaN or Inf")
    err = float(diff.max()) if diff.numel() else 0.0
    if err > tol:
        return Check(False, err, tol,
                     f"{lead}max error {err:.3g} > {tol:.3g} (2x PyTorch's {baseline_err:.3g})")
    return Check(True, err, tol)


@dataclass(frozen=True)
class ExpectedGrads:
    """The reference gradients of one workload's forward + backward and their error budgets.

    Attributes:
        refs: fp32 gradients of `GRAD_NAMES`, in that order (autograd through the fp32 reference).
        baseline_errs: max error of each gradient of plain PyTorch in the workload's dtype.
        tols: the largest error allowed for each.
        tol: NaN: no single budget applies before a check (a `Check` reports the budget of the
            gradient it names).
    """

    refs: tuple[torch.Tensor, ...]
    baseline_errs: tuple[float, ...]
    tols: tuple[float, ...]
    tol: float = math.nan

    def check(self, grads: object) -> Check:
        """Every gradient within its budget. Fails on the first one that is not; when all pass, the
        Check carries the error and budget of the gradient closest to its budget."""
        if not isinstance(grads, (tuple, list)) or len(grads) != len(self.refs):
            return Check(False, math.inf, self.tol,
                         f"expected the {len(self.refs)} gradients of {', '.join(GRAD_NAMES)}")
        worst = None
        for name, g, ref, base, tol in zip(GRAD_NAMES, grads, self.refs, self.baseline_errs, self.tols):
            if g is None:
                return Check(False, math.inf, tol, f"no gradient for {name}")
            check = _compare(g, ref, base, tol, name)
            if not check.ok:
                return check
            if worst is None or check.max_err * worst.tol > worst.max_err * check.tol:
                worst = check
        return worst


def experts_same_dtype(x: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
                       topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                       h_pass: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """Plain PyTorch in the inputs' dtype, one pass per expert: the error baseline (see module doc).
    h_pass: applied to each expert's silu(gate) * up rows before the down projection (FP8's
    quantization of h, `moekit.bench.fp8`)."""
    inter = down_proj.shape[2]
    out = torch.zeros(x.shape[0], down_proj.shape[1], dtype=x.dtype, device=x.device)
    ids = topk_ids.long()
    for e in range(gate_up_proj.shape[0]):
        tok, slot = torch.nonzero(ids == e, as_tuple=True)
        if tok.numel() == 0:
            continue
        h = F.linear(x[tok], gate_up_proj[e])
        h = F.silu(h[:, :inter]) * h[:, inter:]
        y = F.linear(h if h_pass is None else h_pass(h), down_proj[e])
        out.index_add_(0, tok, y * topk_weights[tok, slot, None].to(y.dtype))
    return out


def budget(ref: torch.Tensor, base: torch.Tensor, reduction: int) -> Expected:
    """The reference `ref` (fp32) and its tolerance: 2x the error of plain PyTorch's `base`, floored
    at the rounding of fp32 sums of `reduction` terms (see module doc)."""
    baseline_err = float((base.float() - ref).abs().max()) if ref.numel() else 0.0
    scale = float(ref.abs().max()) if ref.numel() else 0.0
    fp32_floor = torch.finfo(torch.float32).eps * math.sqrt(reduction) * scale
    return Expected(ref=ref, baseline_err=baseline_err,
                    tol=TOLERANCE_FACTOR * max(baseline_err, fp32_floor))


def expected_output(x: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
                    topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> Expected:
    """fp32 reference and the tolerance for every backend run on these inputs."""
    ref = moe_experts_ref(x, gate_up_proj, down_proj, topk_weights, topk_ids)
    base = experts_same_dtype(x, gate_up_proj, down_proj, topk_weights, topk_ids)
    return budget(ref, base, x.shape[1] + down_proj.shape[2])


def _grads_of(fn, inputs: tuple[torch.Tensor, ...], topk_ids: torch.Tensor, grad_out: torch.Tensor,
              dtype: torch.dtype | None) -> list[torch.Tensor]:
    """Autograd gradients of fn(x, gate_up, down, weights, ids) for copies of `inputs` (the first three
    cast to `dtype` when given; the weights keep theirs)."""
    leaves = [t.detach().to(dtype if dtype is not None and i < 3 else t.dtype).clone().requires_grad_(True)
              for i, t in enumerate(inputs)]
    with torch.enable_grad():
        fn(*leaves, topk_ids).backward(grad_out.to(leaves[0].dtype))
    return [t.grad for t in leaves]


def expected_grads(x: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
                   topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                   grad_out: torch.Tensor) -> ExpectedGrads:
    """fp32 reference gradients of out.backward(grad_out) and each one's tolerance (see module doc)."""
    inputs = (x, gate_up_proj, down_proj, topk_weights)
    refs = [g.float() for g in _grads_of(moe_experts_ref, inputs, topk_ids, grad_out, torch.float32)]
    base = _grads_of(experts_same_dtype, inputs, topk_ids, grad_out, None)
    reduction = x.shape[1] + 2 * down_proj.shape[2] + x.shape[0]
    eps = torch.finfo(torch.float32).eps * math.sqrt(reduction)
    errs, tols = [], []
    for ref, b in zip(refs, base):
        err = float((b.float() - ref).abs().max()) if ref.numel() else 0.0
        scale = float(ref.abs().max()) if ref.numel() else 0.0
        errs.append(err)
        tols.append(TOLERANCE_FACTOR * max(err, eps * scale))
    return ExpectedGrads(tuple(refs), tuple(errs), tuple(tols))
