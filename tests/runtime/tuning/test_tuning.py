"""Tuning as data (`moekit.tuning`): the default heuristic, the log-scale lookup, the shared-memory
fit, the packaged H200 and H100 tables and what they record, bad table files and metadata, the warning
for a table tuned with another Triton, and the tile configs' field checks. The tuner that writes the
tables (`moekit tune`): tests/lab/test_tune.py."""

from __future__ import annotations

import dataclasses
import json
import warnings

import pytest
import torch

from helpers import smem_bytes
from moekit import moe_experts, tuning
from moekit.shapes import PRESETS, MoEShape
from moekit.tuning import (
    PACKAGED_DIR,
    SHARED_MEMORY_BUDGET,
    SHARED_MEMORY_LIMIT,
    ExpertsConfig,
    TuningTable,
    default_config,
    fit_shared_memory,
    get_config,
    load_table,
    packaged_table,
    parse_table,
    shape_key,
)

QWEN = PRESETS["qwen3-30b-a3b"]   # E=128, K=8: mean rows per expert = T / 16


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


@pytest.mark.parametrize("tokens,pair_blocks,tma", [(192, 1, False), (208, 2, False), (256, 2, False),
                                                   (512, 2, True), (1024, 1, True), (2048, 2, True),
                                                   (8192, 1, True)])
def test_default_config_switches_follow_the_rows_per_expert(tokens, pair_blocks, tma):
    """Qwen3 (T*K/E rows an expert): up to 12 rows plain 16-row blocks; 13-16 rows in 32-row pairs of
    16-row blocks, the H200 tuner's choice for gpt-oss-20b and OLMoE at 16 rows; 32 (16-48) in 64-row
    pairs of 32-row blocks with TMA weights, the H200 tuner's choice for OLMoE and the 64-expert slice;
    64 with TMA weights; 128 (80-384)
    in 128-row pairs of 64-row blocks with TMA weights, its choice for three shapes; 512 in 128-row
    blocks."""
    cfg = default_config(QWEN, tokens)
    assert (cfg.pair_blocks, cfg.tma_weights, cfg.persistent) == (pair_blocks, tma, False)


@pytest.mark.parametrize("preset,tokens", [("mixtral-8x7b", 16), ("mixtral-8x7b", 64), ("mixtral-8x7b", 128),
                                           ("qwen3-30b-a3b", 1), ("qwen3-30b-a3b", 512),
                                           ("qwen3-30b-a3b", 8192)])
def test_default_config_groups_row_blocks_at_every_size(preset, tokens):
    """group_m 8 in every family: an expert with several row blocks (Mixtral 8x7B at 64 tokens: 16
    rows an expert, 16-row blocks) runs them on one column tile together, so its weights are read
    from memory once (group_m 1 there: 72% of the floor against 91% on the H200)."""
    assert default_config(PRESETS[preset], tokens).group_m == 8


def test_default_config_of_an_empty_batch_is_the_smallest_tile():
    assert default_config(QWEN, 0) == default_config(QWEN, 1)


@pytest.mark.parametrize("tokens,expect", [
    (0, "small"), (1, "small"), (2, "small"),
    (3, "default"),         # nearest is 1 (log: 3x against 5.3x), out of TUNED_REACH = 2x
    (8, "large"),           # 2x from 16: in reach
    (12, "large"),          # linear would pick... 16 too; log: 1.33x against 12x
    (32, "large"), (33, "default"), (10**6, "default"),
])
def test_lookup_takes_the_nearest_token_count_in_log_scale_within_reach(table_dir, tokens, expect):
    """The nearest entry in log scale while it is within 2x of the call's token count; past every
    entry's reach, the default heuristic."""
    shape = PRESETS["tiny"]
    small, large = ExpertsConfig(block_m=16, block_n1=32), ExpertsConfig(block_m=128, block_k1=32)
    table_dir({shape_key(shape, torch.float32): {"1": small.to_dict(), "16": large.to_dict()}})
    got = get_config(shape, tokens, torch.float32, "cpu")
    default = default_config(shape, tokens, 4)
    assert got == {"small": small, "large": large, "default": default}[expect]
    assert default not in (small, large)


def test_lookup_tie_goes_to_the_smaller_token_count(table_dir):
    """T = 128 between entries at 64 and 256 (the tuner's default counts, equally far in log scale and
    both in reach): the smaller count's tiles, and either entry alone is taken."""
    shape = PRESETS["tiny"]
    at_64, at_256 = ExpertsConfig(block_m=16, block_n1=32), ExpertsConfig(block_m=128, block_k1=32)
    table_dir({shape_key(shape, torch.float32): {"256": at_256.to_dict(), "64": at_64.to_dict()}})
    assert get_config(shape, 128, torch.float32, "cpu") == at_64
    assert get_config(shape, 129, torch.float32, "cpu") == at_256


def test_lookup_without_an_entry_uses_the_default(table_dir):
    shape = PRESETS["tiny"]
    table_dir({shape_key(shape, torch.float32): {"4": ExpertsConfig(block_m=16).to_dict()}})
    assert get_config(shape, 300, torch.float16, "cpu") == default_config(shape, 300, 2)


def test_lookup_in_a_given_table_ignores_the_config_dir(table_dir):
    """get_config(table=...) reads that table alone: the packaged one beside a table under test in
    $MOEKIT_CONFIG_DIR (`moekit sweep --set tiles`: "packaged")."""
    shape = PRESETS["tiny"]
    under_test, shipped = ExpertsConfig(block_m=16, block_n1=32), ExpertsConfig(block_m=32, block_k1=32)
    table_dir({shape_key(shape, torch.float32): {"16": under_test.to_dict()}})
    given = TuningTable({shape_key(shape, torch.float32): {16: shipped}})
    assert get_config(shape, 16, torch.float32, "cpu") == under_test
    assert get_config(shape, 16, torch.float32, "cpu", table=given) == shipped
    assert get_config(shape, 16, torch.float32, "cpu", table=TuningTable()) == default_config(shape, 16, 4)


def test_config_dir_set_after_a_lookup_is_the_table_the_triton_path_uses(tmp_path, monkeypatch):
    """A table in $MOEKIT_CONFIG_DIR is what the triton path resolves, also when the variable is set
    (or changed) after an earlier lookup in the process: nothing cached hides it."""
    from moekit.experts.triton import auto_config

    shape = MoEShape(8, 64, 32, 2)
    gate_up = torch.empty(8, 64, 64)
    mine = ExpertsConfig(16, 32, 32, 2, 2, 32, 32, 2, 2, 1)
    other = dataclasses.replace(mine, block_n1=64)
    for name, cfg in (("a", mine), ("b", other)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "cpu.json").write_text(
            json.dumps({shape_key(shape, torch.float32): {"16": dataclasses.asdict(cfg)}}))
    cpu = torch.device("cpu")
    monkeypatch.delenv("MOEKIT_CONFIG_DIR", raising=False)
    assert auto_config(16, gate_up, 2, torch.float32, cpu) == default_config(shape, 16, 4)
    monkeypatch.setenv("MOEKIT_CONFIG_DIR", str(tmp_path / "a"))
    assert auto_config(16, gate_up, 2, torch.float32, cpu) == mine
    monkeypatch.setenv("MOEKIT_CONFIG_DIR", str(tmp_path / "b"))
    assert auto_config(16, gate_up, 2, torch.float32, cpu) == other
    monkeypatch.delenv("MOEKIT_CONFIG_DIR")
    assert auto_config(16, gate_up, 2, torch.float32, cpu) == default_config(shape, 16, 4)


def test_packaged_table_skips_the_config_dir(table_dir, tmp_path):
    """$MOEKIT_CONFIG_DIR's own (empty) H200 table shadows the packaged one for `load_table`, not
    for `packaged_table`."""
    (tmp_path / "nvidia_h200.json").write_text("{}")
    load_table.cache_clear()
    assert load_table("nvidia_h200") == {}
    assert packaged_table("nvidia_h200") == parse_table(PACKAGED_DIR / "nvidia_h200.json") != {}
    assert packaged_table("cpu") == {} and packaged_table("no_such_gpu") == {}


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
    # Already fits: unchanged; so is a tile that needs exactly the budget, 5 x (16x256 + 2 x 256x32) x 2.
    small = ExpertsConfig(block_m=16, block_n1=32, block_k1=64, stages1=5)
    assert fit_shared_memory(small, 2) == small
    exact = ExpertsConfig(block_m=16, block_n1=32, block_k1=256, stages1=5)
    assert smem_bytes(exact, 2, 1) == SHARED_MEMORY_BUDGET and fit_shared_memory(exact, 2) == exact
    # Nothing fits: 2 stages x (256x16 + 2 x 16x2048) x 2 = 272 KiB at the smallest step; it stops
    # there (stages 2, block_k 16) and leaves the rest to the caller.
    huge = ExpertsConfig(block_m=256, block_n1=2048, block_k1=64, stages1=3)
    assert (fit_shared_memory(huge, 2).stages1, fit_shared_memory(huge, 2).block_k1) == (2, 16)


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


PACKAGED_TABLES = sorted(p.stem for p in PACKAGED_DIR.glob("*.json"))


def test_packaged_tables_are_the_h200s_and_the_h100s():
    assert PACKAGED_TABLES == ["nvidia_h100_80gb_hbm3", "nvidia_h200"]


@pytest.mark.parametrize("slug", PACKAGED_TABLES)
def test_packaged_table_parses_fits_shared_memory_and_records_its_device(slug):
    """Every packaged table: readable, each entry within the shared memory of one SM and its FP8 entries
    configs the block-scaled kernels accept, token counts written in increasing order, and tuned on
    the device its file is named for (the slug `table_slug` looks up)."""
    path = PACKAGED_DIR / f"{slug}.json"
    table = parse_table(path)
    assert table == load_table(slug) and table
    for k, entry in table.items():
        dtype = getattr(torch, k.rsplit("dtype=", 1)[1])
        for tokens, cfg in entry.items():
            assert tokens >= 1
            for gemm in (1, 2):
                assert smem_bytes(cfg, dtype.itemsize, gemm) <= SHARED_MEMORY_LIMIT, (k, tokens, gemm)
            if dtype == torch.float8_e4m3fn:
                assert tuning.check_fp8_config(cfg) == cfg, (k, tokens)
    raw = json.loads(path.read_text())
    for k in table:
        assert [int(t) for t in raw[k]] == sorted(table[k]), k       # written in increasing order
    assert set(table.meta) == {"triton", "torch", "device"}
    assert tuning.name_slug(table.meta["device"]) == slug


def test_packaged_h200_table_covers_qwen3_from_1_token_and_fp8_from_16():
    """The H200's: Qwen3-30B-A3B's bf16 tiles from 1 token, its FP8 entries (`moekit tune --weights
    fp8`, key dtype=float8_e4m3fn) from 16 to 16,384 tokens."""
    table = parse_table(PACKAGED_DIR / "nvidia_h200.json")
    bf16 = table[shape_key(QWEN, torch.bfloat16)]
    assert min(bf16) == 1 and len(bf16) >= 5
    assert sorted(table[shape_key(QWEN, torch.float8_e4m3fn)]) == [16, 64, 256, 1024, 2048, 4096, 8192, 16384]


def test_packaged_h100_table_covers_qwen3_in_bf16_and_fp8():
    """The H100's (`moekit tune` and `moekit tune --weights fp8` at 16, 256, 2,048 and 16,384 tokens):
    within the table's 2x reach of those, an H100 runs Qwen3-30B-A3B on tuned tiles."""
    table = parse_table(PACKAGED_DIR / "nvidia_h100_80gb_hbm3.json")
    for dtype in (torch.bfloat16, torch.float8_e4m3fn):
        assert sorted(table[shape_key(QWEN, dtype)]) == [16, 256, 2048, 16384], dtype


# Bad table files: ValueError naming the file and the problem.


BAD_TABLES = [
    ("token-zero", '{"E=8,H=64,I=48,K=2,dtype=float32": {"0": {}}}', "token count must be a positive"),
    ("token-word", '{"k": {"x": {}}}', "token count must be a positive integer"),
    ("token-negative", '{"k": {"-4": {}}}', "token count must be a positive integer"),
    ("token-arabic-digits", '{"k": {"\u0661\u0662": {}}}', "token count must be a positive integer"),
    ("token-superscript", '{"k": {"\u00b2": {}}}', "token count must be a positive integer"),
    ("token-5000-digits", '{"k": {"' + "9" * 5000 + '": {}}}', "token count must be a positive integer"),
    ("token-past-int32", '{"k": {"2147483647": {}}}', "token count must be a positive integer of at most"),
    ("not-utf8", b'{"k": {"1": {"block_m": 16, "\xff": 1}}}', "not UTF-8"),
    ("deep-lists", "[" * 100_000 + "]" * 100_000, "nested too deeply"),
    ("deep-objects", '{"a":' * 100_000 + "1" + "}" * 100_000, "nested too deeply"),
    ("duplicate-token", '{"k": {"1": {}, "1": {"block_m": 32}}}', "duplicate key '1'"),
    ("config-not-object", '{"k": {"1": [16]}}', "expected an object of tiles"),
    ("tma-not-bool", '{"k": {"1": {"tma_weights": 1}}}', "tma_weights must be true or false"),
    ("tma-string", '{"k": {"1": {"tma_weights": "yes"}}}', "tma_weights must be true or false"),
    ("persistent-not-bool", '{"k": {"1": {"persistent": 0}}}', "persistent must be true or false"),
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


def test_bad_token_key_is_named_in_a_short_message(tmp_path):
    """A 5000-digit token count: the file and the entry named, the key cut short (Python's own error
    for such a number names neither)."""
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"E=8,H=64,I=48,K=2,dtype=float32": {"9" * 5000: {}}}), encoding="utf-8")
    with pytest.raises(ValueError) as info:
        parse_table(path)
    message = str(info.value)
    assert message.startswith(f"tuning table {path}: bad entry 'E=8,H=64,I=48,K=2,dtype=float32'[")
    assert "'999999999999...' (5000 chars)]: a token count must be" in message and len(message) < 300


# The tma_weights switch: a bool, left out of table entries while off, so old tables read the same.


@pytest.mark.parametrize("switch,extra,bad", [("tma_weights", {}, 1),
                                               ("persistent", {"tma_weights": True}, "yes")])
def test_switches_serialise_backwards_compatibly(table_dir, switch, extra, bad):
    """tma_weights and persistent: bools left out of table entries while off."""
    shape = PRESETS["tiny"]
    off, on = ExpertsConfig(block_m=16), ExpertsConfig(block_m=32, **{switch: True}, **extra)
    assert getattr(off, switch) is False and switch not in off.to_dict()
    assert on.to_dict()[switch] is True
    assert ExpertsConfig.from_dict(on.to_dict()) == on and ExpertsConfig.from_dict(off.to_dict()) == off
    table_dir({shape_key(shape, torch.float32): {"1": off.to_dict(), "1024": on.to_dict()}})
    assert get_config(shape, 1, torch.float32, "cpu") == off
    assert get_config(shape, 1024, torch.float32, "cpu") == on
    # The packaged table: an entry without the key reads as off, one with it as written.
    raw = json.loads((PACKAGED_DIR / "nvidia_h200.json").read_text())
    for key, entry in parse_table(PACKAGED_DIR / "nvidia_h200.json").items():
        for tokens, cfg in entry.items():
            assert getattr(cfg, switch) is raw[key][str(tokens)].get(switch, False)
    with pytest.raises(ValueError, match=f"{switch} must be true or false"):
        ExpertsConfig(**{switch: bad})

# What a table records of its tuning, and the tile configs' own checks.


def test_running_versions_on_the_cpu():
    import triton

    got = tuning.running_versions("cpu")
    assert got == {"triton": triton.__version__, "torch": torch.__version__, "device": "cpu"}


def test_packaged_table_records_what_it_was_tuned_with():
    table = parse_table(PACKAGED_DIR / "nvidia_h200.json")
    assert table.meta == {"triton": "3.6.0", "torch": "2.11.0+cu130", "device": "NVIDIA H200"}
    assert "_meta" not in table and all(k.startswith("E=") for k in table)


BAD_META = [
    ('{"_meta": [1], "k": {}}', "'_meta' must be an object of strings"),
    ('{"_meta": {"triton": 3.6}}', "_meta['triton'] must be a string, got 3.6"),
]


@pytest.mark.parametrize("content,message", BAD_META)
def test_bad_meta_is_a_value_error_naming_the_file(tmp_path, content, message):
    path = tmp_path / "t.json"
    path.write_text(content)
    with pytest.raises(ValueError) as info:
        parse_table(path)
    assert str(path) in str(info.value) and message in str(info.value)


@pytest.fixture
def fresh_warnings(monkeypatch):
    monkeypatch.setattr(tuning, "_warned", set())


@pytest.mark.parametrize("recorded,warns", [("0.0.1-fake", True), ("running", False), (None, False)])
def test_get_config_warns_once_when_the_table_s_triton_differs(table_dir, fresh_warnings, recorded, warns):
    import triton

    shape = PRESETS["tiny"]
    cfg = ExpertsConfig(block_m=16, block_n1=32)
    table = {shape_key(shape, torch.float32): {"1": cfg.to_dict()}}
    if recorded is not None:
        version = triton.__version__ if recorded == "running" else recorded
        table = {"_meta": {"triton": version, "torch": "x", "device": "Fake GPU"}, **table}
    table_dir(table)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert get_config(shape, 1, torch.float32, "cpu") == cfg
        assert get_config(shape, 2, torch.float32, "cpu") == cfg
    mine = [w for w in caught if "tuned with Triton" in str(w.message)]
    assert len(mine) == (1 if warns else 0)
    if warns:
        text = str(mine[0].message)
        assert "0.0.1-fake" in text and triton.__version__ in text
        assert "cpu.json" in text and "Fake GPU" in text


def test_tile_configs_share_one_field_check():
    """ExpertsConfig, WgradConfig and the decode tiles refuse a bool or a non-positive tile and a
    block size off the powers of two, naming the class and the field."""
    from moekit.decode import GemvTiles
    from moekit.tuning import WgradConfig

    for cls, field, pow2_field in ((ExpertsConfig, "warps1", "block_n2"), (WgradConfig, "stages", "block_c"),
                                   (GemvTiles, "unroll", "block_k")):
        with pytest.raises(ValueError, match=rf"{cls.__name__}\.{field} must be a positive int, got True"):
            cls(**{field: True})
        with pytest.raises(ValueError, match=rf"{cls.__name__}\.{field} must be a positive int, got 0"):
            cls(**{field: 0})
        with pytest.raises(ValueError, match=rf"{cls.__name__}\.{pow2_field} must be a power of two, got 48"):
            cls(**{pow2_field: 48})


@pytest.mark.parametrize("field,value,msg", [
    ("block_m", 2**70, r"ExpertsConfig\.block_m must be at most 4096, got 1180591620717411303424"),
    ("block_n1", 8192, r"ExpertsConfig\.block_n1 must be at most 4096, got 8192"),
    ("warps1", 64, r"ExpertsConfig\.warps1 must be at most 32, got 64"),
    ("warps2", 3, r"ExpertsConfig\.warps2 must be a power of two, got 3"),
    ("stages1", 100, r"ExpertsConfig\.stages1 must be at most 16, got 100"),
], ids=["block-m-2**70", "block-n1", "warps-64", "warps-3", "stages-100"])
def test_tiles_past_what_a_launch_takes_are_refused_naming_the_file(field, value, msg, tmp_path, monkeypatch):
    """A tile no launch could take (a block size past 4,096, warps past 32 or off the powers of two,
    more than 16 stages) is refused where the config is made; from a table, naming the file."""
    with pytest.raises(ValueError, match=msg):
        ExpertsConfig(**{field: value})
    table = {"E=8,H=64,I=48,K=2,dtype=float32": {"12": {field: value}}}
    (tmp_path / "cpu.json").write_text(json.dumps(table))
    monkeypatch.setenv("MOEKIT_CONFIG_DIR", str(tmp_path))
    monkeypatch.setenv("MOEKIT_DECODE_DIRECT", "0")        # the grouped path, which reads the table
    with pytest.raises(ValueError, match=r"cpu\.json") as err:
        moe_experts(torch.randn(12, 64), torch.randn(8, 96, 64), torch.randn(8, 64, 48),
                           torch.rand(12, 2), torch.randint(0, 8, (12, 2)), backend="triton")
    assert field in str(err.value)


def test_shrink_to_fit_lowers_fields_in_order_down_to_their_floors():
    """Stages by one down to 2, then block_k halved down to 16; as far as it goes past that."""
    from moekit.tuning import shrink_to_fit

    @dataclasses.dataclass(frozen=True)
    class Tiles:
        stages: int
        block_k: int

    def size(t):
        return t.stages * t.block_k

    assert shrink_to_fit(Tiles(5, 64), size, 1000, (("stages", 2), ("block_k", 16))) == Tiles(5, 64)
    assert shrink_to_fit(Tiles(5, 64), size, 192, (("stages", 2), ("block_k", 16))) == Tiles(3, 64)
    assert shrink_to_fit(Tiles(5, 64), size, 100, (("stages", 2), ("block_k", 16))) == Tiles(2, 32)
    assert shrink_to_fit(Tiles(5, 64), size, 1, (("stages", 2), ("block_k", 16))) == Tiles(2, 16)
