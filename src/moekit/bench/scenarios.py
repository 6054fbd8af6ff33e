"""Routing scenarios: synthetic and recorded (T, K) routings, from balanced to full collapse.

Every generator returns `(topk_weights float32 (T, K), topk_ids int32 (T, K))`, like `moekit.route`,
with K distinct experts in [0, E) per token and each row's weights positive, sorted descending and
summing to 1 (as a renormalised top-k router gives them). The same seed gives the same routing on
every device: everything is drawn on the CPU with a `torch.Generator` and moved afterwards.

    balanced        every expert gets S / E pairs (+-1): the ideal a load-balancing loss aims at
    random_router   a random router matrix (E, H) applied to random tokens through `moekit.route`
    zipf(s)         expert of popularity rank r drawn with probability ~ 1 / r^s, K without
                    replacement; ranks are given to experts by a seeded permutation
    hot(n)          n seeded experts that every token picks, the other K - n uniform
    collapse        every token on experts 0..K-1: busiest / mean = E / K, the maximum skew
    from_file       a saved trace (.pt or .npy of ids), so routing recorded from a model replays

`make_scenario(name, ...)` builds one by name ("balanced", "zipf-1.5", "hot-4", "file", ...).
T tokens, E experts, K top_k, S = T * K pairs.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from moekit._validation import check_tensor, check_top_k
from moekit.routing import route

ZIPF_EXPONENTS = (0.5, 1.0, 1.5)
INTEGER_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.uint16, torch.uint32,
                  torch.uint64)     # a trace's ids: any integer dtype (bool, floats and complex refused)
# The study's default scenarios, in order of rising skew (roughly); "hot" takes n = K // 2 there.
SCENARIOS = ("balanced", "random_router", "zipf-0.5", "zipf-1.0", "zipf-1.5", "hot", "collapse")

Routing = tuple[torch.Tensor, torch.Tensor]


def _check_sizes(num_tokens: int, num_experts: int, top_k: int) -> None:
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 0:
        raise ValueError(f"num_tokens must be an int >= 0, got {num_tokens!r}")
    if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"num_experts must be a positive int, got {num_experts!r}")
    check_top_k(top_k, num_experts)


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _weights(num_tokens: int, top_k: int, gen: torch.Generator) -> torch.Tensor:
    # Softmax of random logits, sorted descending: the shape a renormalised top-k router's output has.
    w = torch.softmax(torch.randn(num_tokens, top_k, generator=gen), dim=-1)
    return w.sort(dim=-1, descending=True).values


def _finish(weights: torch.Tensor, ids: torch.Tensor, device: torch.device | str | None) -> Routing:
    return (weights.to(device=device, dtype=torch.float32),
            ids.to(device=device, dtype=torch.int32).contiguous())


def _shuffle_rows(ids: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Permute each row's K ids independently, so no expert is tied to one slot."""
    if ids.numel() == 0:
        return ids
    perm = torch.rand(ids.shape, generator=gen).argsort(dim=1)
    return torch.gather(ids, 1, perm)


def balanced(num_tokens: int, num_experts: int, top_k: int, *, seed: int = 0,
             device: torch.device | str | None = None) -> Routing:
    """Perfect balance: pair p = t*K + j goes to expert perm[p mod E], so counts differ by at most 1.

    K consecutive residues mod E are distinct because K <= E; a seeded permutation of the expert
    labels and of each row's slots hides the construction without changing any count.
    """
    _check_sizes(num_tokens, num_experts, top_k)
    gen = _generator(seed)
    pairs = torch.arange(num_tokens * top_k).view(num_tokens, top_k)
    labels = torch.randperm(num_experts, generator=gen)
    ids = _shuffle_rows(labels[pairs % num_experts], gen)
    return _finish(_weights(num_tokens, top_k, gen), ids, device)


def random_router(num_tokens: int, num_experts: int, top_k: int, *, hidden_size: int = 64,
                  seed: int = 0, renormalize: bool = True,
                  device: torch.device | str | None = None) -> Routing:
    """Random tokens x (T, H) ~ N(0, 1) through a random router (E, H) ~ N(0, 1/H), via `route`.

    This is the routing of an untrained model: mild skew from the spread of the router rows' norms
    and from sampling noise. Routed in fp32 on the CPU so the ids are the same on every device.
    """
    _check_sizes(num_tokens, num_experts, top_k)
    if isinstance(hidden_size, bool) or not isinstance(hidden_size, int) or hidden_size < 1:
        raise ValueError(f"hidden_size must be a positive int, got {hidden_size!r}")
    gen = _generator(seed)
    router = torch.randn(num_experts, hidden_size, generator=gen) / hidden_size**0.5
    x = torch.randn(num_tokens, hidden_size, generator=gen)
    weights, ids = route(x, router, top_k, renormalize=renormalize, backend="torch")
    return _finish(weights, ids, device)


def zipf(num_tokens: int, num_experts: int, top_k: int, s: float = 1.0, *, seed: int = 0,
         device: torch.device | str | None = None) -> Routing:
    """Zipf popularity: each token draws K distinct experts, P(rank r) ~ 1 / r^s, without replacement.

    Popularity ranks 1..E are given to experts by a seeded permutation, so the hot experts are
    scattered over expert-parallel ranks rather than all in the first one (`collapse` covers that).
    s = 0 is uniform; larger s is more skewed; busiest / mean never exceeds E / K (the hottest expert
    can take at most one pair per token).
    """
    _check_sizes(num_tokens, num_experts, top_k)
    if not (isinstance(s, int | float) and not isinstance(s, bool) and s >= 0 and np.isfinite(s)):
        raise ValueError(f"zipf exponent s must be a finite number >= 0, got {s!r}")
    gen = _generator(seed)
    ranks = torch.arange(1, num_experts + 1, dtype=torch.float64)
    probs = ranks.pow(-float(s))
    labels = torch.randperm(num_experts, generator=gen)
    if num_tokens == 0:
        ids = torch.empty(0, top_k, dtype=torch.int64)
    else:
        # multinomial without replacement is sequential draws renormalised over the experts left
        # (Plackett-Luce): exactly "K distinct experts, each draw proportional to 1 / r^s".
        drawn = torch.multinomial(probs.expand(num_tokens, -1), top_k, replacement=False, generator=gen)
        ids = labels[drawn]
    return _finish(_weights(num_tokens, top_k, gen), ids, device)


def hot(num_tokens: int, num_experts: int, top_k: int, n: int | None = None, *, seed: int = 0,
        device: torch.device | str | None = None) -> Routing:
    """n hot experts (seeded choice) that every token picks; its other K - n experts are uniform.

    Default n = max(1, K // 2) (4 of 8 for Qwen3-30B-A3B, as in the article). Each hot expert gets T
    pairs, so busiest / mean = E / K, the same peak as `collapse`, but on only n experts.
    """
    _check_sizes(num_tokens, num_experts, top_k)
    if n is None:
        n = max(1, top_k // 2)
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= top_k:
        raise ValueError(f"hot: n must be an int in [1, top_k={top_k}], got {n!r}")
    gen = _generator(seed)
    labels = torch.randperm(num_experts, generator=gen)
    hot_ids, cold_pool = labels[:n], labels[n:]
    # The K - n cold picks: the first K - n of a random permutation of the E - n cold experts.
    scores = torch.rand(num_tokens, num_experts - n, generator=gen)
    cold = cold_pool[scores.argsort(dim=1)[:, : top_k - n]]
    ids = torch.cat([hot_ids.expand(num_tokens, -1), cold], dim=1)
    ids = _shuffle_rows(ids, gen)
    return _finish(_weights(num_tokens, top_k, gen), ids, device)


def collapse(num_tokens: int, num_experts: int, top_k: int, *, seed: int = 0,
             device: torch.device | str | None = None) -> Routing:
    """Every token on experts 0..K-1 (in a per-row shuffled order): busiest / mean = E / K exactly.

    Experts 0..K-1 sit on the first expert-parallel rank under contiguous placement, so this is also
    the worst case for expert parallelism.
    """
    _check_sizes(num_tokens, num_experts, top_k)
    gen = _generator(seed)
    ids = _shuffle_rows(torch.arange(top_k).expand(num_tokens, -1).contiguous(), gen)
    return _finish(_weights(num_tokens, top_k, gen), ids, device)


def _load_trace(path: Path) -> tuple[torch.Tensor, torch.Tensor | None]:
    suffix = path.suffix.lower()
    if suffix not in (".pt", ".npy"):
        raise ValueError(f"routing trace {path}: expected a .pt or .npy file, got {suffix!r}")
    try:
        if suffix == ".npy":
            obj = np.load(path, allow_pickle=False)
        else:
            obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # any failure to read is reported against the file
        raise ValueError(f"routing trace {path}: cannot read it ({type(exc).__name__}: {exc})") from exc
    weights = None
    if isinstance(obj, dict):
        key = next((k for k in ("topk_ids", "ids") if k in obj), None)
        if key is None:
            raise ValueError(f"routing trace {path}: a dict trace needs a 'topk_ids' entry, got keys "
                             f"{sorted(map(str, obj))}")
        weights = obj.get("topk_weights", obj.get("weights"))
        obj = obj[key]
    if isinstance(obj, np.ndarray):
        obj = torch.from_numpy(obj)
    if not isinstance(obj, torch.Tensor):
        raise ValueError(f"routing trace {path}: expected a tensor or array of ids, got {type(obj).__name__}")
    if isinstance(weights, np.ndarray):
        weights = torch.from_numpy(weights)
    return obj, weights


def from_file(path: str | os.PathLike, num_experts: int, *, num_tokens: int | None = None,
              top_k: int | None = None, device: torch.device | str | None = None) -> Routing:
    """Replay a recorded routing: a .npy array of ids (T, K), or a .pt tensor of ids or dict
    {"topk_ids": (T, K), optional "topk_weights": (T, K)} (what `save_trace` writes).

    Args:
        path: the trace file.
        num_experts: E of the layer it will run on; every id must lie in [0, E).
        num_tokens: replay this many tokens: the first T rows, cycling through the trace again
            when it is shorter. Default: all of its rows.
        top_k: if given, the trace must have exactly this many columns.
        device: where the result goes.

    Returns:
        (topk_weights, topk_ids); weights are the recorded ones, or 1/K each when none were saved.

    Raises:
        ValueError naming the file when it cannot be read, is not 2-D integer ids, has ids out of
        range or repeated within a row, or its weights do not match the ids' shape.
    """
    path = Path(path)
    ids, weights = _load_trace(path)
    if ids.dim() != 2 or ids.shape[1] < 1 or ids.dtype not in INTEGER_DTYPES:
        raise ValueError(f"routing trace {path}: expected 2-D integer ids (T, K), got "
                         f"{ids.dtype} of shape {tuple(ids.shape)}")
    ids = ids.long()
    if top_k is not None and ids.shape[1] != top_k:
        raise ValueError(f"routing trace {path}: has K={ids.shape[1]} ids per token, expected {top_k}")
    if ids.shape[1] > num_experts:
        raise ValueError(f"routing trace {path}: has K={ids.shape[1]} ids per token, more than the layer's "
                         f"{num_experts} experts")
    if ids.numel():
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= num_experts:
            raise ValueError(f"routing trace {path}: ids must lie in [0, {num_experts}), got values "
                             f"in [{lo}, {hi}]")
        srt = ids.sort(dim=1).values
        if (srt[:, 1:] == srt[:, :-1]).any():
            raise ValueError(f"routing trace {path}: some token lists an expert twice; a router "
                             "picks K distinct experts")
    if weights is None:
        weights = torch.full(ids.shape, 1.0 / ids.shape[1])
    else:
        if not isinstance(weights, torch.Tensor) or tuple(weights.shape) != tuple(ids.shape):
            got = tuple(weights.shape) if isinstance(weights, torch.Tensor) else type(weights).__name__
            raise ValueError(f"routing trace {path}: weights must have the ids' shape "
                             f"{tuple(ids.shape)}, got {got}")
        weights = weights.float()
    if num_tokens is not None:
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 0:
            raise ValueError(f"num_tokens must be an int >= 0, got {num_tokens!r}")
        if num_tokens and ids.shape[0] == 0:
            raise ValueError(f"routing trace {path}: is empty, cannot replay {num_tokens} tokens")
        rows = torch.arange(num_tokens) % max(1, ids.shape[0])
        ids, weights = ids[rows], weights[rows]
    return _finish(weights, ids, device)


def save_trace(path: str | os.PathLike, topk_ids: torch.Tensor,
               topk_weights: torch.Tensor | None = None) -> Path:
    """Save a routing for `from_file`: .pt keeps ids and weights, .npy the ids only.

    Written to a temporary file and renamed, so a crash never leaves half a trace behind.
    """
    path = Path(path)
    check_tensor("topk_ids", topk_ids, ndim=2)
    suffix = path.suffix.lower()
    if suffix not in (".pt", ".npy"):
        raise ValueError(f"save_trace: path must end in .pt or .npy, got {path}")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=suffix)
    try:
        with os.fdopen(fd, "wb") as f:
            if suffix == ".npy":
                np.save(f, topk_ids.detach().cpu().to(torch.int32).numpy())
            else:
                obj = {"topk_ids": topk_ids.detach().cpu().to(torch.int32)}
                if topk_weights is not None:
                    obj["topk_weights"] = topk_weights.detach().cpu().float()
                torch.save(obj, f)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def make_scenario(name: str, num_tokens: int, num_experts: int, top_k: int, *, seed: int = 0,
                  hidden_size: int = 64, trace: str | os.PathLike | None = None,
                  device: torch.device | str | None = None) -> Routing:
    """Build a scenario by name: "balanced", "random_router", "zipf-<s>", "hot" or "hot-<n>",
    "collapse", or "file" (needs `trace`)."""
    kind, _, arg = name.partition("-")
    common = dict(seed=seed, device=device)
    if name == "balanced":
        return balanced(num_tokens, num_experts, top_k, **common)
    if name == "random_router":
        return random_router(num_tokens, num_experts, top_k, hidden_size=hidden_size, **common)
    if name == "collapse":
        return collapse(num_tokens, num_experts, top_k, **common)
    if kind == "zipf" and arg:
        return zipf(num_tokens, num_experts, top_k, _parse(name, arg, float), **common)
    if kind == "hot":
        return hot(num_tokens, num_experts, top_k, _parse(name, arg, int) if arg else None, **common)
    if name == "file":
        if trace is None:
            raise ValueError("scenario 'file' needs a trace path")
        return from_file(trace, num_experts, num_tokens=num_tokens, top_k=top_k, device=device)
    known = [*SCENARIOS, "hot-<n>", "zipf-<s>", "file"]
    raise ValueError(f"unknown scenario {name!r}; expected one of {known}")


def _parse(name: str, arg: str, kind: type) -> float | int:
    try:
        return kind(arg)
    except ValueError:
        raise ValueError(f"scenario {name!r}: cannot read {arg!r} as {kind.__name__}") from None


def expert_loads(topk_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """int64 (E,) pairs per expert; ids outside [0, E) (expert-parallel -1s) are not counted."""
    flat = topk_ids.reshape(-1).long()
    flat = flat[(flat >= 0) & (flat < num_experts)]
    return torch.bincount(flat, minlength=num_experts)


def busiest_over_mean(loads: torch.Tensor | Sequence[int]) -> float:
    """Busiest count / mean count (1.0 = perfect balance; E / K = collapse). 0 pairs -> 1.0."""
    loads = torch.as_tensor(loads, dtype=torch.float64)
    mean = loads.mean().item() if loads.numel() else 0.0
    return loads.max().item() / mean if mean > 0 else 1.0
