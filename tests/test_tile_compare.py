"""scripts/tile_compare.py on the CPU: the `--set group` variants (the row-block grouping study for
few-expert shapes). The timings themselves run on a GPU."""

from __future__ import annotations

from helpers import load_script
from moekit.shapes import PRESETS
from moekit.tuning import default_config


def test_group_set_varies_group_m_and_block_m_only():
    mod = load_script("tile_compare")
    base = default_config(PRESETS["mixtral-8x7b"], 64)          # 16 rows an expert: block_m 16, group_m 8
    assert (base.block_m, base.group_m) == (16, 8)
    out = mod.variants(base, [], 2, 1 << 30, which="group")
    assert list(out) == ["table", "group 1", "group 2", "group 4", "bm32", "bm32 group 1"]
    assert out["table"] == base
    for name, g, bm in (("group 1", 1, 16), ("group 2", 2, 16), ("group 4", 4, 16), ("bm32", 8, 32),
                        ("bm32 group 1", 1, 32)):
        cfg = out[name]
        assert (cfg.group_m, cfg.block_m) == (g, bm), name
        assert cfg.block_n1 == base.block_n1 and cfg.stages2 == base.stages2, name


def test_group_set_drops_the_variant_equal_to_the_table():
    mod = load_script("tile_compare")
    base = default_config(PRESETS["mixtral-8x7b"], 64)
    base = type(base)(**{**base.to_dict(), "group_m": 4})
    out = mod.variants(base, [], 2, 1 << 30, which="group")
    assert "group 4" not in out and out["table"].group_m == 4


def test_tables_set_puts_the_table_beside_the_packaged_and_default_configs():
    """`--set tables`: the table's config first, then the packaged table's and the default, each
    dropped when it equals one before it (an untuned shape's three are one config)."""
    mod = load_script("tile_compare")
    base = default_config(PRESETS["olmoe-1b-7b"], 64)
    shipped = type(base)(**{**base.to_dict(), "block_n1": 2 * base.block_n1})
    out = mod.variants(base, [], 2, 1 << 30, which="tables", others={"packaged": shipped, "default": base})
    assert out == {"table": base, "packaged": shipped}
    out = mod.variants(shipped, [], 2, 1 << 30, which="tables", others={"packaged": shipped, "default": base})
    assert out == {"table": shipped, "default": base}


def test_table_variants_read_the_packaged_table_of_the_device(monkeypatch):
    """"packaged" is the packaged table's entry in reach of T (looked up under the device's table
    name), "default" the heuristic's, whatever the table under test holds."""
    import torch

    from moekit.tuning import TuningTable, shape_key

    mod = load_script("tile_compare")
    shape = PRESETS["qwen3-30b-a3b"]
    shipped = default_config(shape, 4096, 4)                    # any config other than T = 64's default
    asked = []
    monkeypatch.setattr(mod, "packaged_table", lambda slug: asked.append(slug) or TuningTable(
        {shape_key(shape, torch.float32): {64: shipped}}))
    got = mod.table_variants(shape, 64, torch.float32, torch.device("cpu"))
    assert got == {"packaged": shipped, "default": default_config(shape, 64, 4)} and asked == ["cpu"]
    assert shipped != default_config(shape, 64, 4)
