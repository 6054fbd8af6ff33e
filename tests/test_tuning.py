"""Tuning as data: the default heuristic, the log-scale lookup, the shared-memory fit, the packaged
H200 table and bad table files."""

from __future__ import annotations

import json

import pytest
import torch

from moekit.shapes import PRESETS
from moekit.tuning import (
    PACKAGED_DIR,
    SHARED_MEMORY_BUDGET,
    SHARED_MEMORY_LIMIT,
    ExpertsConfig,
    default_config,
    fit_shared_memory,
    get_config,
    load_table,
    parse_table,
    shape_key,
)

QWEN = PRESETS["qwen3-30b-a3b"]   # E=128, K=8: mean rows per expert = T / 16


def smem_bytes(cfg: ExpertsConfig, itemsize: int, gemm: int) -> int:
    """Shared memory of one GEMM's pipelined tiles, written out by hand: per stage an A tile
    (block_m x block_k) and the B tiles (block_k x block_n; GEMM1 streams gate and up: two)."""
    if gemm == 1:
        return cfg.stages1 * (cfg.block_m * cfg.block_k1 + 2 * cfg.block_k1 * cfg.block_n1) * itemsize
    return cfg.stages2 * (cfg.block_m * cfg.block_k2 + cfg.block_k2 * cfg.block_n2) * itemsize


@pytest.fixture
def table_dir(tmp_path, monkeypatch):
    """A private MOEKIT_CONFIG_DIR; returns a function that writes cpu.json there."""
    monkeypatch.setenv("MOEKIT_CONFIG_DIR", str(tmp_path))
    load_table.cache_clear()

    def write(table: dict) -> None:
        (tmp_path / "cpu.json").write_text(json.dumps(table))
        load_table.cache_clear()

    yield write
    load_table.cache_clear()


# The default heuristic and the lookup.


@pytest.mark.parametrize("tokens,block_m", [(1, 16), (256, 16), (512, 32), (2048, 64), (8192, 128),
                                             (262_144, 128)])
def test_default_config_follows_the_token_count(tokens, block_m):
    """Tile height follows the mean rows per expert T*K/E (16 at T=256 on Qwen3: 16 rows)."""
    cfg = default_config(QWEN, tokens)
    assert cfg.block_m == block_m
    for gemm in (1, 2):
        assert smem_bytes(cfg, 2, gemm) <= SHARED_MEMORY_BUDGET


def test_default_config_of_an_empty_batch_is_the_smallest_tile():
    assert default_config(QWEN, 0) == default_config(QWEN, 1)


@pytest.mark.parametrize("tokens,expect", [
    (1, "small"), (16, "small"),
    (32, "small"),          # equally far from 1 and 1024 in log scale: the smaller count wins
    (64, "large"),          # log: nearer 1024 (4x less far); linear would pick 1 (63 < 960)
    (200, "large"),         # linear would pick 1 (199 < 824)
    (0, "small"), (10**6, "large"),
])
def test_lookup_takes_the_nearest_token_count_in_log_scale(table_dir, tokens, expect):
    shape = PRESETS["tiny"]
    small, large = ExpertsConfig(block_m=16, block_n1=32), ExpertsConfig(block_m=128, block_k1=32)
    table_dir({shape_key(shape, torch.float32): {"1": small.to_dict(), "1024": large.to_dict()}})
    got = get_config(shape, tokens, torch.float32, "cpu")
    assert got == {"small": small, "large": large}[expect]


def test_lookup_without_an_entry_uses_the_default(table_dir):
    shape = PRESETS["tiny"]
    table_dir({shape_key(shape, torch.float32): {"4": ExpertsConfig(block_m=16).to_dict()}})
    assert get_config(shape, 300, torch.float16, "cpu") == default_config(shape, 300, 2)


# The shared-memory fit.


def test_fit_shared_memory_hand_examples():
    # GEMM1: 4 stages x (128x128 A + 2 x 128x128 B) x 2 bytes = 384 KiB; 3 stages 288 KiB; 2 stages
    # 192 KiB <= 200 KiB: stop there, block_k untouched.
    cfg = ExpertsConfig(block_m=128, block_n1=128, block_k1=128, stages1=4)
    assert fit_shared_memory(cfg, 2) == ExpertsConfig(block_m=128, block_n1=128, block_k1=128, stages1=2)
    # fp32, 256 x 256 tiles: 2 stages at block_k 128 = 768 KiB, 64 -> 384 KiB, 32 -> 192 KiB.
    cfg = ExpertsConfig(block_m=256, block_n1=256, block_k1=128, stages1=4, block_n2=64, block_k2=64,
                        stages2=3)
    fit = fit_shared_memory(cfg, 4)
    assert (fit.stages1, fit.block_k1) == (2, 32)
    # GEMM2: 3 x (256x64 + 64x64) x 4 = 240 KiB -> 2 stages = 160 KiB.
    assert (fit.stages2, fit.block_k2, fit.block_n2) == (2, 64, 64)
    assert fit.block_m == 256 and fit.block_n1 == 256
    # Already fits: unchanged.
    small = ExpertsConfig(block_m=16, block_n1=32, block_k1=64, stages1=5)
    assert fit_shared_memory(small, 2) == small


def shrink_steps(cfg: ExpertsConfig, gemm: int) -> list[tuple[int, int]]:
    """(stages, block_k) in the shrink order: stages down to 2 first, then block_k halved to 16."""
    stages, block_k = getattr(cfg, f"stages{gemm}"), getattr(cfg, f"block_k{gemm}")
    steps = [(stages, block_k)]
    while stages > 2:
        stages -= 1
        steps.append((stages, block_k))
    while block_k > 16:
        block_k //= 2
        steps.append((stages, block_k))
    return steps


GRID = [ExpertsConfig(block_m=bm, block_n1=bn, block_k1=bk, stages1=st, block_n2=2 * bn, block_k2=bk,
                      stages2=st)
        for bm in (16, 64, 256) for bn in (32, 128, 256) for bk in (32, 128, 512) for st in (2, 3, 6)]


@pytest.mark.parametrize("itemsize", [2, 4])
def test_fit_shared_memory_is_the_first_shrink_step_that_fits(itemsize):
    for cfg in GRID:
        fit = fit_shared_memory(cfg, itemsize)
        for gemm in (1, 2):
            steps = shrink_steps(cfg, gemm)
            fits = [s for s in steps if smem_bytes(ExpertsConfig(**{
                **cfg.to_dict(), f"stages{gemm}": s[0], f"block_k{gemm}": s[1]}), itemsize, gemm)
                <= SHARED_MEMORY_BUDGET]
            expected = fits[0] if fits else steps[-1]   # nothing fits: the smallest step
            assert (getattr(fit, f"stages{gemm}"), getattr(fit, f"block_k{gemm}")) == expected, (cfg, gemm)
        others = {k: v for k, v in cfg.to_dict().items() if not k.startswith(("stages", "block_k"))}
        assert {k: v for k, v in fit.to_dict().items() if k in others} == others


# The packaged table.


def test_packaged_h200_table_parses_and_fits_shared_memory():
    path = PACKAGED_DIR / "nvidia_h200.json"
    table = parse_table(path)
    key = shape_key(QWEN, torch.bfloat16)
    assert key in table and len(table[key]) >= 5
    assert table == load_table("nvidia_h200")
    for k, entry in table.items():
        itemsize = getattr(torch, k.rsplit("dtype=", 1)[1]).itemsize
        for tokens, cfg in entry.items():
            assert tokens >= 1
            for gemm in (1, 2):
                assert smem_bytes(cfg, itemsize, gemm) <= SHARED_MEMORY_LIMIT, (k, tokens, gemm)
    raw = json.loads(path.read_text())
    assert [int(t) for t in raw[key]] == sorted(table[key])          # written in increasing order


# Bad table files: ValueError naming the file and the problem.


BAD_TABLES = [
    ("token-zero", '{"E=8,H=64,I=48,K=2,dtype=float32": {"0": {}}}', "token count must be a positive"),
    ("token-word", '{"k": {"x": {}}}', "token count must be a positive integer"),
    ("token-negative", '{"k": {"-4": {}}}', "token count must be a positive integer"),
    ("token-arabic-digits", '{"k": {"\u0661\u0662": {}}}', "token count must be a positive integer"),
    ("token-superscript", '{"k": {"\u00b2": {}}}', "token count must be a positive integer"),
    ("not-utf8", b'{"k": {"1": {"block_m": 16, "\xff": 1}}}', "not UTF-8"),
    ("deep-lists", "[" * 100_000 + "]" * 100_000, "nested too deeply"),
    ("deep-objects", '{"a":' * 100_000 + "1" + "}" * 100_000, "nested too deeply"),
    ("duplicate-token", '{"k": {"1": {}, "1": {"block_m": 32}}}', "duplicate key '1'"),
    ("config-not-object", '{"k": {"1": [16]}}', "expected an object of tiles"),
    ("top-level-list", "[1]", "expected an object of shape keys"),
]


@pytest.mark.parametrize("name,content,message", BAD_TABLES, ids=[b[0] for b in BAD_TABLES])
def test_bad_table_file_is_a_value_error_naming_the_file(tmp_path, name, content, message):
    path = tmp_path / f"{name}.json"
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content, encoding="utf-8")
    with pytest.raises(ValueError) as info:
        parse_table(path)
    assert str(path) in str(info.value) and message in str(info.value)
