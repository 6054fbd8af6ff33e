"""`moekit tune` (`moekit.bench.tune`): the candidate tiles, the search with the GPU timer stubbed
(CPU, interpreter), the switches tried on the fastest tiles, the search on block-scaled FP8 weights
(`--weights fp8`), the report, the table it writes (merged in token order, never partial, never into
the package, with its "_meta") and the command line. The tables themselves and their lookup:
tests/runtime/tuning/test_tuning.py."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import subprocess
import sys

import pytest
import torch

from helpers import rel_err, smem_bytes
from moekit.bench import tune as tuner
from moekit.bench.tune_report import CONFIG_FIELDS
from moekit.cli import build_parser, main
from moekit.grouped_gemm.fp8 import experts_fp8_torch, gemm1_swiglu_fp8_torch, gemm2_weighted_fp8_torch
from moekit.quant import Fp8Weight, dequantize_rows, quantize_rows_torch
from moekit.shapes import PRESETS, MoEShape
from moekit.tuning import (
    PACKAGED_DIR,
    SHARED_MEMORY_LIMIT,
    ExpertsConfig,
    check_fp8_config,
    default_config,
    fp8_tiles,
    parse_table,
    shape_key,
)

QWEN = PRESETS["qwen3-30b-a3b"]   # E=128, K=8: mean rows per expert = T / 16
FP8_SHAPE = MoEShape(8, 128, 128, 2)   # H and I one FP8 scale block each (the tiny preset's are not)


# The tuner's logic (the GPU timer stubbed).


def test_block_m_candidates_grow_with_rows_per_expert():
    got = [tuner.block_m_candidates(QWEN, t) for t in (1, 64, 256, 1024, 4096, 16384)]
    assert got == [[16], [16], [16, 32], [16, 32, 64], [32, 64, 128], [64, 128]]


@pytest.mark.parametrize("block_m", [16, 32, 64, 128])
@pytest.mark.parametrize("itemsize", [2, 4])
def test_gemm_candidates_fit_shared_memory(block_m, itemsize):
    for swiglu, gemm in ((True, 1), (False, 2)):
        cands = tuner.gemm_candidates(block_m, itemsize, swiglu)
        assert cands and len({tuple(p.items()) for p in cands}) == len(cands)
        for p in cands:
            cfg = tuner._with(ExpertsConfig(block_m=block_m), gemm, p)
            assert smem_bytes(cfg, itemsize, gemm) <= SHARED_MEMORY_LIMIT, (swiglu, p)


def test_gemm_candidates_drop_only_tiles_over_the_limit():
    # 4 x (128x128 + 2 x 128x128) x 2 = 384 KiB: over; 3 x (128x64 + 2 x 64x128) x 2 = 144 KiB: kept.
    cands = tuner.gemm_candidates(128, 2, swiglu=True)
    assert dict(block_n=128, block_k=128, warps=8, stages=4) not in cands
    assert dict(block_n=128, block_k=64, warps=8, stages=3) in cands
    # 16-row tiles with the widest block_k: 5 x (16x256 + 2 x 256x128) x 2 = 680 KiB: over.
    small = tuner.gemm_candidates(16, 2, swiglu=True)
    assert dict(block_n=128, block_k=256, warps=4, stages=5) not in small
    assert dict(block_n=128, block_k=256, warps=4, stages=3) not in small   # 408 KiB
    assert dict(block_n=32, block_k=256, warps=4, stages=5) in small         # 200 KiB


@pytest.mark.parametrize("block_m", [16, 32, 64, 128])
def test_fp8_gemm_candidates_are_fp8_tiles_within_shared_memory(block_m):
    """The FP8 search's tiles: the dense search's space (counted at one byte an operand) cut to
    GEMM1's block_n 128 and block_k 64 or 128 in both GEMMs; every one runs on the FP8 kernels."""
    limit = 96 * 1024                    # below some 1-byte tiles: the limit must cut them
    cut = False
    for swiglu, gemm in ((True, 1), (False, 2)):
        cands = tuner.gemm_candidates(block_m, 1, swiglu, limit, fp8=True)
        expected = [p for p in tuner.gemm_candidates(block_m, 1, swiglu, limit)
                    if p["block_k"] in (64, 128) and (not swiglu or p["block_n"] == 128)]
        assert cands and cands == expected
        for p in cands:
            cfg = tuner._with(fp8_tiles(ExpertsConfig(block_m=block_m)), gemm, p)
            check_fp8_config(cfg)
            assert smem_bytes(cfg, 1, gemm) <= limit, (gemm, p)
        cut |= len(cands) < len(tuner.gemm_candidates(block_m, 1, swiglu, fp8=True))
    assert cut


FAST1 = dict(block_n=32, block_k=64, warps=4, stages=3)
FAST2 = dict(block_n=64, block_k=128, warps=4, stages=4)


def fake_timer(calls: list):
    """ms of a candidate without running it: FAST1 / FAST2 win their GEMM; one tile "fails to compile"."""
    def timer(fn) -> float:
        assert isinstance(fn, functools.partial)
        cfg = fn.args[-1]
        calls.append((fn.func.__name__, cfg))
        if fn.func is tuner._path_all:
            return 0.5 if cfg.block_m == 16 else 0.3
        gemm = 1 if fn.func is tuner._gemm1_all else 2
        p = dict(block_n=getattr(cfg, f"block_n{gemm}"), block_k=getattr(cfg, f"block_k{gemm}"),
                 warps=getattr(cfg, f"warps{gemm}"), stages=getattr(cfg, f"stages{gemm}"))
        if p == dict(block_n=16, block_k=64, warps=4, stages=3):
            raise RuntimeError("out of resources")
        return 0.1 if p == (FAST1 if gemm == 1 else FAST2) else 1.0 + p["block_n"] / 1000

    return timer


def test_tune_tokens_picks_the_fastest_tiles_and_records_every_timing():
    shape = PRESETS["tiny"]
    calls, logged = [], []
    best, records = tuner.tune_tokens(shape, 4, torch.float32, rotations=2, log=logged.append,
                                      device="cpu", timer=fake_timer(calls), switches=False)
    assert best.block_m == 16 and best.group_m == 8
    assert (best.block_n1, best.block_k1, best.warps1, best.stages1) == tuple(FAST1.values())
    assert (best.block_n2, best.block_k2, best.warps2, best.stages2) == tuple(FAST2.values())
    n1, n2 = len(tuner.gemm_candidates(16, 4, True)), len(tuner.gemm_candidates(16, 4, False))
    assert len(calls) == n1 + n2 + 1
    gemm_records = [r for r in records if r["gemm"] in (1, 2)]
    assert len(gemm_records) == n1 + n2 - 2                 # the failing tile, once per GEMM, skipped
    assert sum("skip" in m for m in logged) == 2
    for r in gemm_records:
        assert set(r) == {"tokens", "block_m", "gemm", "ms", "block_n", "block_k", "warps", "stages"}
        assert r["tokens"] == 4 and r["block_m"] == 16
    fast = [r for r in gemm_records if r["ms"] == 0.1 / 2]    # ms per routing: divided by rotations
    assert [(r["gemm"], r["block_n"]) for r in fast] == [(1, 32), (2, 64)]
    (path,) = [r for r in records if r["gemm"] == 0]
    assert path["ms"] == 0.25 and ExpertsConfig(**{k: v for k, v in path.items()
                                                   if k not in ("tokens", "gemm", "ms")}) == best
    json.dumps(records)                                         # the --records lines are JSON


def test_tune_tokens_times_each_block_m_with_the_switches_off():
    """Each block_m's GEMM tiles and its whole path are timed plain (the switches come after, on the
    winners), even where the default config, the search's starting point, turns TMA weights on."""
    shape = PRESETS["tiny"]
    assert default_config(shape, 240, 4).tma_weights            # 60 rows an expert: TMA's band
    calls = []
    best, records = tuner.tune_tokens(shape, 240, torch.float32, rotations=1, log=lambda m: None,
                                      device="cpu", timer=fake_timer(calls), switches=False)
    assert calls and all(tuner.variant_label(cfg) == "" for _, cfg in calls)
    assert all(label(r) == "" for r in records if r["gemm"] == 0)
    assert tuner.variant_label(best) == ""


def label(record: dict) -> str:
    """The switches of a whole-path record's config ("" for a block_m's own tiles)."""
    return tuner.variant_label(ExpertsConfig(**{k: record[k] for k in CONFIG_FIELDS}))


def test_tune_tokens_keeps_the_block_m_of_the_fastest_path():
    # tiny at T=48: 12 rows per expert, block_m 16 and 32 are tried; the stub times 32's path faster.
    assert tuner.block_m_candidates(PRESETS["tiny"], 48) == [16, 32]
    best, records = tuner.tune_tokens(PRESETS["tiny"], 48, torch.float32, rotations=1, log=lambda m: None,
                                      device="cpu", timer=fake_timer([]))
    assert best.block_m == 32 and best.block_n1 == FAST1["block_n"]
    assert sorted((r["block_m"], r["ms"]) for r in records if r["gemm"] == 0 and not label(r)) == [
        (16, 0.5), (32, 0.3)]
    # The switches are tried on block_m 32's tiles; timed level with them, they do not displace them.
    assert {r["block_m"] for r in records if r["gemm"] == 0 and label(r)} == {32} and best.pair_blocks == 1


def switch_timer(calls: list):
    """fake_timer, except that whole paths with switches are timed by them: paired + persistent
    fastest, TMA "fails to compile" alone."""
    tiles = fake_timer(calls)

    def timer(fn) -> float:
        cfg = fn.args[-1]
        if fn.func is not tuner._path_all or tuner.variant_label(cfg) == "":
            return tiles(fn)
        calls.append((fn.func.__name__, cfg))
        label = tuner.variant_label(cfg)
        if label == "tma":
            raise RuntimeError("out of resources")
        return {"paired+persistent": 0.1, "paired": 0.2}.get(label, 0.4)

    return timer


def test_tune_tokens_tries_the_switches_on_the_fastest_tiles(monkeypatch):
    shape = PRESETS["tiny"]
    calls, logged = [], []
    best, records = tuner.tune_tokens(shape, 4, torch.float32, rotations=2, log=logged.append,
                                      device="cpu", timer=switch_timer(calls))
    assert (best.pair_blocks, best.tma_weights, best.persistent) == (2, False, True)
    assert (best.block_n1, best.block_n2) == (FAST1["block_n"], FAST2["block_n"])   # the tuned tiles kept
    variants = {label(r): r["ms"] for r in records if r["gemm"] == 0 and label(r)}
    # Every combination but the tiles alone and TMA alone (it failed: logged, not recorded).
    assert set(variants) == {"paired", "persistent", "paired+persistent", "paired+tma", "tma+persistent",
                             "paired+tma+persistent"}
    assert variants["paired+persistent"] == 0.1 / 2 and variants["paired"] == 0.2 / 2
    assert sum("skip T=4 bm=16 tma:" in m for m in logged) == 1
    # Weights the device cannot read through TMA: the TMA variants are not tried at all.
    monkeypatch.setattr(tuner, "resolve_tma",
                        lambda cfg, *a, **k: dataclasses.replace(cfg, tma_weights=False))
    cfg = ExpertsConfig()
    assert [tuner.variant_label(v) for v in tuner.switch_variants(cfg, None, None)] == [
        "", "persistent", "paired", "paired+persistent"]


def test_switches_are_tried_on_every_block_m_near_the_fastest():
    """block_m 16's tiles alone are 1.2x slower than 32's (within SWITCH_SPAN), so both get the
    switch search; paired tiles on block_m 16 are the fastest of all and are chosen. The report names
    each variant's block_m."""
    from moekit.bench.results import Provenance
    from moekit.bench.tune_report import output_files, tune_rows

    tiles = fake_timer([])

    def timer(fn) -> float:
        cfg = fn.args[-1]
        if fn.func is not tuner._path_all:
            return tiles(fn)
        label = tuner.variant_label(cfg)
        if label == "":
            return 0.36 if cfg.block_m == 16 else 0.3
        return 0.1 if (cfg.block_m, label) == (16, "paired") else 0.4

    assert 0.36 / 0.3 <= tuner.SWITCH_SPAN
    best, records = tuner.tune_tokens(PRESETS["tiny"], 48, torch.float32, rotations=1, log=lambda m: None,
                                      device="cpu", timer=timer)
    assert (best.block_m, best.pair_blocks) == (16, 2)
    tried = {(r["block_m"], label(r)) for r in records if r["gemm"] == 0 and label(r)}
    assert {bm for bm, _ in tried} == {16, 32} and len(tried) == 2 * 7      # every combination, each
    prov = Provenance("20260101T000000Z", "2026-01-01T00:00:00+00:00", "abc", "cuda", "Stub GPU", "2", "3",
                      "", "3.11", "0.1.0", "float16", 1000.0, 100.0)
    report = output_files(tune_rows(prov, "tiny", PRESETS["tiny"], 1, records, best))["report.md"]
    line = next(ln for ln in report.splitlines() if ln.startswith("| 48 |"))
    assert "block_m 16 paired **100.0**" in line and "block_m 32 paired 400.0" in line


def test_paired_variants_take_the_tiles_of_twice_their_block_m():
    """Paired tiles compute 2 * block_m rows: block_m 16's paired variants run block_m 32's tuned
    tiles; its other variants keep its own (the two block_m get different winners here)."""
    own1 = next(p for p in tuner.gemm_candidates(16, 4, swiglu=True) if p != FAST1)
    own2 = next(p for p in tuner.gemm_candidates(16, 4, swiglu=False) if p != FAST2)

    def timer(fn) -> float:
        cfg = fn.args[-1]
        if fn.func is tuner._path_all:
            return 0.3 if cfg.block_m == 32 and cfg.pair_blocks == 1 else 0.33
        gemm = 1 if fn.func is tuner._gemm1_all else 2
        p = dict(block_n=getattr(cfg, f"block_n{gemm}"), block_k=getattr(cfg, f"block_k{gemm}"),
                 warps=getattr(cfg, f"warps{gemm}"), stages=getattr(cfg, f"stages{gemm}"))
        fast = (FAST1, FAST2) if cfg.block_m == 32 else (own1, own2)
        return 0.1 if p == fast[gemm - 1] else 1.0

    best, records = tuner.tune_tokens(PRESETS["tiny"], 48, torch.float32, rotations=1, log=lambda m: None,
                                      device="cpu", timer=timer)
    paths = [ExpertsConfig(**{k: r[k] for k in CONFIG_FIELDS}) for r in records if r["gemm"] == 0]
    own16 = [c for c in paths if c.block_m == 16 and c.pair_blocks == 1]
    paired16 = [c for c in paths if c.block_m == 16 and c.pair_blocks == 2]
    assert own16 and paired16 and best.block_m == 32 and best.pair_blocks == 1
    assert all((c.block_n1, c.block_n2) == (own1["block_n"], own2["block_n"]) for c in own16)
    assert all((c.block_n1, c.block_k1, c.warps1, c.stages1, c.block_n2, c.block_k2, c.warps2, c.stages2)
               == (*FAST1.values(), *FAST2.values()) for c in paired16)
    assert len(paths) == len(set(paths))                             # each config timed once
    w32 = next(c for c in paths if c.block_m == 32 and not tuner.variant_label(c))
    assert tuner.paired_tiles(dataclasses.replace(w32, pair_blocks=2), {}) == \
        dataclasses.replace(w32, pair_blocks=2)                      # no tuned 2 * block_m: its own tiles


def test_tune_report_shows_the_switches_tried_and_chosen():
    from moekit.bench.results import Provenance
    from moekit.bench.tune_report import output_files, tune_rows

    prov = Provenance("20260101T000000Z", "2026-01-01T00:00:00+00:00", "abc", "cuda", "Stub GPU", "2", "3",
                      "", "3.11", "0.1.0", "float16", 1000.0, 100.0)
    best, records = tuner.tune_tokens(PRESETS["tiny"], 4, torch.float32, rotations=2, log=lambda m: None,
                                      device="cpu", timer=switch_timer([]))
    rows = tune_rows(prov, "tiny", PRESETS["tiny"], 2, records, best)
    (chosen,) = [r for r in rows if r.chosen]
    assert tuner.variant_label(chosen) == "paired+persistent"
    assert (chosen.pair_blocks, chosen.persistent) == (2, 1)
    report = output_files(rows)["report.md"]
    line = next(ln for ln in report.splitlines() if ln.startswith("| 4 |"))
    assert "| paired, persistent |" in line and "paired+persistent **50.0**" in line
    assert "| 250.0 |" in line             # block_m 16's tiles alone: 0.25 ms per routing, not chosen


FAST1_FP8 = dict(block_n=128, block_k=64, warps=4, stages=4)


def test_tune_tokens_on_fp8_weights_times_the_fp8_kernels():
    """--weights fp8: the weights quantized once, GEMM1 timed on x quantized per row, GEMM2 on
    GEMM1's quantized h, the path through the FP8 experts; every config timed and the winner pass
    `check_fp8_config`; the 5-stage 128-deep GEMM1 tile (fits in e4m3 only) is among those timed."""
    timed = []

    def timer(fn) -> float:
        cfg = fn.args[-1]
        timed.append(fn)
        if fn.func is not tuner._path_all:
            gemm = 1 if fn.func is tuner._gemm1_all else 2
            p = {k: getattr(cfg, f"{k}{gemm}") for k in ("block_n", "block_k", "warps", "stages")}
            return 0.1 if p == (FAST1_FP8, FAST2)[gemm - 1] else 1.0
        label = tuner.variant_label(cfg)
        if label == "":
            return 0.36 if cfg.block_m == 16 else 0.3
        return 0.1 if (cfg.block_m, label) == (16, "paired") else 0.4

    assert tuner.block_m_candidates(FP8_SHAPE, 48) == [16, 32]
    best, records = tuner.tune_tokens(FP8_SHAPE, 48, torch.float32, rotations=1, log=lambda m: None,
                                      device="cpu", timer=timer, fp8=True)
    for fn in timed:
        check_fp8_config(fn.args[-1])
        assert fn.args[1].fp8 and isinstance(fn.args[1].gate_up, Fp8Weight)
    assert check_fp8_config(best) is best and (best.block_m, best.pair_blocks) == (16, 2)
    # The winner keeps the FP8 tiles the timer favours.
    assert {k: getattr(best, f"{k}1") for k in FAST1_FP8} == FAST1_FP8
    assert {k: getattr(best, f"{k}2") for k in FAST2} == FAST2
    gemm1 = [fn for fn in timed if fn.func is tuner._gemm1_all]
    # 5 x (16x128 + 2 x 128x128) x 1 = 170 KiB as e4m3 (x too); 340 KiB at 2 bytes, over the limit.
    assert any((c.block_m, c.block_k1, c.stages1) == (16, 128, 5) for c in (fn.args[-1] for fn in gemm1))
    assert all(r["block_k"] in (64, 128) for r in records if r["gemm"] in (1, 2))

    # What was timed computes what the FP8 path computes: run one of each kind once on the CPU.
    path = next(fn for fn in timed if fn.func is tuner._path_all)
    xs, weights, ws, ids, _ = path.args
    gu, dn, k = weights.gate_up, weights.down, FP8_SHAPE.top_k
    g1, g2 = gemm1[0], next(fn for fn in timed if fn.func is tuner._gemm2_all)
    for x, (xq, xscale) in zip(xs, g1.args[0]):
        ref_q, ref_s = quantize_rows_torch(x, dtype=xq.dtype)
        assert torch.equal(xq, ref_q) and torch.equal(xscale, ref_s)
    (xq, xscale), align = g1.args[0][0], g1.args[2][0]
    (hq, hs), = g1()
    hq_t, hs_t = gemm1_swiglu_fp8_torch(xq, xscale, gu, align, k)
    live = int(align.num_padded)
    assert rel_err(dequantize_rows(hq[:live], hs[:live]), dequantize_rows(hq_t[:live], hs_t[:live])) < 1e-3
    (hq, hs), align = g2.args[0][0], g2.args[3][0]
    (y,) = g2()
    assert rel_err(y, gemm2_weighted_fp8_torch(hq, hs, dn, ws[0], align)) < 1e-5
    (out,) = path()
    # h's e4m3 rounding may flip where the fp32 sums run in another order, as in the GEMM1 check above.
    assert rel_err(out, experts_fp8_torch(xs[0], gu, dn, ws[0], ids[0])) < 1e-3


def test_tune_tokens_says_so_when_no_tile_runs():
    def failing(fn):
        raise RuntimeError("out of resources")

    with pytest.raises(RuntimeError, match="no candidate config ran at T=4"):
        tuner.tune_tokens(PRESETS["tiny"], 4, torch.float32, rotations=1, log=lambda m: None,
                          device="cpu", timer=failing)


KEY = shape_key(PRESETS["tiny"], torch.bfloat16)


def test_write_table_merges_in_token_order_and_keeps_other_shapes(tmp_path):
    path = tmp_path / "t.json"
    other = shape_key(QWEN, torch.bfloat16)
    a, b, c = ExpertsConfig(block_m=16), ExpertsConfig(block_m=32), ExpertsConfig(block_m=64)
    tuner.write_table(path, other, {4: a})
    tuner.write_table(path, KEY, {256: b})
    tuner.write_table(path, KEY, {16: a, 256: c, 4: b})       # replaces 256, adds 4 and 16 before it
    raw = json.loads(path.read_text())
    assert list(raw[KEY]) == ["4", "16", "256"] and raw[KEY]["256"] == c.to_dict()   # numeric order
    assert parse_table(path) == {other: {4: a}, KEY: {4: b, 16: a, 256: c}}
    umask = os.umask(0)
    os.umask(umask)
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask      # a plain file's mode, not mkstemp's 0600


def test_write_table_refuses_a_bad_table_and_leaves_it_alone(tmp_path):
    path = tmp_path / "t.json"
    path.write_text('{"k": {"0": {}}}')
    with pytest.raises(ValueError, match="token count") as info:
        tuner.write_table(path, KEY, {16: ExpertsConfig()})
    assert str(path) in str(info.value)
    assert path.read_text() == '{"k": {"0": {}}}'


def test_write_table_never_leaves_a_partial_file(tmp_path):
    class Unwritable(ExpertsConfig):
        def to_dict(self):
            return {**super().to_dict(), "block_m": object()}  # json cannot write it

    path = tmp_path / "t.json"
    tuner.write_table(path, KEY, {1: ExpertsConfig()})
    before = path.read_text()
    with pytest.raises(TypeError):
        tuner.write_table(path, KEY, {2: Unwritable()})
    assert path.read_text() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.json"]


def test_write_table_keeps_a_tma_entry_and_leaves_the_others_without_the_key(tmp_path):
    path = tmp_path / "t.json"
    on = ExpertsConfig(block_m=32, tma_weights=True)
    tuner.write_table(path, KEY, {4: ExpertsConfig(block_m=16), 64: on})
    tuner.write_table(path, KEY, {16: ExpertsConfig(block_m=16)})
    raw = json.loads(path.read_text())
    assert raw[KEY]["64"]["tma_weights"] is True
    assert "tma_weights" not in raw[KEY]["4"] and "tma_weights" not in raw[KEY]["16"]
    assert parse_table(path)[KEY][64] == on


# The command line.


TUNE_BAD_ARGUMENTS = [("--tokens", "0"), ("--tokens", "1,x"), ("--tokens", ","), ("--rotations", "-1"),
                      ("--out", "/dev/null/x.json"), ("--out", "/dev/null/dir"), ("--table", "{dir}"),
                      ("--table", "/dev/null/x.json"), ("--records", "/dev/null/r.jsonl"), ("--rep", "0"),
                      ("--seed", "-1"), ("--preset", "nope"), ("--dtype", "float32"),
                      ("--weights", "int8")]


@pytest.mark.parametrize("flag,value", TUNE_BAD_ARGUMENTS, ids=[f"{f} {v}" for f, v in TUNE_BAD_ARGUMENTS])
def test_tune_refuses_a_bad_argument_while_parsing(flag, value, tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["tune", flag, value.format(dir=tmp_path)])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1].startswith(f"moekit tune: error: argument {flag}:")


def test_tune_defaults_parse():
    args = build_parser(["tune"]).parse_args(["tune"])
    assert args.tokens == list(tuner.DEFAULT_TOKENS) and args.rotations == 0
    assert args.rep == tuner.GRAPH_REPS and args.out is None and args.table is None
    assert args.weights == "dtype"
    assert build_parser(["tune"]).parse_args(["tune", "--weights", "fp8"]).weights == "fp8"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without CUDA")
def test_tune_without_cuda_is_one_error_line(tmp_path, capsys):
    assert main(["tune", "--out", str(tmp_path / "t.json")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("moekit tune: error: ") and "CUDA" in err and len(err.strip().splitlines()) == 1


def test_python_dash_m_moekit_help():
    done = subprocess.run([sys.executable, "-m", "moekit", "--help"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    for command in ("bench", "report", "imbalance", "ep-bench", "tune"):
        assert command in done.stdout


STUB_META = {"triton": "9.9.9", "torch": "2.99", "device": "Stub GPU"}


@pytest.fixture
def stub_gpu(monkeypatch):
    """`moekit tune` with the GPU stubbed: provenance, the device's name and meta, and the tuner
    (stubbed timer, on the CPU). Returns the provenance."""
    from moekit.bench.results import Provenance

    prov = Provenance("20260101T000000Z", "2026-01-01T00:00:00+00:00", "abc", "cuda", "Stub GPU", "2", "3",
                      "", "3.11", "0.1.0", "float16", 1000.0, 100.0)
    real = tuner.tune_tokens

    def on_cpu(shape, tokens, dtype, rotations, log, *, device, timer, seed, switches, fp8):
        assert device.type == "cuda" and seed == 7 and switches
        return real(shape, tokens, torch.float32, rotations, log, device="cpu", timer=fake_timer([]),
                    seed=seed, switches=switches, fp8=fp8)

    monkeypatch.setattr(tuner.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(tuner.torch.cuda, "mem_get_info", lambda device=None: (80 << 30, 80 << 30))
    monkeypatch.setattr(tuner, "measure_provenance", lambda *a, **k: (None, prov))
    monkeypatch.setattr(tuner, "tune_tokens", on_cpu)
    monkeypatch.setattr(tuner, "device_slug", lambda device=None: "stub_gpu")
    monkeypatch.setattr(tuner, "running_versions", lambda device=None: dict(STUB_META))
    return prov


def test_tune_study_writes_rows_report_plot_and_table(tmp_path, monkeypatch, capsys, stub_gpu):
    """The study end to end with the GPU stubbed: every timing a row, the winners in the table, the
    report and plot drawn from the rows (and redrawn by `moekit report`)."""
    from moekit.bench import study
    from moekit.bench.tune_report import STUDY

    prov = stub_gpu
    out, table = tmp_path / "run", tmp_path / "t.json"
    assert main(["tune", "--preset", "tiny", "--tokens", "4,48", "--dtype", "float16", "--seed", "7",
                 "--out", str(out), "--table", str(table)]) == 0
    rows = STUDY.read(out / "results.csv")
    chosen = {r.tokens: r for r in rows if r.chosen}
    assert sorted(chosen) == [4, 48] and chosen[48].block_m == 32 and chosen[4].block_m == 16
    assert {r.weights for r in rows} == {"float16"}          # dense weights: the dtype's name
    key = shape_key(PRESETS["tiny"], torch.float16)
    assert {t: c.block_m for t, c in parse_table(table)[key].items()} == {4: 16, 48: 32}
    report = (out / "report.md").read_text()
    assert "# moekit tune: tiny on Stub GPU" in report and (out / "tune_tiny.png").stat().st_size > 0
    assert study.find_results(out)[0].name == "tune"
    assert main(["report", str(out), "--out", str(tmp_path / "again")]) == 0
    assert (tmp_path / "again" / "report.md").read_text() == report
    # The older spelling `--out TABLE.json` still names the table; --out refuses earlier results.
    monkeypatch.chdir(tmp_path)   # the results of this run go to the default folder under it
    assert main(["tune", "--preset", "tiny", "--tokens", "4", "--seed", "7", "--out", "old.json"]) == 0
    assert key.replace("float16", "bfloat16") in parse_table(tmp_path / "old.json")
    assert (tmp_path / "moekit-results" / f"tune-{prov.run_id}" / "results.csv").exists()
    assert main(["tune", "--preset", "tiny", "--tokens", "4", "--seed", "7", "--out", str(out),
                 "--table", str(table)]) == 2
    assert "--overwrite" in capsys.readouterr().err


def test_tune_refuses_a_layer_the_gpu_cannot_hold(tmp_path, monkeypatch, capsys, stub_gpu):
    monkeypatch.setattr(tuner.torch.cuda, "mem_get_info", lambda device=None: (100_000, 80 << 30))
    out = tmp_path / "run"
    assert main(["tune", "--preset", "tiny", "--tokens", "4", "--out", str(out), "--table",
                 str(tmp_path / "t.json")]) == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith("moekit tune: error: layer tiny (E=8,H=64,I=48,K=2) needs ") and "T=4" in line
    assert "(80% of the 0.0001 GB free)" in line and not out.exists()


# Where the table goes, and what it records.


def packaged_state() -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in PACKAGED_DIR.iterdir()}


TUNE_ARGS = ["tune", "--preset", "tiny", "--tokens", "4", "--seed", "7"]


def test_tune_never_writes_into_the_package_by_default(tmp_path, monkeypatch, stub_gpu):
    """Without --table: ./moekit-results/<device>.json, or --out's folder, or $MOEKIT_CONFIG_DIR when
    set; the installed package's tables are left alone. The table records "_meta"."""
    before = packaged_state()
    monkeypatch.delenv("MOEKIT_CONFIG_DIR", raising=False)
    monkeypatch.chdir(tmp_path)
    key = shape_key(PRESETS["tiny"], torch.bfloat16)

    assert main(TUNE_ARGS) == 0
    table = tmp_path / "moekit-results" / "stub_gpu.json"
    raw = json.loads(table.read_text())
    assert list(raw) == ["_meta", key] and raw["_meta"] == STUB_META
    assert parse_table(table).meta == STUB_META

    assert main([*TUNE_ARGS, "--out", str(tmp_path / "run")]) == 0
    assert key in parse_table(tmp_path / "run" / "stub_gpu.json")

    monkeypatch.setenv("MOEKIT_CONFIG_DIR", str(tmp_path / "tables"))
    assert main([*TUNE_ARGS, "--out", str(tmp_path / "run2")]) == 0
    assert key in parse_table(tmp_path / "tables" / "stub_gpu.json")
    assert not (tmp_path / "run2" / "stub_gpu.json").exists()
    assert packaged_state() == before


@pytest.mark.parametrize("where", ["env-file", "env-unwritable"])
def test_tune_refuses_an_unusable_config_dir_before_tuning(tmp_path, monkeypatch, capsys, stub_gpu, where):
    monkeypatch.setattr(tuner, "tune_tokens", lambda *a, **k: pytest.fail("started tuning"))
    if where == "env-file":
        target = tmp_path / "file"
        target.write_text("x")
    else:
        target = tmp_path / "ro"
        target.mkdir()
        target.chmod(0o500)
        if os.access(target, os.W_OK):
            pytest.skip("running as a user who can write anywhere")
    monkeypatch.setenv("MOEKIT_CONFIG_DIR", str(target))
    assert main([*TUNE_ARGS, "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("moekit tune: error: $MOEKIT_CONFIG_DIR")
    assert str(target) in err[0]


def test_tune_keeps_the_meta_of_a_merged_table_current(tmp_path, monkeypatch, capsys, stub_gpu):
    table = tmp_path / "t.json"
    table.write_text(json.dumps({"_meta": {"triton": "3.0.0", "torch": "2.5", "device": "Stub GPU"},
                                 KEY: {"1": ExpertsConfig(block_m=16).to_dict()}}))
    assert main([*TUNE_ARGS, "--out", str(tmp_path / "run"), "--table", str(table)]) == 0
    assert "was tuned with" in capsys.readouterr().out
    got = parse_table(table)
    assert got.meta == STUB_META and sorted(got[KEY]) == [1, 4]     # merged, meta of this run


def test_tune_with_a_shape(tmp_path, stub_gpu):
    out = tmp_path / "run"
    assert main(["tune", "--shape", "E=8,H=64,I=48,K=2", "--tokens", "4", "--seed", "7", "--out", str(out),
                 "--table", str(tmp_path / "t.json")]) == 0
    from moekit.bench.tune_report import STUDY

    assert {r.preset for r in STUDY.read(out / "results.csv")} == {"shape:E=8,H=64,I=48,K=2"}
    assert (out / "tune_shape_E8_H64_I48_K2.png").exists()
    assert shape_key(PRESETS["tiny"], torch.bfloat16) in parse_table(tmp_path / "t.json")


FP8_ARGS = ["tune", "--shape", "E=8,H=128,I=128,K=2", "--weights", "fp8", "--seed", "7"]


def test_tune_on_fp8_weights_writes_the_fp8_key(tmp_path, stub_gpu):
    """--weights fp8 (activations in --dtype float16): the winners under the FP8 key, each a config
    the FP8 kernels run, merged beside the dense entry of the same shape; the rows say "fp8"."""
    from moekit.bench.tune_report import STUDY

    out, table = tmp_path / "run", tmp_path / "t.json"
    dense = shape_key(FP8_SHAPE, torch.float16)
    tuner.write_table(table, dense, {4: ExpertsConfig(block_m=16)})
    assert main([*FP8_ARGS, "--dtype", "float16", "--tokens", "4,48", "--out", str(out),
                 "--table", str(table)]) == 0
    got = parse_table(table)
    key = shape_key(FP8_SHAPE, torch.float8_e4m3fn)
    assert set(got) == {dense, key} and got[dense] == {4: ExpertsConfig(block_m=16)}
    assert sorted(got[key]) == [4, 48]
    for cfg in got[key].values():
        check_fp8_config(cfg)
    rows = STUDY.read(out / "results.csv")
    assert rows and {r.weights for r in rows} == {"fp8"} and {r.dtype for r in rows} == {"float16"}
    chosen = {r.tokens: r for r in rows if r.chosen}
    assert {t: r.block_m for t, r in chosen.items()} == {t: c.block_m for t, c in got[key].items()}
    assert "fp8 weights, float16 activations" in (out / "report.md").read_text()


def test_tune_weights_fp8_refuses_a_layer_without_fp8_blocks(tmp_path, monkeypatch, capsys, stub_gpu):
    monkeypatch.setattr(tuner, "tune_tokens", lambda *a, **k: pytest.fail("started tuning"))
    assert main(["tune", "--preset", "tiny", "--weights", "fp8", "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert err[0].startswith("moekit tune: error: --weights fp8: layer 'tiny' has H=64, I=48")
    assert not (tmp_path / "run").exists()


def test_tune_rows_before_the_weights_column_read_as_dense(tmp_path):
    """A results.csv written before the weights column reads, its rows the dense weights in their
    dtype (the same report as rows that say so); a weights value other than fp8 or the dtype is
    refused, naming the column."""
    import csv

    from moekit.bench.results import Provenance
    from moekit.bench.tune_report import STUDY, output_files, tune_rows

    prov = Provenance("20260101T000000Z", "2026-01-01T00:00:00+00:00", "abc", "cuda", "Stub GPU", "2", "3",
                      "", "3.11", "0.1.0", "bfloat16", 1000.0, 100.0)
    best, records = tuner.tune_tokens(PRESETS["tiny"], 4, torch.float32, rotations=1, log=lambda m: None,
                                      device="cpu", timer=fake_timer([]), switches=False)
    rows = tune_rows(prov, "tiny", PRESETS["tiny"], 1, records, best)
    assert {r.weights for r in rows} == {"bfloat16"}
    STUDY.write(rows, tmp_path)
    with open(tmp_path / "results.csv", newline="") as f:
        table = list(csv.reader(f))
    col = table[0].index("weights")

    def rewrite(cells):
        with open(tmp_path / "results.csv", "w", newline="") as f:
            csv.writer(f).writerows(cells(r) for r in table)

    rewrite(lambda r: r[:col] + r[col + 1:])
    old = STUDY.read(tmp_path / "results.csv")
    assert {r.weights for r in old} == {""}
    assert output_files(old)["report.md"] == output_files(rows)["report.md"]
    rewrite(lambda r: r[:col] + ["int4" if r is not table[0] else "weights"] + r[col + 1:])
    with pytest.raises(ValueError, match="'weights' must be 'fp8' or the dtype 'bfloat16', got 'int4'"):
        STUDY.read(tmp_path / "results.csv")
