"""`Fp8Weight`s from the expert tensors of block-scaled FP8 checkpoints, in the layouts they ship in.

    fused        {prefix}.gate_up_proj (E, 2I, H) float8_e4m3fn, gate rows first, with
                 {prefix}.gate_up_proj_scale_inv (E, 2I / 128, H / 128); {prefix}.down_proj (E, H, I)
                 with {prefix}.down_proj_scale_inv (E, H / 128, I / 128): Transformers' FineGrainedFP8
                 experts (`FP8Experts`), and its state dicts
    per expert   {prefix}.{e}.gate_proj.weight (I, H) float8_e4m3fn with
                 {prefix}.{e}.gate_proj.weight_scale_inv (I / 128, H / 128); up_proj likewise;
                 down_proj (H, I) with (H / 128, I / 128): DeepSeek-V3's and Qwen3-FP8's safetensors
                 (prefix e.g. "model.layers.3.mlp.experts")

Every scale is `weight_scale_inv`: block (i, j) of a weight is data * scale, as `Fp8Weight` holds it.
Fused tensors are wrapped without a copy (float32 scales) or with their scales converted once to
float32 (float8_e8m0fnu, bfloat16 or float16 scales; exact for e8m0's powers of two); per-expert
tensors are stacked ([gate; up] rows into gate_up), one copy. The scales are read once
(`check_scale_values`: finite and positive), a host sync on CUDA, so load where the weights are loaded.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

import torch

from moekit.quant import FP8_BLOCK, FP8_DTYPE, Fp8Weight, check_scale_values

__all__ = ["check_fp8_tensors", "check_scale_values", "experts_from_checkpoint", "fp8_weight",
           "stack_experts"]

SCALE_DTYPES = tuple(d for d in (torch.float32, torch.bfloat16, torch.float16,
                                 getattr(torch, "float8_e8m0fnu", None)) if d is not None)


def _describe(t: object) -> str:
    return f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__


def check_fp8_tensors(name: str, weight: object, scale: object, ndim: int = 3) -> None:
    """Raise TypeError / ValueError naming `name` or `name`_scale_inv unless weight is an ndim-D
    float8_e4m3fn tensor whose last two sizes are multiples of 128 and scale a float32 /
    float8_e8m0fnu / bfloat16 / float16 tensor with one value per 128 x 128 block, on weight's
    device. Reads no tensor data."""
    dims = "(E, N, K)" if ndim == 3 else "(N, K)"
    if not isinstance(weight, torch.Tensor) or weight.dtype != FP8_DTYPE or weight.dim() != ndim:
        hint = (" (a dense weight: quantize it with moekit.quant.quantize_experts)"
                if isinstance(weight, torch.Tensor) and weight.dtype.is_floating_point
                and weight.element_size() > 1 else "")
        raise TypeError(f"{name} must be a {ndim}-D float8_e4m3fn tensor {dims}, got "
                        f"{_describe(weight)}{hint}")
    n, k = weight.shape[-2:]
    if n % FP8_BLOCK or k % FP8_BLOCK:
        raise ValueError(f"{name}: moekit's FP8 experts need its last two sizes divisible by {FP8_BLOCK} "
                         f"(128 x 128 scale blocks), got {tuple(weight.shape)}")
    want = (*weight.shape[:-2], n // FP8_BLOCK, k // FP8_BLOCK)
    if not isinstance(scale, torch.Tensor) or scale.dtype not in SCALE_DTYPES:
        raise TypeError(f"{name}_scale_inv must be a float32 (or float8_e8m0fnu, bfloat16, float16) tensor "
                        f"of shape {want}, got {_describe(scale)}")
    if tuple(scale.shape) != want:
        raise ValueError(f"{name}_scale_inv must have shape {want} (one scale per {FP8_BLOCK}x{FP8_BLOCK} "
                         f"block of {name} {tuple(weight.shape)}), got {tuple(scale.shape)}")
    if scale.device != weight.device:
        raise ValueError(f"{name}_scale_inv must be on {weight.device} (as {name}), got {scale.device}")


def fp8_weight(weight: torch.Tensor, weight_scale_inv: torch.Tensor, *, name: str = "weight") -> Fp8Weight:
    """An `Fp8Weight` of fused expert tensors: weight (E, N, K) float8_e4m3fn (N and K multiples of
    128) and weight_scale_inv (E, N / 128, K / 128), float32 (taken as is: no copy) or float8_e8m0fnu /
    bfloat16 / float16 (converted to float32). Raises TypeError / ValueError naming `name` (and
    `name`_scale_inv) for another dtype or shape, another device, or a scale that is NaN, infinite
    or not positive. `Fp8Weight.from_checkpoint` is this function."""
    check_fp8_tensors(name, weight, weight_scale_inv, 3)
    scale = weight_scale_inv if weight_scale_inv.dtype == torch.float32 else weight_scale_inv.float()
    check_scale_values(f"{name}_scale_inv", scale)
    return Fp8Weight(weight, scale)


@torch.no_grad()
def _stacked(rows: Sequence[Sequence[torch.Tensor]], scales: Sequence[Sequence[torch.Tensor]]) -> Fp8Weight:
    """Expert e's data: its row blocks rows[e] one under another (scales likewise, in float32),
    copied once into one (E, N, K) tensor; the blocks are checked already."""
    first = rows[0][0]
    n = sum(t.shape[0] for t in rows[0])
    data = torch.empty((len(rows), n, first.shape[1]), dtype=first.dtype, device=first.device)
    scale = torch.empty((len(rows), n // FP8_BLOCK, first.shape[1] // FP8_BLOCK), dtype=torch.float32,
                        device=first.device)
    for e, (parts, part_scales) in enumerate(zip(rows, scales)):
        torch.cat(list(parts), 0, out=data[e])
        torch.cat(list(part_scales), 0, out=scale[e])
    return Fp8Weight(data, scale)


def _check_experts(name: str, weights: Sequence[torch.Tensor], scales: Sequence[torch.Tensor],
                   names: Sequence[str] | None = None) -> None:
    if isinstance(weights, torch.Tensor) or isinstance(scales, torch.Tensor):
        raise TypeError(f"{name}: takes sequences of per-expert tensors; for one (E, N, K) tensor use "
                        "moekit.quant.loading.fp8_weight")
    if len(weights) != len(scales) or not weights:
        raise ValueError(f"{name}: need one scale per weight and at least one expert, got "
                         f"{len(weights)} weights and {len(scales)} scales")
    for e, (w, s) in enumerate(zip(weights, scales)):
        what = names[e] if names is not None else f"{name}[{e}]"
        check_fp8_tensors(what, w, s, 2)
        if w.shape != weights[0].shape or w.device != weights[0].device:
            raise ValueError(f"{what} has shape {tuple(w.shape)} on {w.device}, expert 0's "
                             f"{tuple(weights[0].shape)} on {weights[0].device}: the experts must match")


def stack_experts(weights: Sequence[torch.Tensor], scales: Sequence[torch.Tensor], *,
                  name: str = "weight") -> Fp8Weight:
    """An `Fp8Weight` (E, N, K) stacked from E per-expert tensors: weights[e] (N, K) float8_e4m3fn,
    scales[e] (N / 128, K / 128) (the dtypes `fp8_weight` takes). Errors name `name`[e]."""
    _check_experts(name, weights, scales)
    w = _stacked([[t] for t in weights], [[t] for t in scales])
    names = [f"{name}[{e}]_scale_inv" for e in range(len(weights))]
    check_scale_values(f"{name}_scale_inv", w.scale, [names])
    return w


def _get(tensors: Mapping[str, torch.Tensor], key: str, what: str) -> torch.Tensor:
    if key not in tensors:
        raise KeyError(f"{what}: the checkpoint has no {key!r}")
    return tensors[key]


def _num_experts(tensors: Mapping[str, torch.Tensor], prefix: str) -> int:
    """One more than the highest expert index any per-expert weight under prefix has (0: none); a
    gap below it is then a missing tensor, named, not the end of the experts."""
    pattern = re.compile(re.escape(prefix) + r"(\d+)\.(?:gate_proj|up_proj|down_proj)\.weight")
    found = [int(m.group(1)) for key in tensors if isinstance(key, str) and (m := pattern.fullmatch(key))]
    return max(found) + 1 if found else 0


def experts_from_checkpoint(tensors: Mapping[str, torch.Tensor], prefix: str = "",
                            ) -> tuple[Fp8Weight, Fp8Weight]:
    """(gate_up (E, 2I, H), down (E, H, I)) as `Fp8Weight`s, from a checkpoint's tensors (a state
    dict, or what `safetensors.torch.load_file` returns) under prefix, fused or per expert (module
    docstring). Per expert, gate and up are stacked as [gate; up] rows (the Transformers layout)
    with their scales likewise; the experts are 0, 1, ... up to the highest index present, each
    with all three projections (one missing is an error naming it).

    Raises:
        KeyError: neither layout under prefix, or a weight's or scale's tensor missing (named).
        TypeError / ValueError: a dtype, shape or device that is not the layout's (naming the
            tensor), gate_up and down that disagree, or a scale NaN, infinite or not positive.
    """
    if not isinstance(tensors, Mapping):
        raise TypeError(f"tensors must be a mapping of names to tensors, got {type(tensors).__name__}")
    if not isinstance(prefix, str):
        raise TypeError(f"prefix must be a str, got {type(prefix).__name__}")
    base = prefix + "." if prefix and not prefix.endswith(".") else prefix
    if f"{base}gate_up_proj" in tensors:
        gate_up = fp8_weight(tensors[f"{base}gate_up_proj"],
                             _get(tensors, f"{base}gate_up_proj_scale_inv", "fused gate_up_proj"),
                             name=f"{base}gate_up_proj")
        down = fp8_weight(_get(tensors, f"{base}down_proj", "fused down_proj"),
                          _get(tensors, f"{base}down_proj_scale_inv", "fused down_proj"),
                          name=f"{base}down_proj")
    else:
        num_experts = _num_experts(tensors, base)
        if not num_experts:
            raise KeyError(f"no FP8 experts under prefix {prefix!r}: expected {base}gate_up_proj (fused) or "
                           f"{base}0.gate_proj.weight (per expert)")
        parts = {}
        for proj in ("gate_proj", "up_proj", "down_proj"):
            keys = [f"{base}{e}.{proj}.weight" for e in range(num_experts)]
            weights = [_get(tensors, k, f"expert {e} {proj}") for e, k in enumerate(keys)]
            scales = [_get(tensors, k + "_scale_inv", f"expert {e} {proj}") for e, k in enumerate(keys)]
            _check_experts(f"{base}[e].{proj}.weight", weights, scales, keys)
            parts[proj] = weights, scales
        (gate, gate_s), (up, up_s) = parts["gate_proj"], parts["up_proj"]
        if gate[0].shape != up[0].shape or gate[0].device != up[0].device:
            raise ValueError(f"{base}0.gate_proj.weight {tuple(gate[0].shape)} on {gate[0].device} and "
                             f"{base}0.up_proj.weight {tuple(up[0].shape)} on {up[0].device} must match")
        gate_up = _stacked(list(zip(gate, up)), list(zip(gate_s, up_s)))
        down = _stacked([[t] for t in parts["down_proj"][0]], [[t] for t in parts["down_proj"][1]])
        keys = {p: [f"{base}{e}.{p}.weight_scale_inv" for e in range(num_experts)] for p in parts}
        check_scale_values("gate_up_proj_scale_inv", gate_up.scale, [keys["gate_proj"], keys["up_proj"]])
        check_scale_values("down_proj_scale_inv", down.scale, [keys["down_proj"]])
    num_experts, two_i, hidden = gate_up.shape
    if two_i % 2 or tuple(down.shape) != (num_experts, hidden, two_i // 2):
        raise ValueError(f"down_proj must have shape (E, H, I) = {(num_experts, hidden, two_i // 2)} for "
                         f"gate_up_proj {tuple(gate_up.shape)}, got {tuple(down.shape)}")
    if down.device != gate_up.device:
        raise ValueError(f"down_proj is on {down.device}, gate_up_proj on {gate_up.device}")
    return gate_up, down
