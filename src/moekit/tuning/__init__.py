"""Tile configurations as data: one frozen dataclass, JSON tables per device, a default heuristic.
The weight-gradient kernel's tiles are apart (`WgradConfig`, `wgrad_config`): one default per dtype,
or $MOEKIT_WGRAD_TILES; so are the Hopper Gluon weight gradient's (`GluonWgradTiles`, `gluon_wgrad_tiles`)
and the Hopper Gluon SwiGLU backward's (`GluonSwigluTiles`, `gluon_swiglu_tiles`).

Table files live in `moekit/tuning/configs/<device>.json` (device name lower-cased, spaces -> '_'):

    {"_meta": {"triton": "3.6.0", "torch": "2.11.0+cu130", "device": "NVIDIA H200"},
     "E=128,H=2048,I=768,K=8,dtype=bfloat16": {"1": {"block_m": 16, ...}, "64": {...}}}

The entry whose token count is nearest to T (in log scale) is used when it lies within
`TUNED_REACH` (2x) of T; else, and for a shape with no table entry, `default_config` (a shape
missing from a GPU's table warns once; the CPU's does not): the untuned path is always correct. "_meta"
(optional; `moekit tune` writes it) records what the table was tuned with: `get_config` warns once
per table when the running Triton's version differs from the recorded one (its tiles may no longer
be the fastest; they stay correct).
Environment: MOEKIT_CONFIG_DIR adds a directory searched before the packaged tables (and is where
`moekit tune` writes its table when set).
A table file that cannot be used (not UTF-8, not JSON, nested absurdly deep, a token count that is
not a positive integer, a bad config, a "_meta" that is not an object of strings) raises ValueError
naming the file and the problem.
"""

from __future__ import annotations

import functools
import json
import math
import re
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import TypeVar

import torch

from moekit import env
from moekit._validation import MAX_PAIRS
from moekit.shapes import MoEShape

_Tiles = TypeVar("_Tiles")

PACKAGED_DIR = Path(__file__).parent / "configs"
META_KEY = "_meta"
META_FIELDS = ("triton", "torch", "device")


class TuningTable(dict):
    """{shape_key: {tokens: ExpertsConfig}}, with the file's `path` and its "_meta" record (`meta`:
    str -> str; empty when the file has none)."""

    def __init__(self, entries: dict | None = None, *, path: Path | None = None,
                 meta: dict[str, str] | None = None):
        super().__init__(entries or {})
        self.path = path
        self.meta = dict(meta or {})


# The most a tile field can be and still launch: a block's side, a program's warps (1,024 threads),
# pipeline stages. A table entry past them is refused where it is read, naming the file.
TILE_MAX = 4096
WARPS_MAX = 32
STAGES_MAX = 16


def check_tile(owner: str, name: str, value: object, power_of_two: bool = False,
               most: int = TILE_MAX) -> None:
    """ValueError naming `owner.name` unless value is a positive int of at most `most` (and a power
    of two when asked): the tile dataclasses' field check (ExpertsConfig, WgradConfig, moekit.decode's)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{owner}.{name} must be a positive int, got {value!r}")
    if value > most:
        raise ValueError(f"{owner}.{name} must be at most {most}, got {value}")
    if power_of_two and value & (value - 1):
        raise ValueError(f"{owner}.{name} must be a power of two, got {value}")


def tile_bound(name: str) -> int:
    """The most a tile field named `name` can be: warps*, stages*, else a block's side."""
    return WARPS_MAX if name.startswith("warps") else STAGES_MAX if name.startswith("stages") else TILE_MAX


@dataclass(frozen=True)
class ExpertsConfig:
    """Tiles of the Triton expert path. block_m is shared: it is the align block size.

    Attributes:
        block_m: rows per block (one expert per block).
        block_n1, block_k1, warps1, stages1: GEMM1 (gate_up + SwiGLU); block_n1 counts columns
            of each half, so a program holds 2 * block_n1 accumulator columns.
        block_n2, block_k2, warps2, stages2: GEMM2 (down + routing weight).
        group_m: row blocks that share a weight tile in L2 (both GEMMs).
        pair_blocks: 1, or 2 to compute two consecutive blocks of one expert as one tile of
            2 * block_m rows (experts stay padded to block_m: big tiles, less padding).
        tma_weights: opt-in (Hopper and later): the forward GEMMs read the expert weights through
            a TMA tensor descriptor instead of pointer loads, with any expert math (biases,
            gpt_oss, interleaved rows). Used only where `moekit.grouped_gemm.tma_supported` holds
            for both weights (interleaved gate_up: a box of 2 * block_n1 rows), else the pointer
            path runs (the triton backend records the decision in the config it resolves,
            `resolve_tma`). A table entry without the key reads False, and `to_dict` leaves it
            out while it is False.
        persistent: opt-in: the forward GEMMs run as persistent kernels, as many programs as the
            device holds at once, each looping over tiles in the usual L2-friendly order (with any
            of the above: TMA weights, paired tiles, expert math). Off: the one-tile-per-program
            kernels, compiled exactly as before. Absent from a table entry: False (as tma_weights).
    """

    block_m: int = 64
    block_n1: int = 64
    block_k1: int = 64
    warps1: int = 4
    stages1: int = 3
    block_n2: int = 64
    block_k2: int = 64
    warps2: int = 4
    stages2: int = 3
    group_m: int = 8
    pair_blocks: int = 1
    tma_weights: bool = False
    persistent: bool = False

    def __post_init__(self) -> None:
        powers_of_two = ("block_m", "block_n1", "block_k1", "block_n2", "block_k2", "warps1", "warps2")
        for name in TILE_FIELDS:
            check_tile("ExpertsConfig", name, getattr(self, name), name in powers_of_two, tile_bound(name))
        for name in SWITCH_FIELDS:
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"ExpertsConfig.{name} must be true or false, got {getattr(self, name)!r}")
        if self.pair_blocks not in (1, 2):
            raise ValueError(f"ExpertsConfig.pair_blocks must be 1 or 2, got {self.pair_blocks}")

    def to_dict(self) -> dict[str, int | bool]:
        """The fields as a table entry; a switch at False (its default) is left out, so tables
        written without it read the same."""
        return {k: v for k, v in asdict(self).items() if k not in SWITCH_FIELDS or v}

    @classmethod
    def from_dict(cls, d: dict, source: str = "config") -> ExpertsConfig:
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"{source}: unknown ExpertsConfig keys {sorted(unknown)}")
        try:
            return cls(**d)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{source}: {exc}") from None


@dataclass(frozen=True)
class WgradConfig:
    """Tiles of the weight-gradient kernel (`moekit.grouped_gemm.backward_kernels.moe_wgrad_kernel`),
    its own, not the forward's: each program computes a (block_n, block_c) tile of one expert's
    gradient, reducing over the expert's sorted rows block_m at a time.

    Pipelining: the loop's operand loads hang off an index load (sorted_ids, one indirection), so
    Triton's pipeliner splits the stages between the two: the operand tiles are fetched
    lead = (stages - 1) // 2 steps ahead. At 3 or 4 stages the lead is 1 and every step waits for
    all its copies before its MMA (nothing overlaps: compiled for sm_90, `async_wait num = 0`);
    from 5 stages the next step's tiles are in flight during this step's MMA.
    The default (16-bit): 128 x 128 output tiles, 64 rows a step, 8 warps, 3 stages, 96 KiB of the
    pipeline's shared memory: the fastest of `moekit.bench.wgrad.CANDIDATES` (`moekit sweep --set
    wgrad`) at 4,096 and 16,384 tokens for the unscaled launches a training step runs (dpre and h come
    scaled by the routing weight). Without the scale both operand tiles go from global to shared
    memory untouched, so longer steps (64 rows) with fewer stages pay off. `fit` shrinks it for wider dtypes.
    Environment:
    MOEKIT_WGRAD_TILES="block_n=128,block_c=64,..." (fields left out keep their defaults) replaces
    the default, as given (not fitted).

    Attributes:
        block_n, block_c: the gradient tile, rows (N) by columns (C); powers of two >= 16.
        block_m: sorted rows reduced per step; a power of two in [16, 128] (tl.dot needs 16).
        warps: num_warps (1, 2, 4, 8 or 16).
        stages: the loop's num_stages (>= 1; odd counts: an even one has the lead of the one below).
        experts: consecutive experts a program walks (`moe_wgrad_range_kernel`: one loop over their
            rows, so its pipeline fills once per `experts` tiles, not once per tile); 1 (the
            default): one program per expert tile (`moe_wgrad_kernel`). The range kernel runs the
            unscaled launches with an align block size that is a power of two >= 16, its steps at
            most that many rows; other calls take the per-tile kernel.
    """

    block_n: int = 128
    block_c: int = 128
    block_m: int = 64
    warps: int = 8
    stages: int = 3
    experts: int = 1

    def __post_init__(self) -> None:
        for f in fields(self):
            check_tile("WgradConfig", f.name, getattr(self, f.name), f.name not in ("stages", "experts"),
                       tile_bound(f.name))
        if self.block_n < 16 or self.block_c < 16:
            raise ValueError(f"WgradConfig tiles must be >= 16, got {self.block_n} x {self.block_c}")
        if not 16 <= self.block_m <= 128:
            raise ValueError(f"WgradConfig.block_m must be in [16, 128], got {self.block_m}")
        if self.warps > 16:
            raise ValueError(f"WgradConfig.warps must be at most 16, got {self.warps}")

    def pipeline_bytes(self, itemsize: int) -> int:
        """Shared memory of the loop's tiles, an upper bound: lead + 1 buffers of each operand tile
        ([BN, BM] and [BM, BC]) and a copy of the smaller one, which the kernel's scaled mode (the
        routing weight applied in registers) stages; the training step's launches are unscaled
        (both tiles streamed as loaded), so they use at most this."""
        lead = max(1, (self.stages - 1) // 2)
        operands = (lead + 1) * (self.block_n + self.block_c) * self.block_m
        return (operands + self.block_m * min(self.block_n, self.block_c)) * itemsize

    def fit(self, itemsize: int, budget: int) -> WgradConfig:
        """Stages first (down to 2), then block_m (down to 16), until the tiles fit `budget`."""
        return shrink_to_fit(self, lambda c: c.pipeline_bytes(itemsize), budget,
                             (("stages", 2), ("block_m", 16)))

    @classmethod
    def parse(cls, text: str, source: str = "tiles") -> WgradConfig:
        """'block_n=128,block_m=32' -> WgradConfig (the other fields at their defaults);
        ValueError naming `source` and the problem."""
        known = {f.name for f in fields(cls)}
        values = {}
        for item in filter(None, (part.strip() for part in text.split(","))):
            key, sep, value = item.partition("=")
            key = key.strip()
            if not sep or key not in known:
                raise ValueError(f"{source}: expected name=int with a name of {sorted(known)}, got {item!r}")
            if key in values:
                raise ValueError(f"{source}: {key} given twice")
            try:
                values[key] = int(value)
            except ValueError:
                raise ValueError(f"{source}: {key} must be an int, got {value.strip()!r}") from None
        try:
            return cls(**values)
        except ValueError as exc:
            raise ValueError(f"{source}: {exc}") from None

    def label(self) -> str:
        label = f"n{self.block_n} c{self.block_c} m{self.block_m} w{self.warps} s{self.stages}"
        return label if self.experts == 1 else f"{label} e{self.experts}"


WGRAD_ENV = "MOEKIT_WGRAD_TILES"


# Wider output tiles where each expert has many rows: 128 x 256, 32 rows a step, 8 warps, 5 stages
# (fewer operand bytes per FLOP: (128 + 256) / (128 * 256) against 2 / 128): faster than the
# default from 512 rows an expert, slower below.
WIDE_WGRAD = WgradConfig(block_n=128, block_c=256, block_m=32, warps=8, stages=5)
WIDE_WGRAD_ROWS = 512    # rows per expert (on average) from which WIDE_WGRAD is used
# Few rows an expert: the range kernel, a program walking 8 experts' rows with 128 x 128 tiles, 64 rows
# a step, 4 warps, 4 stages. With one program an expert tile its loop is a step or two, all pipeline
# fill: faster than the default at 64 rows an expert, level at 256, slower from 1,024.
RANGE_WGRAD = WgradConfig(block_n=128, block_c=128, block_m=64, warps=4, stages=4, experts=8)
RANGE_WGRAD_ROWS = 128   # rows per expert (on average) below which RANGE_WGRAD is used


def check_config_type(config: object, name: str = "config") -> None:
    """TypeError naming the argument unless config is an ExpertsConfig or None."""
    if config is not None and not isinstance(config, ExpertsConfig):
        raise TypeError(f"{name} must be a moekit.ExpertsConfig or None, got {type(config).__name__} "
                        f"{config!r}")


@dataclass(frozen=True)
class GluonWgradTiles:
    """Tiles of the Hopper Gluon weight gradient (`moekit.grouped_gemm.gluon_wgrad`), which
    `moekit.grouped_gemm.backward.wgrad` runs where it applies (`gluon_wgrad_tiles` picks them).

    Attributes:
        block_n, block_c: the gradient tile, rows (N) by columns (C); each must divide its dimension.
        stages: the shared-memory ring's depth.
        pingpong: the two consumer warpgroups take alternate tiles (one's epilogue under the other's
            main loop), else both work on every tile, each on half its N rows ("cooperative").
        block_m: sorted rows a step; the align block size must be a multiple (a step never crosses
            an expert's group).
    """

    block_n: int
    block_c: int
    stages: int
    pingpong: bool
    block_m: int = 64

    def smem_bytes(self, itemsize: int = 2) -> int:
        """Shared memory: the ring (A and B tiles a stage) and the two warpgroups' output tiles
        (cooperative: half the N rows each; ping-pong: a whole tile each), barriers aside."""
        acc_n = self.block_n if self.pingpong else self.block_n // 2
        ring = self.stages * self.block_m * (self.block_n + self.block_c)
        return (ring + 2 * acc_n * self.block_c) * itemsize

    def label(self) -> str:
        return f"{'pp' if self.pingpong else 'coop'}_{self.block_n}x{self.block_c}_s{self.stages}"


# Ping-pong 128 x 128 tiles where experts have few rows (one warpgroup's epilogue under the other's
# main loop), cooperative 128 x 256 from GLUON_COOP_WGRAD_ROWS rows (fewer operand bytes per FLOP):
# with the gathered operand's copy included, both beat the Triton kernels 1.3-1.8x. A launch that
# gathers its A operand's token rows itself takes the cooperative tiles too: each row is gathered once
# per 256 output columns instead of 128.
GLUON_PP_WGRAD = GluonWgradTiles(block_n=128, block_c=128, stages=5, pingpong=True)
GLUON_COOP_WGRAD = GluonWgradTiles(block_n=128, block_c=256, stages=3, pingpong=False)
GLUON_COOP_WGRAD_ROWS = 512    # rows per expert (on average) from which GLUON_COOP_WGRAD is used


def gluon_wgrad_tiles(rows_per_expert: float, *, gathers_a: bool = False) -> GluonWgradTiles:
    """The Gluon weight gradient's tiles: GLUON_PP_WGRAD below GLUON_COOP_WGRAD_ROWS rows an expert,
    GLUON_COOP_WGRAD from there, and GLUON_COOP_WGRAD wherever the launch gathers A's token rows."""
    return GLUON_COOP_WGRAD if gathers_a or rows_per_expert >= GLUON_COOP_WGRAD_ROWS else GLUON_PP_WGRAD


@dataclass(frozen=True)
class GluonSwigluTiles:
    """Tiles of the Hopper Gluon SwiGLU backward (`moekit.grouped_gemm.gluon_swiglu_bwd`), which
    `moekit.grouped_gemm.backward.swiglu_backward` runs where it applies (`gluon_swiglu_tiles`).

    Attributes:
        block_n: columns of I a work item (one wgmma accumulator a warpgroup); must divide I.
        stages: the shared-memory ring's depth (dout rows [block_m, block_k], down [block_k, block_n]).
        producer_regs, consumer_regs: registers a thread after setmaxnreg (the producer's four warps,
            which gather dout's rows, and the two consumer warpgroups; producer + 2 consumers <= 3 x
            168, the launch's cap).
        block_m, block_k: rows a work item (one warpgroup's m64: the align block size must be a
            multiple) and H a ring step.
    """

    block_n: int
    stages: int
    producer_regs: int
    consumer_regs: int
    block_m: int = 64
    block_k: int = 64

    def smem_bytes(self, itemsize: int = 2) -> int:
        """Shared memory: the ring and both consumers' three epilogue slots [block_m, block_n]."""
        ring = self.stages * (self.block_m * self.block_k + self.block_k * self.block_n)
        return (ring + 6 * self.block_m * self.block_n) * itemsize

    def label(self) -> str:
        return f"pp_{self.block_m}x{self.block_n}_s{self.stages}"


# Ping-pong 64 x 128, 5 stages: the fastest Hopper tiles at Qwen3-30B-A3B (bf16, chosen on dout copied
# into sorted rows; the producer that gathers dout's rows itself takes 4 warps at 40 registers).
# 64 x 64 (8 stages) serves an I that 128 does not divide.
GLUON_SWIGLU_128 = GluonSwigluTiles(block_n=128, stages=5, producer_regs=40, consumer_regs=232)
GLUON_SWIGLU_64 = GluonSwigluTiles(block_n=64, stages=8, producer_regs=40, consumer_regs=232)


def gluon_swiglu_tiles(inter: int) -> GluonSwigluTiles | None:
    """The Gluon SwiGLU backward's tiles for intermediate size `inter`: GLUON_SWIGLU_128 where 128
    divides it, GLUON_SWIGLU_64 where 64 does, else None (the Triton kernel runs)."""
    for tiles in (GLUON_SWIGLU_128, GLUON_SWIGLU_64):
        if inter % tiles.block_n == 0:
            return tiles
    return None


def wgrad_config(itemsize: int = 2, device: torch.device | str | None = None,
                 rows_per_expert: float | None = None) -> WgradConfig:
    """The weight-gradient tiles: $MOEKIT_WGRAD_TILES when set (as given), else, fitted to the
    device's shared-memory budget for the dtype and by the rows per expert when the caller says how
    many: RANGE_WGRAD below RANGE_WGRAD_ROWS, WIDE_WGRAD from WIDE_WGRAD_ROWS, the default between."""
    text = env.text(WGRAD_ENV)
    if text:
        return _parse_wgrad_env(text)
    tiles = WgradConfig()
    if rows_per_expert is not None:
        if rows_per_expert >= WIDE_WGRAD_ROWS:
            tiles = WIDE_WGRAD
        elif rows_per_expert < RANGE_WGRAD_ROWS:
            tiles = RANGE_WGRAD
    return tiles.fit(itemsize, shared_memory_budget(device))


@functools.lru_cache(maxsize=16)
def _parse_wgrad_env(text: str) -> WgradConfig:
    return WgradConfig.parse(text, f"${WGRAD_ENV}")


SWITCH_FIELDS = ("tma_weights", "persistent")    # bool fields of ExpertsConfig, off by default
TILE_FIELDS = tuple(f.name for f in fields(ExpertsConfig) if f.name not in SWITCH_FIELDS)


def shape_key(shape: MoEShape, dtype: torch.dtype) -> str:
    return (f"E={shape.num_experts},H={shape.hidden_size},I={shape.intermediate_size},"
            f"K={shape.top_k},dtype={str(dtype).removeprefix('torch.')}")


SHARED_MEMORY_LIMIT = 227 * 1024   # Hopper's shared memory per block: no tile may need more
EPILOGUE_RESERVE = 27 * 1024       # what default configs leave free for the epilogue's scratch
SHARED_MEMORY_BUDGET = SHARED_MEMORY_LIMIT - EPILOGUE_RESERVE


def shared_memory_limit(device: torch.device | str | None = None) -> int:
    """Shared memory one block may use on `device` (the opt-in maximum); Hopper's off the GPU,
    where the kernels run interpreted."""
    if device is not None and torch.device(device).type == "cuda":
        return _cuda_shared_memory(torch.device(device).index)
    return SHARED_MEMORY_LIMIT


@functools.lru_cache(maxsize=16)
def _cuda_shared_memory(index: int | None) -> int:
    props = torch.cuda.get_device_properties(index)
    return int(getattr(props, "shared_memory_per_block_optin", SHARED_MEMORY_LIMIT))


def shared_memory_budget(device: torch.device | str | None = None) -> int:
    """What default configs may use on `device`: its limit less the epilogue's reserve."""
    return shared_memory_limit(device) - EPILOGUE_RESERVE


def default_config(shape: MoEShape, num_tokens: int, itemsize: int = 2,
                   device: torch.device | str | None = None) -> ExpertsConfig:
    """A sane config for any shape: tile height follows the mean rows per expert; the pipelined
    tiles are shrunk (stages first, then block_k) until they fit in the device's shared memory
    budget for the dtype. Memoised (a pure function of its arguments and the device's budget):
    an eager call at one token spends tens of µs of host time on it otherwise."""
    return _default_config(shape, num_tokens, itemsize, shared_memory_budget(device))


@functools.lru_cache(maxsize=4096)
def _default_config(shape: MoEShape, num_tokens: int, itemsize: int, budget: int) -> ExpertsConfig:
    rows = max(1, num_tokens) * shape.top_k / shape.num_experts
    # group_m 8 in every family: when an expert takes several row blocks (few experts: Mixtral
    # 8x7B's 16 rows an expert at 64 tokens), its blocks' programs run side by side and share the
    # weight tiles in L2; with group_m 1 each block streams the expert's weights from memory again.
    if rows <= 12:
        cfg = ExpertsConfig(16, 64, 128, 4, 4, 64, 128, 4, 4, 8)
    elif rows <= 16:
        # At 16 rows an expert (Poisson: ~40% of the experts take two 16-row blocks) `moekit tune` chose
        # on the H200, for gpt-oss-20b and OLMoE 1B-7B at 128 tokens alike, 16-row blocks computed as
        # 32-row pairs over 64 x 128 / 128 x 128 tiles: an expert's two blocks are one tile, its weight
        # tiles loaded once (also faster on Mixtral 8x7B at 64 tokens than the unpaired tiles above).
        cfg = ExpertsConfig(16, 64, 128, 4, 4, 128, 128, 4, 3, 8, pair_blocks=2)
    elif rows <= 48:
        # What `moekit tune` chose on the H200 for OLMoE 1B-7B and Qwen3-30B-A3B's 64-expert
        # expert-parallel slice at ~32 rows an expert: 32-row blocks computed as 64-row pairs, TMA
        # weights, 64 x 64 / 128 x 64 tiles, 3 stages (1.19x the plain 32-row tiles at 256 tokens).
        cfg = ExpertsConfig(32, 64, 64, 4, 3, 128, 64, 4, 3, 8, pair_blocks=2, tma_weights=True)
    elif rows <= 80:
        cfg = ExpertsConfig(64, 64, 64, 4, 4, 128, 64, 4, 4, 8, tma_weights=True)
    elif rows <= 384:
        # What `moekit tune` chose on the H200 for Qwen3-30B-A3B, OLMoE 1B-7B and DeepSeek-V2-Lite
        # from ~100 to ~400 rows an expert: 64-row blocks computed as 128-row pairs, TMA weights.
        cfg = ExpertsConfig(64, 128, 64, 8, 4, 256, 64, 8, 4, 8, pair_blocks=2, tma_weights=True)
    else:
        cfg = ExpertsConfig(128, 128, 64, 8, 4, 256, 64, 8, 4, 8, tma_weights=True)
    if itemsize == 1:
        # Past ~48 rows an expert the FP8 GEMMs ran fastest on the H200 with unpaired 64-row blocks,
        # 8 warps, 4 stages, 256-column down tiles and TMA weights (larger tiles spill registers).
        cfg = fp8_tiles(cfg if rows <= 48 else ExpertsConfig(64, 128, 128, 8, 4, 256, 128, 8, 4, 8,
                                                              tma_weights=True))
    return fit_shared_memory(cfg, itemsize, budget)


FP8_SCALE_BLOCK = 128    # `moekit.quant.FP8_BLOCK`: the span of one activation or weight scale


def fp8_tiles(cfg: ExpertsConfig) -> ExpertsConfig:
    """cfg made fit for the block-scaled FP8 kernels: GEMM1's column tile one scale block (its
    epilogue quantizes h per 128 columns), both reduction steps one scale block (each step's dot is
    scaled once)."""
    return replace(cfg, block_n1=FP8_SCALE_BLOCK, block_k1=FP8_SCALE_BLOCK, block_k2=FP8_SCALE_BLOCK)


def check_fp8_config(cfg: ExpertsConfig) -> ExpertsConfig:
    """ValueError naming the field unless the FP8 kernels can run cfg (`fp8_tiles`): block_n1 = 128,
    block_k1 and block_k2 in (32, 64, 128)."""
    if cfg.block_n1 != FP8_SCALE_BLOCK:
        raise ValueError(f"config.block_n1 must be {FP8_SCALE_BLOCK} for FP8 weights (GEMM1 quantizes h per "
                         f"{FP8_SCALE_BLOCK} columns), got {cfg.block_n1}")
    for name in ("block_k1", "block_k2"):
        if getattr(cfg, name) not in (32, 64, 128):
            raise ValueError(f"config.{name} must be 32, 64 or 128 for FP8 weights (a step within one scale "
                             f"block, at least one fp8 MMA deep), got {getattr(cfg, name)}")
    return cfg


def pipeline_bytes(cfg: ExpertsConfig, itemsize: int, gemm: int) -> int:
    """Shared memory of one GEMM's pipelined operand tiles (GEMM1 streams gate and up tiles)."""
    rows = cfg.block_m * cfg.pair_blocks          # the tallest tile a program computes
    if gemm == 1:
        return cfg.stages1 * (rows * cfg.block_k1 + 2 * cfg.block_k1 * cfg.block_n1) * itemsize
    return cfg.stages2 * (rows * cfg.block_k2 + cfg.block_k2 * cfg.block_n2) * itemsize


def shrink_to_fit(tiles: _Tiles, size: Callable[[_Tiles], int], budget: int,
                  steps: Sequence[tuple[str, int]]) -> _Tiles:
    """`tiles` (a dataclass) with fields lowered until size(tiles) <= budget: each step lowers the
    first field of `steps` ((name, floor) pairs, in order) still above its floor, a stages field by
    one, any other halved; as far as it goes when every field is at its floor. The one shrink rule
    of the forward's tiles (`fit_shared_memory`), the SwiGLU backward's and the weight gradients'."""
    while size(tiles) > budget:
        for name, floor in steps:
            value = getattr(tiles, name)
            if value > floor:
                tiles = replace(tiles, **{name: value - 1 if name.startswith("stages") else value // 2})
                break
        else:
            break
    return tiles


def fit_shared_memory(cfg: ExpertsConfig, itemsize: int, budget: int = SHARED_MEMORY_BUDGET) -> ExpertsConfig:
    """Each GEMM's stages dropped (down to 2), then its block_k halved (down to 16), until its
    pipeline fits `budget`."""
    for gemm in (1, 2):
        cfg = shrink_to_fit(cfg, lambda c, g=gemm: pipeline_bytes(c, itemsize, g), budget,
                            ((f"stages{gemm}", 2), (f"block_k{gemm}", 16)))
    return cfg


def device_slug(device: torch.device | str | None = None) -> str:
    """The tuning tables' name for a device ("nvidia_h200"); "cpu" where CUDA is absent. The
    name is read from the driver once per GPU (every eager layer call asks)."""
    if not torch.cuda.is_available():
        return "cpu"
    if device is None or torch.device(device).type == "cuda":
        index = None if device is None else torch.device(device).index
        return _cuda_slug(torch.cuda.current_device() if index is None else index)
    return name_slug(torch.cuda.get_device_name(device))


def name_slug(device_name: str) -> str:
    """A device name as the tuning tables' file names spell it: "NVIDIA H200" -> "nvidia_h200"."""
    return device_name.lower().replace(" ", "_")


@functools.lru_cache(maxsize=16)
def _cuda_slug(index: int) -> str:
    return name_slug(torch.cuda.get_device_name(index))


def _config_dirs(extra: str | None) -> list[Path]:
    return ([Path(extra)] if extra else []) + [PACKAGED_DIR]


def _first_table(slug: str, dirs: list[Path]) -> TuningTable:
    """The first of dirs' `<slug>.json` files, parsed (empty when none has one)."""
    for d in dirs:
        path = d / f"{slug}.json"
        if path.is_file():
            return parse_table(path)
    return TuningTable()


def load_table(slug: str) -> TuningTable:
    """{shape_key: {tokens: ExpertsConfig}} from the first table file found for `slug` (empty when
    there is none), searching $MOEKIT_CONFIG_DIR as it is at this call: setting or changing it
    takes effect at the next lookup. Files are parsed once per (slug, directory);
    `load_table.cache_clear()` forgets them (a table rewritten in place)."""
    return _load_table(slug, env.text("MOEKIT_CONFIG_DIR") or None)


@functools.lru_cache(maxsize=64)
def _load_table(slug: str, extra: str | None) -> TuningTable:
    return _first_table(slug, _config_dirs(extra))


load_table.cache_clear = _load_table.cache_clear


def packaged_table(slug: str) -> TuningTable:
    """The table moekit ships for `slug` (empty when there is none), whatever $MOEKIT_CONFIG_DIR holds."""
    return _first_table(slug, [PACKAGED_DIR])


def table_slug(device: torch.device | str | None = None) -> str:
    """The table `get_config` reads for a call on `device`: the GPU's (`device_slug`), or "cpu" for a
    CPU device."""
    return device_slug(device) if device is None or torch.device(device).type == "cuda" else "cpu"


_TOKENS_KEY = re.compile(r"[1-9][0-9]*")
_MAX_TOKENS_KEY = MAX_PAIRS     # the most tokens a call has: at least one pair each


def _unique_keys(pairs: list[tuple[str, object]]) -> dict:
    seen: dict = {}
    for k, v in pairs:
        if k in seen:
            raise ValueError(f"duplicate key {k!r}")
        seen[k] = v
    return seen


def _parse_meta(raw: object, where: str) -> dict[str, str]:
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: {META_KEY!r} must be an object of strings ({', '.join(META_FIELDS)}), "
                         f"got {type(raw).__name__}")
    bad = [k for k, v in raw.items() if not isinstance(v, str)]
    if bad:
        raise ValueError(f"{where}: {META_KEY}[{bad[0]!r}] must be a string, got {json.dumps(raw[bad[0]])}")
    return dict(raw)


def parse_table(path: Path) -> TuningTable:
    """{shape_key: {tokens: ExpertsConfig}} of a table file, its "_meta" in `.meta`; ValueError naming
    the file and the problem."""
    where = f"tuning table {path}"
    try:
        text = Path(path).read_bytes().decode("utf-8")
    except OSError as exc:
        raise ValueError(f"{where}: cannot read it ({exc})") from None
    except UnicodeDecodeError as exc:
        raise ValueError(f"{where}: not UTF-8 text (byte {exc.start}: {exc.reason})") from None
    try:
        raw = json.loads(text, object_pairs_hook=_unique_keys)
    except RecursionError:
        raise ValueError(f"{where}: cannot read JSON (nested too deeply)") from None
    except ValueError as exc:  # json.JSONDecodeError, or a duplicate key
        raise ValueError(f"{where}: cannot read JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: expected an object of shape keys, got {type(raw).__name__}")
    meta = _parse_meta(raw.pop(META_KEY), where) if META_KEY in raw else {}
    table = TuningTable(path=Path(path), meta=meta)
    for key, by_tokens in raw.items():
        if not isinstance(by_tokens, dict):
            raise ValueError(f"{where}: entry {key!r} must map token counts to configs, "
                             f"got {type(by_tokens).__name__}")
        entry = {}
        for tokens, cfg in by_tokens.items():
            # the length first: int() refuses strings of over 4300 digits with a message of its own
            if (not _TOKENS_KEY.fullmatch(tokens) or len(tokens) > len(str(_MAX_TOKENS_KEY))
                    or int(tokens) > _MAX_TOKENS_KEY):
                shown = repr(tokens) if len(tokens) <= 24 else f"'{tokens[:12]}...' ({len(tokens)} chars)"
                raise ValueError(f"{where}: bad entry {key!r}[{shown}]: a token count must be a positive "
                                 f"integer of at most {_MAX_TOKENS_KEY}, written in decimal digits")
            if not isinstance(cfg, dict):
                raise ValueError(f"{where}: bad entry {key!r}[{tokens!r}]: expected an object of tiles, "
                                 f"got {type(cfg).__name__}")
            entry[int(tokens)] = ExpertsConfig.from_dict(cfg, f"{where} [{key}][{tokens}]")
        table[key] = entry
    return table


_warned: set[tuple[str, ...]] = set()


def running_versions(device: torch.device | str | None = None) -> dict[str, str]:
    """What a table tuned now would record in its "_meta": the Triton and torch versions and the
    device's name."""
    import triton  # here: `import moekit.tuning` loads no Triton

    dev = torch.device(device) if device is not None else None
    on_gpu = dev.type == "cuda" if dev is not None else torch.cuda.is_available()
    name = torch.cuda.get_device_name(dev) if on_gpu else "cpu"
    return {"triton": triton.__version__, "torch": torch.__version__, "device": name}


def _running_triton() -> str | None:
    try:
        import triton
    except ImportError:
        return None
    return getattr(triton, "__version__", None)


def check_table_versions(table: TuningTable) -> None:
    """Warn once per table when it records a Triton version other than the running one."""
    tuned, running = table.meta.get("triton"), _running_triton()
    if not tuned or not running or tuned == running:
        return
    key = ("triton", str(table.path), tuned, running)
    if key not in _warned:
        _warned.add(key)
        warnings.warn(f"moekit: the tuning table {table.path} was tuned with Triton {tuned}"
                      f"{' on ' + table.meta['device'] if table.meta.get('device') else ''}; this is Triton "
                      f"{running}: its tiles stay correct but may no longer be the fastest (re-tune with "
                      "`moekit tune`)", stacklevel=4)


TUNED_REACH = 2          # a table entry serves token counts within this factor of its own


def get_config(shape: MoEShape, num_tokens: int, dtype: torch.dtype,
               device: torch.device | str | None = None, table: TuningTable | None = None) -> ExpertsConfig:
    """The tuned config nearest to num_tokens (in log scale; a tie to the smaller count) for this
    shape and device, when its token count is within TUNED_REACH of num_tokens; else the default. A
    table tuned over part of the range (say 256-4,096 tokens) so never lends a 256-token tile to 16
    tokens: the tuner's default counts are 4x apart, so a fully tuned shape always has an entry in reach.
    table: look in this table instead of the device's (`load_table`; e.g. the packaged one,
    `packaged_table`, to compare it with a table in $MOEKIT_CONFIG_DIR)."""
    slug = table_slug(device)
    key = shape_key(shape, dtype)
    table = load_table(slug) if table is None else table
    entry = table.get(key)
    if not entry:
        if slug != "cpu" and (slug, key) not in _warned:
            _warned.add((slug, key))
            warnings.warn(f"moekit: no tuned config for {key} on {slug}; using defaults", stacklevel=3)
        return default_config(shape, num_tokens, dtype.itemsize, device)
    check_table_versions(table)
    t = max(1, num_tokens)
    best = min(entry, key=lambda n: (abs(math.log(n) - math.log(t)), n))
    if max(best, t) > TUNED_REACH * min(best, t):
        return default_config(shape, num_tokens, dtype.itemsize, device)
    return entry[best]
