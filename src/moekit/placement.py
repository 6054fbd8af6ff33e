"""Expert placement for expert parallelism (EP): which rank holds which experts, and who runs a pair.

N ranks each hold up to `slots_per_rank` experts' weights. Every expert has at least one copy; a hot
expert may have copies on several ranks (the idea behind DeepSeek's EPLB), and then its pairs are
split among the copies by a fixed rule, so that every rank can compute the split on the device
without talking to the others:

    copies of expert e   the ranks holding e, in ascending rank order: c_0, c_1, ..., c_{n_e - 1}
    pair split           count the pairs routed to e in ascending pair index p = t * K + k; the
                         j-th of them runs on copy c_{(j + s) mod n_e}, s = the source rank whose
                         batch it is (0 for one global batch)

The split is round-robin, so copies differ by at most one pair per source batch whatever the
tokens are, and the offset s spreads the leftover pairs of different sources over different copies.
It depends only on per-expert counts, so `rank_loads` predicts every rank's pairs exactly from
(E,) loads, which is what lets `replicate_hot_experts` plan from loads alone.

Data (T tokens, K top_k, E global experts, N ranks, L = slots_per_rank):
    Placement.slots        slots[r] = global expert ids on rank r; local index i holds slots[r][i]
    Assignment.rank        int32 (T, K): the rank that runs pair (t, k); -1 for ids outside [0, E)
    Assignment.local_ids   int32 (T, K): the pair's expert index on that rank; -1 likewise

Placements: `contiguous_placement` (rank r holds experts [r*E/N, (r+1)*E/N), plus free slots),
`strided_placement` (rank r holds r, r+N, ...) and `replicate_hot_experts` (fills free slots with
copies of the hottest experts). `rank_loads` predicts pairs per rank from pairs per expert; `assign`
maps topk_ids to ranks on the device (no host sync, CUDA-graph safe; without replicas a table
lookup, with them a sort for each pair's rank among its expert's pairs); `rank_weights` copies out
one rank's experts. `Placement.device_tables` keeps the lookup tables on each device.
"""

from __future__ import annotations

import operator
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, fields
from functools import cached_property

import torch

from moekit._validation import ID_DTYPES, check_tensor
from moekit.align import sort_pairs


def _as_id(value, name: str) -> int:
    """An int (Python, NumPy or 0-d integer tensor) as a Python int; a float or bool is a TypeError."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__})") from None


@dataclass(frozen=True)
class Placement:
    """Which global experts each expert-parallel rank holds.

    Attributes:
        num_experts: E, global experts; each of 0..E-1 is held by at least one rank.
        slots: N tuples; slots[r][i] is the global expert at rank r's local index i. A rank holds an
            expert at most once; an expert on several ranks is replicated (see the module docstring
            for how its pairs are split).
        slots_per_rank: L, the most experts one rank may hold (its weight memory); len(slots[r]) <= L.
    """

    num_experts: int
    slots: tuple[tuple[int, ...], ...]
    slots_per_rank: int

    def __post_init__(self) -> None:
        e = self.num_experts
        if isinstance(e, bool) or not isinstance(e, int) or e < 1:
            raise ValueError(f"Placement.num_experts must be a positive int, got {e!r}")
        slots = tuple(tuple(_as_id(x, f"Placement.slots[{r}][{i}]") for i, x in enumerate(s))
                      for r, s in enumerate(self.slots))
        object.__setattr__(self, "slots", slots)
        if not slots:
            raise ValueError("Placement.slots must list at least one rank")
        # assign() splits flat slots with // slots_per_rank: a float would send pairs to wrong ranks.
        object.__setattr__(self, "slots_per_rank", _as_id(self.slots_per_rank, "Placement.slots_per_rank"))
        if self.slots_per_rank < max(len(s) for s in slots):
            raise ValueError(f"Placement: a rank holds {max(len(s) for s in slots)} experts, more than "
                             f"slots_per_rank={self.slots_per_rank}")
        seen: set[int] = set()
        for r, s in enumerate(slots):
            if len(set(s)) != len(s):
                raise ValueError(f"Placement: rank {r} holds an expert twice: {s}")
            bad = [x for x in s if not 0 <= x < e]
            if bad:
                raise ValueError(f"Placement: rank {r} holds experts {bad} outside [0, {e})")
            seen.update(s)
        if len(seen) != e:
            missing = sorted(set(range(e)) - seen)
            raise ValueError(f"Placement: experts {missing[:8]}{'...' if len(missing) > 8 else ''} "
                             "are held by no rank")

    @property
    def num_ranks(self) -> int:
        return len(self.slots)

    @cached_property
    def copies(self) -> tuple[tuple[tuple[int, int], ...], ...]:
        """copies[e] = ((rank, local index), ...) of expert e, in ascending rank order."""
        out: list[list[tuple[int, int]]] = [[] for _ in range(self.num_experts)]
        for r, s in enumerate(self.slots):
            for i, e in enumerate(s):
                out[e].append((r, i))
        return tuple(tuple(c) for c in out)

    @cached_property
    def num_copies(self) -> tuple[int, ...]:
        return tuple(len(c) for c in self.copies)

    @cached_property
    def num_replicas(self) -> int:
        """Copies beyond the first, over all experts."""
        return sum(self.num_copies) - self.num_experts

    @cached_property
    def digest(self) -> int:
        """CRC-32 of (num_experts, slots), the same in every process: what the ranks of a group compare
        to agree on the placement (the slots decide where every pair goes)."""
        return zlib.crc32(repr((self.num_experts, self.slots)).encode())

    @cached_property
    def _on_device(self) -> dict[torch.device, DeviceTables]:
        return {}

    def __getstate__(self) -> dict:
        # The fields only: a pickled placement (spawned ranks, all_gather_object) carries no cached
        # property, in particular no device tensor.
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def device_tables(self, device: torch.device | str) -> DeviceTables:
        """The placement's lookup tables on `device`, built on the first call for that device and
        kept (later calls make no copy, so they are safe inside a CUDA graph capture)."""
        dev = torch.device(device)
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        if dev not in self._on_device:
            self._on_device[dev] = DeviceTables.build(self, dev)
        return self._on_device[dev]

    def copy_table(self, device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Device tables for `assign`: (table int64 (E, max copies), n_copies int64 (E,)).

        table[e, c] = rank * slots_per_rank + local index of copy c of e (unused entries repeat copy
        0, never read).
        """
        width = max(self.num_copies)
        table = torch.empty(self.num_experts, width, dtype=torch.int64)
        for e, cs in enumerate(self.copies):
            flat = [r * self.slots_per_rank + i for r, i in cs]
            table[e] = torch.tensor(flat + [flat[0]] * (width - len(flat)))
        return table.to(device), torch.tensor(self.num_copies, dtype=torch.int64, device=device)


@dataclass(frozen=True)
class DeviceTables:
    """A placement's lookup tables on one device (`Placement.device_tables`). E experts, N ranks.

    Attributes:
        table, n_copies: `Placement.copy_table(device)`.
        rep_index: int32 (E,), expert e's index among the replicated experts (those with more than
            one copy, in ascending id), -1 for an expert with one copy.
        num_replicated: R, the replicated experts.
        rank0, local0: int32 (E + 1,), copy 0's rank and local index; entry E (what an id outside
            [0, E) is clamped to, or -1 wraps to) is -1.
        dest0, local0_long: int64 (E + 1,), the same for `plan_routes`: entry E is N (nowhere) and -1.
    """

    table: torch.Tensor
    n_copies: torch.Tensor
    rep_index: torch.Tensor
    num_replicated: int
    rank0: torch.Tensor
    local0: torch.Tensor
    dest0: torch.Tensor
    local0_long: torch.Tensor

    @classmethod
    def build(cls, placement: Placement, device: torch.device) -> DeviceTables:
        table, n_copies = placement.copy_table(device)
        replicated = [e for e, n in enumerate(placement.num_copies) if n > 1]
        rep = [-1] * placement.num_experts
        for i, e in enumerate(replicated):
            rep[e] = i
        first = [c[0] for c in placement.copies]
        ranks = [r for r, _ in first]
        locals_ = [i for _, i in first]
        i32 = dict(dtype=torch.int32, device=device)
        i64 = dict(dtype=torch.int64, device=device)
        return cls(table, n_copies, torch.tensor(rep, **i32), len(replicated),
                   torch.tensor(ranks + [-1], **i32), torch.tensor(locals_ + [-1], **i32),
                   torch.tensor(ranks + [placement.num_ranks], **i64), torch.tensor(locals_ + [-1], **i64))


def contiguous_placement(num_experts: int, num_ranks: int, spare_slots: int = 0) -> Placement:
    """Rank r holds a contiguous block of experts, sizes as even as possible (the first E mod N ranks
    one more), and room for `spare_slots` more experts each (for replicas). N <= E."""
    for name, v, lo in (("num_experts", num_experts, 1), ("num_ranks", num_ranks, 1),
                        ("spare_slots", spare_slots, 0)):
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise ValueError(f"{name} must be an int >= {lo}, got {v!r}")
    if num_ranks > num_experts:
        raise ValueError(f"num_ranks ({num_ranks}) must be <= num_experts ({num_experts}): a rank "
                         "without an expert has nothing to run")
    base, extra = divmod(num_experts, num_ranks)
    slots, lo = [], 0
    for r in range(num_ranks):
        hi = lo + base + (r < extra)
        slots.append(tuple(range(lo, hi)))
        lo = hi
    return Placement(num_experts, tuple(slots), base + (extra > 0) + spare_slots)


def strided_placement(num_experts: int, num_ranks: int, spare_slots: int = 0) -> Placement:
    """Rank r holds experts r, r + N, r + 2N, ...: neighbouring expert ids land on different ranks
    (so a router that favours a block of ids, as `collapse` does, is spread out). N <= E."""
    base = contiguous_placement(num_experts, num_ranks, spare_slots)  # validates the arguments
    slots = tuple(tuple(range(r, num_experts, num_ranks)) for r in range(num_ranks))
    return Placement(num_experts, slots, base.slots_per_rank)


PLACEMENTS = {"contiguous": contiguous_placement, "strided": strided_placement}


def _as_loads(expert_loads: torch.Tensor | Sequence[int], num_experts: int) -> list[int]:
    loads = [int(x) for x in torch.as_tensor(expert_loads).reshape(-1).tolist()]
    if len(loads) != num_experts:
        raise ValueError(f"expert_loads must have E={num_experts} entries, got {len(loads)}")
    if any(x < 0 for x in loads):
        raise ValueError("expert_loads must be >= 0")
    return loads


def _rank_loads(loads: list[int], slots: list[list[int]], source_rank: int = 0) -> list[int]:
    holders: dict[int, list[int]] = {}
    for r, s in enumerate(slots):
        for e in s:
            holders.setdefault(e, []).append(r)
    out = [0] * len(slots)
    for e, ranks in holders.items():
        n = len(ranks)
        for c, r in enumerate(sorted(ranks)):
            off = (c - source_rank) % n
            out[r] += (loads[e] - off + n - 1) // n  # pairs j < L with (j + s) mod n == c
    return out


def rank_loads(expert_loads: torch.Tensor | Sequence[int], placement: Placement,
               source_rank: int = 0) -> list[int]:
    """Pairs each rank runs under `placement`, exactly as `assign(..., source_rank)` splits them.

    Copy c of an expert with L pairs and n copies gets ceil((L - (c - s) mod n) / n) of them.
    """
    loads = _as_loads(expert_loads, placement.num_experts)
    return _rank_loads(loads, [list(s) for s in placement.slots], source_rank)


def replicate_hot_experts(expert_loads: torch.Tensor | Sequence[int], placement: Placement) -> Placement:
    """Fill `placement`'s free slots with copies of hot experts, to lower the busiest rank's load.

    Greedy, one copy at a time: among the experts of the busiest rank and the destination ranks with
    a free slot that do not hold the expert yet, add the copy that leaves the lowest load profile
    (the rank loads sorted descending, compared from the top). A copy is kept only if it lowers the
    profile strictly, so the busiest rank's load never rises (the profile's first entry) and the
    search ends when no copy helps or no slot is free. Loads count pairs, split as `assign` does;
    a copy also costs its rank one more expert's weights to read, which pair counts do not see.

    Args:
        expert_loads: (E,) pairs per expert, e.g. `torch.bincount` of the valid topk_ids.
        placement: the starting placement (e.g. `contiguous_placement(E, N, spare_slots=R)`); its
            experts stay where they are.

    Returns:
        A new Placement with the same slots_per_rank; every original slot kept, copies appended.
    """
    loads = _as_loads(expert_loads, placement.num_experts)
    cap = placement.slots_per_rank
    slots = [list(s) for s in placement.slots]
    current = _rank_loads(loads, slots)
    while True:
        hot = current.index(max(current))
        current_profile = sorted(current, reverse=True)
        best: tuple[list[int], list[int], int, int] | None = None
        for e in sorted(set(slots[hot]), key=lambda x: -loads[x]):
            if loads[e] == 0:
                break
            for dest in range(len(slots)):
                if len(slots[dest]) >= cap or e in slots[dest]:
                    continue
                slots[dest].append(e)
                trial = _rank_loads(loads, slots)
                slots[dest].pop()
                profile = sorted(trial, reverse=True)
                if profile < (best[0] if best else current_profile):
                    best = (profile, trial, e, dest)
        if best is None:
            break
        _, current, e, dest = best
        slots[dest].append(e)
    return Placement(placement.num_experts, tuple(tuple(s) for s in slots), cap)


@dataclass(frozen=True)
class Assignment:
    """Where each token-expert pair runs under a Placement (see the module docstring).

    Attributes:
        rank: int32 (T, K), rank running pair (t, k); -1 where topk_ids is outside [0, E).
        local_ids: int32 (T, K), the expert's local index on that rank; -1 likewise.
        num_ranks: N.
    """

    rank: torch.Tensor
    local_ids: torch.Tensor
    num_ranks: int

    def local_topk_ids(self, r: int) -> torch.Tensor:
        """int32 (T, K) ids for rank r's experts: local index where the pair runs on r, else -1.

        Pass to `moekit.moe_experts(..., ignore_invalid_ids=True)` with rank r's weights.
        """
        return torch.where(self.rank == r, self.local_ids, -1)

    def pairs_per_rank(self) -> torch.Tensor:
        """int64 (N,) pairs each rank runs (on the device, no sync)."""
        flat = self.rank.reshape(-1).long()
        valid = flat >= 0
        counts = torch.zeros(self.num_ranks + 1, dtype=torch.int64, device=flat.device)
        counts.scatter_add_(0, torch.where(valid, flat, self.num_ranks), torch.ones_like(flat))
        return counts[: self.num_ranks]


def assign(topk_ids: torch.Tensor, placement: Placement, *, source_rank: int = 0,
           tables: tuple[torch.Tensor, torch.Tensor] | None = None) -> Assignment:
    """Map each pair to the rank and local expert that run it. No host sync: CUDA-graph safe.

    Args:
        topk_ids: (T, K) int32 or int64 global expert ids; ids outside [0, E) map to -1.
        placement: who holds what.
        source_rank: the rank whose batch topk_ids is (offsets the round-robin; 0 for one batch).
        tables: `placement.copy_table(device)`, to reuse across calls (built here when None).

    Returns:
        Assignment with rank and local_ids, int32 (T, K).
    """
    check_tensor("topk_ids", topk_ids, ndim=2, dtypes=ID_DTYPES)
    e_count, dev = placement.num_experts, topk_ids.device
    if placement.num_replicas == 0:
        # Every expert has one copy: copy 0 whatever the pair's rank among its expert's pairs, so
        # no sort. An id outside [0, E) clamps to -1 or E, both the "nowhere" entry E.
        t = placement.device_tables(dev)
        key = topk_ids.clamp(-1, e_count)
        return Assignment(t.rank0[key], t.local0[key], placement.num_ranks)
    if tables is None:
        t = placement.device_tables(dev)
        tables = (t.table, t.n_copies)
    table, n_copies = tables
    pairs = sort_pairs(topk_ids, e_count)
    flat, valid = topk_ids.reshape(-1).long(), pairs.valid
    j = pairs.ranks()               # how many earlier pairs (lower pair index) went to the same expert
    safe = torch.where(valid, flat, 0)  # never index with an out-of-range id, not even -1
    copy = (j + source_rank) % n_copies[safe]
    slot = table[safe, copy]
    rank = torch.where(valid, slot // placement.slots_per_rank, -1).to(torch.int32)
    local = torch.where(valid, slot % placement.slots_per_rank, -1).to(torch.int32)
    return Assignment(rank.view(topk_ids.shape), local.view(topk_ids.shape), placement.num_ranks)


def rank_weights(gate_up_proj: torch.Tensor, down_proj: torch.Tensor, placement: Placement,
                 r: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank r's expert weights (E_r, 2I, H) and (E_r, H, I), in its local order (copies), from the
    whole layer's (E, 2I, H) and (E, H, I): E the placement's, r in [0, num_ranks)."""
    for name, w in (("gate_up_proj", gate_up_proj), ("down_proj", down_proj)):
        if not isinstance(w, torch.Tensor) or w.dim() != 3 or w.shape[0] != placement.num_experts:
            got = tuple(w.shape) if isinstance(w, torch.Tensor) else type(w).__name__
            raise ValueError(f"{name} must hold the placement's E={placement.num_experts} experts (a 3-D "
                             f"tensor of the whole layer), got {got}")
    if isinstance(r, bool) or not isinstance(r, int):
        raise TypeError(f"r must be an int rank, got {r!r}")
    if not 0 <= r < placement.num_ranks:
        raise ValueError(f"r must be a rank in [0, {placement.num_ranks}), got {r}")
    idx = torch.tensor(placement.slots[r], dtype=torch.int64, device=gate_up_proj.device)
    return gate_up_proj.index_select(0, idx), down_proj.index_select(0, idx)
