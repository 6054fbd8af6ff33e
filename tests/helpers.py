"""Test helpers shared by the suite (imported as `helpers`: pyproject.toml's `pythonpath` puts tests/ on
sys.path, for the tests in every folder under it).

The oracles here are written independently of the code under test (RELIABILITY.md case 27): plain
PyTorch, no moekit import except `moekit.reference.moe_experts_ref`, the project's fp32 reference
of the expert path (itself used by no backend).
"""

from __future__ import annotations

import importlib.util
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from moekit.reference import moe_experts_ref

ROOT = Path(__file__).resolve().parents[1]      # the checkout: src/, tools/, README.md, ...
DATA = ROOT / "tests" / "data"                  # the files the tests read (configs, recorded results)


def aot_compile_check(*args: str) -> str:
    """stdout of tools/aot_compile_check.py run with these arguments on this checkout's sources,
    which must exit 0; the test is skipped where this Triton has no CUDA backend or ptxas (exit 2)."""
    done = subprocess.run([sys.executable, str(ROOT / "tools" / "aot_compile_check.py"), *args],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    if done.returncode == 2:
        pytest.skip(done.stdout.strip())
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def poisoned(shape, dtype, device) -> torch.Tensor:
    """A fresh buffer full of NaN (or -1 for integers): unwritten elements show up in checks."""
    if dtype.is_floating_point:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.full(shape, -1, dtype=dtype, device=device)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """‖out − ref‖ / ‖ref‖ in fp64; NaN or Inf in either gives NaN, which fails every comparison."""
    out, ref = out.double(), ref.double()
    if not (torch.isfinite(out).all() and torch.isfinite(ref).all()):
        return math.nan
    denom = ref.norm().item()
    return (out - ref).norm().item() / (denom if denom > 0 else 1.0)


def distinct_topk_ids(num_tokens, num_experts, top_k, *, generator=None, device="cpu",
                      dtype=torch.int32, avoid: int | None = None) -> torch.Tensor:
    """(T, K) ids with K distinct experts per row; expert `avoid` (default E-1 when K < E) gets none."""
    if avoid is None and top_k < num_experts:
        avoid = num_experts - 1
    pool = [e for e in range(num_experts) if e != avoid] if avoid is not None else list(range(num_experts))
    pool_t = torch.tensor(pool)
    scores = torch.rand(num_tokens, len(pool), generator=generator)
    idx = scores.argsort(dim=1)[:, :top_k]
    return pool_t[idx].to(dtype=dtype, device=device)


def experts_same_dtype(x: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
                       topk_weights: torch.Tensor, topk_ids: torch.Tensor, *,
                       gate_up_bias: torch.Tensor | None = None, down_bias: torch.Tensor | None = None,
                       activation: str = "swiglu", alpha: float = 1.702, limit: float = 7.0,
                       interleaved: bool = False) -> torch.Tensor:
    """Plain PyTorch in x's dtype: the "PyTorch in the same dtype" baseline of the tolerance rule.

    Every (token, slot) pair with an id in [0, E) is computed on its own row: gate and up
    projections (+ gate_up_bias), the activation and the down projection (+ down_bias), each rounded
    to the dtype; times the routing weight (one rounding to the dtype); the K slots are added in
    slot order in the dtype. activation "gpt_oss" is Transformers' GptOssExperts._apply_gate
    written out (gate = min(gate, limit), up = clamp(up, -limit, limit), (up + 1) * gate *
    sigmoid(gate * alpha)); interleaved: gate rows 0, 2, 4, ..., up rows 1, 3, 5, ...
    Written without any moekit code, so a backend under test never sets its own bound.
    """
    num_tokens, hidden = x.shape
    num_experts, two_i, _ = gate_up_proj.shape
    inter = two_i // 2
    gate_rows = slice(0, two_i, 2) if interleaved else slice(0, inter)
    up_rows = slice(1, two_i, 2) if interleaved else slice(inter, two_i)
    out = torch.zeros(num_tokens, hidden, dtype=x.dtype, device=x.device)
    for slot in range(topk_ids.shape[1]):
        ids = topk_ids[:, slot].long()
        contrib = torch.zeros_like(out)
        for e in range(num_experts):
            rows = torch.nonzero(ids == e)[:, 0]
            if rows.numel() == 0:
                continue
            xe = x[rows]
            gate = xe @ gate_up_proj[e, gate_rows].T
            up = xe @ gate_up_proj[e, up_rows].T
            if gate_up_bias is not None:
                gate, up = gate + gate_up_bias[e, gate_rows], up + gate_up_bias[e, up_rows]
            if activation == "gpt_oss":
                gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
                h = (up + 1) * (gate * torch.sigmoid(gate * alpha))
            else:
                h = F.silu(gate) * up
            y = h @ down_proj[e].T
            if down_bias is not None:
                y = y + down_bias[e]
            contrib[rows] = (y.float() * topk_weights[rows, slot].float()[:, None]).to(x.dtype)
        out = out + contrib
    return out


def same_dtype_bound(x: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
                     topk_weights: torch.Tensor, topk_ids: torch.Tensor, ref: torch.Tensor,
                     **expert_math) -> float:
    """2x the relative error of `experts_same_dtype` against the fp32 reference `ref` (quack's rule).
    `expert_math`: the keyword arguments of `experts_same_dtype` (biases, activation, interleaved).

    A baseline that is not finite sets no bound: the test fails here instead of comparing with inf.
    """
    base = experts_same_dtype(x, gate_up_proj, down_proj, topk_weights, topk_ids, **expert_math)
    base_err = rel_err(base, ref)
    assert math.isfinite(base_err), f"the same-dtype baseline or the reference is not finite ({base_err})"
    return 2 * base_err


def experts_plain(x, gate_up, down, w, ids):
    """Plain PyTorch in x's dtype, differentiated by autograd: the baseline of the 2x rule."""
    inter = gate_up.shape[1] // 2
    out = torch.zeros_like(x)
    for e in range(gate_up.shape[0]):
        tok, slot = torch.nonzero(ids == e, as_tuple=True)
        if tok.numel() == 0:
            continue
        a = x[tok] @ gate_up[e].T
        y = (F.silu(a[:, :inter]) * a[:, inter:]) @ down[e].T
        out = out.index_add(0, tok, (y.float() * w[tok, slot, None]).to(x.dtype))
    return out


def check_exact_zeros(grads, ids, num_experts):
    """Experts without pairs: exactly 0 weight grads; slots outside [0, E): exactly 0 weight grad;
    tokens with no valid slot: exactly 0 dx."""
    valid = (ids >= 0) & (ids < num_experts)
    used = torch.zeros(num_experts, dtype=torch.bool)
    used[ids[valid]] = True
    dx, d_gu, d_down, d_w = grads
    assert not used.all(), "every case must leave an expert without pairs"
    for g in (d_gu, d_down):
        if g is not None:
            assert torch.equal(g[~used], torch.zeros_like(g[~used]))
    if d_w is not None:
        assert torch.equal(d_w[~valid], torch.zeros_like(d_w[~valid]))
    if dx is not None:
        dead = ~valid.any(1)
        assert torch.equal(dx[dead], torch.zeros_like(dx[dead]))


class EagerReplay:
    """Stands in for a `torch.cuda.CUDAGraph` on the CPU: `replay()` runs the recorded body again,
    under no_grad as it was captured, so a captured layer's `__call__` runs unchanged."""

    def __init__(self, body):
        self.body = body

    def replay(self) -> None:
        with torch.no_grad():
            self.body()


def check_replay_refusals(captured, x: torch.Tensor) -> None:
    """What a captured layer whose parameters require grad must refuse with grad mode on: the call
    itself (a replay records no autograd), then x of another dtype or device (never cast)."""
    with pytest.raises(RuntimeError, match="the layer's parameters require grad.*forward-only.*no_grad"):
        captured(x)
    with pytest.raises(TypeError, match=rf"x has dtype torch.float64.*captured in {x.dtype}"):
        captured(x.double())
    with pytest.raises(ValueError, match=f"x must be on the captured layer's device {x.device}, got meta"):
        captured(x.to("meta"))


def topk_softmax_fp32(logits: torch.Tensor, top_k: int,
                      renormalize: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Independent fp32 router reference: (weights float32 (T, K), ids int32 (T, K)).

    Experts ordered by logit, highest first; equal logits (-0.0 equals +0.0) go to the lower
    expert id; NaN ranks below every number. Weights: softmax over the fp32 logits with +inf read
    as the largest float and -inf, NaN as the most negative one (moekit's documented behaviour),
    gathered at the ids; renormalised to sum 1 if asked (a zero sum is left at 0, not NaN).
    """
    x = logits.float() + 0.0
    nan = torch.isnan(x)
    # Two stable sorts: by value (highest first), then NaN last; ties keep ascending expert order.
    order = torch.sort(torch.where(nan, 0.0, -x), dim=-1, stable=True).indices
    order = order.gather(-1, torch.sort(nan.gather(-1, order).int(), dim=-1, stable=True).indices)
    ids = order[:, :top_k]
    big = torch.finfo(torch.float32).max
    probs = torch.softmax(x.nan_to_num(nan=-big, posinf=big, neginf=-big), dim=-1)
    weights = probs.gather(-1, ids)
    if renormalize:
        total = weights.sum(-1, keepdim=True)
        weights = torch.where(total > 0, weights / total, 0.0)
    return weights, ids.to(torch.int32)


def layer_ref(x: torch.Tensor, router_weight: torch.Tensor, gate_up_proj: torch.Tensor,
              down_proj: torch.Tensor, top_k: int, renormalize: bool = True) -> torch.Tensor:
    """The whole layer in fp32: fp32 logits, `topk_softmax_fp32`, then `moe_experts_ref`."""
    weights, ids = topk_softmax_fp32(x.float() @ router_weight.float().T, top_k, renormalize)
    return moe_experts_ref(x, gate_up_proj, down_proj, weights, ids)


def align_ref(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> dict[str, torch.Tensor]:
    """What `align_block_size` must return, built pair by pair in Python (independent of moekit).

    Pair p = t * K + k. Expert by expert (ascending), its pairs in ascending order, then the
    sentinel S up to a multiple of block_m; after the last expert the sentinel up to the buffer
    length L = S + min(E, S) * (block_m - 1). expert_ids: the expert of each block in use, -1 after;
    block_codes: how paired tiles cover each block (`Alignment.block_codes`).
    """
    flat = topk_ids.reshape(-1).tolist()
    num_pairs = len(flat)
    length = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    by_expert: list[list[int]] = [[] for _ in range(num_experts)]
    for p, e in enumerate(flat):
        if 0 <= e < num_experts:
            by_expert[e].append(p)
    sorted_ids: list[int] = []
    expert_ids: list[int] = []
    block_codes: list[int] = []   # paired tiles: 2 starts a two-block tile, 1 a lone block, 0 skip
    for e, pairs in enumerate(by_expert):
        blocks = -(-len(pairs) // block_m)
        sorted_ids += pairs + [num_pairs] * (blocks * block_m - len(pairs))
        expert_ids += [e] * blocks
        block_codes += [0 if j % 2 else (2 if j + 1 < blocks else 1) for j in range(blocks)]
    num_padded = len(sorted_ids)
    sorted_ids += [num_pairs] * (length - num_padded)
    max_blocks = -(-length // block_m)
    expert_ids += [-1] * (max_blocks - len(expert_ids))
    block_codes += [0] * (max_blocks - len(block_codes))
    return {
        "sorted_ids": torch.tensor(sorted_ids, dtype=torch.int32),
        "expert_ids": torch.tensor(expert_ids, dtype=torch.int32),
        "num_padded": torch.tensor(num_padded, dtype=torch.int32),
        "tokens_per_expert": torch.tensor([len(p) for p in by_expert], dtype=torch.int32),
        "block_codes": torch.tensor(block_codes, dtype=torch.int32),
    }


def assert_alignment_equals(a, expected: dict[str, torch.Tensor]) -> None:
    """Every field of an `Alignment` equal (values and dtype) to `align_ref`'s."""
    for name, want in expected.items():
        got = getattr(a, name).cpu()
        assert got.dtype == want.dtype and got.shape == want.shape, (name, got.dtype, tuple(got.shape))
        assert torch.equal(got, want), name


def run_cli(argv: list[str]) -> int:
    """`moekit` with argv, in this process; its exit status (argparse's SystemExit code included)."""
    from moekit.cli import main

    try:
        return main(argv)
    except SystemExit as exc:
        return exc.code


def error_line(capsys, prog: str) -> str:
    """The single error line the command printed to stderr (argparse may print its usage before it)."""
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = [ln for ln in err.strip().splitlines() if ln.startswith(f"{prog}: error: ")]
    assert len(lines) == 1, err
    return lines[0]


def hopper_with_gluon() -> bool:
    """A CUDA device of compute capability 9 and a Triton with Gluon: where the Hopper Gluon kernels'
    GPU tests run."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        return False
    return importlib.util.find_spec("triton.experimental.gluon") is not None


def softmax_routing(num_tokens, num_experts, top_k, *, generator, device="cuda", kind="softmax"):
    """(weights (T, K) fp32 renormalised and contiguous, ids (T, K) int32) from softmax(randn) top-k
    with the last expert never picked (it gets no pairs); kind "one-expert": every id 5; "sentinels":
    every third token's first slot -1 and the next token's last slot E (pairs never placed)."""
    logits = torch.randn(num_tokens, num_experts, device=device, generator=generator)
    logits[:, -1] = float("-inf")
    w, ids = torch.softmax(logits, -1).topk(top_k, -1)
    w, ids = (w / w.sum(-1, keepdim=True)).contiguous(), ids.to(torch.int32)
    if kind == "one-expert":
        ids = torch.full_like(ids, 5)
    elif kind == "sentinels":
        ids[::3, 0] = -1
        ids[1::3, -1] = num_experts
    return w, ids


def check_training_step(run, shape, num_tokens, *, seed=0, device="cuda", dtype=torch.bfloat16):
    """A training step of the experts at shape (E, H, I, K) on fresh random inputs: run(x, gate_up,
    down, w, ids) -> out is the call under test. Its four gradients must lie within 2x plain PyTorch's
    error in `dtype` against fp32 autograd through `moe_experts_ref`, a second backward through the
    retained graph must give them bit for bit while making no host sync (CUDA), and experts without
    pairs must get exact zeros. Returns the first backward's gradients."""
    num_experts, hidden, inter, top_k = shape
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(num_tokens, hidden, device=device, generator=gen).to(dtype)
    gate_up = torch.randn(num_experts, 2 * inter, hidden, device=device, generator=gen) / hidden**0.5
    gate_up = gate_up.to(dtype)
    down = (torch.randn(num_experts, hidden, inter, device=device, generator=gen) / inter**0.5).to(dtype)
    w, ids = softmax_routing(num_tokens, num_experts, top_k, generator=gen, device=device)
    dout = torch.randn(num_tokens, hidden, device=device, generator=gen).to(dtype)
    ref_leaves = [t.detach().float().clone().requires_grad_(True) for t in (x, gate_up, down, w)]
    moe_experts_ref(*ref_leaves, ids).backward(dout.float())
    base = [t.clone().requires_grad_(True) for t in (x, gate_up, down, w)]
    experts_plain(*base, ids).backward(dout)
    leaves = [t.clone().requires_grad_(True) for t in (x, gate_up, down, w)]
    out = run(*leaves, ids)
    got = torch.autograd.grad(out, leaves, dout, retain_graph=True)
    cuda = torch.device(device).type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
    try:
        again = torch.autograd.grad(out, leaves, dout)
    finally:
        if cuda:
            torch.cuda.set_sync_debug_mode("default")
    for g, b, ref, g2 in zip(got, (t.grad for t in base), (t.grad for t in ref_leaves), again, strict=True):
        assert g.dtype == b.dtype
        assert rel_err(g, ref) <= 2 * rel_err(b, ref), (rel_err(g, ref), rel_err(b, ref))
        assert torch.equal(g, g2)
    check_exact_zeros([g.cpu() for g in got], ids.cpu().long(), num_experts)
    return got


def smem_bytes(cfg, itemsize: int, gemm: int) -> int:
    """Shared memory of one GEMM's pipelined tiles of an `ExpertsConfig`, written out by hand: per
    stage an A tile (block_m x block_k) and the B tiles (block_k x block_n; GEMM1 streams gate and up:
    two)."""
    if gemm == 1:
        return cfg.stages1 * (cfg.block_m * cfg.block_k1 + 2 * cfg.block_k1 * cfg.block_n1) * itemsize
    return cfg.stages2 * (cfg.block_m * cfg.block_k2 + cfg.block_k2 * cfg.block_n2) * itemsize
