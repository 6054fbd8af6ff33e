"""The seeded fuzz of the triton expert path (imported as `fuzz_plan`): a fixed pool of kernel
specialisations, the cases drawn inside it, their check against the fp32 reference, and a count of
the Triton specialisations the cases compile. The GPU test is
`test_gpu_reliability::test_fuzz_triton_against_fp32_reference`; `test_fuzz_plan.py` checks the plan
on the CPU.

Why a pool. Triton compiles one binary per specialisation of a kernel, keyed on: the values of its
constexpr arguments (tiles, TOP_K, EVEN_K, PAIRED, the align kernels' CHUNK, C_BLOCK, E_PAD, ...),
num_warps and num_stages, the dtype of every pointer and whether its address is a multiple of 16
bytes, and for every plain int argument its type (i32 / i64 by value) and whether it equals 1 (then
it is compiled in as a constant) or is a multiple of 16 (`triton_spec`). Drawing E, H, I, K, the dtype
and the tiles afresh for each case compiled a few kernels per case, about half a second each on the
H200's host: 36 cases in 90 s.

Here every case belongs to one of the ten `COMBOS` (E, H, I, K, dtype, ids dtype, routing weights
dtype, x's row stride, an explicit `ExpertsConfig`, so the tiles never follow T), and its token
count T comes from one of the combo's four `BANDS`. T is the one input left that reaches a
specialisation: the align kernels' CHUNK and num_warps follow the pair count S = T * K (and so does
the one-launch kernel's HIST, see `KERNELS`), C_BLOCK the chunk count, and S, T, the padded length
and the block counts are int arguments (their 1 / multiple-of-16 class). So a band is a list of T
that launch identically (primes where the band has them; the qwen3 and top-1 large bands take S a
multiple of 16 on purpose, as real batches have); `test_fuzz_plan.py` checks that every T of a band
launches the same keys. Everything else a case draws compiles nothing new: the routing (uniform,
zipf-skewed, every pair on the same K experts, experts left empty, duplicate ids in a row), invalid
ids (-1, >= E, int64 ids that wrap into [0, E) in 32 bits) under ignore_invalid_ids, the routing
weights (zero, negative, unnormalised), x's scale, a NaN element in one row, an out= buffer,
column-major routing tensors. The caller turns workspace poisoning on.

Order: case i is combo i % 10 (round robin), and the first four rounds take each band's first T in
turn, so every specialisation compiles within the first WARMUP_CASES = 40 cases; later cases draw a
band (weights BAND_WEIGHTS) and a T in it at random and run compiled kernels only. A case is a
function of its index alone (`draw_case`): MOEKIT_FUZZ_CASE=<index> reruns it.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import random
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from helpers import rel_err, same_dtype_bound
from moekit import ExpertsConfig, moe_experts
from moekit.reference import moe_experts_ref

SEED = "moekit-fuzz-1"
DEFAULT_CASES = 600         # MOEKIT_FUZZ_CASES
DEFAULT_SECONDS = 160.0     # MOEKIT_FUZZ_SECONDS: the time budget after the warm-up cases
FLOOR = 200                 # at least min(cases, FLOOR) cases must run
FP32_BOUND = 1e-5           # fp32 runs in full fp32 (ieee dots): no same-dtype baseline needed
ALL_ROWS = 64               # up to this many tokens every row is checked,
CHECKED_ROWS = 32           # else the first, the last and sampled rows, this many in all

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
I32, I64 = torch.int32, torch.int64

# The bands, in the order the first rounds visit them: the fused align (S <= 1024) with a few
# blocks per expert or a few pairs per expert; the multi-chunk align with T > 2048 (hist, scan,
# scatter; one launch of `align_one_launch_kernel` where S <= 4,096, in the K = 1 combos); fewer rows
# than a block; decode (T = 1; T = 0 launches nothing).
BANDS = ("mid", "large", "tiny", "decode")
BAND_WEIGHTS = (3, 3, 2, 1)


@dataclass(frozen=True)
class Combo:
    """One pool of kernel specialisations: everything that picks a compiled kernel, but T."""

    name: str
    num_experts: int
    hidden: int
    inter: int
    top_k: int                      # > num_experts: an expert-parallel rank (the other slots are -1)
    dtype: torch.dtype
    ids_dtype: torch.dtype
    config: ExpertsConfig
    x_pad: int                      # x is the first H columns of a (T, H + x_pad) tensor
    bands: tuple[tuple[int, ...], ...]   # T values per band (BANDS order), the first compiled first
    weights_dtype: torch.dtype = FP32

    def describe(self) -> str:
        c = self.config
        tiles = ",".join(str(v) for v in c.to_dict().values())
        return (f"{self.name} (E={self.num_experts} H={self.hidden} I={self.inter} K={self.top_k} "
                f"{_name(self.dtype)}, ids {_name(self.ids_dtype)}, weights {_name(self.weights_dtype)}, "
                f"x row stride H+{self.x_pad}, {'paired' if c.pair_blocks == 2 else 'unpaired'} "
                f"tiles ExpertsConfig({tiles}))")


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _cfg(*values: int) -> ExpertsConfig:
    return ExpertsConfig(*values)


# Tiles: the H200 table's entries for the Qwen3 shape at T = 2048 (paired) and T = 1, and
# `default_config`'s four families fitted to the shared memory for the dtype
# (`tuning.fit_shared_memory`), paired where the last value is 2. The bands were picked with
# `specialisations` over every T of a range, grouping the T that launch the same keys.
COMBOS = (
    # The production shape and tuned paired tiles; x contiguous; S a multiple of 16 when large.
    Combo("qwen3", 128, 2048, 768, 8, BF16, I32, _cfg(64, 128, 64, 8, 4, 256, 64, 8, 4, 8, 2), x_pad=0,
          bands=((101, 65, 67, 73, 79, 89, 107, 109, 127),
                 (3208, 2050, 2328, 2618, 2890, 3476, 3756, 4056),
                 (13, 9, 11, 15), (1, 0))),
    # The table's decode tiles, int64 ids (wrap-arounds), x with row stride 2056.
    Combo("qwen3-decode", 128, 2048, 768, 8, BF16, I64, _cfg(16, 32, 128, 4, 4, 64, 64, 4, 5, 1), x_pad=8,
          bands=((101, 65, 67, 73, 83, 97, 107, 109, 127),
                 (3019, 2049, 2053, 2273, 2579, 2789, 3313, 3709, 4057, 4061),
                 (13, 9, 11, 15), (1, 0))),
    # E = 1 = top_k, fp16; H and I off the tiles (EVEN_K false), one column tile.
    Combo("one-expert", 1, 1000, 48, 1, FP16, I32, _cfg(16, 64, 128, 4, 4, 64, 128, 4, 4, 1), x_pad=8,
          bands=((811, 514, 521, 599, 647, 719, 863, 941, 1021, 1023),
                 (3209, 2146, 2153, 2441, 2707, 2957, 3461, 3631, 3803, 3807),
                 (7, 2, 3, 5, 11, 13, 15), (1, 0))),
    # E > 256 (E_PAD = 512 in the align), bf16 routing weights, int64 ids, paired.
    Combo("257-experts", 257, 256, 96, 4, BF16, I64, _cfg(16, 64, 128, 4, 4, 64, 128, 4, 4, 1, 2), x_pad=0,
          bands=((193, 129, 131, 149, 163, 179, 211, 229, 241, 255),
                 (3533, 2049, 2053, 2389, 2741, 3187, 3911, 4337, 4691, 4699),
                 (3, 2), (1, 0)), weights_dtype=BF16),
    # top_k = E = 8, fp32, int64 ids.
    Combo("top-k-equals-E", 8, 1000, 48, 8, FP32, I64, _cfg(32, 64, 128, 4, 2, 64, 128, 4, 4, 4), x_pad=8,
          bands=((101, 65, 67, 73, 79, 89, 107, 109, 127),
                 (3229, 2051, 2053, 2339, 2663, 2903, 3527, 3797, 4057, 4061),
                 (13, 9, 11, 15), (1, 0))),
    # Prime H, I and E, fp32, paired 64-row tiles, x with row stride 139.
    Combo("primes", 3, 131, 37, 2, FP32, I32, _cfg(64, 64, 64, 4, 3, 128, 64, 4, 3, 8, 2), x_pad=8,
          bands=((419, 257, 281, 317, 353, 443, 479, 509, 511),
                 (3163, 2049, 2053, 2297, 2609, 2833, 3413, 3701, 3967),
                 (5, 2, 3, 7), (1, 0))),
    # An expert-parallel rank: K = 4 > E = 3, every row has -1 slots (ignore_invalid_ids always).
    Combo("ep-rank", 3, 64, 48, 4, BF16, I64, _cfg(16, 32, 64, 4, 3, 32, 64, 4, 3, 2), x_pad=0,
          bands=((193, 129, 131, 149, 163, 181, 211, 229, 251, 255),
                 (3089, 2049, 2053, 2273, 2473, 2777, 3457, 3719, 4003, 4005),
                 (3, 2), (1, 0))),
    # fp16 at H = 2048 with 128-row tiles, E = 60.
    Combo("fp16-wide", 60, 2048, 768, 4, FP16, I32, _cfg(128, 128, 64, 8, 3, 128, 64, 8, 4, 8), x_pad=0,
          bands=((211, 147, 151, 163, 179, 191, 223, 239, 251, 255),
                 (3181, 2057, 2069, 2309, 2557, 2833, 3461, 3761, 4021, 4030),
                 (3, 2), (1, 0))),
    # top_k = 1 over 128 experts, fp32, paired; T a multiple of 16 when large.
    Combo("top-1", 128, 1000, 768, 1, FP32, I64, _cfg(32, 64, 128, 4, 2, 64, 128, 4, 3, 4, 2), x_pad=8,
          bands=((821, 513, 521, 593, 673, 743, 881, 953, 1021, 1023),
                 (3840, 2064, 2336, 2544, 2800, 3024, 3280, 3504),
                 (7, 2, 3, 5, 11, 13, 15), (1, 0))),
    # fp32 with 128 x 128 tiles at H = 2048.
    Combo("fp32-big-tiles", 8, 2048, 768, 2, FP32, I32, _cfg(128, 128, 64, 8, 2, 128, 64, 8, 3, 8), x_pad=0,
          bands=((367, 257, 281, 311, 347, 397, 421, 449, 451),
                 (3079, 2049, 2053, 2293, 2617, 2833, 3347, 3701, 3967),
                 (3, 2, 4), (1, 0))),
)
WARMUP_CASES = len(COMBOS) * len(BANDS)

ROUTINGS = ("uniform", "zipf", "collapse", "subset", "duplicates")
WEIGHTS = ("uniform", "softmax", "signed", "sparse", "zero", "large")


@dataclass(frozen=True)
class Case:
    """One fuzz case: a combo, T, and the draws that compile nothing new."""

    index: int
    combo: Combo
    band: str
    num_tokens: int
    routing: str
    invalid: float                  # fraction of ids replaced by ids outside [0, E)
    ignore_invalid_ids: bool
    weights: str
    x_scale: float
    nan_row: bool                   # one element of one token's row is NaN
    out_buffer: bool                # out= a NaN-filled buffer
    strided_routing: bool           # topk_weights and topk_ids as column-major views
    seed: int

    def describe(self) -> str:
        return (f"case {self.index}: {self.combo.describe()}, T={self.num_tokens} ({self.band}), "
                f"routing={self.routing}, invalid={self.invalid}, "
                f"ignore_invalid_ids={self.ignore_invalid_ids}, weights={self.weights}, "
                f"x_scale={self.x_scale}, nan_row={self.nan_row}, out_buffer={self.out_buffer}, "
                f"strided_routing={self.strided_routing}")


def draw_case(index: int) -> Case:
    """Case `index`: a function of the index alone (a generator seeded by it)."""
    combo = COMBOS[index % len(COMBOS)]
    round_ = index // len(COMBOS)
    rng = random.Random(f"{SEED}:{index}")
    if round_ < len(BANDS):
        band, num_tokens = round_, combo.bands[round_][0]
    else:
        band = rng.choices(range(len(BANDS)), weights=BAND_WEIGHTS)[0]
        num_tokens = rng.choice(combo.bands[band])
    invalid = rng.choices((0.0, 0.1, 0.5, 1.0), weights=(6, 2, 1, 1))[0]
    return Case(
        index=index, combo=combo, band=BANDS[band], num_tokens=num_tokens,
        routing=rng.choice(ROUTINGS), invalid=invalid,
        ignore_invalid_ids=invalid > 0 or combo.top_k > combo.num_experts or rng.random() < 0.3,
        weights=rng.choices(WEIGHTS, weights=(3, 2, 2, 2, 1, 1))[0],
        x_scale=rng.choice((1.0, 1.0, 0.25, 4.0)), nan_row=num_tokens > 1 and rng.random() < 0.05,
        out_buffer=rng.random() < 0.25, strided_routing=rng.random() < 0.2, seed=rng.getrandbits(62),
    )


def default_cases(count: int = DEFAULT_CASES) -> list[Case]:
    return [draw_case(i) for i in range(count)]


def plain_case(combo: Combo, num_tokens: int) -> Case:
    """A case of the combo at T = num_tokens with nothing drawn (for checking and picking bands)."""
    return Case(-1, combo, "", num_tokens, "uniform", 0.0, True, "uniform", 1.0, False, False, False, 0)


# Inputs.

def expert_weights(combo: Combo, device: torch.device | str, cache: dict | None = None,
                   values: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate_up_proj, down_proj) of the combo's shape, seeded by the shape: built once per shape and
    device in `cache`. values=False: uninitialised (what `specialisations` needs)."""
    key = (combo.num_experts, combo.hidden, combo.inter, combo.dtype, str(device), values)
    if cache is not None and key in cache:
        return cache[key]
    e, h, i = combo.num_experts, combo.hidden, combo.inter
    if values:
        gen = torch.Generator(device).manual_seed(zlib.crc32(repr(key[:4]).encode()))
        gate_up = (torch.randn(e, 2 * i, h, generator=gen, device=device) / h**0.5).to(combo.dtype)
        down = (torch.randn(e, h, i, generator=gen, device=device) / i**0.5).to(combo.dtype)
    else:
        gate_up = torch.empty(e, 2 * i, h, dtype=combo.dtype, device=device)
        down = torch.empty(e, h, i, dtype=combo.dtype, device=device)
    if cache is not None:
        cache[key] = gate_up, down
    return gate_up, down


def _routing(case: Case, gen: torch.Generator) -> torch.Tensor:
    """int64 (T, K) ids in [0, E) (-1 in the slots past E when K > E), before invalid ids."""
    t, e, k = case.num_tokens, case.combo.num_experts, case.combo.top_k
    picked = min(k, e)                                   # distinct experts per row
    if case.routing == "duplicates":                     # ids drawn with replacement: repeats in a row
        return torch.randint(0, e, (t, k), generator=gen)
    if case.routing == "collapse":                       # every pair on the same `picked` experts
        ids = torch.randperm(e, generator=gen)[:picked].repeat(t, 1)
    else:
        scores = torch.rand(t, e, generator=gen)
        if case.routing == "zipf":                       # a few hot experts, at random ids
            scores = scores * (1.0 / (torch.randperm(e, generator=gen) + 1).float()) ** 1.2
        elif case.routing == "subset":                   # only m >= picked experts get pairs
            m = int(torch.randint(picked, e + 1, (1,), generator=gen))
            scores[:, torch.randperm(e, generator=gen)[m:]] -= 2.0
        ids = scores.topk(picked, dim=1).indices
    if k > picked:                                       # an EP rank: the other slots' experts live elsewhere
        ids = torch.cat([ids, torch.full((t, k - picked), -1)], dim=1)
        ids = ids.gather(1, torch.rand(t, k, generator=gen).argsort(dim=1))
    return ids


def _invalid_ids(case: Case, ids: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    e = case.combo.num_experts
    bad = [-1, e, e + 7, 2**31 - 1, -(2**31)]
    if case.combo.ids_dtype == I64:                      # wrap into [0, E) when truncated to 32 bits
        bad += [2**32, 2**32 + 1, -(2**32), 2**33 + 2]
    mask = torch.rand(ids.shape, generator=gen) < case.invalid
    values = torch.tensor(bad)[torch.randint(0, len(bad), ids.shape, generator=gen)]
    return torch.where(mask, values, ids)


def _routing_weights(case: Case, gen: torch.Generator) -> torch.Tensor:
    shape = (case.num_tokens, case.combo.top_k)
    kind = case.weights
    if kind == "softmax":
        w = torch.softmax(torch.randn(shape, generator=gen), dim=-1)
    elif kind == "signed":
        w = torch.randn(shape, generator=gen)
    elif kind == "sparse":
        w = torch.rand(shape, generator=gen) * (torch.rand(shape, generator=gen) > 0.3)
    elif kind == "zero":
        w = torch.zeros(shape)
    else:
        w = torch.rand(shape, generator=gen) * (8.0 if kind == "large" else 1.0)
    return w


@dataclass
class Inputs:
    args: tuple[torch.Tensor, ...]          # x, gate_up_proj, down_proj, topk_weights, topk_ids
    out: torch.Tensor | None
    nan_token: int | None
    gen: torch.Generator                    # for the row sampling of the check


def build(case: Case, device: torch.device | str, cache: dict | None = None, values: bool = True) -> Inputs:
    """The case's tensors. values=False: x, the weights and out= uninitialised, ids and routing
    weights zero: the same dtypes, shapes, strides and alignment (all a specialisation sees), cheaply."""
    combo, t = case.combo, case.num_tokens
    gate_up, down = expert_weights(combo, device, cache, values)
    gen = torch.Generator().manual_seed(case.seed)
    if values:
        x_gen = torch.Generator(device).manual_seed(case.seed)
        x = torch.randn(t, combo.hidden + combo.x_pad, generator=x_gen, device=device) * case.x_scale
        x = x.to(combo.dtype)
        ids = _routing(case, gen)
        if case.invalid:
            ids = _invalid_ids(case, ids, gen)
        w = _routing_weights(case, gen)
    else:
        x = torch.empty(t, combo.hidden + combo.x_pad, dtype=combo.dtype, device=device)
        ids = torch.zeros(t, combo.top_k, dtype=I64)
        w = torch.zeros(t, combo.top_k)
    x = x[:, :combo.hidden]                              # x_pad > 0: a strided view
    nan_token = None
    if case.nan_row:
        nan_token = int(torch.randint(0, t, (1,), generator=gen))
        x[nan_token, int(torch.randint(0, combo.hidden, (1,), generator=gen))] = float("nan")
    ids = ids.to(device=device, dtype=combo.ids_dtype)
    w = w.to(device=device, dtype=combo.weights_dtype)
    if case.strided_routing:
        ids, w = ids.t().contiguous().t(), w.t().contiguous().t()
    out = None
    if case.out_buffer:
        out = torch.empty(t, combo.hidden, dtype=combo.dtype, device=device)
        if values:
            out.fill_(float("nan"))
    return Inputs((x, gate_up, down, w, ids), out, nan_token, gen)


def launch(case: Case, inputs: Inputs) -> torch.Tensor:
    return moe_experts(*inputs.args, backend="triton", config=case.combo.config,
                       ignore_invalid_ids=case.ignore_invalid_ids, out=inputs.out)


# The check.

def _compact(x, gate_up, down, w, ids):
    """The same rows against only the experts they use, renumbered (invalid ids -1): the references
    loop over the experts, and sampled rows use few of E = 128 or 257."""
    num_experts = gate_up.shape[0]
    ids = ids.long()
    valid = (ids >= 0) & (ids < num_experts)
    used = torch.unique(ids[valid])
    renumber = torch.full((num_experts,), -1, dtype=torch.long, device=ids.device)
    renumber[used] = torch.arange(used.numel(), device=ids.device)
    ids = torch.where(valid, renumber[ids.clamp(0, num_experts - 1)], -1)
    return x, gate_up[used], down[used], w, ids


def check(case: Case, inputs: Inputs, out: torch.Tensor) -> None:
    """out against the fp32 reference: within FP32_BOUND in fp32, else within twice the error of
    plain PyTorch in the dtype (tests/helpers.py); every row up to ALL_ROWS tokens, else the first,
    the last and sampled rows. The NaN row, if any, must be NaN exactly where the reference is."""
    x, gate_up, down, w, ids = inputs.args
    t = x.shape[0]
    where = f"{case.describe()} (rerun: MOEKIT_FUZZ_CASE={case.index})"
    assert out.shape == x.shape and out.dtype == x.dtype, f"{where}: out {tuple(out.shape)} {out.dtype}"
    if inputs.out is not None:
        assert out.data_ptr() == inputs.out.data_ptr(), f"{where}: out= was not written in place"
    if t == 0:
        return
    if t <= ALL_ROWS:
        rows = torch.arange(t)
    else:
        middle = torch.randint(1, t - 1, (CHECKED_ROWS - 2,), generator=inputs.gen)
        rows = torch.cat([torch.tensor([0, t - 1]), middle]).unique()
    if inputs.nan_token is not None:
        nan_row = torch.tensor([inputs.nan_token], device=x.device)
        ref = moe_experts_ref(*_compact(x[nan_row], gate_up, down, w[nan_row], ids[nan_row]))
        assert torch.equal(out[nan_row].isnan(), ref.isnan()), f"{where}: NaN row {inputs.nan_token}"
        rows = rows[rows != inputs.nan_token]
    rows = rows.to(x.device)
    checked = _compact(x[rows], gate_up, down, w[rows], ids[rows])
    ref = moe_experts_ref(*checked)
    err = rel_err(out[rows], ref)
    bound = FP32_BOUND if x.dtype == torch.float32 else same_dtype_bound(*checked, ref)
    assert err <= bound, f"{where}: error {err:.2e} > bound {bound:.2e}"


def run_case(case: Case, device: torch.device | str, cache: dict | None = None) -> None:
    inputs = build(case, device, cache)
    check(case, inputs, launch(case, inputs))


# What the cases compile: the kernels' launches recorded instead of run, keyed as Triton keys them.

# align_one_launch_kernel (above FUSED_MAX_PAIRS, up to `moekit.align.ONE_LAUNCH_MAX_PAIRS` = 4,096
# pairs by default): BLOCK_J follows E alone, FILL_COLS E and block_m, num_warps is 8, CHUNK is the
# three launches' (follows S), and HIST = max(CHUNK, min(8192, next_pow2(S))) follows S too, like
# CHUNK: a band must not straddle a power of two of S there. The two bands that run it (the large
# bands of one-expert and top-1, K = 1, S from 2,064 to 3,840) all have HIST = 4,096 and so
# hist_steps = cdiv(S, HIST) = 1 (compiled in as the constant 1); `test_fuzz_plan.py` checks that
# every T of a band launches the same keys.
KERNELS = {
    "moekit.align": ("align_hist_kernel", "align_scan_kernel", "align_scatter_kernel",
                     "align_one_launch_kernel"),
    "moekit.grouped_gemm": ("moe_gemm1_swiglu_kernel", "moe_gemm2_kernel", "moe_sum_kernel"),
}
LAUNCH_OPTIONS = ("num_warps", "num_stages", "num_ctas", "maxnreg")


def triton_spec(arg) -> tuple:
    """How Triton's JIT keys a non-constexpr argument (`specialize_impl` with the CUDA backend): an
    int equal to 1 becomes the constant 1; another int keys on its type (i32 / i64 / u64 by value)
    and on being a multiple of 16 ("D"); a tensor on its dtype and on its address being a multiple
    of 16 bytes; a float or bool on its type alone."""
    if arg is None:
        return ("constexpr", None)
    if isinstance(arg, bool):
        return ("u1", None)
    if isinstance(arg, int):
        if arg == 1:
            return ("constexpr", 1)
        kind = "i32" if -(2**31) <= arg < 2**31 else ("u64" if arg >= 2**63 else "i64")
        return (kind, "D" if arg % 16 == 0 else "")
    if isinstance(arg, float):
        return ("fp32", None)
    if isinstance(arg, torch.Tensor):
        return ("*" + _name(arg.dtype), "D" if arg.data_ptr() % 16 == 0 else "")
    raise TypeError(f"no Triton specialisation rule for {type(arg).__name__}")


@dataclass
class Recording:
    keys: set


class _Recorder:
    """Stands in for a @triton.jit kernel: `kernel[grid](*args, **kwargs)` adds the launch's key
    (kernel name, one key per argument, launch options) to `sink.keys` and runs nothing."""

    def __init__(self, name: str, kernel, sink: Recording):
        self.name, self.sink = name, sink
        self.signature = inspect.signature(kernel.fn)
        self.constexpr = {n: "constexpr" in str(p.annotation) for n, p in self.signature.parameters.items()}

    def __getitem__(self, grid):
        def record(*args, **kwargs):
            options = tuple((k, kwargs.pop(k)) for k in LAUNCH_OPTIONS if k in kwargs)
            bound = self.signature.bind(*args, **kwargs)
            bound.apply_defaults()
            key = tuple(("constexpr", v) if self.constexpr[n] else triton_spec(v)
                        for n, v in bound.arguments.items())
            self.sink.keys.add((self.name, key, options))
        return record


@contextlib.contextmanager
def recording() -> Iterator[Recording]:
    """Inside, the expert path's kernels add their launches' keys to the yielded `Recording.keys`
    instead of running (assign a new set to split the launches up)."""
    sink = Recording(set())
    saved = []
    for module_name, names in KERNELS.items():
        module = importlib.import_module(module_name)
        for name in names:
            saved.append((module, name, getattr(module, name)))
            setattr(module, name, _Recorder(name, getattr(module, name), sink))
    try:
        yield sink
    finally:
        for module, name, kernel in saved:
            setattr(module, name, kernel)


def specialisations(cases: Iterable[Case], device: torch.device | str = "cpu") -> list[set]:
    """The keys of each case's launches, in case order (inputs from `build(values=False)`)."""
    cache: dict = {}
    found = []
    with torch.no_grad(), recording() as sink:
        for case in cases:
            sink.keys = set()
            launch(case, build(case, device, cache, values=False))
            found.append(sink.keys)
    return found
